"""The sidecar's ops routes (sidecar process): ``GET /health``, ``GET /v1/stitch/status``,
``GET /metrics`` and ``GET /engine/metrics`` (their bodies: :mod:`stitchboard.proto.sidecar_wire`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stitchboard.proto.sidecar_wire import Health, HealthStatus, LeaseView, SidecarStatus

from .adapter_follower import AdapterFollower
from .engines.base import EngineAdapter
from .gate import Gate
from .metrics import SidecarMetrics
from .reconciler import Reconciler
from .settings import SidecarSettings


def add_ops_routes(app: FastAPI, settings: SidecarSettings, engine: EngineAdapter, metrics: SidecarMetrics) -> None:
    """Add the ops routes to ``app`` (whose state holds the ``gate``, ``reconciler`` and ``proxy``
    once its lifespan has started)."""

    def unhealthy(health: Health) -> JSONResponse:
        return JSONResponse(health.wire(), status_code=503, headers={"Retry-After": str(settings.retry_after_s)})

    @app.get("/health", tags=["ops"], response_model=Health)
    async def health(request: Request) -> JSONResponse:
        """200 when this sidecar holds the engine's lease, a verified version is applied, the
        engine is still the instance at that version (checked now, unless a commit or a check is
        under way), is not slow to answer a check, answers its health check, and syncing is
        healthy; else 503 with the reason."""
        reconciler: Reconciler | AdapterFollower = request.app.state.reconciler
        gate: Gate = request.app.state.gate
        applied = gate.applied
        follower = reconciler if isinstance(reconciler, AdapterFollower) else None
        body: dict[str, Any] = {
            "applied_version": applied,
            "state": reconciler.state,
            "lease": LeaseView(**reconciler.lease.body()),
            "refused": reconciler.refused,
            "relays": request.app.state.relays.body(),
            "adapters": None if follower is None else follower.health_body(),
        }

        def answer(status: HealthStatus, reason: str, **changed: Any) -> JSONResponse:
            return unhealthy(Health(**{**body, **changed}, status=status, reason=reason))

        if not reconciler.lease.held and reconciler.lease.holder is not None:  # another sidecar holds the engine
            return answer("standby", reconciler.lease.reason())
        body["squash_quarantine"] = reconciler.quarantine.body() or None
        if reconciler.unhealthy_reason:
            return answer("unhealthy", reconciler.unhealthy_reason)
        if applied is None:
            status: HealthStatus = "recovering" if reconciler.state == "recovering" else "starting"
            return answer(status, "no verified weight version applied" if follower is None else "no adapter resident")
        if gate.stalled:
            return answer(
                "engine_slow",
                f"the engine has not answered a state check in {settings.engine_call_timeout_s:g} s: new requests are "
                "held until it does",
            )
        if not reconciler.engine_busy:  # the engine is still the instance, at the version, verified?
            dropped = await reconciler.check_engine()
            if dropped is not None:
                return answer("engine_changed", dropped, applied_version=None, state=reconciler.state)
        try:
            ok = await asyncio.wait_for(asyncio.to_thread(engine.health), settings.engine_call_timeout_s)
            reason = "the engine's health check failed"
        except Exception as exc:  # noqa: BLE001 - any failure means the engine is not healthy
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            return answer("engine_unhealthy", reason)
        return JSONResponse(Health(**body, status="ok").wire())

    @app.get("/v1/stitch/status", tags=["ops"])
    async def status(request: Request) -> SidecarStatus:
        """Applied and target version, lag, state, last error, the last sync's bytes and seconds, and
        the requests in flight and held (waiting for their version)."""
        reconciler: Reconciler | AdapterFollower = request.app.state.reconciler
        gate: Gate = request.app.state.gate
        lag = None if gate.target is None else gate.target - (gate.applied if gate.applied is not None else -1)
        return SidecarStatus(
            run_id=settings.run, applied_version=gate.applied, target_version=gate.target, lag_versions=lag,
            state=reconciler.state,
            healthy=reconciler.unhealthy_reason is None and gate.applied is not None,
            unhealthy_reason=reconciler.unhealthy_reason,
            last_error=reconciler.last_error and reconciler.last_error.body(), last_sync=reconciler.last_sync,
            requests_in_flight=gate.in_flight, requests_waiting=gate.waiting,
            committing=gate.committing, time=time.time(), refused=reconciler.refused,
            pause_seconds_by_route=dict(reconciler.pause_by_route),
        )  # fmt: skip

    @app.get("/metrics", tags=["ops"])
    def metrics_endpoint() -> Response:
        """The sidecar's Prometheus metrics."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/engine/metrics", tags=["ops"])
    async def engine_metrics(request: Request) -> Response:
        """The engine's own ``/metrics``, passed through."""
        proxy = request.app.state.proxy
        response: Response = await proxy.forward_plain(request, "/metrics")
        return response
