"""REST routes for blobs: streamed, verified upload; download with Range/ETag; presigned URLs (S3)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

from anyio import to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from stitchboard.proto.answers import BlobStored, UploadUrl

from .cache_headers import immutable
from .deps import BulletinState, Publish, Read
from .errors import BlobMismatchError, NotFoundError, PayloadTooLargeError, RequestTimeoutError
from .ledger import blob_key, stored_digest
from .routes_relay import RELAY_HEADER
from .settings import BulletinSettings
from .stores import ObjectStat, StreamDigest

router = APIRouter(prefix="/v1", tags=["blobs"])
SizeQuery = Annotated[int | None, Query(ge=0, description="expected size in bytes; checked while receiving")]
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _too_large(run: str, sha256: str, size: int, limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"blob {sha256} of run {run!r} is {size} bytes, over the {limit}-byte limit (max_blob_bytes); "
        "split snapshots into smaller shards",
        run_id=run,
        sha256=sha256,
    )


def _sound(stat: ObjectStat | None, sha256: str) -> bool:
    """Whether a stored blob carries a record of exactly its name's digest (see :attr:`ObjectStat.sha256`)."""
    return stat is not None and stat.sha256 == sha256


async def _paced(request: Request, settings: BulletinSettings, what: str) -> AsyncIterator[bytes]:
    """The request body's chunks; raises :class:`RequestTimeoutError` when it idles or trickles (see the ``upload_*``
    settings)."""
    started, received = time.monotonic(), 0
    chunks = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(settings.upload_idle_timeout_s):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RequestTimeoutError(
                f"{what}: nothing received for {settings.upload_idle_timeout_s} s (upload_idle_timeout_s) "
                f"after {received} bytes; send it again"
            ) from None
        received += len(chunk)
        elapsed = time.monotonic() - started
        if elapsed > settings.upload_rate_grace_s and received < settings.upload_min_bytes_per_s * elapsed:
            raise RequestTimeoutError(
                f"{what}: {received} bytes in {elapsed:.1f} s is under the {settings.upload_min_bytes_per_s:.0f} "
                "bytes/s minimum (upload_min_bytes_per_s); send it again faster"
            )
        yield chunk


@router.put(
    "/runs/{run}/blobs/{sha256}",
    response_model=BlobStored,
    status_code=201,
    responses={200: {"description": "already stored"}, 408: {}, 413: {}, 422: {}},
)
async def put_blob(
    run: str, sha256: str, request: Request, state: Publish, size_bytes: SizeQuery = None
) -> JSONResponse:
    """Upload a blob (raw body, streamed). Its sha256 and size are verified while receiving;
    nothing is stored on mismatch.

    A stored copy that is missing or fails its check (no record of this sha256, or its bytes
    read back hash to something else) is replaced; a sound one answers 200 "already stored". A body that idles or
    trickles is answered 408.
    """
    key = blob_key(run, sha256)
    if size_bytes is not None and size_bytes > state.settings.max_blob_bytes:
        raise _too_large(run, sha256, size_bytes, state.settings.max_blob_bytes)
    tmp = state.upload_dir / f".{sha256}.{uuid.uuid4().hex}"
    try:
        digest, received = StreamDigest(state.store.part_bytes), 0
        with open(tmp, "wb") as f:  # noqa: ASYNC230 - page-cache writes, cheaper than a thread hop per chunk; the fsync runs in a thread
            # at most max_blob_bytes: the body rule (body_caps.py) cuts a longer body
            async for chunk in _paced(request, state.settings, f"upload of blob {sha256} of run {run!r}"):
                received += len(chunk)
                digest.update(chunk)
                f.write(chunk)
            await to_thread.run_sync(os.fsync, f.fileno())
        if size_bytes is not None and received != size_bytes:
            raise BlobMismatchError(
                f"blob {sha256} of run {run!r}: received {received} bytes, size_bytes says {size_bytes}",
                run_id=run,
                sha256=sha256,
            )
        if digest.sha256 != sha256:
            raise BlobMismatchError(
                f"blob of run {run!r}: received bytes hash to {digest.sha256}, not {sha256}; "
                "the upload was corrupted or mislabeled",
                run_id=run,
                sha256=sha256,
            )
        stored = (
            _sound(await to_thread.run_sync(state.store.stat, key), sha256)
            and await to_thread.run_sync(stored_digest, state.store, key) == sha256
        )
        if not stored:
            await to_thread.run_sync(state.store.put_file, key, tmp, digest)
            state.metrics.blob_bytes_received.inc(received)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    body = BlobStored(run_id=run, sha256=sha256, size_bytes=received, created=not stored)
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if stored else 201)


