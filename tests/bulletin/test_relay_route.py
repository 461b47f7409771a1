"""The bulletin's side of a relay: the read-check route (``routes_relay.py``) and presign redirects off for requests
through a relay, judged over loopback against a real S3 server (moto) and, where nginx is installed, through the
relay configuration itself."""

from __future__ import annotations

import os

import httpx
import pytest

from stitchboard.bulletin.routes_relay import RELAY_HEADER
from stitchboard.bulletin.settings import BulletinSettings
from tests.bulletin.bulletin_helpers import ThreadServer, make_backend, sha
from tests.bulletin.relay_nginx import NGINX, NO_NGINX, Nginx

TOKENS = {
    "t-publish": {"scopes": ["publish"], "runs": ["run-a"]},
    "t-replica": {"scopes": ["replica"], "runs": ["run-a"]},
    "t-metrics": {"scopes": ["metrics"]},
    "t-other": {"scopes": ["read"], "runs": ["run-b"]},
}


def test_the_read_check_answers_as_a_read_of_the_run_would(tmp_path) -> None:
    """204 with no body for a token that may read the run (publish and replica imply read), the token rules' 401 and
    403 otherwise, 422 for a bad run id; never cacheable by a cache that does not key it by the token; a body is
    refused before the route runs (cap 0)."""
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", tokens=TOKENS))
    try:
        with httpx.Client(base_url=server.url) as http:

            def check(token: str | None, run: str = "run-a", **kwargs) -> httpx.Response:
                headers = {"authorization": f"Bearer {token}"} if token else {}
                return http.get(f"/v1/runs/{run}/read-check", headers=headers, **kwargs)

            for token in ("t-publish", "t-replica"):
                ok = check(token)
                assert (ok.status_code, ok.content, ok.headers["cache-control"]) == (204, b"", "no-store")
            assert check(None).status_code == 401
            assert check("t-unknown").status_code == 401
            assert check("t-metrics").status_code == 403
            assert check("t-other").status_code == 403
            assert check("t-other", "run-b").status_code == 204
            assert check("t-publish", "bad..run").status_code in (403, 422)
            with_body = http.request(
                "GET", "/v1/runs/run-a/read-check", content=b"x" * 10, headers={"authorization": "Bearer t-publish"}
            )
            assert with_body.status_code == 413
    finally:
        server.stop()


def test_a_relay_gets_the_bytes_where_others_get_a_presigned_redirect(request, tmp_path) -> None:
    """With S3 and presign on, a blob GET is a 307 (no-store) to the store, except one carrying the relay header: the
    bytes, cacheable. A client that sets the header itself passes the same token check and reads the same bytes."""
    backend = make_backend("s3", request, tmp_path, presign=True)
    server = ThreadServer(backend.settings)
    data = os.urandom(20_000)
    try:
        with server.client() as client, httpx.Client(base_url=server.url) as http:
            client.put_blob("run-a", sha(data), data)
            path = f"/v1/runs/run-a/blobs/{sha(data)}"
            direct = http.get(path)
            assert direct.status_code == 307 and direct.headers["cache-control"] == "no-store"
            relayed = http.get(path, headers={RELAY_HEADER: "1"})
            assert relayed.status_code == 200 and relayed.content == data
            assert "immutable" in relayed.headers["cache-control"]
    finally:
        server.stop()


@pytest.mark.slow  # starts a process (docs/testing.md, the slow tier)
@pytest.mark.skipif(NGINX is None, reason=NO_NGINX)
def test_the_nginx_relay_caches_blobs_of_a_presigning_bulletin(request, tmp_path) -> None:
    """Through deploy/relay's nginx, a presigning bulletin's blob is fetched once as bytes and then served from the
    cache (MISS, then HIT), whole and by Range; the bulletin's 307 never reaches the cache, nor its 404 for a blob
    not uploaded yet."""
    backend = make_backend("s3", request, tmp_path, presign=True)
    server = ThreadServer(backend.settings)
    relay = None
    data = os.urandom(50_000)
    try:
        with server.client() as client, httpx.Client() as http:
            relay = Nginx(server.url.removeprefix("http://"), tmp_path / "relay")
            url = f"{relay.url}/v1/runs/run-a/blobs/{sha(data)}"
            assert http.get(url).status_code == 404  # not uploaded yet: a no-store answer, never cached
            client.put_blob("run-a", sha(data), data)
            first, second = http.get(url), http.get(url)
            assert (first.status_code, first.headers["x-stitch-relay-cache"], first.content) == (200, "MISS", data)
            assert (second.status_code, second.headers["x-stitch-relay-cache"], second.content) == (200, "HIT", data)
            part = http.get(url, headers={"range": "bytes=100-199"})
            assert (part.status_code, part.content) == (206, data[100:200])
    finally:
        if relay is not None:
            relay.stop()
        server.stop()
