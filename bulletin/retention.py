"""Retention: which versions and blobs a run keeps, and the garbage collector that removes the rest.

Policy: keep the last ``keep_snapshots`` snapshot versions and every version after the oldest
kept snapshot (so every kept version can be reached from a kept anchor). Runs with fewer
snapshots keep everything. The latest version is always kept.

Removal waits out a grace period so in-flight plans and uploads finish:

* a version that fell out of the policy is removed once the snapshot that pushed it out (the
  ``keep_snapshots``-th snapshot after it) was committed at least ``grace_s`` ago;
* a blob is removed when no remaining version references it and it was last written at least
  ``grace_s`` ago (this covers uploads whose publish never happened).

Squash records (:mod:`.squash_store`) go with their versions: one whose base or target version
is removed (or gone) is dropped in the same pass, and the blobs of the others are protected
like a version's (also those of a squash being written: it declares an intent, and gc re-reads
the squash records under each blob's lock).

Manifests go before blobs, so a reader never sees a version whose files are missing. Before
each blob is deleted gc takes the blob's lock (a create-only object, :mod:`.ledger`), then
re-reads from the store the publish intents, the versions committed since it started and the
blob's own age, and spares the blob if any of them protects it. A publish names its blobs in
an intent, waits while gc holds a lock on one of them, then checks them and commits: so a
publish either is seen by gc (intent or commit) or checks the blob after gc decided, and then
answers BlobMissing (re-upload, then publish) instead of committing a version whose blob is
gone. Intents protect for ``max(grace_s, INTENT_LIFETIME_S)``; older ones (left by a crashed
publish) are removed, as are locks older than ``GC_LOCK_STALE_S`` and temporaries (``.tmp-*``,
unfinished multipart uploads) older than ``grace_s``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime

from .errors import InvalidRequestError, NotFoundError
from .ledger import GC_LOCK_STALE_S, Ledger, blob_key, gc_locks_key, intents_key, run_key, version_key
from .squash_store import prune_squashes, squash_blobs

#: Seconds a publish intent protects its blobs at least (a publish checks its files and commits in far less).
INTENT_LIFETIME_S = 900.0


@dataclass
class GcReport:
    """What :func:`collect_garbage` removed (or would remove with ``dry_run``), per run."""

    versions_removed: dict[str, list[int]] = field(default_factory=dict)
    blobs_removed: dict[str, list[str]] = field(default_factory=dict)
    squashes_removed: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    temporaries_removed: dict[str, int] = field(default_factory=dict)
    bytes_freed: int = 0


def kept_from(snapshots: list[int], keep_snapshots: int) -> int:
    """The oldest version the policy keeps, given the run's snapshot versions (ascending)."""
    if len(snapshots) < keep_snapshots:
        return 0
    return snapshots[-keep_snapshots]


def _epoch(rfc3339: str | None) -> float:
    return datetime.fromisoformat(rfc3339).timestamp() if rfc3339 else 0.0


def _referenced(ledger: Ledger, run: str, versions: list[int]) -> set[str]:
    refs: set[str] = set()
    for v in versions:
        try:
            refs.update(f.sha256 for f in ledger.committed(run, v).manifest.files)
        except NotFoundError:
            continue
    return refs


