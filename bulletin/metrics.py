"""Prometheus metrics of one bulletin process (its own registry, so several apps can coexist).

Label values come only from bounded sets or from runs that exist in the store, never from what
an unauthenticated request names: a rejected publish to a run without versions counts under
``run="other"`` (:data:`OTHER`), a request's method outside :data:`METHODS` as ``OTHER``,
a path no route matches as ``unmatched``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .body_caps import UNMATCHED
from .stores import Store

#: The label value standing for any run that does not exist, or any method outside :data:`METHODS`.
OTHER = "other"
#: HTTP methods that get a label value of their own.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})


class StoredBytesCollector(Collector):
    """``stitch_bulletin_bytes_stored{run}``: bytes of blobs per run, from a store listing cached ``ttl_s`` seconds."""

    def __init__(self, store: Store, ttl_s: float = 60.0) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._sizes: dict[str, int] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            if time.monotonic() - self._at > self._ttl_s:
                self._sizes = {
                    run: sum(o.size_bytes for o in self._store.list(f"runs/{run}/blobs/"))
                    for run in self._store.list_dirs("runs/")
                }
                self._at = time.monotonic()
            sizes = dict(self._sizes)
        family = GaugeMetricFamily(
            "stitch_bulletin_bytes_stored",
            "Bytes of blobs stored per run (refreshed at most once a minute).",
            labels=["run"],
        )
        for run, size in sizes.items():
            family.add_metric([run], size)
        yield family


class BulletinMetrics:
    """The counters, gauges and histograms the app updates; :attr:`registry` is what ``/metrics`` exposes."""

    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.publishes = Counter(
            "stitch_bulletin_publishes",
            "Publish requests by outcome (created, noop, rejected); "
            f"run={OTHER!r}: rejected for a run with no version.",
            ["run", "outcome"],
            registry=r,
        )
        self.latest_version = Gauge(
            "stitch_bulletin_latest_version",
            "Latest committed version per run seen by this process.",
            ["run"],
            registry=r,
        )
        self.blob_bytes_received = Counter(
            "stitch_bulletin_blob_bytes_received", "Blob bytes received and verified by this process.", registry=r
        )
        self.waiters = Gauge("stitch_bulletin_waiters", "Long-poll requests currently waiting.", registry=r)
        self.request_body_bytes = Counter(
            "stitch_bulletin_request_body_bytes",
            f"Request body bytes read, by route template ({UNMATCHED!r}: a path no route matches); the body rule "
            "stops reading each body at its route's cap (body_caps.py).",
            ["route"],
            registry=r,
        )
        self.bodies_refused = Counter(
            "stitch_bulletin_bodies_refused",
            "Requests answered 413 PayloadTooLarge by the body rule before the route ran, by route template.",
            ["route"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "stitch_bulletin_request_seconds",
            "Request latency by method, route and status, seconds (long-polls include their wait).",
            ["method", "route", "status"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        r.register(StoredBytesCollector(store))


class LatencyMiddleware:
    """Pure ASGI middleware observing :attr:`BulletinMetrics.request_seconds` per route template."""

    def __init__(self, app: ASGIApp, metrics: BulletinMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"] if scope["method"] in METHODS else OTHER
            self.metrics.request_seconds.labels(method, route, str(status)).observe(time.perf_counter() - start)
