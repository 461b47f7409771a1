"""prime-rl's admin API on the sidecar (sidecar process), opt-in: ``STITCH_SIDECAR_ADMIN_API=prime-rl``.

prime-rl's orchestrator (PrimeIntellect-ai/prime-rl ``src/prime_rl/utils/client.py``) drives each
inference server through routes at the server's root. With this setting a sidecar answers them
itself, so a fleet of sidecars serves as prime-rl's inference servers (docs/integrations/prime-rl.md);
off (the default), none is registered and each stays a 403 ``RouteForbidden`` of the catch-all route:

* ``POST /pause?mode=keep&clear_cache=false``: closes admission of new model requests (the route
  table's ``model`` routes): each is held before the proxy, as during a commit, until ``/resume`` or
  its wait (``X-Stitch-Wait-S``, else ``request_wait_s``; at most ``max_request_wait_s``) runs out:
  then 503 ``NotReady``. Requests in flight run on. ``mode`` ``keep`` or ``wait`` (both leave
  requests in flight to finish); ``clear_cache`` is ignored: the sidecar salts or resets the
  prefix cache at its commits (:mod:`.salt`).
* ``POST /resume``: reopens admission; held requests go on to the gate.
* ``POST /update_weights {"weight_dir": ".../step_N"}`` (or ``.../step_N/weight``, prime-rl's
  checkpoint folder on resume): asks the bulletin for the first version whose manifest records step
  N or later (``GET /v1/runs/{run}/versions?step=N``), asking again whenever the sidecar learns of a newer
  version (the reconciler follows the bulletin: one follower for every wait), and answers 200
  ``{"status", "step", "version", "applied_version"}`` once the sidecar's applied, verified version is
  that one or later; 503 ``StepNotApplied`` past ``admin_update_wait_s`` (prime-rl retries 5xx),
  409 ``StepRefused`` when the engine refused that version for good (:mod:`.refusals`), 422
  ``InvalidAdminRequest`` for a body it cannot read (not JSON, nested too deep, a step not in ASCII
  digits). The sidecar applies versions as it always does (following the bulletin); this route only
  waits for one, on the event loop: its lookups run on threads of their own (:data:`.admin_steps.ADMIN_LOOKUP_THREADS`),
  so any number of waits never holds the executor that ``/health``'s engine call and the claim check use.
* ``POST /load_lora_adapter {"lora_name", "lora_path"}``, ``POST /v1/unload_lora_adapter {"lora_name"}`` (an
  adapter run): ``lora_name`` stands for the version of ``lora_path``'s step once it is resident, pinned until
  unloaded (:mod:`.admin_prime_rl_lora`).
* ``GET /health`` and ``GET /v1/models`` are the sidecar's own and the engine's (unchanged); prime-rl
  checks that ``/v1/models``'s ``data`` lists an ``id`` equal to its model name.

No route here calls the engine: its pause, resume and weight routes are the reconciler's alone
(DESIGN.md invariant 1). Every body is capped at :data:`ADMIN_BODY_CAP` (``bulletin/body_caps.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from stitchboard.bulletin.body_caps import Cap
from stitchboard.bulletin.client import BulletinClient

from .admin_prime_rl_lora import lora_router
from .admin_steps import APPLIED_POLL_S, EXPECTED_WEIGHT_DIR, step_of_weight_dir, version_of_step
from .errors import (
    InvalidAdminRequestError,
    InvalidPathError,
    InvalidVersionConstraintError,
    NotReadyError,
    SidecarError,
    StepNotAppliedError,
    StepRefusedError,
)
from .gate import Gate, parse_constraint
from .reconciler import Reconciler
from .routes import normalise_path
from .settings import SidecarSettings

log = logging.getLogger("stitchboard.sidecar")

#: The body cap of every admin route that takes a body, bytes (prime-rl's bodies are a path or two).
ADMIN_BODY_CAP = Cap(4 * 1024)
PAUSE_MODES = ("keep", "wait")
LORA_ROUTES = ("/load_lora_adapter", "/v1/unload_lora_adapter")


def _weight_dir_of(body: bytes) -> Any:
    """``weight_dir`` of an ``/update_weights`` body (other keys are ignored)."""
    try:
        data = json.loads(body) if body else None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
        data = None
    if not isinstance(data, dict) or "weight_dir" not in data:
        raise InvalidAdminRequestError(
            f"the body of POST /update_weights must be a JSON object with weight_dir, got {body[:80]!r}; expected "
            f"{EXPECTED_WEIGHT_DIR}",
            field="body",
            value=body[:80].decode("utf-8", "replace"),
        )
    return data["weight_dir"]


class AdminPause:
    """Whether prime-rl has paused new model requests (event-loop only).

    Attributes:
        paused: True between ``/pause`` and ``/resume``.
        held: model requests held by the pause now.
    """

    def __init__(self) -> None:
        self.paused = False
        self.held = 0
        self._resumed = asyncio.Event()
        self._resumed.set()

    def pause(self) -> None:
        """Close admission of new model requests (again: no change)."""
        self.paused = True
        self._resumed.clear()

    def resume(self) -> None:
        """Reopen admission and let the held requests go on."""
        self.paused = False
        self._resumed.set()

    async def hold(self, wait_s: float) -> bool:
        """Wait while paused, at most ``wait_s`` seconds; True once admission is open."""
        if not self.paused:
            return True
        self.held += 1
        try:
            await asyncio.wait_for(self._resumed.wait(), wait_s)
            return True
        except TimeoutError:
            return False
        finally:
            self.held -= 1


class PauseHold:
    """ASGI layer holding new model requests while :class:`AdminPause` is paused (inside the body rule's
    layer: nothing of a held request's body is read or counted against the budget while it waits).

    Args:
        app: the rest of the app.
        pause: the pause state the admin routes set.
        settings: the sidecar's settings (``request_wait_s``, ``max_request_wait_s``).
    """

    def __init__(self, app: ASGIApp, *, pause: AdminPause, settings: SidecarSettings) -> None:
        self.app, self.pause, self.settings = app, pause, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.pause.paused and self._is_model_request(scope):
            try:
                constraint = parse_constraint(Headers(scope=scope), None)
            except InvalidVersionConstraintError:
                constraint = None  # the proxy answers it 400
            if constraint is not None:
                wanted = constraint.wait_s if constraint.wait_s is not None else self.settings.request_wait_s
                wait_s = min(wanted, self.settings.max_request_wait_s)
                if not await self.pause.hold(wait_s):
                    exc = NotReadyError(
                        f"new requests are paused by the orchestrator (POST /pause; held {wait_s:g} s): they are "
                        "admitted again after POST /resume",
                        applied_version=None,
                        target_version=None,
                    )
                    app = scope["app"]
                    response = await app.exception_handlers[SidecarError](Request(scope), exc)  # the app's answer
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    def _is_model_request(scope: Scope) -> bool:
        raw = scope.get("raw_path", b"").decode("latin-1").split("?", 1)[0] or scope["path"]
        try:
            route = normalise_path(raw)
        except InvalidPathError:
            return False  # the app answers it 400
        proxy = getattr(scope["app"].state, "proxy", None)
        return proxy is not None and proxy.routes.kind(scope["method"], route) == "model"


async def wait_for_step(
    step: int, client: BulletinClient, settings: SidecarSettings, gate: Gate, reconciler: Reconciler
) -> dict[str, Any]:
    """Wait until the sidecar's applied, verified version is the version of training ``step`` or later,
    at most ``settings.admin_update_wait_s`` seconds; returns the answer's body.

    Raises:
        StepNotAppliedError: no version at ``step`` or later was published, or its version was not applied, in time.
        StepRefusedError: the engine refused that version (or a later one with its tensor set) for good.
    """
    loop = asyncio.get_running_loop()
    wait_s = settings.admin_update_wait_s
    deadline = loop.time() + wait_s
    info, problem = await version_of_step(client, settings, gate, step, deadline)
    if info is None:
        raise StepNotAppliedError(
            f"no version of run {settings.run!r} records step {step} or later after {wait_s:g} s"
            f"{f' ({problem})' if problem else ''}: is `stitchboard watch --layout prime-rl` publishing the trainer's "
            "broadcast folder to this run? Retry once it has published the step",
            step=step,
            version=None,
            applied_version=gate.applied,
            wait_s=wait_s,
        )
    version = info.version
    while True:
        applied = gate.applied
        if applied is not None and applied >= version:
            return {"status": "ok", "step": step, "version": version, "applied_version": applied}
        refused = reconciler.refused
        if refused is not None and refused.permanent and refused.to_version >= version:
            raise StepRefusedError(
                f"step {step} is version {version} of run {settings.run!r}, and the engine refused version "
                f"{refused.to_version} for good ({refused.type}: {refused.message}); the sidecar holds version "
                f"{applied}. Publish a version whose tensors the engine serves (an anchor of this model), or point the "
                "run at an engine serving the trainer's model",
                step=step,
                version=version,
                refused_version=refused.to_version,
                applied_version=applied,
                cause=refused.type,
            )
        remaining = deadline - loop.time()
        if remaining <= 0:
            why = reconciler.unhealthy_reason or reconciler.state
            raise StepNotAppliedError(
                f"step {step} is version {version} of run {settings.run!r}, not applied after {wait_s:g} s: the "
                f"sidecar holds version {applied} ({why}); see its /health and /v1/stitch/status. Retry later",
                step=step,
                version=version,
                applied_version=applied,
                wait_s=wait_s,
            )
        await asyncio.sleep(min(APPLIED_POLL_S, remaining))


def register(app: FastAPI, settings: SidecarSettings, client: BulletinClient) -> dict[tuple[str, str], Cap]:
    """Serve prime-rl's admin routes on ``app`` when ``settings.admin_api`` is ``prime-rl`` (otherwise add
    nothing). Call it before the catch-all route is added, so that these routes match first.

    Returns:
        the body caps of the routes added, for the app's body rule (``{}`` when off).
    """
    if settings.admin_api != "prime-rl":
        return {}
    pause = AdminPause()
    app.state.admin_pause = pause
    app.add_middleware(PauseHold, pause=pause, settings=settings)
    router = APIRouter(tags=["prime-rl admin"])

    @router.post("/pause")
    async def pause_requests(mode: str = "keep") -> dict[str, Any]:
        """Hold new model requests until ``/resume`` (in-flight ones finish); the engine is not paused
        (``clear_cache`` and other query parameters are ignored)."""
        if mode not in PAUSE_MODES:
            raise InvalidAdminRequestError(
                f"pause mode {mode!r} is not served: the sidecar holds new requests and lets those in flight finish "
                f"(mode {' or '.join(PAUSE_MODES)}); it never aborts requests",
                field="mode",
                value=mode,
            )
        pause.pause()
        log.info("prime-rl /pause: new model requests are held until /resume")
        return {"status": "paused", "requests_held": pause.held}

    @router.post("/resume")
    async def resume_requests() -> dict[str, Any]:
        """Admit new model requests again (the held ones go on to the gate)."""
        held = pause.held
        pause.resume()
        log.info("prime-rl /resume: admission reopened (%d requests were held)", held)
        return {"status": "resumed", "requests_released": held}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        """Answer once the version of ``weight_dir``'s step N is applied and verified (see the module docstring)."""
        step = step_of_weight_dir(_weight_dir_of(await request.body()))
        state = request.app.state
        try:
            body = await wait_for_step(step, client, settings, state.gate, state.reconciler)
        except SidecarError as exc:
            log.warning("prime-rl /update_weights for step %d: %s: %s", step, exc.type, exc)
            raise
        log.info("prime-rl /update_weights: step %d is version %d, applied", step, body["version"])
        return JSONResponse(body)

    app.include_router(router)
    app.include_router(lora_router(settings, client))
    return {("POST", route): ADMIN_BODY_CAP for route in ("/update_weights", *LORA_ROUTES)}
