"""The REST API over real HTTP, once per store backend (local folder and S3 via moto's server)."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from stitchboard.bulletin.errors import NotFoundError, VersionConflictError
from stitchboard.proto.schema import canonical_json
from tests.bulletin.bulletin_helpers import ThreadServer, make_backend, make_manifest, sha, upload_version


def test_publish_then_read_everything_back(client, run):
    v0 = upload_version(client, run, 0, snapshot_bytes=3000)
    v1 = upload_version(client, run, 1, patch_bytes=100)
    v2 = upload_version(client, run, 2, patch_bytes=200, snapshot_bytes=2500)

    assert client.latest(run) == 2
    info = client.latest_info(run)
    assert info.snapshot and info.snapshot_bytes == 2500 and info.size_bytes == 200 and info.committed_at
    for m in (v0, v1, v2):
        assert canonical_json(client.manifest(run, m.version)) == canonical_json(m)
    assert [i.version for i in client.versions(run)] == [0, 1, 2]
    assert [i.version for i in client.versions(run, after=0, limit=1)] == [1]
    assert any(r.run_id == run and r.latest_version == 2 for r in client.runs())
    with pytest.raises(NotFoundError, match="no version 7"):
        client.manifest(run, 7)


def test_republishing_identical_bytes_is_a_noop_and_different_bytes_conflict(client, run, backend):
    m = upload_version(client, run, 0, snapshot_bytes=10)
    first = client.publish(m)  # retry of the same manifest
    assert first.version == 0
    r = httpx.post(f"{client.url}/v1/runs/{run}/versions", content=canonical_json(m))
    assert r.status_code == 200 and r.json()["manifest_sha256"] == first.manifest_sha256
    before = backend.keys()
    other = make_manifest(run, 0, m.files, metadata={"step": 1})
    with pytest.raises(VersionConflictError, match="already published with different content"):
        client.publish(other)
    assert backend.keys() == before


def test_the_client_follows_version_pages(request, tmp_path, run):
    backend = make_backend("file", request, tmp_path, versions_page_max=2)
    srv = ThreadServer(backend.settings)
    try:
        with srv.client() as c:
            for v in range(5):
                upload_version(c, run, v, snapshot_bytes=10 if v == 0 else 0)
            page = httpx.get(f"{srv.url}/v1/runs/{run}/versions", params={"after": 0, "limit": 100}).json()
            assert (
                [i["version"] for i in page["versions"]] == [1, 2] and page["next_after"] == 2 and page["run_id"] == run
            )
            assert [i.version for i in c.versions(run)] == [0, 1, 2, 3, 4]
            assert [i.version for i in c.versions(run, after=1, limit=3)] == [2, 3, 4]
    finally:
        srv.stop()


def test_latest_of_a_run_without_versions_is_not_an_error(client, run):
    assert client.latest(run) is None
    t0 = time.monotonic()
    assert client.latest(run, wait_s=0.3) is None
    assert time.monotonic() - t0 >= 0.25
    assert client.versions(run) == []


def test_blob_upload_download_range_etag(client, run, tmp_path):
    data = os.urandom(100_000)
    digest = sha(data)
    assert client.put_blob(run, digest, data) is True
    assert client.put_blob(run, digest, data) is False  # already stored: skipped
    assert client.has_blob(run, digest) == len(data)
    assert client.has_blob(run, "0" * 64) is None

    out = client.download_blob(run, digest, tmp_path / "x.bin", expected_size=len(data))
    assert out.read_bytes() == data

    base = f"{client.url}/v1/runs/{run}/blobs/{digest}"
    r = httpx.get(base, headers={"range": "bytes=10-19"})
    assert (
        r.status_code == 206 and r.content == data[10:20] and r.headers["content-range"] == f"bytes 10-19/{len(data)}"
    )
    r = httpx.get(base, headers={"range": "bytes=-5"})
    assert r.status_code == 206 and r.content == data[-5:]
    assert httpx.get(base, headers={"range": f"bytes={len(data)}-"}).status_code == 416
    r = httpx.get(base)
    assert r.headers["etag"] == f'"{digest}"'
    assert httpx.get(base, headers={"if-none-match": r.headers["etag"]}).status_code == 304

    # resume: a partial file is completed with a Range request and verified as a whole
    part = tmp_path / "y.bin.part"
    part.write_bytes(data[:33_333])
    assert client.download_blob(run, digest, tmp_path / "y.bin").read_bytes() == data
    assert not part.exists()


def test_upload_from_file_path(client, run, tmp_path):
    data = os.urandom(70_000)
    path = tmp_path / "shard.safetensors"
    path.write_bytes(data)
    assert client.put_blob(run, sha(data), path, size_bytes=len(data))
    assert client.has_blob(run, sha(data)) == len(data)


def test_long_poll_is_woken_by_a_publish(client, server, run):
    upload_version(client, run, 0, snapshot_bytes=10)
    got = {}

    def wait() -> None:
        with server.client() as c:
            t0 = time.monotonic()
            got["version"] = c.latest(run, after=0, wait_s=20)
            got["s"] = time.monotonic() - t0

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    upload_version(client, run, 1, patch_bytes=10)
    waiter.join(25)
    assert got["version"] == 1
    assert got["s"] < 20  # woken, not timed out (latency itself is a benchmark figure)


def test_publish_through_another_bulletin_is_noticed_by_polling(backend, server, run):
    other = ThreadServer(backend.settings)  # a second bulletin over the same store
    try:
        with server.client() as a, other.client() as b:
            upload_version(a, run, 0, snapshot_bytes=10)
            got = {}
            waiter = threading.Thread(target=lambda: got.setdefault("v", b.latest(run, after=0, wait_s=20)))
            waiter.start()
            time.sleep(0.3)
            upload_version(a, run, 1, patch_bytes=10)
            waiter.join(25)
            assert got["v"] == 1
    finally:
        other.stop()


def test_plan_api(client, run):
    upload_version(client, run, 0, snapshot_bytes=5000)
    upload_version(client, run, 1, patch_bytes=100)
    upload_version(client, run, 2, patch_bytes=100, snapshot_bytes=5000)
    upload_version(client, run, 3, patch_bytes=100)

    p = client.plan(run, from_version=1)
    assert (
        p.to_version == 3
        and [(s.version, s.kind) for s in p.steps] == [(2, "delta"), (3, "delta")]
        and p.total_bytes == 200
    )
    p = client.plan(run)
    assert [(s.version, s.kind) for s in p.steps] == [(2, "snapshot"), (3, "delta")] and p.total_bytes == 5100
    assert client.plan(run, from_version=3).steps == []
    assert [s.kind for s in client.plan(run, from_version=0, to_version=1).steps] == ["delta"]
    with pytest.raises(NotFoundError):
        client.plan(run, to_version=9)


def test_ops_endpoints_and_openapi(client, run):
    upload_version(client, run, 0, snapshot_bytes=10)
    assert httpx.get(f"{client.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{client.url}/readyz").json()["status"] == "ready"
    paths = httpx.get(f"{client.url}/openapi.json").json()["paths"]
    for p in (
        "/v1/runs/{run}/blobs/{sha256}",
        "/v1/runs/{run}/versions",
        "/v1/runs/{run}/versions/latest",
        "/v1/runs/{run}/versions/{version}",
        "/v1/runs",
        "/v1/runs/{run}/plan",
    ):
        assert p in paths
    text = httpx.get(f"{client.url}/metrics").text
    assert f'stitch_bulletin_publishes_total{{outcome="created",run="{run}"}} 1.0' in text
    assert f'stitch_bulletin_latest_version{{run="{run}"}} 0.0' in text
    assert f'stitch_bulletin_bytes_stored{{run="{run}"}}' in text
    assert "stitch_bulletin_waiters 0.0" in text
    assert 'stitch_bulletin_request_seconds_count{method="POST",route="/v1/runs/{run}/versions",status="201"}' in text
