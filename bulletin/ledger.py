"""Versions of runs as objects in a :class:`~stitchboard.bulletin.stores.Store`: publish, read, list.

Store layout (all the state there is; DESIGN.md invariants 3, 4 and 9)::

    runs/{run}/blobs/{sha256}              patch/anchor/asset files, content-addressed
    runs/{run}/versions/{version:012d}.json  the commit object: {"info": VersionInfo, "manifest": ...}
    runs/{run}/latest                      cache pointer: VersionInfo of the latest version (CAS'd)
    runs/{run}/intents/{uuid}.json         a publish in progress: the sha256s it is about to reference
    runs/{run}/gc-locks/{sha256}           gc is deciding whether to delete that blob (held for a few requests)

The commit point of a version is the create-only write of its ``versions/`` object, made only
after every referenced blob is verified against the digest the store recorded for it (or, for
a blob with no record, by reading it back). Publish and gc exclude each other per blob, so no
interleaving commits a version whose blob gc deletes: a publish writes an intent naming its
blobs, then waits while gc holds a lock on any of them, then verifies and commits, then removes
the intent; gc takes a blob's lock (create-only), then reads intents and versions and deletes
the blob only if neither names it (:mod:`.retention`). Either gc took the lock first (the
publish waits, then finds the blob present or gone) or the intent was written before gc read
intents. A lock older than :data:`GC_LOCK_STALE_S` is a crashed gc's and is ignored. ``latest``
is derived: it is advanced by compare-and-swap after the commit, and every reader probes past it
for committed versions (and repairs it), so a crash between the two loses nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import NamedTuple, TypeVar, cast

from stitchboard.proto.adapter import spec_mismatch
from stitchboard.proto.errors import SchemaError
from stitchboard.proto.schema import RunInfo, VersionInfo, VersionManifest, canonical_json, check_run_id, parse_manifest

from .errors import (
    AdapterMismatchError,
    BaseMissingError,
    BlobMismatchError,
    BlobMissingError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    VersionConflictError,
    VersionRewindError,
)
from .steps import check_step, first_at_step
from .stores import ObjectStat, Store, StreamDigest

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
R = TypeVar("R")
_VERSION_NAME = re.compile(r"^(\d{12})\.json$")


def run_key(run: str) -> str:
    """Folder of a run. Raises :class:`InvalidRequestError` for a bad run id."""
    try:
        return f"runs/{check_run_id(run)}/"
    except SchemaError as exc:
        raise InvalidRequestError(exc.message, run_id=run) from None


def blob_key(run: str, sha256: str) -> str:
    """Key of a blob. Raises :class:`InvalidRequestError` for a bad run id or a non-sha256 name."""
    if not _SHA256.match(sha256):
        raise InvalidRequestError(
            f"blob name {sha256!r} is not a sha256 (64 lowercase hex digits)", run_id=run, sha256=sha256
        )
    return f"{run_key(run)}blobs/{sha256}"


def version_key(run: str, version: int) -> str:
    """Key of a version's commit object."""
    if not 0 <= version < 10**12:
        raise InvalidRequestError(
            f"version {version} of run {run!r} is out of range (0 .. 10**12 - 1)", run_id=run, version=version
        )
    return f"{run_key(run)}versions/{version:012d}.json"


def intents_key(run: str) -> str:
    """Folder of a run's publish intents (see the module docstring)."""
    return f"{run_key(run)}intents/"


def gc_locks_key(run: str) -> str:
    """Folder of the locks gc holds on a run's blobs while it decides to delete them."""
    return f"{run_key(run)}gc-locks/"


#: Seconds after which a gc lock is taken for a crashed gc's and ignored (gc holds one for a few requests).
GC_LOCK_STALE_S = 30.0


