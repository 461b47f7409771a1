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

Reading: records are parsed once per stored etag (:meth:`.Ledger.derived_record`), so a plan
with squashes costs one listing of the folder, not a read per record. A record this bulletin
cannot read (a newer schema written by a newer bulletin on the same store, or damaged bytes) is
left out of plans and listings and logged once; it never fails them, nor gc, which spares every
blob name (a sha256 in hex) found in its bytes until the record is dropped. The put check reads only
each patch file's header and index, by ranged reads (:func:`~stitchboard.proto.decode.read_patch_index`),
never a whole blob.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable

from pydantic import ValidationError

from stitchboard.proto.decode import read_patch_index
from stitchboard.proto.errors import PatchError, PatchFormatError, SchemaError
from stitchboard.proto.schema import canonical_json
from stitchboard.proto.squash_schema import SquashManifest, check_patch_lineage

from .errors import BlobMismatchError, BlobMissingError, InvalidRequestError, NotFoundError, VersionConflictError
from .ledger import Ledger, blob_is_sound, blob_key, intents_key, run_key
from .stores import Store

log = logging.getLogger("stitchboard.bulletin")
_BLOB_NAME = re.compile(rb"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")  # a blob key: sha256 in hex

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


def _readable(key: str) -> Callable[[bytes], SquashManifest | None]:
    # Parses a stored record; None (logged here, once per stored etag) for one this bulletin cannot read.
    def parse(data: bytes) -> SquashManifest | None:
        try:
            return SquashManifest.model_validate_json(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in exc.errors()[:3])
            log.warning(
                "skipping the squash record %s: this bulletin cannot read it (%s); plans and listings leave it out "
                "(a newer bulletin's schema: upgrade this one; else drop the record, its versions' chain serves)",
                key,
                problems,
            )
            return None

    return parse


def list_squashes(ledger: Ledger, run: str) -> list[SquashManifest]:
    """Every readable squash record of ``run`` (by target, then base).

    One listing of the run's squash folder; a record is read only when its etag changed since
    this process last read it. Records removed while listing are skipped; so are records this
    bulletin cannot read (logged once per stored etag: see the module docstring).
    """
    out = []
    for o in ledger.store.list(squashes_key(run)):
        if span_of_key(o.key) is None:
            continue
        try:
            record = ledger.derived_record(o, _readable(o.key))
        except NotFoundError:
            continue
        if record is not None:
            out.append(record)
    return out


def drop_squash(ledger: Ledger, run: str, base: int, target: int) -> bool:
    """Remove the squash ``base -> target`` (its blobs go with the next gc). True if it was stored."""
    key = squash_key(run, base, target)
    if ledger.store.stat(key) is None:
        return False
    ledger.store.delete(key)
    return True


def _ranged(store: Store, key: str) -> Callable[[int, int], bytes]:
    # read(offset, length) of one stored object, by a ranged read
    def read(offset: int, length: int) -> bytes:
        data = b"".join(store.iter_range(key, offset, offset + length - 1)) if length else b""
        if len(data) != length:
            raise PatchFormatError(f"{key}: the store returned {len(data)} of the {length} bytes at {offset}")
        return data

    return read


def _check_files(ledger: Ledger, squash: SquashManifest) -> None:
    # Every blob stored, of the stated size, sound; its index agrees with the two versions. Only
    # each file's header and index are read (ranged, capped: read_patch_index), never its payload.
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
                f"squash {squash.base_version} -> {squash.target_version} of run {run!r} references {f.path!r} "
                f"(sha256 {f.sha256}), never uploaded: PUT it first",
                run_id=run,
                sha256=f.sha256,
            )
        if stat.size_bytes != f.size_bytes or not blob_is_sound(ledger.store, run, f.sha256, stat):
            raise BlobMismatchError(
                f"squash {squash.base_version} -> {squash.target_version} of run {run!r}: "
                f"the stored {f.path!r} is not {f.size_bytes} bytes of sha256 {f.sha256}: upload it again",
                run_id=run,
                sha256=f.sha256,
            )
        what = f"{f.path} of squash {squash.base_version} -> {squash.target_version}"
        try:
            patch = read_patch_index(_ranged(ledger.store, blob_key(run, f.sha256)), f.size_bytes, what)
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
                f"squash {squash.base_version} -> {squash.target_version} of run {run!r} names manifest {digest} "
                f"for version {version}, which is {info.manifest_sha256}",
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
            f"squash {squash.base_version} -> {squash.target_version} of run {run!r} was stored meanwhile with "
            "other content",
            run_id=run,
        )
    finally:
        ledger.store.delete(intent)


def _same_stored(ledger: Ledger, key: str, body: bytes, squash: SquashManifest) -> bool:
    try:
        stored, _ = ledger.store.get(key)
    except NotFoundError:
        return False
    record = _readable(key)(stored)
    if record is not None and canonical_json(record) == body:
        return True
    raise VersionConflictError(
        f"squash {squash.base_version} -> {squash.target_version} of run {squash.run_id!r} is stored with "
        "other content: drop it first "
        f"(DELETE /v1/runs/{squash.run_id}/squashes/{squash.base_version}/{squash.target_version})",
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
                cache[(o.key, o.etag)] = _named_blobs(o.key, ledger.store.get(o.key)[0])
            except NotFoundError:
                continue
        out |= cache[(o.key, o.etag)]
    return out


def _named_blobs(key: str, data: bytes) -> set[str]:
    # The blobs a stored squash record references. One this bulletin cannot read (a newer
    # schema, damaged bytes) still spares every blob name (a sha256 in hex) found in its bytes:
    # gc cannot tell which of them a newer reader needs, and must not stop on the record.
    try:
        return {f.sha256 for f in SquashManifest.model_validate_json(data).files}
    except ValidationError:
        names = {m.decode() for m in _BLOB_NAME.findall(data)}
        log.warning(
            "gc cannot read the squash record %s: it spares the %d blob names found in its bytes "
            "(drop the record to free them, or upgrade this bulletin)",
            key,
            len(names),
        )
        return names


def prune_squashes(ledger: Ledger, run: str, kept: set[int], dry_run: bool = False) -> list[tuple[int, int]]:
    """Drop the squash records of ``run`` whose base or target version is not in ``kept``; the (base, target)
    spans dropped."""
    dropped = []
    for o in ledger.store.list(squashes_key(run)):
        span = span_of_key(o.key)
        if span is None or (span[0] in kept and span[1] in kept):
            continue
        if not dry_run:
            ledger.store.delete(o.key)
        dropped.append(span)
    return dropped
