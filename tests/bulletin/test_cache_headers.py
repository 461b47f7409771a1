"""Cache-Control on the bulletin's answers (bulletin/cache_headers.py), over real HTTP on loopback: immutable
objects (blobs, committed manifests) may be kept, `public` only on an open bulletin; everything else, the
long-poll's fast path and its whole answers included, says no-store; a presign redirect is never cacheable."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from stitchboard.bulletin.settings import BulletinSettings, TokenGrant
from tests.bulletin.bulletin_helpers import ThreadServer, make_backend, upload_version
from tests.sidecar.sidecar_helpers import wait_for

KEEP = "max-age=31536000, immutable"
TOKENS = {"pub": TokenGrant(scopes=["publish", "read"])}


@pytest.fixture(params=["open", "tokens"])
def served(request, tmp_path):
    tokens = TOKENS if request.param == "tokens" else {}
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", tokens=tokens, poll_interval_s=0.05))
    yield server, request.param == "open"
    server.stop()


def test_immutable_objects_are_kept_and_everything_else_is_not_stored(served, run):
    server, is_open = served
    keep = f"public, {KEEP}" if is_open else KEEP
    auth = {} if is_open else {"authorization": "Bearer pub"}
    with server.client(None if is_open else "pub") as pub:
        manifest = upload_version(pub, run, 0, snapshot_bytes=64)
    blob = f"{server.url}/v1/runs/{run}/blobs/{manifest.files[0].sha256}"
    etag = f'"{manifest.files[0].sha256}"'
    with httpx.Client(headers=auth) as http:
        kept = {
            "blob 200": http.get(blob),
            "blob 206": http.get(blob, headers={"range": "bytes=0-9"}),
            "blob 304": http.get(blob, headers={"if-none-match": etag}),
            "blob HEAD": http.head(blob),
            "manifest": http.get(f"{server.url}/v1/runs/{run}/versions/0"),
        }
        assert [r.status_code for r in kept.values()] == [200, 206, 304, 200, 200]
        assert {name: r.headers.get("cache-control") for name, r in kept.items()} == dict.fromkeys(kept, keep)
        not_stored = {
            "latest (fast path)": http.get(f"{server.url}/v1/runs/{run}/versions/latest", params={"after": -1}),
            "latest 204 (fast path)": http.get(
                f"{server.url}/v1/runs/{run}/versions/latest", params={"after": 0, "wait_s": 0.1}
            ),
            "latest (route: a bad query)": http.get(f"{server.url}/v1/runs/{run}/versions/latest?after=x"),
            "version list": http.get(f"{server.url}/v1/runs/{run}/versions"),
            "plan": http.get(f"{server.url}/v1/runs/{run}/plan", params={"target": 0}),
            "missing blob 404": http.get(f"{server.url}/v1/runs/{run}/blobs/{'0' * 64}"),
            "missing manifest 404": http.get(f"{server.url}/v1/runs/{run}/versions/7"),
            "range 416": http.get(blob, headers={"range": "bytes=999-"}),
            "fleet": http.get(f"{server.url}/v1/runs/{run}/fleet", params={"version": 0}),
            "replicas": http.get(f"{server.url}/v1/runs/{run}/replicas"),
            "status page": http.get(f"{server.url}/status"),
            "healthz": http.get(f"{server.url}/healthz"),
        }
        statuses = {name: r.status_code for name, r in not_stored.items()}
        assert statuses == {
            **dict.fromkeys(not_stored, 200),
            "latest 204 (fast path)": 204,
            "latest (route: a bad query)": 422,
            "missing blob 404": 404,
            "missing manifest 404": 404,
            "range 416": 416,
        }
        assert {name: r.headers.get("cache-control") for name, r in not_stored.items()} == dict.fromkeys(
            not_stored, "no-store"
        )
        if not is_open:  # a refused token's answer is not stored either
            refused = httpx.get(blob, headers={"authorization": "Bearer nope"})
            assert refused.status_code == 401 and refused.headers["cache-control"] == "no-store"


def test_a_long_poll_woken_by_a_publish_says_no_store(tmp_path, run):
    """The answer the watcher sends to waiting long-polls (built once, sent whole past the ASGI layer)."""
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", poll_interval_s=0.05))
    try:
        with server.client() as pub:
            upload_version(pub, run, 0, snapshot_bytes=8)
            url = f"{server.url}/v1/runs/{run}/versions/latest"

            async def wait_all() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=30) as http:
                    return await asyncio.gather(*(http.get(url, params={"after": 0, "wait_s": 20}) for _ in range(8)))

            answers: list[httpx.Response] = []
            waiting = threading.Thread(target=lambda: answers.extend(asyncio.run(wait_all())))
            waiting.start()
            try:
                wait_for(lambda: server.app.state.bulletin.watcher.waiting >= 8, 20)  # all 8 wait
            finally:
                upload_version(pub, run, 1, patch_bytes=8)  # wakes them (also when the wait above failed)
                waiting.join(30)
        assert [(r.status_code, r.json()["version"]) for r in answers] == [(200, 1)] * 8
        assert {r.headers["cache-control"] for r in answers} == {"no-store"}
    finally:
        server.stop()


def test_a_presign_redirect_is_never_cacheable(request, tmp_path, run):
    backend = make_backend("s3", request, tmp_path, presign=True)
    server = ThreadServer(backend.settings)
    try:
        with server.client() as pub:
            manifest = upload_version(pub, run, 0, snapshot_bytes=16)
        r = httpx.get(f"{server.url}/v1/runs/{run}/blobs/{manifest.files[0].sha256}", follow_redirects=False)
        assert r.status_code == 307 and r.headers["cache-control"] == "no-store"
    finally:
        server.stop()
