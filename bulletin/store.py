"""The storage seam of the bulletin: a small protocol over string keys, and the local-folder backend.

Everything the bulletin knows lives behind :class:`Store`, so a restart loses nothing and
several bulletin processes can share one store. Keys are ``/``-separated relative names
(e.g. ``runs/r1/blobs/<sha256>``); a "folder" is a key prefix ending in ``/``.

Two backends implement it: :class:`FileStore` (a local folder; atomic writes via temp file,
fsync and rename; create-only writes via ``link``; compare-and-swap under an ``flock``) and
:class:`stitchboard.bulletin.s3store.S3Store` (any S3). :func:`open_store` picks one by URL.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol
from urllib.parse import unquote, urlparse

from stitchboard.proto.schema import check_name

from .errors import BulletinError, InvalidRequestError, NotFoundError

if TYPE_CHECKING:
    from .settings import BulletinSettings

_CHUNK = 1 << 20


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

    Errors: a missing key raises :class:`NotFoundError` where documented; backend failures
    raise :class:`BulletinError` subclasses (``UnavailableError`` when unreachable).
    """

    url: str

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
        """Bytes ``start`` .. ``end`` (inclusive) of ``key`` in chunks. Raises :class:`NotFoundError`."""

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectStat]:
        """Objects directly under the folder ``prefix`` (ends in ``/``), sorted by key."""

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the sub-folders directly under ``prefix``, sorted."""

    def delete(self, key: str) -> None:
        """Remove ``key``; no error if it is already gone."""

    def presign(self, key: str, method: str, expires_s: int) -> str | None:
        """A URL that lets anyone ``GET``/``PUT`` ``key`` for ``expires_s`` seconds, or ``None`` if unsupported."""

    def check(self) -> None:
        """Raise :class:`UnavailableError` when the store cannot be reached (readiness probe)."""


def check_key(key: str) -> str:
    """Reject keys that could escape the store root. Raises :class:`InvalidRequestError`."""
    try:
        check_name(key, "store key")
    except BulletinError:
        raise
    except Exception as exc:
        raise InvalidRequestError(str(exc), key=key) from None
    if any(part in ("", ".") or part.startswith(".") for part in key.rstrip("/").split("/")):
        raise InvalidRequestError(f"invalid store key {key!r}: empty or hidden path component", key=key)
    return key


class FileStore:
    """A store in a local folder (also works on NFS-like shared folders that support ``flock`` and ``link``).

    Writes go to a hidden temp file in the same folder, are fsynced, then renamed (replace) or
    linked (create-only) into place, and the folder is fsynced, so a crash leaves either the old
    or the new object, never a torn one. Hidden names (``.tmp-*``, ``.locks``) are never listed.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ".locks").mkdir(exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    @staticmethod
    def _etag(st: os.stat_result) -> str:
        return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"

    def stat(self, key: str) -> ObjectStat | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return ObjectStat(key, st.st_size, self._etag(st), st.st_mtime)

    def get(self, key: str) -> tuple[bytes, str]:
        try:
            with open(self._path(key), "rb") as f:
                return f.read(), self._etag(os.fstat(f.fileno()))
        except FileNotFoundError:
            raise NotFoundError(f"no object {key!r} in {self.url}", key=key) from None

    def _write_temp(self, folder: Path, data: bytes) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    @staticmethod
    def _fsync_dir(folder: Path) -> None:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put_new(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._write_temp(path.parent, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        self._fsync_dir(path.parent)
        return True

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        name = hashlib.sha256(key.encode()).hexdigest()[:32]
        with open(self.root / ".locks" / name, "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def put_cas(self, key: str, data: bytes, etag: str | None) -> bool:
        path = self._path(key)
        with self._lock(key):
            current = self.stat(key)
            if (current.etag if current else None) != etag:
                return False
            tmp = self._write_temp(path.parent, data)
            os.replace(tmp, path)
            self._fsync_dir(path.parent)
        return True

    def put_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            os.link(path, tmp)  # same filesystem: no copy
        except OSError:
            shutil.copyfile(path, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        self._fsync_dir(dest.parent)

    def iter_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        try:
            f = open(self._path(key), "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise NotFoundError(f"no object {key!r} in {self.url}", key=key) from None
        return self._chunks(f, start, end)

    @staticmethod
    def _chunks(f, start: int, end: int) -> Iterator[bytes]:
        with f:
            f.seek(start)
            left = end - start + 1
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    return
                left -= len(chunk)
                yield chunk

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectStat]:
        folder = self._path(prefix) if prefix else self.root
        try:
            names = sorted(e.name for e in os.scandir(folder) if e.is_file() and not e.name.startswith("."))
        except FileNotFoundError:
            return
        for name in names:
            key = prefix + name
            if start_after is not None and key <= start_after:
                continue
            st = self.stat(key)
            if st is not None:
                yield st

    def list_dirs(self, prefix: str) -> list[str]:
        folder = self._path(prefix) if prefix else self.root
        try:
            return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
        except FileNotFoundError:
            return []

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def presign(self, key: str, method: str, expires_s: int) -> str | None:
        return None

    def check(self) -> None:
        if not os.access(self.root, os.W_OK):
            from .errors import UnavailableError

            raise UnavailableError(f"store folder {self.root} is not writable: check its permissions")


def open_store(url: str, settings: BulletinSettings | None = None) -> Store:
    """Open the store named by ``url``.

    Args:
        url: ``file:///abs/path``, ``file://./rel/path``, a plain path, or ``s3://bucket/prefix``.
        settings: S3 endpoint, region, credentials and transfer sizes (defaults when ``None``).

    Raises:
        InvalidRequestError: unknown scheme or missing bucket.
    """
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        path = unquote(parsed.netloc + parsed.path) if parsed.scheme else url
        return FileStore(path)
    if parsed.scheme == "s3":
        from .s3store import S3Store

        if not parsed.netloc:
            raise InvalidRequestError(f"store URL {url!r} has no bucket: use s3://bucket/prefix")
        return S3Store(parsed.netloc, parsed.path.strip("/"), settings)
    raise InvalidRequestError(f"unknown store URL {url!r}: use file:///path or s3://bucket/prefix")
