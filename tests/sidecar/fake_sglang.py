"""A fake engine that answers as SGLang 0.5.23 does, for the sidecar's SGLang gating tests.

The adapter seam is :class:`~tests.sidecar.fake_engine.FakeEngine`'s; only the HTTP answers
differ: native ``/generate`` (a single prompt or a batch, streamed or not) with ``meta_info``,
and OpenAI completions whose non-streamed answers carry a top-level ``metadata``. Every answer
names the engine's weight version as SGLang does: its recorded version as a decimal string
(``"default"`` before any), or :attr:`FakeSglang.report` when a test sets one; a finished output
whose tokens came from more than one version carries ``weight_versions`` spans. Real-SGLang
tests cover the same routes on a real server; this fake lets the mismatch rules be provoked.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tests.sidecar.fake_engine import FakeEngine

#: SGLang's write and admin routes (0.5.23 http_server.py): the sidecar forwards none of them.
SGLANG_CONTROL_ROUTES = [
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/update_weights_from_ipc",
    "/begin_weight_update", "/end_weight_update", "/pause_generation", "/continue_generation", "/flush_cache",
    "/update_weight_version",
    "/release_memory_occupation", "/resume_memory_occupation", "/init_weights_update_group",
    "/destroy_weights_update_group", "/abort_request",
    "/get_weights_by_name", "/weights_checker", "/set_internal_state", "/load_lora_adapter", "/unload_lora_adapter",
    "/open_session",
    "/close_session", "/configure_logging", "/start_profile", "/stop_profile", "/freeze_gc", "/slow_down",
    "/scale_elastic_ep",
    "/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance", "/server_info",
    "/get_server_info", "/health_generate",
]  # fmt: skip


def spans(labels: list[str]) -> list[dict[str, Any]]:
    """SGLang's ``weight_versions`` spans of per-token version labels."""
    out: list[dict[str, Any]] = []
    for i, label in enumerate(labels):
        if out and out[-1]["version"] == label:
            out[-1]["end"] = i + 1
        else:
            out.append({"version": label, "start": i, "end": i + 1})
    return out


class FakeSglang(FakeEngine):
    """:class:`FakeEngine` answering as SGLang.

    Attributes:
        report: when set, the version label every answer names (a test's stand-in for an engine
            that changed behind the sidecar); None: the recorded version.
    """

    report: str | None = None

    def label(self) -> str:
        """The version label answers name now."""
        if self.report is not None:
            return self.report
        return "default" if self.version is None else str(self.version)

    def _meta(self, rid: str, labels: list[str], finished: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": {"type": "length", "length": len(labels)} if finished else None,
            "completion_tokens": len(labels),
            "weight_version": self.label(),
        }
        if finished and len({*labels}) > 1:
            meta["weight_versions"] = spans(labels)
            meta["weight_version"] = labels[-1]
        return meta

    def app(self) -> FastAPI:
        app = super().app()
        engine = self
        app.router.routes = [
            r for r in app.router.routes if getattr(r, "path", None) not in ("/v1/completions", "/v1/chat/completions")
        ]

        async def tokens(n: int, labels: list[str]) -> str:
            text = ""
            for i in range(n):
                text += await engine._token(i)
                labels.append(engine.label())
            return text

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            engine.started += 1
            n = int(body.get("sampling_params", {}).get("max_new_tokens", 4))
            prompts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            if body.get("stream"):

                async def events():
                    labels: list[str] = []
                    text = ""
                    for i in range(n):
                        text += await engine._token(i)
                        labels.append(engine.label())
                        yield f"data: {json.dumps({'text': text, 'output_ids': list(range(i + 1)), 'meta_info': engine._meta('r0', labels, i == n - 1)})}\n\n"  # noqa: E501
                    yield "data: [DONE]\n\n"
                    engine.completed += 1

                return StreamingResponse(events(), media_type="text/event-stream")
            outs = []
            for k, _ in enumerate(prompts):
                labels: list[str] = []
                text = await tokens(n, labels)
                outs.append(
                    {
                        "text": text,
                        "output_ids": list(range(n)),
                        "meta_info": engine._meta(f"r{k}", labels, True),
                        "echo_body": body,
                    }
                )
            engine.completed += 1
            return outs if isinstance(body["text"], list) else outs[0]

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            engine.started += 1
            n = int(body.get("max_tokens", 4))
            rid = f"cmpl-{time.monotonic_ns()}"
            if body.get("stream"):

                async def events():
                    for i in range(n):
                        text = await engine._token(i)
                        yield f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'created': 1, 'model': 'fake', 'choices': [{'index': 0, 'text': text}]})}\n\n"  # noqa: E501
                    yield "data: [DONE]\n\n"
                    engine.completed += 1

                return StreamingResponse(events(), media_type="text/event-stream")
            labels: list[str] = []
            text = await tokens(n, labels)
            engine.completed += 1
            meta = engine._meta(rid, labels, True)
            metadata = {k: meta[k] for k in ("weight_version", "weight_versions") if k in meta}
            return {
                "id": rid,
                "object": "text_completion",
                "created": 1,
                "model": "fake",
                "choices": [{"index": 0, "text": text}],
                "metadata": metadata,
                "echo_body": body,
            }

        for route in SGLANG_CONTROL_ROUTES:

            async def control(request: Request, route: str = route) -> dict[str, bool]:
                engine.http_control_calls.append(route)
                return {"success": True}

            app.add_api_route(route, control, methods=["POST", "GET"])
        return app