def version_of_key(key: str) -> int | None:
    """The version number of a commit object's key, or ``None`` for other keys."""
    m = _VERSION_NAME.match(key.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


class Committed(NamedTuple):
    """A committed version: its manifest, what the bulletin adds, the manifest's canonical bytes,
    and the etag of the stored object."""

    manifest: VersionManifest
    info: VersionInfo
    manifest_json: bytes
    etag: str = ""


def stored_digest(store: Store, key: str) -> str:
    """SHA-256 (hex) of the bytes stored under ``key``, read back in full. Raises :class:`NotFoundError`."""
    stat = store.stat(key)
    if stat is None:
        raise NotFoundError(f"no object {key!r} in {store.url}", key=key)
    digest = StreamDigest()
    for chunk in store.iter_range(key, 0, stat.size_bytes - 1) if stat.size_bytes else ():
        digest.update(chunk)
    return digest.sha256


def blob_is_sound(store: Store, run: str, sha256: str, stat: ObjectStat) -> bool:
    """Whether the stored blob ``sha256`` holds those bytes: its recorded digest, or (no record) its bytes read back."""
    if stat.sha256 is not None:
        return stat.sha256 == sha256
    try:
        return stored_digest(store, blob_key(run, sha256)) == sha256
    except NotFoundError:
        return False


class Ledger:
    """Publishes and reads versions in one store; safe to share between threads and processes.

    Args:
        store: where everything lives.
        max_manifest_bytes: largest manifest :meth:`publish` accepts, bytes.
        cache_entries: committed versions kept in memory; every hit is revalidated against the
            store's etag, so a version removed or rewritten out of band is never served from it.
            As many derived records (squashes) are kept, revalidated by the etag their listing gives.
    """

    def __init__(self, store: Store, *, max_manifest_bytes: int = 32 << 20, cache_entries: int = 1024) -> None:
        self.store = store
        self.max_manifest_bytes = max_manifest_bytes
        self._cache: OrderedDict[tuple[str, int], Committed] = OrderedDict()
        self._cache_entries = cache_entries
        self._records: OrderedDict[str, tuple[str, object]] = OrderedDict()
        self._lock = threading.Lock()

    # -- reading -----------------------------------------------------------------------------

    @staticmethod
    def _decode(data: bytes, etag: str) -> Committed:
        envelope = json.loads(data)
        manifest = parse_manifest(envelope["manifest"])
        return Committed(manifest, VersionInfo.model_validate(envelope["info"]), canonical_json(manifest), etag)

    def committed(self, run: str, version: int) -> Committed:
        """The committed version ``version`` of ``run``. Raises :class:`NotFoundError`."""
        key = version_key(run, version)
        with self._lock:
            hit = self._cache.get((run, version))
            if hit is not None:
                self._cache.move_to_end((run, version))
        if hit is not None:
            current = self.store.stat(key)  # removed by retention, or the run deleted and published again out of band?
            if current is not None and current.etag == hit.etag:
                return hit
        try:
            data, etag = self.store.get(key)
        except NotFoundError:
            with self._lock:
                self._cache.pop((run, version), None)
            raise NotFoundError(
                f"run {run!r} has no version {version} (never published, or removed by retention)",
                run_id=run,
                version=version,
            ) from None
        found = self._decode(data, etag)
        self._remember(run, version, found)
        return found

    def _remember(self, run: str, version: int, found: Committed) -> None:
        if self._cache_entries:
            with self._lock:
                self._cache[(run, version)] = found
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)

    def derived_record(self, listed: ObjectStat, parse: Callable[[bytes], R]) -> R:
        """The derived record (a squash) ``listed`` by a listing of its folder, parsed by ``parse``.

        The parsed value is kept per key and etag, as committed versions are, and revalidated by
        the etag the listing gave: a record read before and unchanged costs no request, one
        rewritten or replaced is read again. ``parse`` runs once per stored etag (an unreadable
        record is its value, e.g. ``None``, so say so there, once).

        Raises:
            NotFoundError: the record was removed since it was listed.
        """
        with self._lock:
            hit = self._records.get(listed.key)
            if hit is not None:
                self._records.move_to_end(listed.key)
        if hit is not None and hit[0] == listed.etag:
            return cast(R, hit[1])
        data, etag = self.store.get(listed.key)
        value = parse(data)
        if self._cache_entries:
            with self._lock:
                self._records[listed.key] = (etag, value)
                while len(self._records) > self._cache_entries:
                    self._records.popitem(last=False)
        return value

    def exists(self, run: str, version: int) -> bool:
        """Whether ``version`` of ``run`` is committed in the store now (one metadata read)."""
        return self.store.stat(version_key(run, version)) is not None

    def version_numbers(self, run: str, after: int = -1) -> list[int]:
        """Committed versions of ``run`` greater than ``after``, ascending (by listing the store)."""
        start = version_key(run, after) if after >= 0 else None
        found = (version_of_key(o.key) for o in self.store.list(f"{run_key(run)}versions/", start_after=start))
        return [v for v in found if v is not None and v > after]

    def version_for_step(self, run: str, step: int) -> VersionInfo | None:
        """The first committed version of ``run`` whose manifest records step ``step`` or later
        (None if none): a binary search over the versions (:func:`.steps.first_at_step`), about
        log2(versions) manifest reads through the cache."""
        latest = self.latest(run)
        if latest is None:
            return None

        def read(version: int) -> VersionManifest | None:
            try:
                return self.committed(run, version).manifest
            except NotFoundError:
                return None

        found = first_at_step(step, latest.version, read)
        return None if found is None else self.committed(run, found).info

    def _pointer(self, run: str) -> tuple[VersionInfo | None, str | None]:
        try:
            data, etag = self.store.get(f"{run_key(run)}latest")
        except NotFoundError:
            return None, None
        return VersionInfo.model_validate_json(data), etag

    def latest(self, run: str) -> VersionInfo | None:
        """The latest committed version of ``run`` (``None`` if none), repairing a stale ``latest`` pointer."""
        pointer, _ = self._pointer(run)
        if pointer is None:
            listed = self.version_numbers(run)
            version = listed[-1] if listed else -1
        else:
            version = pointer.version
        while self.store.stat(version_key(run, version + 1)) is not None:
            version += 1
        if version < 0:
            return None
        if pointer is not None and pointer.version == version:
            return pointer
        info = self.committed(run, version).info
        self._advance(run, info)
        return info

    def _advance(self, run: str, info: VersionInfo) -> None:
        data = canonical_json(info)
        for _ in range(20):
            pointer, etag = self._pointer(run)
            if pointer is not None and pointer.version >= info.version:
                return
            if self.store.put_cas(f"{run_key(run)}latest", data, etag):
                return

    def runs(self) -> list[RunInfo]:
        """Every run in the store with its latest version."""
        out = []
        for name in self.store.list_dirs("runs/"):
            try:
                check_run_id(name)
            except SchemaError:
                continue
            latest = self.latest(name)
            out.append(RunInfo(run_id=name, latest_version=latest.version if latest else None))
        return out

    # -- writing -----------------------------------------------------------------------------

    def stat_blob(self, run: str, sha256: str) -> ObjectStat | None:
        """The stored blob, or ``None``."""
        return self.store.stat(blob_key(run, sha256))

    def publish(
        self, run: str, body: bytes | VersionManifest, on_commit: Callable[[VersionInfo], None] | None = None
    ) -> tuple[VersionInfo, bool]:
        """Validate and commit one version of ``run``.

        Args:
            run: the run id (must equal the manifest's ``run_id``).
            body: the manifest as JSON bytes (at most ``max_manifest_bytes``) or a model.
            on_commit: called with the new version's info right after the commit point, before
                the ``latest`` pointer is advanced (lets the service wake long-polls sooner).

        Returns:
            ``(info, created)``; ``created`` is False when the identical manifest was already
            committed (a retried publish is a no-op success).

        Raises:
            PayloadTooLargeError, InvalidRequestError: bad input.
            BlobMissingError, BlobMismatchError: a referenced file is absent, has another size, or its
                stored copy does not hold its sha256's bytes.
            InvalidRequestError: also when a path is listed twice.
            VersionConflictError: the version exists with different content.
            VersionRewindError: the version is not after the latest one.
            BaseMissingError: ``version - 1`` is not committed.
            VersionConflictError, InvalidRequestError: also when the manifest's step breaks the step rule
                (:mod:`.steps`); the latest version's step with the same bits is a no-op returning
                ``(latest version's info, False)``.
            InvalidRequestError: also when a non-snapshot version changes the tensor set.
            AdapterMismatchError: the manifest's adapter differs from its base version's in a field an adapter run
                keeps (:func:`stitchboard.proto.adapter.spec_mismatch`), or only one of them is an adapter.
            Nothing is written when any of these is raised.
        """
        run_key(run)
        if isinstance(body, VersionManifest):
            manifest = body
        else:
            if len(body) > self.max_manifest_bytes:
                raise PayloadTooLargeError(
                    f"manifest for run {run!r} is {len(body)} bytes, over the {self.max_manifest_bytes}-byte limit",
                    run_id=run,
                )
            try:
                manifest = parse_manifest(body)
            except SchemaError as exc:
                raise InvalidRequestError(exc.message, run_id=run) from None
        if manifest.run_id != run:
            raise InvalidRequestError(
                f"manifest run_id {manifest.run_id!r} does not match the URL's run {run!r}", run_id=run
            )
        canonical = canonical_json(manifest)
        digest = hashlib.sha256(canonical).hexdigest()
        version = manifest.version
        existing = self._existing(run, version, digest)
        if existing is not None:
            return existing, False
        latest = self.latest(run)
        top = latest.version if latest else -1
        if version <= top:
            existing = self._existing(run, version, digest)  # committed meanwhile by a racing publisher?
            if existing is not None:
                return existing, False
            raise VersionRewindError(
                f"run {run!r} is at version {top}; version {version} cannot be published any more: publish {top + 1}",
                run_id=run,
                version=version,
                latest_version=top,
            )
        if version > top + 1:
            raise BaseMissingError(
                f"run {run!r} is at version {top}; publish version {top + 1} before {version}",
                run_id=run,
                version=version,
                latest_version=top,
            )
        previous = self.committed(run, version - 1) if version > 0 else None
        if previous is not None and check_step(manifest, previous.manifest):
            return previous.info, False  # the latest version holds this step with these bits: a no-op (steps.py)
        mismatch = spec_mismatch(previous.manifest.adapter, manifest.adapter) if previous is not None else None
        if mismatch is not None:
            field, base_value, value = mismatch
            raise AdapterMismatchError(
                f"version {version} of run {run!r} has {field} {value!r} but its base version {version - 1} has "
                f"{base_value!r}: every version of an adapter run keeps it; publish that adapter to a new run",
                run_id=run,
                version=version,
                field=field,
                base_value=base_value,
                value=value,
            )
        if previous is not None and not manifest.snapshot and previous.manifest.layout() != manifest.layout():
            raise InvalidRequestError(
                f"version {version} of run {run!r} changes the tensor set (names, dtypes or shapes) "
                f"of version {version - 1}: a delta cannot express that; publish it as an anchor (snapshot=true)",
                run_id=run,
                version=version,
            )
        intent = self._declare_intent(run, manifest)
        try:
            self._await_gc(run, {f.sha256 for f in manifest.files})
            self._verify_files(run, manifest)
            return self._commit(run, manifest, canonical, digest, on_commit)
        finally:
            self.store.delete(intent)

    def _declare_intent(self, run: str, manifest: VersionManifest) -> str:
        """Write the intent naming the blobs this publish is about to reference (gc spares them); its key."""
        key = f"{intents_key(run)}{uuid.uuid4().hex}.json"
        self.store.put_new(key, json.dumps(sorted({f.sha256 for f in manifest.files})).encode())
        return key

    def _await_gc(self, run: str, blobs: set[str], poll_s: float = 0.02) -> None:
        """Wait while gc holds a (live) lock on any of ``blobs`` (seconds, at most :data:`GC_LOCK_STALE_S`)."""
        while True:
            now = time.time()
            if not any(
                o.key.rsplit("/", 1)[-1] in blobs and now - o.modified_at < GC_LOCK_STALE_S
                for o in self.store.list(gc_locks_key(run))
            ):
                return
            time.sleep(poll_s)

    def _verify_files(self, run: str, manifest: VersionManifest) -> None:
        """Check every distinct referenced blob once: stored, with the stated size,
        and sound (see :func:`blob_is_sound`)."""
        version, seen_paths, checked = manifest.version, set(), set()
        for f in manifest.files:
            if f.path in seen_paths:
                raise InvalidRequestError(
                    f"version {version} of run {run!r} lists the file {f.path!r} more than once: list each path once",
                    run_id=run,
                    version=version,
                    path=f.path,
                )
            seen_paths.add(f.path)
            if (f.sha256, f.size_bytes) in checked:
                continue
            checked.add((f.sha256, f.size_bytes))
            stat = self.stat_blob(run, f.sha256)
            if stat is None:
                raise BlobMissingError(
                    f"version {version} of run {run!r} references {f.path!r} (sha256 {f.sha256}) "
                    f"which was never uploaded: PUT it to /v1/runs/{run}/blobs/{f.sha256} first",
                    run_id=run,
                    version=version,
                    path=f.path,
                    sha256=f.sha256,
                )
            if stat.size_bytes != f.size_bytes:
                raise BlobMismatchError(
                    f"version {version} of run {run!r}: {f.path!r} (sha256 {f.sha256}) "
                    f"is stored with {stat.size_bytes} bytes, the manifest says {f.size_bytes}",
                    run_id=run,
                    version=version,
                    path=f.path,
                    sha256=f.sha256,
                )
            if not blob_is_sound(self.store, run, f.sha256, stat):
                raise BlobMismatchError(
                    f"version {version} of run {run!r}: the stored copy of {f.path!r} does not hold the bytes of "
                    f"sha256 {f.sha256} (recorded digest {stat.sha256 or 'none, and its bytes differ'}): "
                    f"upload it again (PUT /v1/runs/{run}/blobs/{f.sha256} replaces a copy that fails its check), "
                    "then publish",
                    run_id=run,
                    version=version,
                    path=f.path,
                    sha256=f.sha256,
                )

    def _commit(
        self,
        run: str,
        manifest: VersionManifest,
        canonical: bytes,
        digest: str,
        on_commit: Callable[[VersionInfo], None] | None,
    ) -> tuple[VersionInfo, bool]:
        """The commit point: the create-only write of the version's object, then the ``latest`` pointer. The
        committed version goes into the cache at once (with the etag the store gives it), so its first readers (the
        sidecars' plans and manifests, the next commit) do not parse it again (~7 ms for SmolLM2's 272 tensors).
        ``canonical`` is the manifest's canonical JSON, ``digest`` its sha256 (hex)."""
        version = manifest.version
        info = VersionInfo(
            run_id=run,
            version=version,
            snapshot=manifest.snapshot,
            manifest_sha256=digest,
            committed_at=datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            size_bytes=manifest.stats.encoded_bytes,
            snapshot_bytes=sum(f.size_bytes for f in manifest.files_of("snapshot")),
        )
        envelope = {"info": info.model_dump(mode="json"), "manifest": manifest.model_dump(mode="json")}
        if not self.store.put_new(
            version_key(run, version), json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode()
        ):
            existing = self._existing(run, version, digest)  # lost a race: same bytes is fine
            if existing is None:
                raise VersionConflictError(
                    f"version {version} of run {run!r} was removed while publishing it", run_id=run, version=version
                )
            return existing, False
        stored = self.store.stat(version_key(run, version))
        if stored is not None:
            self._remember(run, version, Committed(manifest, info, canonical, stored.etag))
        if on_commit is not None:
            on_commit(info)
        self._advance(run, info)
        return info, True

    def _existing(self, run: str, version: int, digest: str) -> VersionInfo | None:
        try:
            found = self.committed(run, version)
        except NotFoundError:
            return None
        if found.info.manifest_sha256 != digest:
            raise VersionConflictError(
                f"version {version} of run {run!r} is already published with different content (sha256 "
                f"{found.info.manifest_sha256}); versions are immutable: publish the next version",
                run_id=run,
                version=version,
                manifest_sha256=found.info.manifest_sha256,
            )
        return found.info
