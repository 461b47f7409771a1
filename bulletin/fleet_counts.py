"""The live replicas of one snapshot of a run's records, indexed once (bulletin process): counts, laggards, the cap.

:class:`FleetWatcher` (:mod:`.fleet_watch`) builds a :class:`LiveIndex` once per snapshot of a
run's records (a read from the store, or a report that changed something) and answers every
fleet count from it until the snapshot changes or a live lease in it runs out: a count costs
a binary search over the live replicas' applied versions plus the size of its answer, however
many callers ask and however many expired records the run keeps. The same index tells the
report route how many replicas are live, for the cap on live replicas per run
(``max_live_replicas``, :class:`~.errors.TooManyReplicasError`).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping

from stitchboard.proto.fleet import FleetCount, Laggard, needed_replicas

from .fleet import Record


class LiveIndex:
    """A run's records at one instant: the live replicas sorted by applied version, the expired ones.

    Args:
        run: the run.
        records: replica id -> record (:meth:`.FleetStore.records`).
        now: the instant, Unix seconds.

    Building costs O(R log R) for R records; :meth:`at_or_above` O(log L) for L live replicas.
    """

    def __init__(self, run: str, records: Mapping[str, Record], now: float) -> None:
        self.run = run
        live: list[tuple[int, str, Record]] = []
        expired: list[str] = []
        #: The instant the first live lease in it runs out (the index is wrong after it), Unix seconds.
        self.valid_until = math.inf
        for replica_id, record in records.items():
            until = record.reported_at + record.lease_s
            if now <= until:
                applied = record.report.applied_version
                live.append((-1 if applied is None else applied, replica_id, record))
                self.valid_until = min(self.valid_until, until)
            else:
                expired.append(replica_id)
        live.sort(key=lambda entry: entry[:2])
        self._live = live
        self._applied = [applied for applied, _, _ in live]
        self._laggards: list[Laggard] | None = None
        #: The ids of the live replicas.
        self.live_ids = frozenset(replica_id for _, replica_id, _ in live)
        #: The ids of the replicas whose lease ran out, sorted.
        self.expired = sorted(expired)

    @property
    def live(self) -> int:
        """How many replicas are live."""
        return len(self._live)

    def at_or_above(self, version: int) -> int:
        """How many live replicas have applied ``version`` or a later one."""
        return len(self._applied) - bisect_left(self._applied, version)

    def count(self, version: int, min_replicas: int | None = None, fraction: float | None = None) -> FleetCount:
        """The :class:`FleetCount` at ``version`` against a requirement (:func:`needed_replicas`).

        The laggards come most behind first (no version applied, then by applied version), ties by id.
        """
        if self._laggards is None:  # made once per index, at the first answer that names laggards
            self._laggards = [
                Laggard(
                    replica_id=replica_id,
                    applied_version=record.report.applied_version,
                    state=record.report.state,
                    error=record.report.last_error.message if record.report.last_error else None,
                )
                for _, replica_id, record in self._live
            ]
        at = self.at_or_above(version)
        needed = needed_replicas(self.live, min_replicas, fraction)
        return FleetCount(
            run_id=self.run,
            version=version,
            live=self.live,
            at_or_above=at,
            needed=needed,
            met=needed is None or at >= needed,
            laggards=self._laggards[: self.live - at],
            expired=self.expired,
        )
