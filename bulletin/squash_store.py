"""Squashes as derived objects of a run in the store: put (checked), list, drop.

Layout (beside the versions; see :mod:`.ledger`)::

    runs/{run}/squashes/{target:012d}-{base:012d}.json   a SquashManifest (create-only)

A squash is never part of a version: versions stay immutable and complete without it, a squash
can be dropped and rebuilt (``stitchboard squash rebuild``), and the planner uses it only while
its base and target versions are stored (:mod:`.planner`). It is written only after both
versions are committed, with the same exclusion from gc as a publish: an intent naming its
blobs, a wait while gc holds a lock on one of them, the check of every blob, then the
create-only write (so gc, which re-reads intents and squashes under each blob's lock, never
deletes a blob of a squash being written; :mod:`.retention`). A squash whose version is removed
meanwhile is left dangling: the planner ignores it and the next gc drops it.
"""

from __future__ import annotations

import json
import re
import uuid

from stitchboard.proto.decode import read_patch
from stitchboard.proto.errors import PatchError, SchemaError
from stitchboard.proto.schema import canonical_json
from stitchboard.proto.squash_schema import SquashManifest, check_patch_lineage

from .errors import BlobMismatchError, BlobMissingError, InvalidRequestError, NotFoundError, VersionConflictError
from .ledger import Ledger, blob_is_sound, blob_key, intents_key, run_key

_NAME = re.compile(r"^(\d{12})-(\d{12})\.json$")


def squashes_key(run: str) -> str:
    """Folder of a run's squash records."""
    return f"{run_key(run)}squashes/"


def squash_key(run: str, base: int, target: int) -> str:
    """Key of the squash ``base -> target`` of ``run``."""
    if not 0 <= base < target < 10**12:
        raise InvalidRequestError(
            f"squash {base} -> {target} of run {run!r}: want 0 <= base < target < 10**12", run_id=run
        )
    return f"{squashes_key(run)}{target:012d}-{base:012d}.json"


def span_of_key(key: str) -> tuple[int, int] | None:
    """(base, target) of a squash record's key, or ``None`` for other keys."""
    m = _NAME.match(key.rsplit("/", 1)[-1])
    return (int(m.group(2)), int(m.group(1))) if m else None


def list_squashes(ledger: Ledger, run: str) -> list[SquashManifest]:
    """Every squash record of ``run`` (by target, then base); records removed while listing are skipped."""
    out = []
    for o in ledger.store.list(squashes_key(run)):
        if span_of_key(o.key) is None:
            continue
        try:
            out.append(SquashManifest.model_validate_json(ledger.store.get(o.key)[0]))
        except NotFoundError:
            continue
    return out


def drop_squash(ledger: Ledger, run: str, base: int, target: int) -> bool:
    """Remove the squash ``base -> target`` (its blobs go with the next gc). True if it was stored."""
    key = squash_key(run, base, target)
    if ledger.store.stat(key) is None:
        return False
    ledger.store.delete(key)
    return True


def _check_files(ledger: Ledger, squash: SquashManifest) -> None:
    # Every blob stored, of the stated size, sound; its index agrees with the two versions.
    run = squash.run_id
    base, target = (
        ledger.committed(run, squash.base_version).manifest,
        ledger.committed(run, squash.target_version).manifest,
    )
    indexes = []
    for f in squash.files:
        stat = ledger.stat_blob(run, f.sha256)
        if stat is None:
            raise BlobMissingError(
                f"squash {squash.base_version} -> {squash.target_version} of run {run!r} references {f.path!r} (sha256 {f.sha256}), never uploaded: PUT it first",
                run_id=run,
                sha256=f.sha256,
            )
        if stat.size_bytes != f.size_bytes or not blob_is_sound(ledger.store, run, f.sha256, stat):
            raise BlobMismatchError(
                f"squash {squash.base_version} -> {squash.target_version} of run {run!r}: the stored {f.path!r} is not {f.size_bytes} bytes of sha256 {f.sha256}: upload it again",
                run_id=run,
                sha256=f.sha256,
            )
        data, _ = ledger.store.get(blob_key(run, f.sha256))
        try:
            patch = read_patch(
                data, f.size_bytes, what=f"{f.path} of squash {squash.base_version} -> {squash.target_version}"
            )
        except PatchError as exc:
            raise InvalidRequestError(exc.message, run_id=run) from None
        if patch.encoding != squash.encoding:
            raise InvalidRequestError(
                f"{f.path}: encoding {patch.encoding!r}, the squash says {squash.encoding!r}", run_id=run
            )
        indexes.append((f.path, patch.entries))
    try:
        check_patch_lineage(indexes, base, target)
    except SchemaError as exc:
        raise InvalidRequestError(exc.message, run_id=run) from None