def collect_run(
    ledger: Ledger,
    run: str,
    keep_snapshots: int,
    grace_s: float,
    report: GcReport,
    dry_run: bool = False,
    now: float | None = None,
) -> None:
    """Apply the policy to one run, adding what was removed to ``report``. See the module docstring."""
    now = time.time() if now is None else now
    numbers = ledger.version_numbers(run)
    infos = {v: ledger.committed(run, v).info for v in numbers}
    snapshots = [v for v in numbers if infos[v].snapshot]
    keep_from = kept_from(snapshots, keep_snapshots)
    drop = []
    for v in numbers:
        if v >= keep_from:
            break
        newer = [s for s in snapshots if s > v]
        pushed_out_at = _epoch(infos[newer[keep_snapshots - 1]].committed_at)
        if now - pushed_out_at >= grace_s:
            drop.append(v)
    for v in drop:
        if not dry_run:
            ledger.store.delete(version_key(run, v))
    if drop:
        report.versions_removed[run] = drop
    squashes = prune_squashes(ledger, run, set(numbers) - set(drop), dry_run)
    if squashes:
        report.squashes_removed[run] = squashes
    squash_cache: dict[tuple[str, str], set[str]] = {}
    protected = _referenced(ledger, run, [v for v in numbers if v not in drop]) | squash_blobs(
        ledger, run, squash_cache
    )
    candidates = [
        o
        for o in ledger.store.list(f"{run_key(run)}blobs/")
        if o.key.rsplit("/", 1)[-1] not in protected and now - o.modified_at >= grace_s
    ]
    seen = max(numbers, default=-1)
    intents: dict[str, list[str]] = {}
    removed = []
    for o in candidates:
        sha = o.key.rsplit("/", 1)[-1]
        if sha in protected:
            continue
        if dry_run:
            removed.append(sha)
            report.bytes_freed += o.size_bytes
            continue
        lock = f"{gc_locks_key(run)}{sha}"
        if not ledger.store.put_new(lock, b""):
            continue  # another gc holds it
        try:  # under the lock: live intents first, then new commits, then the blob's own age
            protected |= _intended(ledger, run, max(grace_s, INTENT_LIFETIME_S), now, intents)
            new = ledger.version_numbers(run, after=seen)
            protected |= _referenced(ledger, run, new) | squash_blobs(ledger, run, squash_cache)
            seen = max(new, default=seen)
            current = ledger.store.stat(blob_key(run, sha))
            if sha in protected or current is None or now - current.modified_at < grace_s:
                continue
            ledger.store.delete(blob_key(run, sha))
        finally:
            ledger.store.delete(lock)
        removed.append(sha)
        report.bytes_freed += o.size_bytes
    if removed:
        report.blobs_removed[run] = removed
    if not dry_run:
        _intended(ledger, run, max(grace_s, INTENT_LIFETIME_S), now, intents)  # removes stale intents
        for stale in [
            o for o in ledger.store.list(gc_locks_key(run)) if time.time() - o.modified_at >= GC_LOCK_STALE_S
        ]:
            ledger.store.delete(stale.key)
        temporaries = sum(
            ledger.store.remove_temporaries(f"{run_key(run)}{folder}", grace_s)
            for folder in ("", "versions/", "blobs/", "intents/", "gc-locks/", "squashes/")
        )
        if temporaries:
            report.temporaries_removed[run] = temporaries


def _intended(ledger: Ledger, run: str, lifetime_s: float, now: float, cache: dict[str, list[str]]) -> set[str]:
    """The blobs named by the run's publish intents younger than ``lifetime_s``; older intents are deleted.

    ``cache`` keeps the contents of intents already read (an intent never changes).
    """
    out: set[str] = set()
    for o in ledger.store.list(intents_key(run)):
        if now - o.modified_at >= lifetime_s:
            ledger.store.delete(o.key)
            continue
        if o.key not in cache:
            try:
                cache[o.key] = json.loads(ledger.store.get(o.key)[0])
            except NotFoundError:  # the publish finished meanwhile
                continue
        out.update(cache[o.key])
    return out


def collect_garbage(
    ledger: Ledger, keep_snapshots: int, grace_s: float, runs: list[str] | None = None, dry_run: bool = False
) -> GcReport:
    """Apply the retention policy to ``runs`` (default: every run in the store).

    Args:
        ledger: the store to clean.
        keep_snapshots: K, the number of most recent snapshot versions to keep (>= 1).
        grace_s: seconds a dropped version or unreferenced blob must wait before removal.
        runs: run ids to clean; None for all.
        dry_run: report what would be removed without removing it.

    Raises:
        InvalidRequestError: a bad run id; BulletinError: the store failed.
    """
    if keep_snapshots < 1:
        raise InvalidRequestError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
    report = GcReport()
    for run in runs if runs is not None else [r.run_id for r in ledger.runs()]:
        collect_run(ledger, run, keep_snapshots, grace_s, report, dry_run)
    return report
