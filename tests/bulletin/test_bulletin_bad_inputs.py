"""Bad inputs each get a 4xx with a JSON error body and leave the store unchanged (both backends)."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from stitchboard.bulletin.ledger import version_key
from stitchboard.bulletin.stores import open_store
from stitchboard.proto.schema import FileRef, canonical_json
from tests.bulletin.bulletin_helpers import make_manifest, sha, upload_version

GOOD = sha(b"x")


@pytest.fixture
def seeded(client, run):
    """A run at version 1, plus one uploaded blob that no version references."""
    upload_version(client, run, 0, snapshot_bytes=100)
    upload_version(client, run, 1, patch_bytes=50)
    spare = os.urandom(64)
    client.put_blob(run, sha(spare), spare)
    return run, sha(spare), len(spare)


def _post(client, run, body, **kw):
    return httpx.post(
        f"{client.url}/v1/runs/{run}/versions", content=body, headers={"content-type": "application/json"}, **kw
    )


def _check(response, status, type_=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["message"]
    if type_:
        assert body["type"] == type_


def _bad_requests(client, run, spare_sha, spare_size):
    """(label, send, status, error type) for each bad input."""
    base = client.url
    ref = FileRef(path="p.bin", sha256=spare_sha, size_bytes=spare_size, role="patch")
    missing = FileRef(path="p.bin", sha256="ab" * 32, size_bytes=10, role="patch")
    snap = FileRef(path="s", sha256=spare_sha, size_bytes=spare_size, role="snapshot")
    wrong_size = FileRef(path="p.bin", sha256=spare_sha, size_bytes=spare_size + 1, role="patch")
    big = make_manifest(run, 2, [ref], metadata={"pad": "x" * 70_000})
    chunks = (b"\0" * 65536 for _ in range(5))
    return [
        (
            "run id traversal in blob PUT",
            lambda: httpx.put(f"{base}/v1/runs/%2E%2E/blobs/{GOOD}", content=b"x"),
            422,
            "InvalidRequest",
        ),
        (
            "run id with dot-dot",
            lambda: httpx.put(f"{base}/v1/runs/a..b/blobs/{GOOD}", content=b"x"),
            422,
            "InvalidRequest",
        ),
        ("run id traversal in publish", lambda: _post(client, "%2E%2E", b"{}"), 422, None),
        (
            "blob name traversal",
            lambda: httpx.put(f"{base}/v1/runs/{run}/blobs/..%2F..%2Fversions%2Fx", content=b"x"),
            404,
            None,
        ),
        (
            "blob name not a sha256",
            lambda: httpx.put(f"{base}/v1/runs/{run}/blobs/..evil", content=b"x"),
            422,
            "InvalidRequest",
        ),
        (
            "blob body over the limit",
            lambda: httpx.put(f"{base}/v1/runs/{run}/blobs/{GOOD}", content=b"\0" * 300_000),
            413,
            "PayloadTooLarge",
        ),
        (
            "chunked blob body over the limit",
            lambda: httpx.put(f"{base}/v1/runs/{run}/blobs/{GOOD}", content=chunks),
            413,
            "PayloadTooLarge",
        ),
        (
            "blob bytes hash to another sha256",
            lambda: httpx.put(f"{base}/v1/runs/{run}/blobs/{GOOD}", content=b"y"),
            422,
            "BlobMismatch",
        ),
        (
            "blob size disagrees",
            lambda: httpx.put(f"{base}/v1/runs/{run}/blobs/{GOOD}?size_bytes=2", content=b"x"),
            422,
            "BlobMismatch",
        ),
        (
            "manifest references a missing blob",
            lambda: _post(client, run, canonical_json(make_manifest(run, 2, [missing]))),
            422,
            "BlobMissing",
        ),
        (
            "manifest states a wrong size",
            lambda: _post(client, run, canonical_json(make_manifest(run, 2, [wrong_size]))),
            422,
            "BlobMismatch",
        ),
        (
            "manifest with a malformed sha256",
            lambda: _post(
                client, run, canonical_json(make_manifest(run, 2, [ref])).replace(spare_sha.encode(), b"Z" * 64)
            ),
            422,
            "InvalidRequest",
        ),
        (
            "version rewind (version 0 again, other bytes)",
            lambda: _post(client, run, canonical_json(make_manifest(run, 0, [snap]))),
            409,
            "VersionConflict",
        ),
        (
            "base version missing",
            lambda: _post(client, run, canonical_json(make_manifest(run, 3, [ref]))),
            409,
            "BaseMissing",
        ),
        ("invalid JSON", lambda: _post(client, run, b'{"run_id": '), 422, "InvalidRequest"),
        (
            "JSON that is not a manifest",
            lambda: _post(client, run, json.dumps({"run_id": run}).encode()),
            422,
            "InvalidRequest",
        ),
        (
            "manifest run differs from URL",
            lambda: _post(client, run, canonical_json(make_manifest("other-run", 2, [ref]))),
            422,
            "InvalidRequest",
        ),
        ("oversized manifest", lambda: _post(client, run, canonical_json(big)), 413, "PayloadTooLarge"),
        ("negative wait", lambda: httpx.get(f"{base}/v1/runs/{run}/versions/latest?wait_s=-1"), 422, "InvalidRequest"),
    ]


def test_bad_inputs_get_4xx_and_change_nothing(client, backend, seeded):
    run, spare_sha, spare_size = seeded
    for label, send, status, type_ in _bad_requests(client, run, spare_sha, spare_size):
        before = backend.keys()
        response = send()
        assert response.status_code == status, f"{label}: {response.status_code} {response.text}"
        _check(response, status, type_)
        assert backend.keys() == before, f"{label}: the store changed"
    assert client.latest(run) == 1


def test_publishing_a_version_removed_by_retention_is_a_rewind(client, backend, run):
    m0 = upload_version(client, run, 0, snapshot_bytes=100)
    upload_version(client, run, 1, snapshot_bytes=100)
    open_store(backend.settings.store, backend.settings).delete(version_key(run, 0))
    before = backend.keys()
    r = _post(client, run, canonical_json(m0))
    _check(r, 409, "VersionRewind")
    assert backend.keys() == before


def test_first_version_must_be_zero(client, backend, run):
    data = os.urandom(10)
    client.put_blob(run, sha(data), data)
    before = backend.keys()
    r = _post(
        client,
        run,
        canonical_json(make_manifest(run, 1, [FileRef(path="p", sha256=sha(data), size_bytes=10, role="patch")])),
    )
    _check(r, 409, "BaseMissing")
    assert backend.keys() == before
