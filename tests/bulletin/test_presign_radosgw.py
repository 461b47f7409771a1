"""Presigned PUT URLs are SigV4 in every region and refuse other bytes and overwrites, judged by a real S3 server.

The server is Ceph's radosgw 16 (fixture :func:`tests.support.radosgw.radosgw`, skipped where it is
not installed): unlike moto it checks signatures and the signed payload digest. It ignores
``x-amz-checksum-sha256`` (checksums came to radosgw in 18), so the signed
``x-amz-content-sha256`` is what refuses other bytes there.
"""

from __future__ import annotations

import hashlib
import os
import threading
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from stitchboard.bulletin.client import presigned_put_headers
from stitchboard.bulletin.ledger import blob_key
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.bulletin.stores import S3Settings, S3Store
from stitchboard.proto.schema import FileRef
from tests.bulletin.bulletin_helpers import ThreadServer, make_manifest, sha
from tests.support.radosgw import RadosGW

#: Regions botocore presigns with SigV2 unless told otherwise (us-east-1 and the other pre-2014
#: regions), and two SigV4-only ones.
REGIONS = ("us-east-1", "us-west-1", "eu-west-1", "ap-southeast-2", "sa-east-1", "eu-central-1", "ap-south-1")


@pytest.fixture
def settings(radosgw: RadosGW) -> BulletinSettings:
    """Bulletin settings over a fresh bucket on radosgw, with presigned URLs on."""
    return BulletinSettings(
        store=f"s3://{radosgw.create_bucket()}/stitch",
        s3_endpoint_url=radosgw.endpoint,
        s3_region=radosgw.region,
        s3_access_key_id=radosgw.access_key_id,
        s3_secret_access_key=radosgw.secret_access_key,
        s3_addressing_style="path",
        presign=True,
        poll_interval_s=0.1,
    )


def _store(settings: BulletinSettings) -> S3Store:
    bucket, _, prefix = settings.store.removeprefix("s3://").partition("/")
    return S3Store(bucket, prefix, settings)


def _error_code(answer: httpx.Response) -> str:
    return answer.text.split("<Code>", 1)[-1].split("</Code>", 1)[0] if "<Code>" in answer.text else ""


@pytest.mark.parametrize("endpoint", [None, "http://127.0.0.1:9"])
def test_presigned_urls_are_sigv4_and_sign_every_header_the_uploader_sends(endpoint):
    """No server needed: the URL's algorithm and signed headers, for regions botocore would presign with SigV2."""
    digest = sha(b"blob")
    for region in REGIONS:
        store = S3Store(
            "bucket",
            "stitch",
            S3Settings(s3_region=region, s3_endpoint_url=endpoint, s3_access_key_id="AK", s3_secret_access_key="SK"),
        )
        put = parse_qs(urlsplit(store.presign("runs/r/blobs/x", "PUT", 60, digest) or "").query)
        get = parse_qs(urlsplit(store.presign("runs/r/blobs/x", "GET", 60) or "").query)
        for what, query in (("PUT", put), ("GET", get)):
            assert query.get("X-Amz-Algorithm") == ["AWS4-HMAC-SHA256"], (region, endpoint, what, query)
            assert "Signature" not in query, (region, endpoint, what)
        assert set(put["X-Amz-SignedHeaders"][0].split(";")) == {"host", *presigned_put_headers(digest)}, region