@router.post("/runs/{run}/blobs/{sha256}/upload-url", response_model=UploadUrl)
def upload_url(run: str, sha256: str, state: Publish, size_bytes: SizeQuery = None) -> UploadUrl:
    """A presigned PUT URL for the blob (S3 with ``presign`` on), else ``{"url": null}``: upload to this bulletin then.

    The URL is signed with the blob's SHA-256 (the store refuses other bytes), its record and
    ``If-None-Match: *`` (it never overwrites a stored object: a 412 means upload to this
    bulletin instead, which replaces a copy that fails its check).
    """
    key = blob_key(run, sha256)
    if size_bytes is not None and size_bytes > state.settings.max_blob_bytes:
        raise _too_large(run, sha256, size_bytes, state.settings.max_blob_bytes)
    url = state.store.presign(key, "PUT", state.settings.presign_expires_s, sha256) if state.settings.presign else None
    return UploadUrl(url=url, method="PUT", expires_s=state.settings.presign_expires_s)


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` inclusive for a single satisfiable ``bytes=`` range; ``None`` to send everything."""
    m = _RANGE.match(header.strip()) if header else None
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):
        return max(0, size - int(m.group(2))), size - 1
    start = int(m.group(1))
    end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
    return start, end


@router.get("/runs/{run}/blobs/{sha256}", responses={206: {}, 304: {}, 307: {}, 404: {}, 416: {}})
def get_blob(run: str, sha256: str, request: Request, state: Read) -> Response:
    """Download a blob. Supports one ``Range`` (206), ``If-None-Match`` (304); ``ETag`` is the quoted sha256.
    A blob never changes: 200, 206 and 304 say ``Cache-Control: max-age=31536000, immutable`` (``public`` on an
    open bulletin; :mod:`.cache_headers`); errors and the 307 say ``no-store``.

    With S3 and ``presign`` on, answers 307 to a presigned URL, except to a relay (``X-Stitch-Relay``,
    :mod:`.routes_relay`), which gets the bytes to cache. Downloaders must verify the sha256.
    """
    return _serve_blob(run, sha256, request, state)


@router.head("/runs/{run}/blobs/{sha256}", responses={404: {}})
def head_blob(run: str, sha256: str, request: Request, state: Read) -> Response:
    """Whether the blob is stored soundly: 200 with ``Content-Length`` (its size in bytes) and ``ETag``, else 404.

    A stored copy without a record of this sha256 counts as not stored (404), so an uploader
    sends it again and the PUT replaces it.
    """
    stat = state.store.stat(blob_key(run, sha256))
    if stat is not None and not _sound(stat, sha256):
        raise NotFoundError(
            f"run {run!r} has a copy of blob {sha256} that fails its check (recorded digest "
            f"{stat.sha256 or 'none'}): upload it again",
            run_id=run,
            sha256=sha256,
        )
    return _serve_blob(run, sha256, request, state)


def _serve_blob(run: str, sha256: str, request: Request, state: BulletinState) -> Response:
    key = blob_key(run, sha256)
    stat = state.store.stat(key)
    if stat is None:
        raise NotFoundError(
            f"run {run!r} has no blob {sha256} (never uploaded, or removed by retention)", run_id=run, sha256=sha256
        )
    etag = f'"{sha256}"'
    headers = {"etag": etag, "accept-ranges": "bytes", "cache-control": immutable(state.auth.open)}
    if state.settings.presign and request.method == "GET" and RELAY_HEADER not in request.headers:
        url = state.store.presign(key, "GET", state.settings.presign_expires_s)
        if url:
            return RedirectResponse(url, status_code=307)
    if etag in (request.headers.get("if-none-match") or ""):
        return Response(status_code=304, headers=headers)
    size = stat.size_bytes
    rng = _parse_range(request.headers.get("range"), size)
    if rng is not None and (rng[0] >= size or rng[0] > rng[1]):
        return Response(status_code=416, headers={"etag": etag, "content-range": f"bytes */{size}"})
    start, end = rng if rng is not None else (0, size - 1)
    headers["content-length"] = str(end - start + 1)
    status = 200
    if rng is not None:
        status = 206
        headers["content-range"] = f"bytes {start}-{end}/{size}"
    if request.method == "HEAD" or size == 0:
        return Response(status_code=status, headers=headers, media_type="application/octet-stream")
    return StreamingResponse(
        state.store.iter_range(key, start, end),
        status_code=status,
        headers=headers,
        media_type="application/octet-stream",
    )
