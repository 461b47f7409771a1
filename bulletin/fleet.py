"""Replica records in the store: one object per replica, written at every report, its lease the object's age.

Store layout (next to the ledger's, :mod:`.ledger`)::

    runs/{run}/replicas/{replica_id}.json   {"lease_s": ..., "report": ReplicaReport}

The bulletin keeps no state of its own (DESIGN.md invariant 9): a report is written to the
store as it arrives (one ``PUT``), and a replica is live while its object is younger than the
lease written into it. A report's bytes change only when the replica's situation does, so a
renewal rewrites the same bytes: on S3 the etag stays the same, and readers, which list the
folder (one request per 1,000 replicas) and keep what they read by etag, read again only the
records that changed. Records whose lease ran out more than ``forget_s`` ago are deleted by the
reader that finds them.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

from pydantic import ValidationError

from stitchboard.proto.errors import SchemaError
from stitchboard.proto.fleet import FleetView, ReplicaReport, ReplicaView, check_replica_id

from .errors import InvalidRequestError, NotFoundError
from .ledger import run_key
from .stores import Store

log = logging.getLogger("stitchboard.bulletin")


def replicas_key(run: str) -> str:
    """Folder of a run's replica records."""
    return f"{run_key(run)}replicas/"


def replica_key(run: str, replica_id: str) -> str:
    """Key of one replica's record. Raises :class:`InvalidRequestError` for a bad run or replica id."""
    try:
        return f"{replicas_key(run)}{check_replica_id(replica_id)}.json"
    except SchemaError as exc:
        raise InvalidRequestError(exc.message, run_id=run, replica_id=replica_id) from None


class Record(NamedTuple):
    """A replica's stored report, the lease written with it (seconds) and when the store last received it (Unix s)."""

    report: ReplicaReport
    lease_s: float
    reported_at: float


class FleetStore:
    """Writes and reads the replica records of runs in one store; safe to share between threads.

    Args:
        store: where the records live.
        tmp_dir: a folder for the record file while it is written (the store's upload folder).
        lease_s: the lease a report grants, seconds.
        forget_s: a record whose lease ran out this long ago is deleted, seconds.
    """

    def __init__(self, store: Store, tmp_dir: Path, lease_s: float, forget_s: float) -> None:
        self.store = store
        self.tmp_dir = tmp_dir
        self.lease_s = lease_s
        self.forget_s = forget_s
        self._cache: dict[str, tuple[str, Record]] = {}  # key -> (etag, record as read)
        self._lock = threading.Lock()

    def write(self, run: str, report: ReplicaReport) -> Record:
        """Store ``report`` as the record of its replica (one unconditional ``PUT``); the record as written.

        Raises:
            InvalidRequestError: a bad run or replica id.
            UnavailableError: the store could not be written.
        """
        key = replica_key(run, report.replica_id)
        data = json.dumps(
            {"lease_s": self.lease_s, "report": report.model_dump(mode="json")}, sort_keys=True, separators=(",", ":")
        ).encode()
        fd, name = tempfile.mkstemp(prefix=".replica-", dir=self.tmp_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self.store.put_file(key, Path(name))
        finally:
            Path(name).unlink(missing_ok=True)
        return Record(report, self.lease_s, time.time())

    def _read(self, key: str, etag: str) -> Record | None:
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] == etag:
            return hit[1]
        try:
            data, etag = self.store.get(key)
            envelope = json.loads(data)
            record = Record(ReplicaReport.model_validate(envelope["report"]), float(envelope["lease_s"]), 0.0)
        except NotFoundError:
            return None
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            log.warning("ignoring the unreadable replica record %s: %s", key, exc)
            return None
        with self._lock:
            self._cache[key] = (etag, record)
        return record

    def records(self, run: str) -> dict[str, Record]:
        """Every replica record of ``run`` not yet forgotten: replica id -> record (one listing,
        plus a read of each record that changed).

        Raises:
            UnavailableError: the store could not be read.
        """
        prefix, now, out = replicas_key(run), time.time(), {}
        listed = set()
        for obj in self.store.list(prefix):
            if not obj.key.endswith(".json"):
                continue
            listed.add(obj.key)
            record = self._read(obj.key, obj.etag)
            if record is None:
                continue
            if now > obj.modified_at + record.lease_s + self.forget_s:
                self.store.delete(obj.key)
                continue
            out[record.report.replica_id] = record._replace(reported_at=obj.modified_at)
        with self._lock:
            for key in [k for k in self._cache if k.startswith(prefix) and k not in listed]:
                del self._cache[key]
        return out


def fleet_view(run: str, records: dict[str, Record], latest: int | None, now: float | None = None) -> FleetView:
    """The :class:`FleetView` of ``records`` at ``now`` (default: the current time): liveness from each lease,
    lag behind ``latest``."""
    now = time.time() if now is None else now
    replicas = []
    for replica_id in sorted(records):
        record = records[replica_id]
        applied = record.report.applied_version
        replicas.append(
            ReplicaView(
                report=record.report,
                live=now <= record.reported_at + record.lease_s,
                reported_at=record.reported_at,
                lease_expires_at=record.reported_at + record.lease_s,
                behind_latest=None if applied is None or latest is None else max(0, latest - applied),
            )
        )
    return FleetView(run_id=run, latest_version=latest, replicas=replicas, time=now)
