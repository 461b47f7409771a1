"""The vLLM adapter against an engine busy generating: its calls wait behind the engine's steps.

vLLM answers ``/collective_rpc`` between engine steps (the engine core takes the call from its
input queue after the step it is in, and the worker runs it after its forward pass), so under
load every in-engine call waits up to a step; with 50 streams on the 2-core CPU host a
staging's poll waited longer than a control call's 10 s. Here a stand-in for vLLM's HTTP
routes answers ``stitch_staged`` only after a "step" longer than the adapter's control timeout,
and ``/is_paused`` and ``stitch_state`` only together, as at one step boundary.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request

from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
from stitchboard.sidecar.errors import EngineRequestError, EngineUnavailableError
from tests.support.app_server import AppServer

#: The adapter's control-call timeout in these tests, seconds.
CONTROL_TIMEOUT_S = 0.3
#: How long the stand-in holds each ``stitch_staged`` call (one engine step under load), seconds.
STEP_S = 1.0


class BusyEngine:
    """``/collective_rpc`` of a vLLM engine whose worker extension answers ``stitch_staged`` only
    after :data:`STEP_S`; staging is ready at the ``ready_after``-th poll (never when None)."""

    def __init__(self, ready_after: int | None) -> None:
        self.ready_after = ready_after
        self.calls: list[str] = []
        self.waits: list[float] = []  # each stitch_staged poll's wait_s

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> dict:
            body = await request.json()
            method, args = body["method"], json.loads(body["args"][0])
            self.calls.append(method)
            if method == "stitch_staged":
                self.waits.append(args.get("wait_s", 0))
            answer: dict = {"ok": True, "state": {"version": 0, "phase": "idle", "instance": "busy"}}
            if "owner" in args:  # the adapter names its lease's owner in every call
                answer["lease"] = {"holder": args["owner"], "expires_in_s": float(args.get("ttl_s", 60.0))}
            if method in ("stitch_stage", "stitch_staged"):
                polls = self.calls.count("stitch_staged")
                ready = method == "stitch_staged" and self.ready_after is not None and polls >= self.ready_after
                if method == "stitch_staged":
                    await asyncio.sleep(STEP_S)
                answer["staging"] = {"state": "ready" if ready else "running", "from_version": 0, "to_version": 1}
                if ready:
                    answer["staging"]["report"] = {"bytes": 10, "read_s": 0.01}
            return {"results": [answer]}

        return app


@pytest.fixture
def busy():
    def start(ready_after: int | None, apply_timeout_s: float) -> tuple[BusyEngine, VllmEngine]:
        engine = BusyEngine(ready_after)
        server = AppServer(engine.app())
        servers.append(server)
        adapter = VllmEngine(server.url, timeout_s=CONTROL_TIMEOUT_S, apply_timeout_s=apply_timeout_s)
        adapters.append(adapter)
        adapter.take_lease("test-busy", 60.0)  # staging changes the engine: only with its lease
        return engine, adapter

    servers: list[AppServer] = []
    adapters: list[VllmEngine] = []
    yield start
    for adapter in adapters:
        adapter.close()
    for server in servers:
        server.stop()


def test_a_staging_poll_waits_behind_an_engine_step_longer_than_a_control_call(busy):
    engine, adapter = busy(ready_after=2, apply_timeout_s=60.0)
    report = adapter.stage_patches([(["/handoff/v1.patch"], 0, 1)], poll_s=0.0)
    assert report["bytes"] == 10
    assert engine.calls.count("stitch_staged") == 2


def test_polls_wait_in_the_engine_only_while_no_request_is_in_flight(busy):
    """The sidecar's ``idle()`` is asked before each poll: the first two find requests in flight (no wait,
    ``poll_s`` apart), the next ones none (each waits in the worker up to ``IDLE_WAIT_S``)."""
    from stitchboard.sidecar.engines.base import WaitsForStaging
    from stitchboard.sidecar.engines.vllm.adapter import IDLE_WAIT_S
    from stitchboard.sidecar.engines.vllm.worker import MAX_STAGED_WAIT_S

    engine, adapter = busy(ready_after=4, apply_timeout_s=60.0)
    assert isinstance(adapter, WaitsForStaging) and 0 < IDLE_WAIT_S <= MAX_STAGED_WAIT_S
    answers = iter([False, False, True, True])
    report = adapter.stage_patches_waiting([(["/handoff/v1.patch"], 0, 1)], lambda: next(answers), poll_s=0.0)
    assert report["bytes"] == 10
    assert engine.waits == [0, 0, IDLE_WAIT_S, IDLE_WAIT_S]
    adapter.stage_patches([(["/handoff/v1.patch"], 0, 1)], poll_s=0.0)  # the plain call never waits in the engine
    assert engine.waits[4:] == [0]


def test_a_staging_that_never_ends_still_fails_at_the_apply_timeout(busy):
    engine, adapter = busy(ready_after=None, apply_timeout_s=2.5)
    with pytest.raises((EngineRequestError, EngineUnavailableError)):
        adapter.stage_patches([(["/handoff/v1.patch"], 0, 1)], poll_s=0.0)
    assert 2 <= engine.calls.count("stitch_staged") <= 4


class StepBoundaryEngine:
    """vLLM's ``/collective_rpc`` (``stitch_state``) and ``/is_paused``, each answered only once the
    other is in flight too: both wait for the same step boundary, as vLLM's engine core takes the
    calls queued during a step after it. A call that comes alone is never answered."""

    def __init__(self, paused: bool) -> None:
        self.paused = paused
        self.arrived: list[str] = []
        self._both = asyncio.Event()

    async def _boundary(self, route: str) -> None:
        self.arrived.append(route)
        if {"stitch_state", "/is_paused"} <= set(self.arrived):
            self._both.set()
        await self._both.wait()

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> dict:
            body = await request.json()
            await self._boundary(body["method"])
            return {"results": [{"ok": True, "state": {"version": 7, "phase": "idle", "instance": "step"}}]}

        @app.get("/is_paused")
        async def is_paused() -> dict:
            await self._boundary("/is_paused")
            return {"is_paused": self.paused}

        return app


@pytest.mark.parametrize("paused", [False, True])
def test_a_state_call_asks_the_worker_and_the_scheduler_at_the_same_step_boundary(paused: bool):
    engine = StepBoundaryEngine(paused)
    server = AppServer(engine.app())
    adapter = VllmEngine(server.url, timeout_s=5.0)
    try:
        state = adapter.state()
    finally:
        adapter.close()
        server.stop()
    assert (state.version, state.phase) == (7, "paused" if paused else "idle")
    assert sorted(engine.arrived) == ["/is_paused", "stitch_state"]
