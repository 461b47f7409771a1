"""The local-folder store: :class:`FileStore` (also shared folders that support ``flock`` and ``link``).

Writes are atomic (temp file, fsync, rename), create-only writes use ``link`` and
compare-and-swap runs under an ``flock``, so a restart loses nothing and several bulletin
processes can share one folder.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..errors import NotFoundError, UnavailableError
from .base import CHUNK_BYTES, ObjectStat, StreamDigest, check_key


class FileStore:
    """A store in a local folder (also works on NFS-like shared folders that support ``flock`` and ``link``).

    Writes go to a hidden temp file in the same folder, are fsynced, then renamed (replace) or
    linked (create-only) into place, and the folder is fsynced, so a crash leaves either the old
    or the new object, never a torn one. Hidden names (``.tmp-*``, ``.locks``, ``.uploads``) are
    never listed. A file stored by :meth:`put_file` gets a record ``.sha256-<name>`` beside it:
    its digest and the etag of the file it was computed for, so a file rewritten out of band
    has no valid record.

    Args:
        root: the folder (created if missing); its path is the store's only setting.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ".locks").mkdir(exist_ok=True)
        self.url = f"file://{self.root}"
        self.upload_dir: Path | None = (
            self.root / ".uploads"
        )  # same filesystem: a verified upload is linked, not copied
        self.part_bytes: int | None = None

    @staticmethod
    def _record_path(path: Path) -> Path:
        return path.parent / f".sha256-{path.name}"

    def _recorded(self, path: Path, etag: str) -> str | None:
        try:
            sha256, _, recorded_for = self._record_path(path).read_text().partition(" ")
        except (FileNotFoundError, NotADirectoryError):
            return None
        return sha256 if recorded_for == etag else None

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    @staticmethod
    def _etag(st: os.stat_result) -> str:
        return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"

    def stat(self, key: str) -> ObjectStat | None:
        path = self._path(key)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        etag = self._etag(st)
        return ObjectStat(key, st.st_size, etag, st.st_mtime, self._recorded(path, etag))

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

    def put_file(self, key: str, path: Path, digest: StreamDigest | None = None) -> None:
        dest = self._path(key)
        sha256 = (digest or StreamDigest.of_file(path)).sha256
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            os.link(path, tmp)  # same filesystem: no copy
        except OSError:
            shutil.copyfile(path, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        record = self._write_temp(dest.parent, f"{sha256} {self._etag(dest.stat())}".encode())
        os.replace(record, self._record_path(dest))
        self._fsync_dir(dest.parent)

    def iter_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        path = self._path(key)
        if not path.is_file():
            raise NotFoundError(f"no object {key!r} in {self.url}", key=key)
        # The file opens at the first chunk, inside the generator: a response dropped before its body
        # started (the client went away) holds no open file.
        return self._chunks(key, path, start, end)

    def _chunks(self, key: str, path: Path, start: int, end: int) -> Iterator[bytes]:
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:  # removed since iter_range looked (content-addressed: gc after its grace)
            raise NotFoundError(f"no object {key!r} in {self.url}", key=key) from None
        with f:
            f.seek(start)
            left = end - start + 1
            while left > 0:
                chunk = f.read(min(CHUNK_BYTES, left))
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

    def list_dirs(self, prefix: str) -> builtins.list[str]:  # ``list`` is the method here
        folder = self._path(prefix) if prefix else self.root
        try:
            return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
        except FileNotFoundError:
            return []

    def delete(self, key: str) -> None:
        path = self._path(key)
        for p in (path, self._record_path(path)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def presign(self, key: str, method: str, expires_s: int, sha256: str | None = None) -> str | None:
        return None

    def remove_temporaries(self, prefix: str, older_than_s: float) -> int:
        folder = self._path(prefix) if prefix else self.root
        cutoff, removed = time.time() - older_than_s, 0
        try:
            entries = [e for e in os.scandir(folder) if e.name.startswith(".tmp-") and e.is_file()]
        except FileNotFoundError:
            return 0
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime <= cutoff:
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def check(self) -> None:
        if not os.access(self.root, os.W_OK):
            raise UnavailableError(f"store folder {self.root} is not writable: check its permissions")
