"""The sidecar's reports to the bulletin's fleet view (one asyncio task beside the reconciler).

Every ``CHECK_S`` the :class:`Reporter` builds the replica's :class:`ReplicaReport` from what
the reconciler and the gate hold (no I/O) and sends it (``PUT /v1/runs/{run}/replicas/{id}``)
when it changed, or when the lease the bulletin granted is due for renewal (any report renews
it). A new applied version goes out as soon as its commit has settled; other changes (target,
state, errors) once they are ``min_interval_s`` old, together with whatever changed meanwhile,
so a sync shorter than that costs one report. The store cost per replica is bounded: a write
per renewal period without reports, per applied version, and per ``min_interval_s`` of other
changes. Reporting never blocks or breaks syncing: the task has
its own HTTP client, a bulletin that refuses or misses a report is logged and tried again
with exponential backoff, and nothing it does is awaited by the reconciler.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections import deque
from collections.abc import Callable

import httpx

from stitchboard.bulletin.errors import error_from_body
from stitchboard.proto.fleet import HISTORY_LEN, ErrorNote, ReplicaReport, ReportAccepted, SyncFigures
from stitchboard.proto.sidecar_wire import COMMIT_STATES

from .adapter_follower import AdapterFollower
from .gate import Gate
from .reconciler import Reconciler
from .settings import SidecarSettings

log = logging.getLogger("stitchboard.sidecar")

#: How often the report is rebuilt and compared with the last one sent, seconds.
CHECK_S = 0.1


def default_replica_id(port: int) -> str:
    """``<host name>-<port>``, reduced to the characters a replica id allows."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-.") or "replica"
    return f"{host[:100]}-{port}"


class SidecarSource:
    """Builds the report of one sidecar from its reconciler and gate; keeps the applied-version history.

    Args:
        replica_id: the replica's id; engine: its engine kind.
        reconciler, gate: where the state is read (an adapter run's follower stands for the
            reconciler: the report's ``applied_version`` is then the newest resident adapter version).
    """

    def __init__(self, replica_id: str, engine: str, reconciler: Reconciler | AdapterFollower, gate: Gate) -> None:
        self.replica_id = replica_id
        self.engine = engine
        self.reconciler = reconciler
        self.gate = gate
        self.started_at = time.time()
        self.history: deque[tuple[int, float]] = deque(maxlen=HISTORY_LEN)

    def __call__(self) -> ReplicaReport:
        r, gate = self.reconciler, self.gate
        sync = r.last_sync
        if gate.applied is not None and (not self.history or self.history[-1][0] != gate.applied):
            at = sync.finished_at if sync is not None and sync.to_version == gate.applied else time.time()
            self.history.append((gate.applied, round(at, 3)))
        error = r.last_error
        if error is not None and self.history and error.at <= self.history[-1][1]:
            error = None  # older than the version now held: it no longer says why the replica lags
        lag = None if gate.target is None else gate.target - (gate.applied if gate.applied is not None else -1)
        return ReplicaReport(
            replica_id=self.replica_id,
            engine=self.engine,
            applied_version=gate.applied,
            target_version=gate.target,
            state=r.state,
            lag_versions=lag,
            healthy=r.unhealthy_reason is None and gate.applied is not None,
            last_sync=None
            if sync is None
            else SyncFigures(
                to_version=sync.to_version,
                bytes_fetched=sync.bytes_fetched,
                total_seconds=round(sync.total_seconds, 4),
                pause_seconds=round(sync.pause_seconds, 4),
                route=sync.route,
                finished_at=round(sync.finished_at, 3),
            ),
            last_error=None
            if error is None
            else ErrorNote(type=error.type, message=error.message[:1000], at=round(error.at, 3)),
            history=list(self.history),
            started_at=round(self.started_at, 3),
            adapters=r.resident.names() if isinstance(r, AdapterFollower) else [],
        )


