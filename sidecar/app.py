"""The sidecar service: :func:`create_app` builds the FastAPI app (nothing starts at import).

Routes (every error answer is JSON ``{"type", "message", ...}``). Answers a retry can fix (503,
409 ``WeightVersionNotReady``) carry ``Retry-After`` and ``x-should-retry: true``; other 4xx
answers of the sidecar (400, 403, 409 ``WeightVersionPassed``, 413) carry ``x-should-retry: false``,
so the OpenAI clients do not retry them:

* ``GET /health``: 200 ``{"status": "ok", ...}`` once a verified version is applied and the
  engine answers and the last sync left the sidecar healthy; else 503 with the reason. A plan
  the engine refused (the held version keeps serving) is reported under ``refused``; the
  engine's lease under ``lease`` (``owner``, ``held``, ``holder``, ``holder_expires_in_s``): a
  sidecar without it answers 503 ``standby`` naming the holder and when its lease lapses.
* ``GET /v1/stitch/status``: applied and target version, lag, state, last error, last sync.
* ``GET /metrics``: the sidecar's Prometheus metrics; ``GET /engine/metrics``: the engine's.
* the engine's model routes, gated and stamped, and its read-only routes (per engine kind,
  :mod:`.routes`; :mod:`.proxy`); any other path: 403 ``RouteForbidden``.
* with ``admin_api = "prime-rl"``: prime-rl's admin routes (``/pause``, ``/resume``, ``/update_weights``,
  LoRA 501), served by the sidecar itself (:mod:`.admin_prime_rl`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from stitchboard.bulletin.body_caps import ANY_METHOD, BodyBudget, BodyCaps, Cap, Refusal
from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.sidecar_wire import SHOULD_RETRY_HEADER

from . import admin_prime_rl
from .adapter_checks import run_kind
from .adapter_follower import AdapterFollower
from .engines import create_adapter
from .engines.base import EngineAdapter, ReplaysRouting
from .errors import BodyBudgetError, BodyTooLargeError, RouteForbiddenError, SidecarError, WeightVersionNotReadyError
from .fetch import Fetcher
from .gate import Gate
from .metrics import SidecarMetrics
from .ops_routes import add_ops_routes
from .proxy import Proxy
from .reconciler import Reconciler
from .relays import Relays
from .report import Reporter
from .routed_experts import RoutingSource
from .routes import normalise_path
from .settings import SidecarSettings

log = logging.getLogger("stitchboard.sidecar")
_ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
#: The route of every proxied request (the only one that takes a body).
PROXIED_ROUTE = "/{path:path}"


def create_app(
    settings: SidecarSettings, engine: EngineAdapter | None = None, client: BulletinClient | None = None
) -> FastAPI:
    """Build a sidecar app; the reconciler starts with the app's lifespan.

    Args:
        settings: configuration.
        engine: the engine adapter (default: :func:`.engines.create_adapter` for ``settings.engine``).
        client: the bulletin client (default: one for ``settings.bulletin``/``token``).

    Engines and clients passed in are not closed at shutdown; those created here are.
    """
    owned: list[Any] = []  # what this app created, closed at shutdown
    if engine is None:
        engine = create_adapter(settings)
        owned.append(engine)
    if client is None:
        client = BulletinClient(
            settings.bulletin, settings.token, timeout_s=settings.bulletin_timeout_s, retries=settings.bulletin_retries
        )
        owned.append(client)
    metrics = SidecarMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gate = Gate()
        relays = Relays(
            settings.relays, settings.token, metrics, timeout_s=settings.relay_timeout_s, retry_s=settings.relay_retry_s
        )  # regional blob relays, asked before the bulletin (sidecar/relays.py; none: the bulletin alone)
        fetcher = Fetcher(
            client,
            settings.run,
            Path(settings.handoff_dir) / f"sidecar-{settings.port}",
            settings.download_concurrency,
            relays,
        )
        reconciler = Reconciler(settings, client, engine, gate, metrics, fetcher)
        routing = (
            RoutingSource(engine.routed_experts, settings.engine_call_timeout_s)
            if isinstance(engine, ReplaysRouting)
            else None
        )  # vLLM: routing replay
        proxy = Proxy(
            settings,
            gate,
            metrics,
            check_engine=reconciler.check_engine,
            spans=reconciler.spans,
            salter=reconciler.salter,
            routing=routing,
        )
        app.state.gate, app.state.reconciler, app.state.proxy = gate, reconciler, proxy
        app.state.relays = relays
        reporter = (
            Reporter.for_sidecar(settings, reconciler, gate) if settings.report else None
        )  # the fleet view (sidecar/report.py)

        async def follow() -> None:
            # A full-model run is the reconciler's; an adapter run the adapter follower's (its own
            # loop; sidecar/adapter_follower.py), which then stands where the reconciler stood.
            spec = await run_kind(client, settings, engine, reconciler.status, reconciler.pools)
            if spec is None:
                await reconciler.run()
                return
            follower = AdapterFollower(settings, client, engine, gate, metrics, fetcher, spec)
            app.state.reconciler, proxy.adapters = follower, follower.resident
            if reporter is not None:
                reporter.follow(follower)
            try:
                await follower.run()
            finally:
                follower.close()

        task = asyncio.create_task(follow(), name="stitch-reconciler")
        reporting = asyncio.create_task(reporter.run_forever(), name="stitch-report") if reporter else None
        log.info(
            "sidecar following run %r at %s for the engine at %s", settings.run, settings.bulletin, settings.engine_url
        )
        try:
            yield
        finally:
            for running in (task, reporting):
                if running is not None:
                    running.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await running
            if reporter is not None:
                await reporter.aclose()
            await proxy.aclose()
            reconciler.close()
            fetcher.close()
            relays.close()
            for resource in owned:
                resource.close()

    app = FastAPI(
        title="stitchboard sidecar",
        version="1",
        description="Keeps one engine at the run's latest weight version and gates requests by version.",
        lifespan=lifespan,
    )
    app.state.metrics = metrics

    def error_answer(exc: SidecarError) -> JSONResponse:
        metrics.requests_rejected.labels(exc.type).inc()
        headers = None
        if exc.status == 503 or isinstance(exc, WeightVersionNotReadyError):  # a later attempt can succeed
            headers = {"Retry-After": str(settings.retry_after_s), SHOULD_RETRY_HEADER: "true"}
        elif 400 <= exc.status < 500:  # the same request fails the same way
            headers = {SHOULD_RETRY_HEADER: "false"}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(SidecarError)
    async def _sidecar_error(request: Request, exc: SidecarError) -> JSONResponse:
        return error_answer(exc)

    def refuse_body(refusal: Refusal) -> JSONResponse:  # the body rule's answers (bulletin/body_caps.py)
        if refusal.reason == "budget":
            return error_answer(BodyBudgetError(refusal.message, budget_bytes=refusal.budget_bytes))
        return error_answer(
            BodyTooLargeError(refusal.message, limit_bytes=refusal.cap.limit_bytes, setting=refusal.cap.setting)
        )

    add_ops_routes(app, settings, engine, metrics)  # /health, /v1/stitch/status, /metrics, /engine/metrics

    admin_caps = admin_prime_rl.register(app, settings, client)  # STITCH_SIDECAR_ADMIN_API; before the catch-all

    @app.api_route(PROXIED_ROUTE, methods=_ALL_METHODS, include_in_schema=False)
    async def proxied(request: Request, path: str) -> Response:
        """Engine routes: OpenAI routes gated and stamped, read-only routes as they are, the rest 403
        (paths normalised first, dot segments 400; bodies over ``max_body_bytes`` get 413 and wait for
        room in ``body_budget_bytes``, before this runs: the body rule)."""
        route = normalise_path(
            request.scope.get("raw_path", b"").decode("latin-1").split("?", 1)[0] or request.url.path
        )
        proxy: Proxy = request.app.state.proxy
        kind = proxy.routes.kind(request.method, route)
        if kind == "model":
            return await proxy.forward_model(request, route, await request.body())
        if kind == "read":
            return await proxy.forward_plain(request, route, await request.body())
        raise RouteForbiddenError(
            f"{request.method} {route} is not forwarded: the sidecar serves inference and read-only routes; engine "
            "control (pause, weight updates, sleep...) is the sidecar's alone",
            method=request.method,
            path=route,
        )

    budget = BodyBudget(settings.body_budget_bytes, settings.body_budget_wait_s)
    metrics.body_budget_held.set_function(lambda: budget.held_bytes)
    app.add_middleware(
        BodyCaps,
        routes=app.router.routes,
        caps={(ANY_METHOD, PROXIED_ROUTE): Cap(settings.max_body_bytes, "STITCH_SIDECAR_MAX_BODY_BYTES"), **admin_caps},
        refuse=refuse_body,
        body_bytes=metrics.request_body_bytes,
        budget=budget,
    )  # every body read up to its cap, and the bodies in flight within the budget, before the app runs
    return app
