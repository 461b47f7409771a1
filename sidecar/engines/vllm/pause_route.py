"""``POST /stitch/pause``: vLLM's pause without its fixed 20 ms sleep (runs in vLLM's API server process).

Loaded by vLLM as ASGI middleware: ``--middleware stitchboard.sidecar.engines.vllm.pause_route.StitchPauseRoute``
(:data:`.launch.PAUSE_MIDDLEWARE`; :func:`.launch.vllm_command` adds it with the worker extension).

vLLM 0.32's ``POST /pause`` (``AsyncLLM.pause_generation``) asks the engine core to pause its
scheduler and then sleeps 20 ms, which vLLM's own comment calls "not required for correctness":
outputs of requests that finished before the pause reach their callers first. The sidecar needs
no such ordering. With ``mode=keep`` no request finishes at the pause (those in flight are frozen),
and the tokens each request had produced at the pause are counted in the workers
(``stitch_output_counts``), not from what the server has sent. The sleep was 20 of the ~26 ms the
pause call took in each SmolLM2 sync on the 2-core CPU host, inside the window in which the
sidecar holds its requests.

This route does what vLLM's ``/pause`` does (clears the multi-modal cache when ``clear_cache``,
then ``engine_core.pause_scheduler_async(mode, clear_cache)``) and answers at once. Like ``/pause``
it answers only with ``VLLM_SERVER_DEV_MODE=1`` (otherwise the request goes on to vLLM, which
answers 404); the sidecar never proxies it (its route allow-list). A vLLM whose engine client
lacks these calls (another release) also gets the request passed on; the adapter then falls back
to ``/pause`` (:meth:`.adapter.VllmEngine.pause`).

A pure ASGI middleware, not ``@app.middleware("http")``: every other request, streamed ones
included, passes through with one path comparison.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.datastructures import QueryParams
from starlette.responses import JSONResponse

__all__ = ["PAUSE_PATH", "StitchPauseRoute"]

log = logging.getLogger("stitchboard.sidecar.engines.vllm.pause_route")

#: The route this middleware answers (``POST``; query ``mode``: ``abort``, ``wait`` or ``keep``; ``clear_cache``).
PAUSE_PATH = "/stitch/pause"
#: The pause modes of vLLM 0.32's ``/pause`` (``vllm.v1.engine.PauseMode``).
MODES = ("abort", "wait", "keep")


def _dev_mode() -> bool:
    """Whether vLLM's dev routes are on (``VLLM_SERVER_DEV_MODE``), as vLLM reads it."""
    from vllm import envs

    return bool(envs.VLLM_SERVER_DEV_MODE)


class StitchPauseRoute:
    """ASGI middleware answering ``POST /stitch/pause`` from vLLM's engine client; every other request goes to
    ``app``.

    Answers (JSON): 200 ``{"status": "paused"}``; 400 ``{"error": ...}`` for a ``mode`` outside :data:`MODES` or a
    ``clear_cache`` other than ``true``/``false``; 500 ``{"error": ...}`` when the engine fails to pause.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._dev_mode: bool | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != PAUSE_PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if self._dev_mode is None:
            self._dev_mode = _dev_mode()
        engine = getattr(scope["app"].state, "engine_client", None)
        core = getattr(engine, "engine_core", None)
        if not self._dev_mode or not hasattr(core, "pause_scheduler_async") or not hasattr(engine, "renderer"):
            await self.app(scope, receive, send)  # vLLM answers 404: the adapter uses /pause
            return
        response = await self._pause(engine, core, scope)
        await response(scope, receive, send)

    @staticmethod
    async def _pause(engine: Any, core: Any, scope: dict[str, Any]) -> JSONResponse:
        query = QueryParams(scope.get("query_string", b""))
        mode, clear = query.get("mode", "abort"), query.get("clear_cache", "true").lower()
        if mode not in MODES or clear not in ("true", "false"):
            return JSONResponse(
                {"error": f"mode must be one of {list(MODES)} and clear_cache true or false, got {mode!r}, {clear!r}"},
                status_code=400,
            )
        try:
            if clear == "true":
                await engine.renderer.clear_mm_cache_async()
            await core.pause_scheduler_async(mode=mode, clear_cache=clear == "true")
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except Exception as exc:  # answered as vLLM's /pause answers it
            log.exception("%s: the engine failed to pause", PAUSE_PATH)
            return JSONResponse({"error": f"failed to pause generation: {exc}"}, status_code=500)
        return JSONResponse({"status": "paused"})
