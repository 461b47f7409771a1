"""What every store backend implements: the :class:`Store` protocol, object metadata and key checks.

Keys are ``/``-separated relative names (e.g. ``runs/r1/blobs/<sha256>``); a "folder" is a key
prefix ending in ``/``. Backends raise the bulletin's typed errors
(:mod:`stitchboard.bulletin.errors`), never their library's own.
"""

from __future__ import annotations

import builtins
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
    """

    key: str
    size_bytes: int
    etag: str
    modified_at: float


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

    def stat(self, key: str) -> ObjectStat | None:
        """Metadata of ``key``, or ``None`` when it does not exist."""

    def get(self, key: str) -> tuple[bytes, str]:
        """The whole object and its etag. Raises :class:`NotFoundError`."""

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` atomically unless it exists. True if created, False if it already existed."""

    def put_cas(self, key: str, data: bytes, etag: str | None) -> bool:
        """Replace ``key`` only if its etag is still ``etag`` (``None``: only if absent). False on a lost race."""

    def put_file(self, key: str, path: Path) -> None:
        """Store the local file ``path`` under ``key`` (large files go up in parts). Overwrites."""

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

    def presign(self, key: str, method: str, expires_s: int) -> str | None:
        """A URL that lets anyone ``GET``/``PUT`` ``key`` for ``expires_s`` seconds, or ``None`` if unsupported."""

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
