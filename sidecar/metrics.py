"""Prometheus metrics of one sidecar (its own registry, so several apps can coexist in a process).

Versions are exported as gauges with ``-1`` meaning "none" (nothing applied or known yet).
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info

from stitchboard.proto.sidecar_wire import ROUTE_KINDS, SidecarState

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class SidecarMetrics:
    """The counters, gauges and histograms the sidecar updates; :attr:`registry` is what ``/metrics`` exposes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.applied_version = Gauge(
            "stitch_sidecar_applied_version", "Verified version the engine holds (-1: none).", registry=r
        )
        self.target_version = Gauge(
            "stitch_sidecar_target_version", "Newest version known at the bulletin (-1: none).", registry=r
        )
        self.lag_versions = Gauge(
            "stitch_sidecar_lag_versions",
            "Target minus applied version (target + 1 while nothing is applied).",
            registry=r,
        )
        self.healthy = Gauge(
            "stitch_sidecar_healthy",
            "1 when the engine answers and the last sync did not leave the sidecar unhealthy.",
            registry=r,
        )
        self.state = Enum(
            "stitch_sidecar_state",
            "What the sidecar is doing (its status's state: idle, staging, committing, retrying...).",
            states=list(get_args(SidecarState)),
            registry=r,
        )
        self.in_flight = Gauge("stitch_sidecar_requests_in_flight", "Admitted requests not yet completed.", registry=r)
        self.bytes_fetched = Counter(
            "stitch_sidecar_bytes_fetched", "Bytes downloaded from the bulletin and verified.", registry=r
        )
        self.commits = Counter(
            "stitch_sidecar_commits",
            "Commits by outcome (applied, flipped: empty deltas only, failed).",
            ["outcome"],
            registry=r,
        )
        self.claims_dropped = Counter(
            "stitch_sidecar_claims_dropped",
            "Times the applied version was withdrawn because the engine restarted, changed its record or stopped "
            "answering.",
            registry=r,
        )
        self.recoveries = Counter(
            "stitch_sidecar_recoveries", "Anchor recoveries by outcome (ok, failed).", ["outcome"], registry=r
        )
        self.pause_seconds = Histogram(
            "stitch_sidecar_pause_seconds",
            "Time the engine spent paused per commit, seconds, by route kind (delta, staged_anchor, anchor, recovery).",
            ["route"],
            buckets=_SECONDS,
            registry=r,
        )
        self.refusals = Counter(
            "stitch_sidecar_refusals",
            "Plans the engine refused before any write (the held version kept serving), by route kind.",
            ["route"],
            registry=r,
        )
        self.squash_quarantines = Counter(
            "stitch_sidecar_squash_quarantines",
            "Squashes set aside after failing a check, by where (fetch, stage, apply); plans avoid them from then on.",
            ["during"],
            registry=r,
        )
        self.refused_version = Gauge(
            "stitch_sidecar_refused_version",
            "Version of the last refused plan, until one at or past it is applied (-1: none).",
            registry=r,
        )
        self.apply_seconds = Histogram(
            "stitch_sidecar_apply_seconds",
            "Time the engine spent applying patches or snapshots per commit, seconds.",
            buckets=_SECONDS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "stitch_sidecar_stage_seconds", "Download and verify time per sync, seconds.", buckets=_SECONDS, registry=r
        )
        self.engine_stage_seconds = Histogram(
            "stitch_sidecar_engine_stage_seconds",
            "Time the engine spent staging an update while serving (decode, checks, GEMM packing), seconds.",
            buckets=_SECONDS,
            registry=r,
        )
        self.sync_seconds = Histogram(
            "stitch_sidecar_sync_seconds",
            "From seeing a new version at the bulletin to having it applied, seconds.",
            buckets=_SECONDS,
            registry=r,
        )
        self.lease_held = Gauge(
            "stitch_sidecar_lease_held",
            "1 while this sidecar holds the engine's lease (it may change the engine and claim a version), else 0.",
            registry=r,
        )
        self.lease = Info(
            "stitch_sidecar_lease",
            "The engine's lease: this sidecar's owner id (owner) and the owner the engine last named as its holder "
            "(holder; '' when none).",
            registry=r,
        )
        self.leases_lost = Counter(
            "stitch_sidecar_leases_lost",
            "Times this sidecar lost the engine's lease (another sidecar took it, or it lapsed unrenewed) and stopped "
            "claiming a version.",
            registry=r,
        )
        self.requests_held = Counter(
            "stitch_sidecar_requests_held", "Requests held by the gate before admission (or rejection).", registry=r
        )
        self.request_body_bytes = Counter(
            "stitch_sidecar_request_body_bytes",
            "Request body bytes read, by route template (the proxied routes are '/{path:path}'); reading stops at "
            "max_body_bytes.",
            ["route"],
            registry=r,
        )
        self.body_budget_held = Gauge(
            "stitch_sidecar_body_budget_held_bytes",
            "Bytes of request bodies held now by requests in flight (at most body_budget_bytes).",
            registry=r,
        )
        self.requests_rejected = Counter(
            "stitch_sidecar_requests_rejected",
            "Requests refused by the sidecar, by error type.",
            ["reason"],
            registry=r,
        )
        self.relay_fetches = Counter(
            "stitch_sidecar_relay_fetches",
            "Blob downloads tried at a relay (STITCH_SIDECAR_RELAYS), by relay base URL and outcome: ok; unavailable "
            "(transport error or 5xx: skipped for relay_retry_s); corrupt (bytes that miss their sha256: fetched "
            "again from the bulletin); refused (another 4xx: the bulletin was asked instead).",
            ["relay", "outcome"],
            registry=r,
        )
        self.relay_up = Gauge(
            "stitch_sidecar_relay_up",
            "1 while a relay is asked for blobs, 0 while it is skipped after failing (relay_retry_s).",
            ["relay"],
            registry=r,
        )
        self.relay_fallbacks = Counter(
            "stitch_sidecar_relay_fallbacks",
            "Blobs fetched from the bulletin itself because every relay failed or was skipped.",
            registry=r,
        )
        for g in (self.applied_version, self.target_version, self.refused_version):
            g.set(-1)
        for kind in ROUTE_KINDS:
            if kind != "flip":
                self.pause_seconds.labels(kind)

    def versions(self, applied: int | None, target: int | None) -> None:
        """Update the applied/target/lag gauges."""
        self.applied_version.set(-1 if applied is None else applied)
        self.target_version.set(-1 if target is None else target)
        if target is not None:
            self.lag_versions.set(max(0, target - (applied if applied is not None else -1)))
        else:
            self.lag_versions.set(0)