def test_a_presigned_put_refuses_other_bytes_and_takes_the_signed_ones(settings):
    store, data = _store(settings), os.urandom(256 << 10)
    key = blob_key("run-a", sha(data))
    url = store.presign(key, "PUT", 60, sha(data)) or ""
    other, flipped = os.urandom(len(data)), data[:-1] + bytes([data[-1] ^ 1])
    signed = presigned_put_headers(sha(data))
    refusals = {
        "other bytes with the signed headers": (other, signed, 400, "XAmzContentSHA256Mismatch"),
        "one bit flipped": (flipped, signed, 400, "XAmzContentSHA256Mismatch"),
        "other bytes with their own digests": (other, presigned_put_headers(sha(other)), 403, "SignatureDoesNotMatch"),
        "other bytes, the checksum of the signed ones": (
            other,
            {"x-amz-checksum-sha256": signed["x-amz-checksum-sha256"]},
            403,
            "SignatureDoesNotMatch",
        ),
        "other bytes without headers": (other, {}, 403, "SignatureDoesNotMatch"),
    }
    for what, (body, headers, status, code) in refusals.items():
        answer = httpx.put(url, content=body, headers=headers)
        assert (answer.status_code, _error_code(answer)) == (status, code), what
        assert store.stat(key) is None, what
    assert httpx.put(url, content=data, headers=signed).status_code == 200
    assert store.get(key)[0] == data
    assert store.stat(key).sha256 == sha(data)  # the record went up with it


def test_a_presigned_put_never_overwrites_a_stored_blob(settings, tmp_path):
    store, data = _store(settings), os.urandom(64 << 10)
    key = blob_key("run-a", sha(data))
    path = tmp_path / "blob"
    path.write_bytes(data)
    store.put_file(key, path)  # committed through the bulletin
    before = store.stat(key)
    url = store.presign(key, "PUT", 60, sha(data)) or ""
    signed = presigned_put_headers(sha(data))
    answer = httpx.put(url, content=data, headers=signed)
    assert (answer.status_code, _error_code(answer)) == (412, "PreconditionFailed")
    for what, headers in {
        "without If-None-Match": {k: v for k, v in signed.items() if k != "if-none-match"},
        "with another If-None-Match": {**signed, "if-none-match": '"0"'},
        "without headers": {},
    }.items():
        answer = httpx.put(url, content=data, headers=headers)
        assert (answer.status_code, _error_code(answer)) == (403, "SignatureDoesNotMatch"), what
    after = store.stat(key)
    assert (after.etag, after.modified_at, after.sha256) == (before.etag, before.modified_at, before.sha256)


def test_racing_presigned_puts_of_one_blob_store_it_once(settings):
    store, data = _store(settings), os.urandom(32 << 10)
    key = blob_key("run-a", sha(data))
    url, statuses = store.presign(key, "PUT", 60, sha(data)) or "", []
    barrier = threading.Barrier(8)

    def put() -> None:
        barrier.wait()
        statuses.append(httpx.put(url, content=data, headers=presigned_put_headers(sha(data))).status_code)

    racers = [threading.Thread(target=put) for _ in range(8)]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    assert sorted(statuses) == [200] + [412] * 7
    assert store.get(key)[0] == data


def test_the_bulletin_upload_path_goes_through_a_presigned_url(settings, tmp_path):
    data = os.urandom(3 << 20)
    path = tmp_path / "shard.safetensors"
    path.write_bytes(data)
    run, digest = "run-presigned", hashlib.sha256(data).hexdigest()
    server = ThreadServer(settings)
    try:
        with server.client() as client:
            assert client.put_blob(run, digest, path)
            assert client._presign is True  # straight to radosgw, not through the bulletin
            stat = _store(settings).stat(blob_key(run, digest))
            assert stat is not None and stat.sha256 == digest and stat.size_bytes == len(data)
            assert client.has_blob(run, digest) == len(data)
            assert not client.put_blob(run, digest, path, force=True)  # radosgw's 412, then the bulletin: stored
            client.publish(
                make_manifest(run, 0, [FileRef(path="s", sha256=digest, size_bytes=len(data), role="snapshot")])
            )
            redirect = httpx.get(f"{server.url}/v1/runs/{run}/blobs/{digest}")
            assert redirect.status_code == 307 and "X-Amz-Algorithm=AWS4-HMAC-SHA256" in redirect.headers["location"]
            assert client.download_blob(run, digest, tmp_path / "down").read_bytes() == data
    finally:
        server.stop()
