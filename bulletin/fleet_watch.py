"""Fleet queries with a bounded store cost: one shared, briefly cached read of a run's records per process.

:class:`FleetWatcher` answers the fleet routes (:mod:`.routes_fleet`). Every query of a run is
answered from one snapshot of its records read at most ``interval_s`` ago (so the store sees
at most one listing per run per interval per bulletin process, whatever the number of callers);
reports received by this process update the snapshot at once. What queries need of a snapshot
(the :class:`FleetView`, the live replicas indexed for counts, :class:`.LiveIndex`) is built
once per snapshot, when first asked, and kept until the snapshot changes or a live lease in it
runs out. A renewal that repeats a live replica's report changes no answer: it updates the
record without waking anyone. Long-polls ("wait until N replicas are at >= v") re-check at
every change and every ``interval_s`` (leases expire with time alone), and share the refresh.
The cap on live replicas per run is checked here too (:meth:`FleetWatcher.admission`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator

from anyio import to_thread

from stitchboard.proto.fleet import FleetCount, FleetView, needed_replicas

from .errors import TooManyReplicasError
from .fleet import FleetStore, Record, fleet_view
from .fleet_counts import LiveIndex
from .hangup import Hangup
from .ledger import Ledger


class _Snapshot:
    """One run's records as last read, when, an event set at every change, and what was built from them."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}
        self.latest: int | None = None
        self.read_at = -float("inf")
        self.changed = asyncio.Event()
        self.refreshing: asyncio.Future[tuple[dict[str, Record], int | None]] | None = None
        self.admitting: set[str] = set()  # new replicas whose first report is being written
        self._index: LiveIndex | None = None
        self._view: tuple[FleetView, float] | None = None  # and the instant its first live lease runs out

    def notify(self) -> None:
        self._index = self._view = None
        self.changed.set()
        self.changed = asyncio.Event()

    def index(self, run: str) -> LiveIndex:
        now = time.time()
        if self._index is None or now > self._index.valid_until:
            self._index = LiveIndex(run, self.records, now)
        return self._index

    def view(self, run: str) -> FleetView:
        now = time.time()
        if self._view is None or now > self._view[1]:
            view = fleet_view(run, self.records, self.latest, now)
            self._view = view, min((r.lease_expires_at for r in view.replicas if r.live), default=math.inf)
        return self._view[0]


class FleetWatcher:
    """Snapshots of runs' replica records for the fleet routes (event-loop thread only).

    Args:
        fleet: the records in the store.
        ledger: where the runs' latest versions are read.
        interval_s: the longest a snapshot is used before it is read again, seconds.

    Attributes:
        waiting: the fleet long-polls (:meth:`wait`) waiting now.
    """

    def __init__(self, fleet: FleetStore, ledger: Ledger, interval_s: float) -> None:
        self.fleet = fleet
        self._ledger = ledger
        self._interval = interval_s
        self._runs: dict[str, _Snapshot] = {}
        self.waiting = 0

    def _snapshot(self, run: str) -> _Snapshot:
        return self._runs.setdefault(run, _Snapshot())

    def _read(self, run: str) -> tuple[dict[str, Record], int | None]:
        latest = self._ledger.latest(run)
        return self.fleet.records(run), None if latest is None else latest.version

    async def _fresh(self, run: str) -> _Snapshot:
        snap = self._snapshot(run)
        if time.monotonic() - snap.read_at < self._interval:
            return snap
        if snap.refreshing is None or snap.refreshing.done():
            snap.refreshing = asyncio.ensure_future(to_thread.run_sync(self._read, run))
        started, started_wall = time.monotonic(), time.time()
        records, latest = await asyncio.shield(snap.refreshing)
        if snap.read_at < started:
            # reports this process wrote while the store was read are newer than what it answered
            local = {k: r for k, r in snap.records.items() if r.reported_at >= started_wall}
            snap.records, snap.latest, snap.read_at = {**records, **local}, latest, time.monotonic()
            snap.notify()
        return snap

    def reported(self, run: str, record: Record) -> None:
        """A report this process wrote: take it into the run's snapshot and wake its long-polls (unless it
        only renews a live replica's lease with the same report, which changes no answer)."""
        snap = self._snapshot(run)
        before = snap.records.get(record.report.replica_id)
        snap.records[record.report.replica_id] = record
        renewal = (
            before is not None
            and before.report == record.report
            and record.reported_at <= before.reported_at + before.lease_s
        )
        if not renewal:
            snap.notify()

    @contextlib.asynccontextmanager
    async def admission(self, run: str, replica_id: str, max_live: int) -> AsyncIterator[None]:
        """Hold a place for ``replica_id``'s report among ``run``'s at most ``max_live`` live replicas while it is
        written.

        A replica live in this process's snapshot is always let in (a renewal); a new one (or
        one whose lease ran out) is counted against the live replicas of a snapshot at most
        ``interval_s`` old plus the new replicas being written in this process.

        Raises:
            TooManyReplicasError: ``max_live`` replicas are live (or being let in).
            BulletinError: the store could not be read.
        """
        snap = self._snapshot(run)
        known = snap.records.get(replica_id)
        new = known is None or time.time() > known.reported_at + known.lease_s
        if new:
            snap = await self._fresh(run)
            index = snap.index(run)
            new = replica_id not in index.live_ids and replica_id not in snap.admitting
            if new and index.live + len(snap.admitting) >= max_live:
                raise TooManyReplicasError(
                    f"run {run!r} already has {index.live + len(snap.admitting)} live replicas, the most this "
                    f"bulletin takes (STITCH_BULLETIN_MAX_LIVE_REPLICAS={max_live}): the report of the new replica "
                    f"{replica_id!r} is refused until a replica's lease runs out or the setting is raised",
                    run_id=run,
                    replica_id=replica_id,
                    setting="STITCH_BULLETIN_MAX_LIVE_REPLICAS",
                    limit=max_live,
                )
        if new:
            snap.admitting.add(replica_id)
        try:
            yield
        finally:
            if new:
                snap.admitting.discard(replica_id)

    async def view(self, run: str) -> FleetView:
        """The run's replicas now (from a snapshot at most ``interval_s`` old).

        Raises:
            BulletinError: the store could not be read.
        """
        return (await self._fresh(run)).view(run)

    async def wait(
        self,
        run: str,
        version: int,
        min_replicas: int | None,
        fraction: float | None,
        wait_s: float,
        hangup: Hangup | None = None,
    ) -> FleetCount:
        """The fleet's count at ``version`` once the requirement is met, or as it is after ``wait_s`` seconds,
        or at once when ``hangup`` says the request's client hung up.

        Raises:
            BulletinError: the store could not be read.
        """
        deadline = time.monotonic() + wait_s
        self.waiting += 1
        try:
            while True:
                snap = await self._fresh(run)
                index = snap.index(run)
                needed = needed_replicas(index.live, min_replicas, fraction)
                remaining = deadline - time.monotonic()
                gone = hangup is not None and hangup.gone
                if needed is None or index.at_or_above(version) >= needed or remaining <= 0 or gone:
                    return index.count(version, min_replicas, fraction)
                bound = min(remaining, self._interval)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(bound) if hangup is None else hangup.within(bound):
                        await snap.changed.wait()
        finally:
            self.waiting -= 1
