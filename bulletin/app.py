"""The bulletin service: :func:`create_app` builds the FastAPI app (nothing is created at import).

Routes live in :mod:`.routes_versions` (versions, long-poll, plans, runs) and
:mod:`.routes_blobs` (blob upload/download), :mod:`.routes_squash` (squashes);
the state they share and the token checks, in :mod:`.deps`. This module adds the ops routes
(``/healthz``, ``/readyz``, ``/metrics``) and the error handlers. Every error answer is JSON
``{"type", "message", ...}`` (:class:`stitchboard.proto.schema.ErrorBody`); the OpenAPI
document is at ``/openapi.json``. Every request body is read only up to its route's cap
(:func:`body_caps`, :mod:`.body_caps`), before any token check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from stitchboard.proto.env import RENAMED_ENV

from .auth import Authorizer
from .body_caps import BodyCaps, Cap, Refusal
from .cache_headers import DefaultNoStore
from .deps import BulletinState
from .errors import BulletinError, PayloadTooLargeError
from .fleet import FleetStore
from .fleet_watch import FleetWatcher
from .ledger import Ledger
from .longpoll import Watcher
from .longpoll_asgi import LongPollFastPath
from .metrics import BulletinMetrics, LatencyMiddleware
from .page import router as page_router
from .routes_blobs import router as blobs_router
from .routes_fleet import router as fleet_router
from .routes_relay import router as relay_router
from .routes_squash import router as squash_router
from .routes_versions import router as versions_router
from .settings import BulletinSettings, ignored_env_names
from .stores import Store, open_store

log = logging.getLogger("stitchboard.bulletin")


def _error(status: int, type_: str, message: str, **details: object) -> JSONResponse:
    return JSONResponse({"type": type_, "message": message, **details}, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BulletinError)
    async def _bulletin_error(request: Request, exc: BulletinError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:10])
        return _error(422, "InvalidRequest", f"invalid request: {problems}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        names = {404: "NotFound", 405: "MethodNotAllowed"}
        return _error(
            exc.status_code,
            names.get(exc.status_code, "InvalidRequest" if exc.status_code < 500 else "BulletinError"),
            str(exc.detail),
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "InternalError", f"internal error ({type(exc).__name__}); see the bulletin log")


def body_caps(settings: BulletinSettings) -> dict[tuple[str, str], Cap]:
    """The routes that take a body and their caps (every other route takes none: ``docs/reference/limits.md``)."""

    def cap(field: str) -> Cap:
        return Cap(getattr(settings, field), f"{BulletinSettings.model_config['env_prefix']}{field.upper()}")

    return {
        ("PUT", "/v1/runs/{run}/blobs/{sha256}"): cap("max_blob_bytes"),
        ("POST", "/v1/runs/{run}/versions"): cap("max_manifest_bytes"),
        ("PUT", "/v1/runs/{run}/squashes/{base}/{target}"): cap("max_manifest_bytes"),
        ("PUT", "/v1/runs/{run}/replicas/{replica_id}"): cap("max_report_bytes"),
        ("POST", "/status/login"): cap("max_login_bytes"),
    }


def _refuse_body(metrics: BulletinMetrics, refusal: Refusal) -> JSONResponse:
    metrics.bodies_refused.labels(refusal.route).inc()
    details: dict[str, Any] = {"limit_bytes": refusal.cap.limit_bytes}
    if refusal.cap.setting:
        details["setting"] = refusal.cap.setting
    if "run" in refusal.path_params:
        details["run_id"] = refusal.path_params["run"]
    exc = PayloadTooLargeError(refusal.message, **details)
    return JSONResponse(exc.body(), status_code=exc.status)


def _remove_stale_uploads(folder: Path, older_than_s: float) -> None:
    # Partial uploads left by a crashed process (live ones are written to continuously).
    cutoff = time.time() - older_than_s
    for path in folder.glob(".*"):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mtime < cutoff:
                path.unlink()


def _warn_ignored_env() -> None:
    """Log a warning for every ``STITCH_BULLETIN_*`` variable of this process that no setting reads."""
    renamed_from = {legacy: new for new, legacy in RENAMED_ENV.items()}
    for name in ignored_env_names(os.environ):
        new = renamed_from.get(name.upper())
        hint = (
            f": it is the legacy name of a client's {new}, not a bulletin setting"
            if new
            else ": no bulletin setting has this name"
        )
        log.warning("ignoring %s%s", name, hint)


def create_app(settings: BulletinSettings | None = None, store: Store | None = None) -> FastAPI:
    """Build a bulletin app.

    Args:
        settings: configuration (default: read from ``STITCH_BULLETIN_*`` env vars).
        store: the object store (default: :func:`open_store` of ``settings.store``).

    Raises:
        InvalidRequestError: the store URL is not understood.
    """
    settings = settings or BulletinSettings()
    store = store or open_store(settings.store, settings)
    if settings.upload_tmp_dir:
        upload_dir = Path(settings.upload_tmp_dir)
    else:
        upload_dir = store.upload_dir or Path(tempfile.gettempdir()) / "stitchboard-uploads"
    upload_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(
        store, max_manifest_bytes=settings.max_manifest_bytes, cache_entries=settings.manifest_cache_entries
    )
    metrics = BulletinMetrics(store)
    fleet = FleetWatcher(
        FleetStore(store, upload_dir, settings.replica_lease_s, settings.replica_forget_s),
        ledger,
        settings.fleet_poll_interval_s,
    )
    state = BulletinState(
        settings,
        store,
        ledger,
        Watcher(ledger, settings.poll_interval_s, metrics),
        Authorizer(settings.tokens),
        metrics,
        upload_dir,
        fleet,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await to_thread.run_sync(_remove_stale_uploads, upload_dir, settings.gc_grace_s)
        if state.auth.open:
            log.warning(
                "no tokens configured (STITCH_BULLETIN_TOKENS): this bulletin accepts reads and publishes from anyone"
            )
        _warn_ignored_env()
        log.info("bulletin serving store %s", store.url)
        yield
        await state.watcher.close()

    app = FastAPI(
        title="stitchboard bulletin",
        version="1",
        description="Publishes immutable weight versions of RL runs and tells rollout engines how to reach the "
        "latest one.",
        lifespan=lifespan,
    )
    app.state.bulletin = state
    _install_error_handlers(app)
    app.include_router(versions_router)
    app.include_router(blobs_router)
    app.include_router(fleet_router)
    app.include_router(page_router)
    app.include_router(squash_router)
    app.include_router(relay_router)

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz() -> JSONResponse:
        """Readiness: the object store is reachable. With tokens configured it says only ready or not ready (no store
        URL, no error text)."""
        try:
            await to_thread.run_sync(store.check)
        except BulletinError as exc:
            if not state.auth.open:
                log.warning("not ready: %s", exc.message)
                return JSONResponse({"status": "not ready"}, status_code=503)
            return _error(503, exc.type, exc.message)
        return JSONResponse({"status": "ready", "store": store.url} if state.auth.open else {"status": "ready"})

    @app.get("/metrics", tags=["ops"])
    def metrics_endpoint(request: Request) -> Response:
        """Prometheus metrics. With tokens configured the caller needs a token with the ``metrics`` scope (401/403
        otherwise)."""
        state.auth.check(request.headers.get("authorization"), "metrics")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(LatencyMiddleware, metrics=metrics)
    app.add_middleware(
        LongPollFastPath, state=state
    )  # outside it: times the long-polls it answers itself (longpoll_asgi.py)
    app.add_middleware(
        BodyCaps,
        routes=app.router.routes,
        caps=body_caps(settings),
        refuse=partial(_refuse_body, metrics),
        body_bytes=metrics.request_body_bytes,
    )  # a body over its cap is refused before anything else runs (body_caps.py)
    app.add_middleware(DefaultNoStore)  # outermost: every answer without a policy says no-store (cache_headers.py)
    return app
