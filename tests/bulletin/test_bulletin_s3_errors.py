"""S3 failures reach callers as the bulletin's typed errors, including failures while streaming a body."""

from __future__ import annotations

import os
import uuid

import httpx
import pytest

from stitchboard.bulletin.errors import UnavailableError
from stitchboard.bulletin.stores import S3Store, open_store
from tests.bulletin.bulletin_helpers import ThreadServer, make_backend
from tests.support.fault_proxy import FaultProxy, Rule


def test_a_body_cut_mid_stream_raises_unavailable_naming_the_key(request, tmp_path):
    backend = make_backend("s3", request, tmp_path)
    data = os.urandom(4 << 20)
    open_store(backend.settings.store, backend.settings).put_new("blobs/big", data)
    proxy = FaultProxy(
        backend.settings.s3_endpoint_url or "",
        [Rule("cut", method="GET", path="/blobs/big", cut_after_bytes=256 << 10)],
    )
    try:
        through_proxy = S3Store(
            backend.bucket or "", "stitch", backend.settings.model_copy(update={"s3_endpoint_url": proxy.url})
        )
        chunks = through_proxy.iter_range("blobs/big", 0, len(data) - 1)  # the answer's headers get through
        with pytest.raises(UnavailableError, match="'blobs/big'") as caught:
            b"".join(chunks)
        assert caught.value.details == {"key": "blobs/big"}
    finally:
        proxy.stop()


def test_every_call_on_a_missing_bucket_raises_unavailable(request, tmp_path):
    backend = make_backend("s3", request, tmp_path)
    store = S3Store(f"missing-{uuid.uuid4().hex[:12]}", "stitch", backend.settings)
    path = tmp_path / "blob"
    path.write_bytes(b"x")
    calls = {
        "get": lambda: store.get("k"),
        "put_new": lambda: store.put_new("k", b"x"),
        "put_cas": lambda: store.put_cas("k", b"x", None),
        "put_file": lambda: store.put_file("k", path),
        "iter_range": lambda: b"".join(store.iter_range("k", 0, 0)),
        "list": lambda: list(store.list("runs/")),
        "list_dirs": lambda: store.list_dirs("runs/"),
        "delete": lambda: store.delete("k"),
        "check": store.check,
    }
    for name, call in calls.items():
        with pytest.raises(UnavailableError, match=store.url if name != "check" else "does not exist") as caught:
            call()
        assert caught.value.status == 503, name


def test_readiness_answers_503_for_a_missing_bucket(request, tmp_path):
    backend = make_backend("s3", request, tmp_path)
    settings = backend.settings.model_copy(update={"store": f"s3://missing-{uuid.uuid4().hex[:12]}/stitch"})
    server = ThreadServer(settings)
    try:
        r = httpx.get(f"{server.url}/readyz")
        assert r.status_code == 503 and r.json()["type"] == "Unavailable" and "does not exist" in r.json()["message"]
    finally:
        server.stop()
