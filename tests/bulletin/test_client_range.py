"""A blob download resumed through a cache that drops Range support (issue #33's faults): the cache answers
the ranged GET with 200 and the whole object, and the client starts the file over instead of appending the
whole object to its partial copy, so the blob still verifies."""

from __future__ import annotations

import hashlib
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from stitchboard.bulletin.client import BulletinClient
from tests.support.app_server import AppServer

BLOB = os.urandom(300_000)
SHA = hashlib.sha256(BLOB).hexdigest()


def _cache(ranged: list[str | None], honour_range: bool) -> Starlette:
    """A cache in front of the bulletin serving one blob, with or without Range support."""

    async def blob(request: Request) -> Response:
        header = request.headers.get("range")
        ranged.append(header)
        if honour_range and header:
            start = int(header.removeprefix("bytes=").rstrip("-"))
            tail = {"content-range": f"bytes {start}-{len(BLOB) - 1}/{len(BLOB)}"}
            return Response(BLOB[start:], status_code=206, headers=tail)
        return Response(BLOB, status_code=200)

    return Starlette(routes=[Route(f"/v1/runs/{{run}}/blobs/{SHA}", blob)])


def _resume(tmp_path, honour_range: bool) -> tuple[bytes, list[str | None]]:
    ranged: list[str | None] = []
    server = AppServer(_cache(ranged, honour_range))
    dest = tmp_path / "blob"
    dest.with_name("blob.part").write_bytes(BLOB[:100_000])  # an earlier download cut off a third of the way
    try:
        with BulletinClient(server.url, retries=0) as client:
            client.download_blob("r", SHA, dest, len(BLOB))
    finally:
        server.stop()
    return dest.read_bytes(), ranged


def test_a_cache_that_drops_range_support_still_gives_a_verified_blob(tmp_path):
    data, ranged = _resume(tmp_path, honour_range=False)
    assert ranged == ["bytes=100000-"] and data == BLOB  # asked for the rest, got the whole: started over


def test_a_cache_that_honours_range_resumes_the_partial_copy(tmp_path):
    data, ranged = _resume(tmp_path, honour_range=True)
    assert ranged == ["bytes=100000-"] and data == BLOB