def put_squash(ledger: Ledger, run: str, squash: SquashManifest) -> bool:
    """Check and store one squash record. Returns True when written, False when the identical record was stored.

    Raises:
        InvalidRequestError: the run differs from the record's, a version's manifest is not the
            one the record names, or a patch file disagrees with the versions (see
            :func:`~stitchboard.proto.squash_schema.check_patch_lineage`).
        NotFoundError: the base or target version is not committed (a squash comes after its target).
        BlobMissingError, BlobMismatchError: a file is not (soundly) stored.
        VersionConflictError: another record is stored for the same span (drop it first).
    """
    if squash.run_id != run:
        raise InvalidRequestError(f"squash run_id {squash.run_id!r} does not match the URL's run {run!r}", run_id=run)
    key = squash_key(run, squash.base_version, squash.target_version)
    body = canonical_json(squash)
    if _same_stored(ledger, key, body, squash):
        return False
    for version, digest in (
        (squash.base_version, squash.base_manifest_sha256),
        (squash.target_version, squash.target_manifest_sha256),
    ):
        info = ledger.committed(run, version).info
        if info.manifest_sha256 != digest:
            raise InvalidRequestError(
                f"squash {squash.base_version} -> {squash.target_version} of run {run!r} names manifest {digest} for version {version}, which is {info.manifest_sha256}",
                run_id=run,
                version=version,
            )
    blobs = sorted({f.sha256 for f in squash.files})
    intent = f"{intents_key(run)}{uuid.uuid4().hex}.json"
    ledger.store.put_new(intent, json.dumps(blobs).encode())
    try:
        ledger._await_gc(run, set(blobs))
        _check_files(ledger, squash)
        if ledger.store.put_new(key, body):
            return True
        if _same_stored(ledger, key, body, squash):
            return False
        raise VersionConflictError(
            f"squash {squash.base_version} -> {squash.target_version} of run {run!r} was stored meanwhile with other content",
            run_id=run,
        )
    finally:
        ledger.store.delete(intent)


def _same_stored(ledger: Ledger, key: str, body: bytes, squash: SquashManifest) -> bool:
    try:
        stored, _ = ledger.store.get(key)
    except NotFoundError:
        return False
    if canonical_json(SquashManifest.model_validate_json(stored)) == body:
        return True
    raise VersionConflictError(
        f"squash {squash.base_version} -> {squash.target_version} of run {squash.run_id!r} is stored with other content: drop it first (DELETE /v1/runs/{squash.run_id}/squashes/{squash.base_version}/{squash.target_version})",
        run_id=squash.run_id,
    )


def squash_blobs(ledger: Ledger, run: str, cache: dict[tuple[str, str], set[str]] | None = None) -> set[str]:
    """The blobs every stored squash record of ``run`` references (gc spares them).

    ``cache`` keeps what was read per (key, etag): a record is rewritten only after a drop.
    """
    cache = {} if cache is None else cache
    out: set[str] = set()
    for o in ledger.store.list(squashes_key(run)):
        if span_of_key(o.key) is None:
            continue
        if (o.key, o.etag) not in cache:
            try:
                cache[(o.key, o.etag)] = {
                    f.sha256 for f in SquashManifest.model_validate_json(ledger.store.get(o.key)[0]).files
                }
            except NotFoundError:
                continue
        out |= cache[(o.key, o.etag)]
    return out


def prune_squashes(ledger: Ledger, run: str, kept: set[int], dry_run: bool = False) -> list[tuple[int, int]]:
    """Drop the squash records of ``run`` whose base or target version is not in ``kept``; the (base, target) spans dropped."""
    dropped = []
    for o in ledger.store.list(squashes_key(run)):
        span = span_of_key(o.key)
        if span is None or (span[0] in kept and span[1] in kept):
            continue
        if not dry_run:
            ledger.store.delete(o.key)
        dropped.append(span)
    return dropped
