"""Fleet queries with a bounded store cost: one shared, briefly cached read of a run's records per process.

:class:`FleetWatcher` answers the fleet routes (:mod:`.routes_fleet`). Every query of a run is
answered from one snapshot of its records read at most ``interval_s`` ago (so the store sees
at most one listing per run per interval per bulletin process, whatever the number of callers);
reports received by this process update the snapshot at once. Long-polls ("wait until N
replicas are at >= v") re-check at every change and every ``interval_s`` (leases expire with
time alone), and share the refresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from anyio import to_thread

from stitchboard.proto.fleet import FleetCount, FleetView, count_fleet

from .fleet import FleetStore, Record, fleet_view
from .ledger import Ledger


class _Snapshot:
    """One run's records as last read, when, and an event set at every change."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}
        self.latest: int | None = None
        self.read_at = -float("inf")
        self.changed = asyncio.Event()
        self.refreshing: asyncio.Task | None = None

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class FleetWatcher:
    """Snapshots of runs' replica records for the fleet routes (event-loop thread only).

    Args:
        fleet: the records in the store.
        ledger: where the runs' latest versions are read.
        interval_s: the longest a snapshot is used before it is read again, seconds.
    """

    def __init__(self, fleet: FleetStore, ledger: Ledger, interval_s: float) -> None:
        self.fleet = fleet
        self._ledger = ledger
        self._interval = interval_s
        self._runs: dict[str, _Snapshot] = {}

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
        """A report this process wrote: take it into the run's snapshot and wake its long-polls."""
        snap = self._snapshot(run)
        snap.records[record.report.replica_id] = record
        snap.notify()

    async def view(self, run: str) -> FleetView:
        """The run's replicas now (from a snapshot at most ``interval_s`` old).

        Raises:
            BulletinError: the store could not be read.
        """
        snap = await self._fresh(run)
        return fleet_view(run, snap.records, snap.latest)

    async def wait(
        self, run: str, version: int, min_replicas: int | None, fraction: float | None, wait_s: float
    ) -> FleetCount:
        """The fleet's count at ``version`` once the requirement is met, or as it is after ``wait_s`` seconds.

        Raises:
            BulletinError: the store could not be read.
        """
        deadline = time.monotonic() + wait_s
        while True:
            snap = await self._fresh(run)
            count = count_fleet(fleet_view(run, snap.records, snap.latest), version, min_replicas, fraction)
            remaining = deadline - time.monotonic()
            if count.met or remaining <= 0:
                return count
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, self._interval)):
                    await snap.changed.wait()
