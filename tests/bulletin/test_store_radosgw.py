"""The S3 store on a real S3 server (Ceph radosgw 16): what moto cannot judge.

moto accepts corrupted bodies, checks no signature and makes create-only writes non-atomic; the
radosgw fixture (:func:`tests.support.radosgw.radosgw`, skipped where it is not installed) does
neither. Where radosgw 16 lacks a feature the code works around it (If-Match with the quoted ETag)
or does not use it (If-None-Match on multipart completion, the completion's ETag, x-amz-checksum-sha256);
the last test pins each gap, and docs/reference/storage.md lists them.
"""

from __future__ import annotations

import base64
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import ClientError

from stitchboard.bulletin.ledger import blob_key, run_key
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.bulletin.stores import S3Store
from stitchboard.proto.schema import FileRef, VersionInfo
from tests.bulletin.bulletin_helpers import ThreadServer, make_manifest, sha
from tests.support.fault_proxy import FaultProxy, Rule
from tests.support.radosgw import RadosGW

MiB = 1 << 20


@pytest.fixture
def settings(radosgw: RadosGW) -> BulletinSettings:
    """Bulletin settings over a fresh bucket on radosgw (parts of 5 MiB from 5 MiB up)."""
    return BulletinSettings(
        store=f"s3://{radosgw.create_bucket()}/stitch",
        s3_endpoint_url=radosgw.endpoint,
        s3_region=radosgw.region,
        s3_access_key_id=radosgw.access_key_id,
        s3_secret_access_key=radosgw.secret_access_key,
        s3_addressing_style="path",
        s3_multipart_threshold_bytes=5 * MiB,
        s3_multipart_chunk_bytes=5 * MiB,
        poll_interval_s=0.1,
    )


def _store(settings: BulletinSettings) -> S3Store:
    bucket, _, prefix = settings.store.removeprefix("s3://").partition("/")
    return S3Store(bucket, prefix, settings)


def test_compare_and_swap_works_where_the_quoted_etag_is_refused(settings):
    store = _store(settings)
    assert store.put_cas("p", b"1", None) is True
    assert store.put_cas("p", b"x", None) is False  # must be absent
    _, etag = store.get("p")
    assert etag.startswith('"')  # radosgw hands out the quoted ETag, and refuses it in If-Match
    assert store.put_cas("p", b"2", "stale-etag") is False
    assert store.put_cas("p", b"2", etag) is True
    assert store.put_cas("p", b"3", etag) is False  # etag changed
    _, etag2 = store.get("p")
    assert store.put_cas("p", b"3", etag2) is True
    assert store.get("p")[0] == b"3"
    assert S3Store(store.bucket, "stitch", settings).put_cas("p", b"4", '"0"') is False  # a fresh store: a stale one


def test_the_latest_pointer_follows_every_publish(settings):
    run, server = "run-latest", ThreadServer(settings)
    try:
        with server.client() as client:
            for version in range(3):
                data = os.urandom(100 + version)
                client.put_blob(run, sha(data), data)
                role = "snapshot" if version == 0 else "patch"
                client.publish(
                    make_manifest(run, version, [FileRef(path=role, sha256=sha(data), size_bytes=len(data), role=role)])
                )
                pointer, _ = _store(settings).get(f"{run_key(run)}latest")
                assert VersionInfo.model_validate_json(pointer).version == version
    finally:
        server.stop()


def test_racing_create_only_writes_have_one_winner(settings):
    store = _store(settings)
    for key in ("race/0", "race/1", "race/2"):
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(store.put_new, [key] * 16, [str(i).encode() for i in range(16)]))
        assert results.count(True) == 1, key
        assert store.get(key)[0] == str(results.index(True)).encode()


@pytest.mark.parametrize(
    ("size", "path", "times"),
    [(3000, "/blobs/[0-9a-f]{64}$", 2), (11 * MiB, "partNumber=2", 1)],
    ids=["single-put", "multipart"],
)
def test_bodies_corrupted_on_the_way_are_refused_sent_again_and_stored_intact(settings, size, path, times):
    """radosgw refuses a changed body by the payload hash botocore signs (it ignores x-amz-checksum-sha256)."""
    proxy = FaultProxy(
        settings.s3_endpoint_url or "", [Rule("corrupt", method="PUT", path=path, times=times)], check_digests=False
    )
    server = ThreadServer(settings.model_copy(update={"s3_endpoint_url": proxy.url, "max_blob_bytes": 64 * MiB}))
    data, run = os.urandom(size), "run-corrupt"
    try:
        with server.client() as client:
            assert client.put_blob(run, sha(data), data)
    finally:
        server.stop()
        proxy.stop()
    assert proxy.actions("corrupt") == times
    body, _ = _store(settings).get(blob_key(run, sha(data)))
    assert hashlib.sha256(body).hexdigest() == sha(data)
    assert _store(settings).stat(blob_key(run, sha(data))).sha256 == sha(data)


def _raw_multipart(client, bucket: str, key: str, body: bytes, **condition: str) -> dict:
    """A one-part multipart upload by plain boto3; the completion's answer."""
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    part = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=body)
    parts = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
    return client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=parts, **condition)


def test_radosgw_16_gaps_are_stated_and_the_store_relies_on_none_of_them(settings, radosgw, tmp_path):
    """What radosgw 16 does not do (pinned here by plain boto3, so an upgrade that changes it shows), and the
    store's writes that would need it, right on radosgw all the same."""
    raw, bucket = radosgw.client(), radosgw.create_bucket()
    # Gap 1: CompleteMultipartUpload ignores If-None-Match (it overwrites) and answers an empty ETag.
    assert _raw_multipart(raw, bucket, "m", b"first")["ETag"] == ""
    assert _raw_multipart(raw, bucket, "m", b"second", IfNoneMatch="*")["ETag"] == ""
    assert raw.get_object(Bucket=bucket, Key="m")["Body"].read() == b"second"
    # Gap 2: x-amz-checksum-sha256 is not checked: a body that does not match it is stored.
    wrong = base64.b64encode(hashlib.sha256(b"other bytes").digest()).decode()
    raw.put_object(Bucket=bucket, Key="c", Body=b"these bytes", ChecksumSHA256=wrong)
    assert raw.get_object(Bucket=bucket, Key="c")["Body"].read() == b"these bytes"
    # Gap 3: If-Match with the quoted ETag it hands out is refused; the bare one is taken.
    etag = raw.head_object(Bucket=bucket, Key="c")["ETag"]
    with pytest.raises(ClientError) as refused:
        raw.put_object(Bucket=bucket, Key="c", Body=b"new", IfMatch=etag)
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    raw.put_object(Bucket=bucket, Key="c", Body=b"new", IfMatch=etag.strip('"'))

    store, data = _store(settings), os.urandom(11 * MiB)  # above the 5 MiB multipart threshold
    # Create-only writes are one PutObject whatever their size (never a conditional multipart completion).
    assert store.put_new("big", data) is True
    assert store.put_new("big", os.urandom(11 * MiB)) is False
    assert store.get("big")[0] == data
    # A multipart blob upload reads nothing from the completion's answer: its ETag and record come from HEAD.
    path = tmp_path / "blob"
    path.write_bytes(data)
    store.put_file("blob", path)
    stat = store.stat("blob")
    assert stat.etag and stat.etag.endswith('-3"') and stat.sha256 == sha(data)  # three parts of 5 MiB
    # Compare-and-swap (the latest pointer) under gap 3: test_compare_and_swap_works_where_the_quoted_etag_is_refused.
