"""``stitchboard demo --lora``: the refusals up front and the checks' verdicts (fast), the whole run with real vLLM
(heavy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer

from stitchboard.demo.cli import demo
from stitchboard.demo.lora_checks import CHECKS, STREAM_TOKENS, check_lora_demo
from stitchboard.proto.sidecar_wire import SidecarStatus
from tests.support.vllm_server import require_vllm


@pytest.mark.parametrize(
    ("kwargs", "hint", "why"),
    [
        ({"engine": "sglang"}, "--lora with --engine sglang", "sglang/srt/lora/layers.py:475"),
        ({"served": "fp8"}, "--lora with --served fp8", "bf16 adapter over the bf16 base"),
        ({"model": "tiny-qwen3-moe"}, "--lora with --model tiny-qwen3-moe", "dense model"),
        ({"engines": 2}, "--lora with --engines 2", "one engine behind one sidecar"),
    ],
)
def test_lora_refused_up_front_with_the_reason(kwargs: dict, hint: str, why: str, tmp_path: Path) -> None:
    with pytest.raises(typer.BadParameter) as info:
        demo(lora=True, workdir=tmp_path / "demo", **{"engine": "vllm", "served": "bf16", "engines": 1, **kwargs})
    assert hint in str(info.value) and why in str(info.value)
    assert not (tmp_path / "demo").exists()  # refused before anything started


def _status(pauses: dict[str, float] | None = None) -> SidecarStatus:
    return SidecarStatus(
        run_id="demo-lora", applied_version=2, target_version=2, lag_versions=0, state="idle", healthy=True,
        unhealthy_reason=None, last_error=None, last_sync=None, requests_in_flight=0, requests_waiting=0,
        committing=False, time=0.0, pause_seconds_by_route=pauses or {},
    )  # fmt: skip


def _answers(seed: float) -> list[dict]:
    return [{"text": "x", "tokens": ["x"], "token_logprobs": [seed], "top_logprobs": [{"x": seed}]}]


def _run(**change) -> tuple[dict[str, bool], list[str]]:
    """The checks of a run that held everything, with ``change`` applied to its inputs."""
    rows = [SimpleNamespace(step=s, changed_pct=40.0 + s, versions_seen=[[s - 1, s - 1]]) for s in (1, 2)]
    answers = {v: _answers(-1.0 - v) for v in range(3)}
    inputs = {
        "run": "demo-lora", "final": 2, "rows": rows, "answers": answers,
        "swap": {"spanned_swap": True, "tokens": STREAM_TOKENS, "error": None},
        "reference": {v: _answers(-1.0 - v) for v in range(3)}, "older": _answers(-2.0),
        "resident": ["demo-lora@1", "demo-lora@2"], "status": _status(),
    }  # fmt: skip
    return check_lora_demo(**{**inputs, **change})


def test_checks_hold_on_a_good_run_and_each_fails_on_its_fault() -> None:
    checks, reasons = _run()
    assert checks == dict.fromkeys(CHECKS.values(), True) and reasons == []
    faults = {
        "oracle": {"reference": {0: _answers(-1.0), 1: _answers(-2.0), 2: _answers(-9.0)}},
        "pinned": {"older": _answers(-3.0)},
        "swap": {"status": _status({"delta": 0.05})},
        "stamps": {"rows": [SimpleNamespace(step=1, changed_pct=40.0, versions_seen=[[0, 1]])]},
        "changed": {"answers": dict.fromkeys(range(3), _answers(-1.0)),
                    "reference": dict.fromkeys(range(3), _answers(-1.0)), "older": _answers(-1.0)},
    }  # fmt: skip
    for key, change in faults.items():
        checks, reasons = _run(**change)
        assert [k for k, held in checks.items() if not held] == [CHECKS[key]], key
        assert reasons and reasons[0].startswith(CHECKS[key]), key
    checks, _ = _run(resident=["demo-lora@2"])  # the older version was evicted
    assert not checks[CHECKS["pinned"]]
    checks, _ = _run(swap={"spanned_swap": False, "tokens": STREAM_TOKENS, "error": None})  # stream ended too early
    assert not checks[CHECKS["swap"]]


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.heavy
def test_lora_demo_two_steps_pass(tmp_path: Path, smollm2_dir: Path) -> None:
    require_vllm()
    exe = Path(sys.executable).with_name("stitchboard")
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [str(exe), "demo", "--lora", "--steps", "2", "--workdir", str(workdir), "--model", str(smollm2_dir)],
        check=False, capture_output=True, text=True, timeout=1800, env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS"), out[-6000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["passed"] and summary["lora"] and summary["final_version"] == 2
    assert summary["checks"] == dict.fromkeys(CHECKS.values(), True)
    assert all(f"ok {line}" in lines for line in CHECKS.values())
    assert [s["version"] for s in summary["steps"]] == [1, 2]
    assert all(0 < s["changed_pct"] <= 100 and s["patch_bytes"] < s["adapter_bytes"] for s in summary["steps"])
    assert summary["swap"]["spanned_swap"] and summary["swap"]["tokens"] == STREAM_TOKENS


def _sse_app(tokens: int, delay_s: float):
    """An OpenAI-style completions stream of ``tokens`` one-token events, ``delay_s`` apart (ends with [DONE])."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def complete() -> StreamingResponse:
        import asyncio

        async def events():
            for i in range(tokens):
                await asyncio.sleep(delay_s)
                choice = {"index": 0, "text": f"t{i}", "finish_reason": "length" if i == tokens - 1 else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_base_stream_counts_tokens_and_sees_whether_it_spanned_the_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from stitchboard.demo import lora_checks
    from tests.support.app_server import AppServer

    monkeypatch.setattr(lora_checks, "STREAM_TOKENS", 40)
    server = AppServer(_sse_app(40, 0.01))
    try:
        stream = lora_checks.BaseStream(server.url, "demo")
        stream.wait_started()
        stream.mark("resident")  # a swap of no time, in the middle of the stream
        spanned = stream.finish(30)
        assert spanned["tokens"] == 40 and spanned["finish_reason"] == "length" and spanned["error"] is None
        assert spanned["spanned_swap"] and spanned["longest_gap_ms"] < 5000
        late = lora_checks.BaseStream(server.url, "demo")
        late.wait_started()
        time.sleep(1.0)  # the stream ends before the version is resident
        late.mark("resident")
        assert not late.finish(30)["spanned_swap"]
    finally:
        server.stop()
