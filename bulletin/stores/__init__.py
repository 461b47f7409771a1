"""The storage seam of the bulletin: the :class:`Store` protocol, its two backends, and :func:`open_store`.

Everything the bulletin knows lives behind :class:`Store`, so a restart loses nothing and
several bulletin processes can share one store (DESIGN.md invariant 9)::

    stores/
    ├── base.py    Store protocol, ObjectStat, StreamDigest, check_key, CHUNK_BYTES
    ├── folder.py  FileStore: a local (or shared) folder; its setting is the folder path
    └── s3.py      S3Store and S3Settings (endpoint, credentials, multipart sizes); every
                   botocore error mapped to the bulletin's errors in one place

Backends import only :mod:`.base` and :mod:`stitchboard.bulletin.errors`; this module picks
one by URL.
"""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from ..errors import InvalidRequestError
from .base import CHUNK_BYTES, ObjectStat, Store, StreamDigest, check_key
from .folder import FileStore
from .s3 import S3Settings, S3Store

__all__ = [
    "CHUNK_BYTES",
    "FileStore",
    "ObjectStat",
    "S3Settings",
    "S3Store",
    "Store",
    "StreamDigest",
    "check_key",
    "open_store",
]


def open_store(url: str, settings: S3Settings | None = None) -> Store:
    """Open the store named by ``url``.

    Args:
        url: ``file:///abs/path``, ``file://./rel/path``, a plain path, or ``s3://bucket/prefix``.
        settings: S3 endpoint, region, credentials and transfer sizes (defaults when ``None``;
            a :class:`~stitchboard.bulletin.settings.BulletinSettings` is one); unused for a folder.

    Raises:
        InvalidRequestError: unknown scheme or missing bucket (names the URL).
    """
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        path = unquote(parsed.netloc + parsed.path) if parsed.scheme else url
        return FileStore(path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise InvalidRequestError(f"store URL {url!r} has no bucket: use s3://bucket/prefix")
        return S3Store(parsed.netloc, parsed.path.strip("/"), settings)
    raise InvalidRequestError(f"unknown store URL {url!r}: use file:///path or s3://bucket/prefix")
