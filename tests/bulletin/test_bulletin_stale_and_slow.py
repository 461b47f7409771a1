"""A run deleted out of band is not served from memory; a blob body that idles or trickles is answered 408."""

from __future__ import annotations

import os
import socket
import time

import pytest

from stitchboard.bulletin.errors import NotFoundError
from stitchboard.bulletin.ledger import run_key
from stitchboard.bulletin.stores import open_store
from tests.bulletin.bulletin_helpers import ThreadServer, make_backend, sha, upload_version


def _delete_run(settings, run: str) -> None:
    store = open_store(settings.store, settings)
    for folder in ("", "versions/", "blobs/"):
        for o in list(store.list(f"{run_key(run)}{folder}")):
            store.delete(o.key)


def test_a_run_deleted_out_of_band_is_not_served_from_the_cache(client, server, backend, run):
    first = [upload_version(client, run, v, patch_bytes=0 if v == 0 else 10) for v in range(4)]
    assert client.latest(run) == 3 and client.manifest(run, 0) == first[0]
    _delete_run(backend.settings, run)
    assert client.latest(run) is None
    with pytest.raises(NotFoundError):
        client.manifest(run, 1)
    again = upload_version(client, run, 0, metadata={"attempt": 2})  # another v0: no 409 from a remembered one
    assert client.manifest(run, 0) == again != first[0]
    assert client.latest(run) == 0
    client.publish(again)  # an identical retry is a no-op


def _trickle(url: str, run: str, gap_s: float, body_bytes: int) -> tuple[bytes, float]:
    """PUT a blob declaring ``body_bytes`` bytes, sending one byte every ``gap_s`` seconds; the answer and its delay."""
    host, port = url.removeprefix("http://").split(":")
    data = os.urandom(body_bytes)
    started = time.monotonic()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"PUT /v1/runs/{run}/blobs/{sha(data)} HTTP/1.1\r\nHost: x\r\nContent-Length: {body_bytes}\r\n\r\n".encode()
        )
        sock.settimeout(gap_s)
        for i in range(body_bytes):
            try:
                answer = sock.recv(65536)
                if answer:
                    return answer, time.monotonic() - started
            except TimeoutError:
                pass
            try:
                sock.sendall(data[i : i + 1])
            except OSError:
                break
        sock.settimeout(10)
        return sock.recv(65536), time.monotonic() - started


@pytest.mark.parametrize(
    ("limits", "gap_s"),
    [
        ({"upload_min_bytes_per_s": 1000, "upload_rate_grace_s": 1.0}, 0.4),
        ({"upload_idle_timeout_s": 0.5, "upload_min_bytes_per_s": 0}, 2.0),
    ],
    ids=["under-the-minimum-rate", "idle"],
)
def test_a_trickling_upload_is_answered_408_and_its_temp_file_removed(request, tmp_path, run, limits, gap_s):
    backend = make_backend("file", request, tmp_path, **limits)
    server = ThreadServer(backend.settings)
    try:
        answer, took_s = _trickle(server.url, run, gap_s, 100)
        assert answer.startswith(b"HTTP/1.1 408") and b"RequestTimeout" in answer, answer
        assert took_s < 4
        time.sleep(0.2)
        assert list(server.app.state.bulletin.upload_dir.iterdir()) == []
    finally:
        server.stop()
