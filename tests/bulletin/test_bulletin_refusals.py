"""Issue 11 items 6-9, 12, 13: amplification, shadowing assets, names and checksums refused at
publish; /metrics and /readyz behind tokens; metric labels only from runs that exist."""

from __future__ import annotations

import json

import httpx
import pytest

from stitchboard.bulletin.settings import TokenGrant
from stitchboard.proto.schema import FileRef, canonical_json
from tests.bulletin.bulletin_helpers import ThreadServer, make_backend, make_manifest, sha, upload_version

WEBDAV = ["PROPFIND", "MKCOL", "LOCK", "UNLOCK", "COPY", "MOVE", "SEARCH", "PURGE"]
TOKENS = {"pub": TokenGrant(scopes=["publish"]), "prom": TokenGrant(scopes=["metrics"])}


@pytest.fixture
def small(request, tmp_path):
    """An open file-store bulletin that takes at most 4 files per version."""
    srv = ThreadServer(make_backend("file", request, tmp_path, max_files_per_version=4).settings)
    yield srv
    srv.stop()


def _post(url: str, run: str, body: dict | bytes) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/runs/{run}/versions", content=data, headers={"content-type": "application/json"})


def _v0(client, run: str, *extra: FileRef) -> dict:
    data = b"snapshot bytes"
    client.put_blob(run, sha(data), data)
    files = [FileRef(path="model.safetensors", sha256=sha(data), size_bytes=len(data), role="snapshot"), *extra]
    return json.loads(canonical_json(make_manifest(run, 0, files)))


def test_one_blob_under_many_paths_is_refused_by_the_files_cap(small, run):
    with small.client() as client:
        asset = b"{}"
        client.put_blob(run, sha(asset), asset)
        many = [FileRef(path=f"a{i}.json", sha256=sha(asset), size_bytes=2, role="asset") for i in range(200)]
        r = _post(small.url, run, _v0(client, run, *many))
        assert r.status_code == 422 and "max_files_per_version" in r.json()["message"], r.text
        assert client.latest(run) is None
        ok = _post(small.url, run, _v0(client, run, *many[:3]))
        assert ok.status_code == 201, ok.text


def test_repeated_path_is_refused(small, run):
    with small.client() as client:
        body = _v0(client, run)
        body["files"].append(dict(body["files"][0], role="asset"))
        r = _post(small.url, run, body)
        assert r.status_code == 422 and "more than once" in r.json()["message"], r.text


@pytest.mark.parametrize(
    "path", ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "sub/extra.safetensors"]
)
def test_asset_named_like_a_checkpoint_file_is_refused(small, run, path):
    with small.client() as client:
        body = _v0(client, run)
        body["files"][0]["path"] = "model-00001-of-00001.safetensors"
        body["files"].append(
            {
                "path": path,
                "sha256": body["files"][0]["sha256"],
                "size_bytes": body["files"][0]["size_bytes"],
                "role": "asset",
            }
        )
        r = _post(small.url, run, body)
        assert r.status_code == 422 and "named like checkpoint files" in r.json()["message"], r.text
        assert client.latest(run) is None


@pytest.mark.parametrize("path", [".", "", "./", "a/", "a/./b", "a//b", "cfg/."])
def test_dot_empty_and_directory_paths_are_refused(small, run, path):
    with small.client() as client:
        body = _v0(client, run)
        body["files"].append(
            {
                "path": path,
                "sha256": body["files"][0]["sha256"],
                "size_bytes": body["files"][0]["size_bytes"],
                "role": "asset",
            }
        )
        r = _post(small.url, run, body)
        assert r.status_code == 422, r.text


@pytest.mark.parametrize("digest", ["0" * 32 + "\n", "0" * 8, "0" * 31, "0" * 33, "0" * 64])
def test_checksums_need_their_exact_length(small, run, digest):
    with small.client() as client:
        body = _v0(client, run)
        body["tensors"][0]["checksums"] = {"xxh3_128": digest}
        r = _post(small.url, run, body)
        assert r.status_code == 422, r.text
        body["tensors"][0]["checksums"] = {"xxh3_128": "0" * 32, "sha256": digest}
        assert _post(small.url, run, body).status_code == 422 if len(digest) != 64 else True


def test_sha256_with_a_trailing_newline_is_refused(small, run):
    with small.client() as client:
        body = _v0(client, run)
        body["files"][0]["sha256"] += "\n"
        assert _post(small.url, run, body).status_code == 422


@pytest.fixture
def secured(request, tmp_path):
    srv = ThreadServer(make_backend("file", request, tmp_path, tokens=TOKENS).settings)
    yield srv
    srv.stop()


def test_metrics_needs_a_metrics_token_and_readyz_says_only_ready(secured):
    assert httpx.get(f"{secured.url}/metrics").status_code == 401
    assert httpx.get(f"{secured.url}/metrics", headers={"authorization": "Bearer pub"}).status_code == 403
    r = httpx.get(f"{secured.url}/metrics", headers={"authorization": "Bearer prom"})
    assert r.status_code == 200 and "stitch_bulletin_publishes" in r.text
    ready = httpx.get(f"{secured.url}/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}


def test_rejected_publishes_to_made_up_runs_add_no_metric_lines(small, run):
    def hostile(first: int, count: int) -> list[str]:
        for i in range(first, first + count):
            assert _post(small.url, f"made-up-{i}", b"{}").status_code == 422
            httpx.request(WEBDAV[i % len(WEBDAV)], f"{small.url}/v1/runs/made-up-{i}/versions")
        httpx.get(f"{small.url}/metrics")  # so the next scrape already holds its own latency series
        return [line.rsplit(" ", 1)[0] for line in httpx.get(f"{small.url}/metrics").text.splitlines()]

    with small.client() as client:
        upload_version(client, run, 0)
        assert _post(small.url, run, b"{}").status_code == 422
        warm = hostile(0, len(WEBDAV))  # each bounded label value once
        after = hostile(len(WEBDAV), 50)
    text = "\n".join(after)
    assert "made-up" not in text and f'stitch_bulletin_publishes_total{{outcome="rejected",run="{run}"}}' in text
    assert 'method="other"' in text and "PROPFIND" not in text
    assert after == warm, sorted(set(after) - set(warm))
