"""Versions of runs as objects in a :class:`~stitchboard.bulletin.stores.Store`: publish, read, list.

Store layout (all the state there is; DESIGN.md invariants 3, 4 and 9)::

    runs/{run}/blobs/{sha256}              patch/anchor/asset files, content-addressed
    runs/{run}/versions/{version:012d}.json  the commit object: {"info": VersionInfo, "manifest": ...}
    runs/{run}/latest                      cache pointer: VersionInfo of the latest version (CAS'd)

The commit point of a version is the create-only write of its ``versions/`` object, made only
after every referenced blob is verified. ``latest`` is derived: it is advanced by
compare-and-swap after the commit, and every reader probes past it for committed versions (and
repairs it), so a crash between the two loses nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import NamedTuple

from stitchboard.proto.errors import SchemaError
from stitchboard.proto.schema import RunInfo, VersionInfo, VersionManifest, canonical_json, check_run_id, parse_manifest

from .errors import (
    BaseMissingError,
    BlobMismatchError,
    BlobMissingError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    VersionConflictError,
    VersionRewindError,
)
from .stores import ObjectStat, Store

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
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
        raise InvalidRequestError(f"blob name {sha256!r} is not a sha256 (64 lowercase hex digits)", run_id=run, sha256=sha256)
    return f"{run_key(run)}blobs/{sha256}"


def version_key(run: str, version: int) -> str:
    """Key of a version's commit object."""
    if not 0 <= version < 10**12:
        raise InvalidRequestError(f"version {version} of run {run!r} is out of range (0 .. 10**12 - 1)", run_id=run, version=version)
    return f"{run_key(run)}versions/{version:012d}.json"


def version_of_key(key: str) -> int | None:
    """The version number of a commit object's key, or ``None`` for other keys."""
    m = _VERSION_NAME.match(key.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


class Committed(NamedTuple):
    """A committed version: its manifest, what the bulletin adds, and the manifest's canonical bytes."""

    manifest: VersionManifest
    info: VersionInfo
    manifest_json: bytes


class Ledger:
    """Publishes and reads versions in one store; safe to share between threads and processes.

    Args:
        store: where everything lives.
        max_manifest_bytes: largest manifest :meth:`publish` accepts, bytes.
        cache_entries: committed versions kept in memory (immutable, re-checked for existence on hit).
    """

    def __init__(self, store: Store, *, max_manifest_bytes: int = 32 << 20, cache_entries: int = 1024) -> None:
        self.store = store
        self.max_manifest_bytes = max_manifest_bytes
        self._cache: OrderedDict[tuple[str, int], Committed] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()

    # -- reading -----------------------------------------------------------------------------

    @staticmethod
    def _decode(data: bytes) -> Committed:
        envelope = json.loads(data)
        manifest = parse_manifest(envelope["manifest"])
        return Committed(manifest, VersionInfo.model_validate(envelope["info"]), canonical_json(manifest))

    def committed(self, run: str, version: int) -> Committed:
        """The committed version ``version`` of ``run``. Raises :class:`NotFoundError`."""
        key = version_key(run, version)
        with self._lock:
            hit = self._cache.get((run, version))
            if hit is not None:
                self._cache.move_to_end((run, version))
        if hit is not None and self.store.stat(key) is not None:  # retention may have removed it
            return hit
        try:
            data, _ = self.store.get(key)
        except NotFoundError:
            raise NotFoundError(f"run {run!r} has no version {version} (never published, or removed by retention)", run_id=run, version=version) from None
        found = self._decode(data)
        if self._cache_entries:
            with self._lock:
                self._cache[(run, version)] = found
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
        return found

    def version_numbers(self, run: str, after: int = -1) -> list[int]:
        """Committed versions of ``run`` greater than ``after``, ascending (by listing the store)."""
        start = version_key(run, after) if after >= 0 else None
        found = (version_of_key(o.key) for o in self.store.list(f"{run_key(run)}versions/", start_after=start))
        return [v for v in found if v is not None and v > after]

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

    def publish(self, run: str, body: bytes | VersionManifest, on_commit: Callable[[VersionInfo], None] | None = None) -> tuple[VersionInfo, bool]:
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
            BlobMissingError, BlobMismatchError: a referenced file is absent or has another size.
            VersionConflictError: the version exists with different content.
            VersionRewindError: the version is not after the latest one.
            BaseMissingError: ``version - 1`` is not committed.
            InvalidRequestError: also when a non-snapshot version changes the tensor set.
            Nothing is written when any of these is raised.
        """
        run_key(run)
        if isinstance(body, VersionManifest):
            manifest = body
        else:
            if len(body) > self.max_manifest_bytes:
                raise PayloadTooLargeError(f"manifest for run {run!r} is {len(body)} bytes, over the {self.max_manifest_bytes}-byte limit", run_id=run)
            try:
                manifest = parse_manifest(body)
            except SchemaError as exc:
                raise InvalidRequestError(exc.message, run_id=run) from None
        if manifest.run_id != run:
            raise InvalidRequestError(f"manifest run_id {manifest.run_id!r} does not match the URL's run {run!r}", run_id=run)
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
            raise VersionRewindError(f"run {run!r} is at version {top}; version {version} cannot be published any more: publish {top + 1}", run_id=run, version=version, latest_version=top)
        if version > top + 1:
            raise BaseMissingError(f"run {run!r} is at version {top}; publish version {top + 1} before {version}", run_id=run, version=version, latest_version=top)
        if version > 0 and not manifest.snapshot and self.committed(run, version - 1).manifest.layout() != manifest.layout():
            raise InvalidRequestError(
                f"version {version} of run {run!r} changes the tensor set (names, dtypes or shapes) of version {version - 1}: a delta cannot express that; publish it as an anchor (snapshot=true)",
                run_id=run,
                version=version,
            )
        for f in manifest.files:
            stat = self.stat_blob(run, f.sha256)
            if stat is None:
                raise BlobMissingError(
                    f"version {version} of run {run!r} references {f.path!r} (sha256 {f.sha256}) which was never uploaded: PUT it to /v1/runs/{run}/blobs/{f.sha256} first",
                    run_id=run,
                    version=version,
                    path=f.path,
                    sha256=f.sha256,
                )
            if stat.size_bytes != f.size_bytes:
                raise BlobMismatchError(
                    f"version {version} of run {run!r}: {f.path!r} (sha256 {f.sha256}) is stored with {stat.size_bytes} bytes, the manifest says {f.size_bytes}", run_id=run, version=version, path=f.path, sha256=f.sha256
                )
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
        if not self.store.put_new(version_key(run, version), json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode()):
            existing = self._existing(run, version, digest)  # lost a race: same bytes is fine
            if existing is None:
                raise VersionConflictError(f"version {version} of run {run!r} was removed while publishing it", run_id=run, version=version)
            return existing, False
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
                f"version {version} of run {run!r} is already published with different content (sha256 {found.info.manifest_sha256}); versions are immutable: publish the next version",
                run_id=run,
                version=version,
                manifest_sha256=found.info.manifest_sha256,
            )
        return found.info
