"""The vLLM adapter's pause: ``/stitch/pause`` where the engine has the route, vLLM's ``/pause`` where it does not.

A stand-in for vLLM's HTTP routes without the stitchboard middleware (a vLLM started by a command
that lacks ``--middleware``) answers ``/stitch/pause`` 404; the adapter then pauses through
``/pause`` and keeps doing so. The route itself on a real vLLM: ``test_vllm_engine.py``. Here also
the middleware in front of an app: every other request passes through it untouched, and without
vLLM's dev mode the route is not answered either.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request

from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
from stitchboard.sidecar.engines.vllm.pause_route import PAUSE_PATH, StitchPauseRoute
from tests.support.app_server import AppServer


def _vllm_routes(seen: list[str]) -> FastAPI:
    """vLLM's ``/pause``, ``/resume`` and the lease's ``/collective_rpc``; every request's path is recorded."""
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next):
        seen.append(f"{request.method} {request.url.path}")
        return await call_next(request)

    @app.post("/collective_rpc")
    async def collective_rpc() -> dict:
        lease = {"holder": "test-pause", "expires_in_s": 60.0}
        return {"results": [{"ok": True, "state": {"version": 0, "phase": "idle", "instance": "i"}, "lease": lease}]}

    @app.post("/pause")
    async def pause(mode: str = "abort") -> dict:
        return {"status": "paused", "mode": mode}

    return app


def test_an_engine_without_the_route_is_paused_through_vllms_own_pause():
    seen: list[str] = []
    server = AppServer(_vllm_routes(seen))
    adapter = VllmEngine(server.url, timeout_s=5.0)
    try:
        adapter.take_lease("test-pause", 60.0)
        seen.clear()
        adapter.pause()
        assert seen == [f"POST {PAUSE_PATH}", "POST /pause"]
        assert adapter.pause_path == "/pause"
        adapter.pause_keeping_cache()  # remembered: vLLM's route only
        assert seen[2:] == ["POST /pause"]
    finally:
        adapter.close()
        server.stop()


@pytest.mark.parametrize("dev_mode", ["0", "1"])
def test_the_middleware_passes_every_other_request_through(monkeypatch, dev_mode):
    """Other paths and methods reach the app unchanged; without ``VLLM_SERVER_DEV_MODE`` the route is the app's
    too (vLLM answers 404), as vLLM's own ``/pause`` is off then."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", dev_mode)
    seen: list[str] = []
    app = _vllm_routes(seen)
    app.add_middleware(StitchPauseRoute)
    server = AppServer(app)
    try:
        assert httpx.post(f"{server.url}/pause", params={"mode": "keep"}).json() == {"status": "paused", "mode": "keep"}
        assert httpx.get(f"{server.url}{PAUSE_PATH}").status_code == 404  # a GET: the app's, no such route there
        answer = httpx.post(f"{server.url}{PAUSE_PATH}", params={"mode": "keep"})
        assert answer.status_code == 404  # passed on: dev mode off, or (on) an app without an engine client
        assert seen == ["POST /pause", f"GET {PAUSE_PATH}", f"POST {PAUSE_PATH}"]
    finally:
        server.stop()
