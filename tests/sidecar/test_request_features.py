"""Request features (sidecar/features/): the proxy calls each feature's hooks in the list's order,
so a new feature is one object added to the list; here a sixth one, added to a running sidecar
over the fake engine, sees the request before and after admission, the whole answer, every
stream event and the release."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from stitchboard.sidecar.engines import lookup
from stitchboard.sidecar.features import ModelRequest, RequestFeature, RequestUse, Verdict
from stitchboard.sidecar.features.salt import CacheSalt
from stitchboard.sidecar.features.spans import SpansFeature
from stitchboard.sidecar.stamps import SseStamper
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import make_view, wait_for


class _Tagged(RequestUse):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def admitted(self, request: ModelRequest, start: int, claims: int) -> None:
        self.log.append(f"admitted@{start}")
        request.payload["tag"] = "sixth"
        request.changed = True

    async def on_answer(self, answer: Any) -> None:
        answer["tagged"] = True

    async def on_event(self, data: bytes, decoded: Any, stamper: SseStamper) -> Verdict:
        self.log.append("done" if data == b"[DONE]" else "event")
        return "send"

    def on_release(self) -> None:
        self.log.append("released")


class Tag(RequestFeature):
    """Tags each request's body and each JSON answer; logs the hooks it gets."""

    def __init__(self) -> None:
        self.log: list[str] = []

    async def open(self, request: ModelRequest) -> RequestUse | None:
        return _Tagged(self.log) if isinstance(request.payload, dict) else None


def test_a_sixth_feature_is_one_object_in_the_list(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine(token_delay_s=0.0))
    sidecar.wait_applied(0)
    features = sidecar.app.state.proxy.features
    assert [type(f) for f in features] == [SpansFeature, CacheSalt], "vLLM's kind: spans and the salt, in order"
    tag = Tag()
    features.append(tag)
    r = sidecar.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    body = r.json()
    assert r.status_code == 200 and body["tagged"] and body["echo_body"]["tag"] == "sixth"
    assert tag.log == ["admitted@0", "released"]
    tag.log.clear()
    r = sidecar.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    events = [e for e in r.text.split("\n\n") if e.strip()]
    assert json.loads(events[-2][len("data: ") :])["weight_version_start"] == 0 and events[-1] == "data: [DONE]"
    wait_for(lambda: "released" in tag.log, what="the stream's release (after its last bytes went out)")
    assert tag.log == ["admitted@0", "event", "event", "done", "released"]


def test_an_engine_kind_names_its_routing_mode_with_its_factory():
    assert lookup("sglang").routing == "engine" and lookup("vllm").routing == "worker"
    with pytest.raises(ValueError, match="engine_rows"):
        replace(lookup("vllm"), name="rowless", routing="engine")
    with pytest.raises(ValueError, match="engine_rows"):
        replace(lookup("sglang"), name="stray", routing="none")


class _RoutingEngine(FakeEngine):
    """The fake engine with a worker that captured one row per position of every marked request
    (layers 1, top-k 1, expert = position) under version 0 (vLLM's routing replay seam)."""

    marks: tuple[str, ...] = ()

    def routed_experts(self, marks: list[str]) -> dict[str, Any]:
        self.marks = (*self.marks, *marks)
        rows = base64.b64encode(np.arange(8, dtype=np.int32).tobytes()).decode()
        requests = {m: {"start": 0, "rows": rows, "versions": [[0, 0, 8]]} for m in marks}
        return {"moe": True, "model": "fake-moe", "num_layers": 1, "top_k": 1, "requests": requests}


def test_worker_routing_replay_goes_through_the_feature_list(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(_RoutingEngine(token_delay_s=0.0))
    sidecar.wait_applied(0)
    assert [type(f).__name__ for f in sidecar.app.state.proxy.features] == [
        "SpansFeature",
        "WorkerRouting",
        "CacheSalt",
    ]
    ask = {"prompt": "x", "max_tokens": 2, "return_routed_experts": True}
    answer = sidecar.http.post("/v1/completions", json=ask).json()
    assert (
        answer["echo_body"]["cache_salt"].startswith("stitch-routing-")
        and "return_routed_experts" not in answer["echo_body"]
    )
    assert (
        answer["routed_experts_start_len"] == 0
        and answer["routed_experts_error"] == "the engine did not report the answer's length"
    )
    stream = sidecar.http.post("/v1/completions", json={**ask, "stream": True}, headers={"X-Request-Id": "mine"})
    events = [json.loads(e[len("data: ") :]) for e in stream.text.split("\n\n") if e.strip() and e != "data: [DONE]"]
    stamp = events[-1]
    assert stamp["routed_experts_start_len"] == 0 and stamp["weight_version_end"] == 0
    assert len(sidecar.engine.marks) == 2 and all(m.startswith("stitch-routing-") for m in sidecar.engine.marks)
