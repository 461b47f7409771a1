"""Faults between the bulletin and its store: corrupted bodies, refused digests, stored copies that fail their check,
presigned uploads.

The proxy (:class:`tests.support.fault_proxy.FaultProxy`) sits between the bulletin and moto's
S3 server and answers ``BadDigest`` as S3 does when a body does not match its checksum.
"""

from __future__ import annotations

import hashlib
import os

import boto3
import httpx
import pytest

from stitchboard.bulletin.client import presigned_put_headers
from stitchboard.bulletin.errors import BlobMismatchError, UnavailableError
from stitchboard.bulletin.ledger import blob_key
from stitchboard.bulletin.stores import open_store
from stitchboard.proto.schema import FileRef
from tests.bulletin.bulletin_helpers import Backend, ThreadServer, make_backend, make_manifest, sha
from tests.support.fault_proxy import FaultProxy, Rule

MiB = 1 << 20


@pytest.fixture
def via_proxy(request, tmp_path):
    """``(backend, proxy, settings)``: an S3 backend whose bulletin reaches moto through a FaultProxy."""

    def make(check_digests: bool = True, **overrides):
        backend = make_backend("s3", request, tmp_path, **overrides)
        proxy = FaultProxy(backend.settings.s3_endpoint_url or "", check_digests=check_digests)
        request.addfinalizer(proxy.stop)
        return backend, proxy, backend.settings.model_copy(update={"s3_endpoint_url": proxy.url})

    return make


def _stored_objects(backend: Backend) -> dict[str, bytes]:
    """Every blob object in the bucket, read straight from moto (not through the proxy)."""
    s3 = boto3.client("s3", endpoint_url=backend.settings.s3_endpoint_url, region_name="us-east-1")
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=backend.bucket)
        for o in page.get("Contents", [])
        if "/blobs/" in o["Key"]
    ]
    return {k: s3.get_object(Bucket=backend.bucket, Key=k)["Body"].read() for k in keys}


def _publish(client, run: str, version: int, data: bytes):
    client.put_blob(run, sha(data), data)
    role = "snapshot" if version == 0 else "patch"
    manifest = make_manifest(
        run, version, [FileRef(path=f"{role}-{version}", sha256=sha(data), size_bytes=len(data), role=role)]
    )
    client.publish(manifest)
    return manifest


def test_bodies_corrupted_on_the_way_to_s3_are_refused_sent_again_and_stored_intact(via_proxy, run, tmp_path):
    backend, proxy, settings = via_proxy()
    blobs = [os.urandom(3000 + v) for v in range(4)]
    for data in blobs:  # the first two sends of every blob arrive with one byte flipped
        proxy.add(Rule("corrupt", method="PUT", path=f"/blobs/{sha(data)}$", times=2))
    server = ThreadServer(settings)
    try:
        with server.client() as client:
            for v, data in enumerate(blobs):
                _publish(client, run, v, data)
            assert proxy.actions("bad_digest") == 8
            for v, data in enumerate(blobs):  # every pull verifies
                assert client.download_blob(run, sha(data), tmp_path / f"{v}", len(data)).read_bytes() == data
    finally:
        server.stop()
    stored = _stored_objects(backend)  # read back and hashed: what S3 holds is what was sent
    assert sorted(k.rsplit("/", 1)[-1] for k in stored) == sorted(sha(d) for d in blobs)
    assert all(hashlib.sha256(body).hexdigest() == key.rsplit("/", 1)[-1] for key, body in stored.items())
    store = open_store(backend.settings.store, backend.settings)
    assert all(store.stat(blob_key(run, sha(d))).sha256 == sha(d) for d in blobs)  # the record


def test_a_body_corrupted_at_every_send_fails_the_upload_and_stores_nothing(via_proxy, run):
    backend, proxy, settings = via_proxy()
    proxy.add(Rule("corrupt", method="PUT", path="/blobs/", times=None))
    server = ThreadServer(settings)
    try:
        with server.client() as client, pytest.raises(UnavailableError, match="BadDigest"):
            client.put_blob(run, sha(b"payload"), b"payload")
    finally:
        server.stop()
    assert proxy.actions("bad_digest") == 6  # 3 sends per request, the client's retry included
    assert _stored_objects(backend) == {}


def test_a_corrupted_multipart_part_is_sent_again(via_proxy, run):
    backend, proxy, settings = via_proxy(
        max_blob_bytes=64 * MiB, s3_multipart_threshold_bytes=5 * MiB, s3_multipart_chunk_bytes=5 * MiB
    )
    data = os.urandom(11 * MiB)  # 3 parts, each with its own SHA-256
    proxy.add(Rule("corrupt", method="PUT", path="partNumber=2", times=1))
    server = ThreadServer(settings)
    try:
        with server.client() as client:
            assert client.put_blob(run, sha(data), data)
    finally:
        server.stop()
    assert proxy.actions("bad_digest") == 1
    [(key, body)] = _stored_objects(backend).items()
    assert hashlib.sha256(body).hexdigest() == sha(data) == key.rsplit("/", 1)[-1]
    assert open_store(backend.settings.store, backend.settings).stat(blob_key(run, sha(data))).sha256 == sha(data)