class Reporter:
    """Sends a replica's report to the bulletin when it changes and before its lease ends.

    Args:
        bulletin: base URL of the bulletin; token: a token with the ``replica`` scope (None: open bulletin).
        run: the run the replica follows.
        source: builds the current report (called every ``check_s``, on the event loop).
        min_interval_s: the least time between two reports that do not change the applied version, seconds.
        max_backoff_s: the longest wait after failed reports, seconds.
        http: an HTTP client to send with (default: one of its own, closed by :meth:`aclose`).
        check_s: how often the report is rebuilt and compared, seconds.
    """

    def __init__(
        self,
        bulletin: str,
        token: str | None,
        run: str,
        source: Callable[[], ReplicaReport],
        *,
        min_interval_s: float = 1.0,
        max_backoff_s: float = 60.0,
        http: httpx.AsyncClient | None = None,
        check_s: float = CHECK_S,
    ) -> None:
        self.run = run
        self.source = source
        self.min_interval_s = min_interval_s
        self.max_backoff_s = max_backoff_s
        self.check_s = check_s
        self._owns_http = http is None
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = http or httpx.AsyncClient(base_url=bulletin.rstrip("/"), headers=headers, timeout=10.0)
        self.sent = 0  # reports the bulletin accepted
        self.failures = 0  # failed reports in a row
        self.last_sent: ReplicaReport | None = None

    @classmethod
    def for_sidecar(cls, settings: SidecarSettings, reconciler: Reconciler, gate: Gate) -> Reporter:
        """The reporter of a sidecar built from its settings (``replica_id``, ``report_min_interval_s``, token)."""
        replica_id = settings.replica_id or default_replica_id(settings.port)
        source = SidecarSource(replica_id, settings.engine, reconciler, gate)
        return cls(
            settings.bulletin,
            settings.token,
            settings.run,
            source,
            min_interval_s=settings.report_min_interval_s,
            max_backoff_s=settings.report_max_backoff_s,
        )

    def follow(self, follower: AdapterFollower) -> None:
        """Report an adapter run's follower instead of the reconciler (the app found an adapter run)."""
        if isinstance(self.source, SidecarSource):
            self.source.reconciler = follower

    async def send(self, report: ReplicaReport) -> ReportAccepted:
        """Send one report; the lease the bulletin granted.

        Raises:
            httpx.HTTPError: the bulletin could not be reached.
            BulletinError: the bulletin refused the report (its answer's type).
        """
        r = await self._http.put(
            f"/v1/runs/{self.run}/replicas/{report.replica_id}",
            content=report.model_dump_json(),
            headers={"content-type": "application/json"},
        )
        if r.status_code >= 400:
            try:
                body: object = r.json()
            except ValueError:
                body = r.text
            raise error_from_body(r.status_code, body)
        return ReportAccepted.model_validate_json(r.content)

    def _due(self, report: ReplicaReport, now: float, changed_since: float, renew_at: float) -> bool:
        # A new applied version once the commit has settled (its state after the resume); other
        # changes once they are min_interval_s old; and the lease's renewal.
        last = self.last_sent
        if last is None or now >= renew_at:
            return True
        if report == last:
            return False
        if report.applied_version != last.applied_version and report.state not in COMMIT_STATES:
            return True
        return now - changed_since >= self.min_interval_s

    async def run_forever(self) -> None:
        """Report until cancelled (see the module docstring); never raises but for cancellation."""
        renew_at = retry_at = changed_since = -float("inf")
        backoff = self.min_interval_s
        while True:
            now = time.monotonic()
            try:
                report = self.source()
            except Exception:  # a report that cannot be built must not end the task
                log.exception("building the fleet report failed")
                report = None
            if report is None or report == self.last_sent:
                changed_since = float("inf")
            elif changed_since == float("inf"):
                changed_since = now
            if report is not None and now >= retry_at and self._due(report, now, changed_since, renew_at):
                try:
                    accepted = await self.send(report)
                except Exception as exc:  # noqa: BLE001 - any failure: log, back off, try again
                    self.failures += 1
                    retry_at = time.monotonic() + backoff
                    if self.failures == 1 or self.failures % 10 == 0:
                        log.warning(
                            "report %d to the bulletin's fleet view failed (%s: %s); trying again in %.1f s",
                            self.failures,
                            type(exc).__name__,
                            exc,
                            backoff,
                        )
                    backoff = min(backoff * 2, self.max_backoff_s)
                else:
                    if self.failures:
                        log.info(
                            "reports to the bulletin's fleet view go through again after %d failures", self.failures
                        )
                    self.failures, backoff = 0, self.min_interval_s
                    self.sent += 1
                    self.last_sent, changed_since = report, float("inf")
                    renew_at = time.monotonic() + accepted.renew_s
            await asyncio.sleep(self.check_s)

    async def aclose(self) -> None:
        """Close the HTTP client if this reporter made it."""
        if self._owns_http:
            await self._http.aclose()
