"""What every store backend implements: the :class:`Store` protocol, object metadata and key checks.

Keys are ``/``-separated relative names (e.g. ``runs/r1/blobs/<sha256>``); a "folder" is a key
prefix ending in ``/``. Backends raise the bulletin's typed errors
(:mod:`stitchboard.bulletin.errors`), never their library's own.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

from stitchboard.proto.errors import SchemaError
from stitchboard.proto.schema import check_name

from ..errors import InvalidRequestError

#: Size of the chunks :meth:`Store.iter_range` yields, bytes.
CHUNK_BYTES = 1 << 20


class ObjectStat(NamedTuple):
    """Metadata of one stored object.

    Attributes:
        key: the object's key.
        size_bytes: its size in bytes.
        etag: an opaque tag that changes whenever the object is rewritten (used for CAS).
        modified_at: last write time, seconds since the epoch.
        sha256: the digest recorded with the object when it was written and acknowledged by
            the store (hex), ``None`` when there is no record or it no longer matches the
            object (rewritten out of band). Filled by :meth:`Store.stat`, not by listings.
    """

    key: str
    size_bytes: int
    etag: str
    modified_at: float
    sha256: str | None = None


class StreamDigest:
    """The SHA-256 of a body computed while it streams in, whole and per part (for S3 multipart uploads).

    Args:
        part_bytes: size of the parts to hash separately, bytes; ``None``: whole body only.
    """

    def __init__(self, part_bytes: int | None = None) -> None:
        self._whole = hashlib.sha256()
        self._part_bytes = part_bytes
        self._part = hashlib.sha256()
        self._in_part = 0
        self._parts: list[bytes] = []
        self.size_bytes = 0

    def update(self, chunk: bytes) -> None:
        """Add the next ``chunk`` of the body."""
        self._whole.update(chunk)
        self.size_bytes += len(chunk)
        if self._part_bytes is None:
            return
        view = memoryview(chunk)
        while view:
            take = min(len(view), self._part_bytes - self._in_part)
            self._part.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self._in_part == self._part_bytes:
                self._parts.append(self._part.digest())
                self._part, self._in_part = hashlib.sha256(), 0

    @property
    def sha256(self) -> str:
        """Hex digest of everything so far."""
        return self._whole.hexdigest()

    def parts(self) -> builtins.list[bytes]:
        """Raw SHA-256 digests of each ``part_bytes`` part (the last one possibly short; none for an empty body)."""
        return self._parts + ([self._part.digest()] if self._in_part else [])

    @classmethod
    def of_file(cls, path: Path, part_bytes: int | None = None) -> StreamDigest:
        """The digests of a local file (read once, in :data:`CHUNK_BYTES` chunks)."""
        digest = cls(part_bytes)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
        return digest


def b64_digest(raw: bytes) -> str:
    """A raw digest as S3 writes checksums (base64)."""
    return base64.b64encode(raw).decode()


class Store(Protocol):
    """What the bulletin needs from an object store. Methods are blocking and thread-safe.

    Errors: a missing key raises :class:`NotFoundError` where documented; a bad key raises
    :class:`InvalidRequestError`; backend failures raise :class:`UnavailableError`.
    """

    #: Where the store is, e.g. ``file:///srv/store`` or ``s3://bucket/prefix/`` (logs, messages).
    url: str
    #: A folder on the store's own filesystem to receive uploads in, so :meth:`put_file`
    #: links instead of copying; ``None`` for a remote store.
    upload_dir: Path | None
    #: Part size the store uploads large files in (hash parts with :class:`StreamDigest` of it), bytes;
    #: ``None``: whole files.
    part_bytes: int | None

    def stat(self, key: str) -> ObjectStat | None:
        """Metadata of ``key`` (with its recorded ``sha256``), or ``None`` when it does not exist."""

    def get(self, key: str) -> tuple[bytes, str]:
        """The whole object and its etag. Raises :class:`NotFoundError`."""

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` atomically unless it exists. True if created, False if it already existed."""

    def put_cas(self, key: str, data: bytes, etag: str | None) -> bool:
        """Replace ``key`` only if its etag is still ``etag`` (``None``: only if absent). False on a lost race."""

    def put_file(self, key: str, path: Path, digest: StreamDigest | None = None) -> None:
        """Store the local file ``path`` under ``key`` (large files go up in parts). Overwrites.

        ``digest`` (default: hashed from the file) is what the caller computed while receiving the
        bytes: every body sent carries its SHA-256 (per part for multipart uploads), a body the
        store receives corrupted is refused by it and sent again, and the digest is recorded
        with the object (see :attr:`ObjectStat.sha256`).

        Raises:
            UnavailableError: the store kept refusing the body or could not be reached.
        """

    def iter_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start`` .. ``end`` (inclusive) of ``key`` in chunks of :data:`CHUNK_BYTES`.

        Raises :class:`NotFoundError` at once; a failure while streaming raises
        :class:`UnavailableError` from the iterator.
        """

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectStat]:
        """Objects directly under the folder ``prefix`` (ends in ``/``), sorted by key."""

    def list_dirs(self, prefix: str) -> builtins.list[str]:  # ``list`` is the method here
        """Names of the sub-folders directly under ``prefix``, sorted."""

    def delete(self, key: str) -> None:
        """Remove ``key``; no error if it is already gone."""

    def presign(self, key: str, method: str, expires_s: int, sha256: str | None = None) -> str | None:
        """A URL that lets anyone ``GET``/``PUT`` ``key`` for ``expires_s`` seconds, or ``None`` if unsupported.

        A ``PUT`` URL needs ``sha256``: its checksum, its record and ``If-None-Match: *`` are
        signed into the URL (the uploader sends them as headers, see
        :func:`stitchboard.bulletin.client.presigned_put_headers`), so the store refuses other
        bytes and never overwrites an existing object.
        """

    def remove_temporaries(self, prefix: str, older_than_s: float) -> int:
        """Remove what interrupted writes left under the folder ``prefix`` (temp files, unfinished uploads)
        older than ``older_than_s`` seconds; returns how many."""

    def check(self) -> None:
        """Raise :class:`UnavailableError` when the store cannot be reached (readiness probe)."""


def check_key(key: str) -> str:
    """Reject keys that could escape the store root.

    Raises:
        InvalidRequestError: an empty, absolute, ``..``, hidden or otherwise unsafe key (names it).
    """
    try:
        check_name(key, "store key")
    except SchemaError as exc:
        raise InvalidRequestError(exc.message, key=key) from None
    if any(part in ("", ".") or part.startswith(".") for part in key.rstrip("/").split("/")):
        raise InvalidRequestError(f"invalid store key {key!r}: empty or hidden path component", key=key)
    return key