def _overwrite_out_of_band(backend: Backend, run: str, sha256: str, data: bytes) -> None:
    if backend.root is not None:
        with open(backend.root / blob_key(run, sha256), "r+b") as f:
            f.write(data)
        return
    s3 = boto3.client("s3", endpoint_url=backend.settings.s3_endpoint_url, region_name="us-east-1")
    s3.put_object(Bucket=backend.bucket, Key=f"stitch/{blob_key(run, sha256)}", Body=data)


def test_a_stored_copy_that_fails_its_check_is_refused_at_commit_and_replaced_by_a_reupload(
    client, backend, run, tmp_path
):
    data = os.urandom(5000)
    client.put_blob(run, sha(data), data)
    bad = bytes([data[0] ^ 1]) + data[1:]
    _overwrite_out_of_band(backend, run, sha(data), bad)
    manifest = make_manifest(
        run, 0, [FileRef(path="snapshot-0", sha256=sha(data), size_bytes=len(data), role="snapshot")]
    )
    with pytest.raises(BlobMismatchError, match="does not hold the bytes of sha256"):
        client.publish(manifest)
    assert client.has_blob(run, sha(data)) is None  # no valid record: not stored, for an uploader
    with pytest.raises(BlobMismatchError, match="stored copy is corrupt"):
        client.download_blob(run, sha(data), tmp_path / "out", len(data))
    assert client.put_blob(run, sha(data), data)  # replaced, not "already stored"
    client.publish(manifest)
    assert client.download_blob(run, sha(data), tmp_path / "out", len(data)).read_bytes() == data


def test_corruption_no_checksum_caught_is_found_by_readers_and_repaired_by_a_forced_reupload(via_proxy, run, tmp_path):
    _, proxy, settings = via_proxy(check_digests=False)  # a store that does not check: the bad body lands
    data = os.urandom(4000)
    proxy.add(Rule("corrupt", method="PUT", path=f"/blobs/{sha(data)}$", times=1))
    server = ThreadServer(settings)
    try:
        with server.client() as client:
            client.put_blob(run, sha(data), data)
            with pytest.raises(BlobMismatchError, match="stored copy is corrupt: upload the file again"):
                client.download_blob(run, sha(data), tmp_path / "out", len(data))
            assert client.put_blob(run, sha(data), data, force=True)  # the bulletin reads its copy back and replaces it
            assert client.download_blob(run, sha(data), tmp_path / "out", len(data)).read_bytes() == data
            assert not client.put_blob(run, sha(data), data, force=True)  # a sound copy: already stored
    finally:
        server.stop()


def test_presigned_uploads_carry_the_checksum_and_never_overwrite(via_proxy, run):
    backend, proxy, settings = via_proxy(presign=True)
    server = ThreadServer(settings)
    data, other = os.urandom(3000), os.urandom(3000)
    try:
        with server.client() as client:
            assert client.put_blob(run, sha(data), data)
            assert proxy.log[-1][0] == "PUT" and "Signature" in proxy.log[-1][1]  # it went straight to the store
            assert open_store(backend.settings.store, backend.settings).stat(blob_key(run, sha(data))).sha256 == sha(
                data
            )
            client.publish(
                make_manifest(run, 0, [FileRef(path="s", sha256=sha(data), size_bytes=len(data), role="snapshot")])
            )
            url = client._call("POST", f"/v1/runs/{run}/blobs/{sha(other)}/upload-url", what="test").json()["url"]
            assert (
                httpx.put(url, content=data, headers=presigned_put_headers(sha(other))).status_code == 400
            )  # other bytes: BadDigest
            url = client._call("POST", f"/v1/runs/{run}/blobs/{sha(data)}/upload-url", what="test").json()["url"]
            assert (
                httpx.put(url, content=data, headers=presigned_put_headers(sha(data))).status_code == 412
            )  # committed: never overwritten
            assert not client.put_blob(
                run, sha(data), data, force=True
            )  # 412, then through the bulletin: already stored
    finally:
        server.stop()


def test_store_errors_dropped_connections_and_delays_are_retried(via_proxy, run, tmp_path):
    backend, proxy, settings = via_proxy()
    blobs = [os.urandom(2000 + v) for v in range(3)]
    proxy.add(Rule("status", method="PUT", path=f"/blobs/{sha(blobs[0])}$", status=503, code="SlowDown", times=2))
    proxy.add(Rule("drop", method="PUT", path=f"/blobs/{sha(blobs[1])}$", times=1))
    proxy.add(Rule("delay", method="PUT", path=f"/blobs/{sha(blobs[2])}$", delay_s=0.3, times=1))
    proxy.add(Rule("status", method="PUT", path="/versions/000000000001", status=500, code="InternalError", times=1))
    server = ThreadServer(settings)
    try:
        with server.client() as client:
            for v, data in enumerate(blobs):
                _publish(client, run, v, data)
            assert [proxy.actions(a) for a in ("status", "drop", "delay")] == [3, 1, 1]
            assert client.latest(run) == 2
    finally:
        server.stop()
    stored = _stored_objects(backend)
    assert (
        all(hashlib.sha256(body).hexdigest() == key.rsplit("/", 1)[-1] for key, body in stored.items())
        and len(stored) == 3
    )
