"""``stitchboard bulletin serve --workers 2``: two processes on one port, each holding its own long-polls.

The command line's settings (``--store``, ``--port``) reach both workers; a publish taken by one
process wakes the long-polls waiting in the other (its read of the store's latest version, every
``poll_interval_s``); a long-poll whose client hangs up ends in whichever process holds it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial

import httpx
import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.processes import free_port
from tests.bulletin.bulletin_helpers import upload_version
from tests.sidecar.sidecar_helpers import wait_for
from tests.support.worker_procs import socket_owner, worker_pids

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

RUN = "workers-run"


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[int, list[int]]]:
    """``bulletin serve --workers 2`` over a file store given on the command line: its port and worker pids."""
    port = free_port()
    env = {**os.environ, "STITCH_BULLETIN_POLL_INTERVAL_S": "0.05", "STITCH_BULLETIN_LOG_LEVEL": "warning"}
    env.pop("STITCH_BULLETIN_STORE", None)
    cmd = [sys.executable, "-c", "from stitchboard.proto.cli import main; main()", "bulletin", "serve"]
    cmd += ["--store", f"file://{tmp_path / 'store'}", "--port", str(port), "--workers", "2"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    try:
        pids = worker_pids(proc, 2, timeout_s=120)
        wait_for(lambda: _healthy(port), 120, "the bulletin's workers answering")
        yield port, pids
    finally:
        proc.terminate()  # the supervisor stops its workers
        try:
            proc.wait(30)
        finally:
            proc.kill()
            assert proc.stderr is not None
            proc.stderr.close()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _owner(port: int, sock: socket.socket, pids: list[int]) -> int:
    """The worker holding ``sock``'s connection, once one has accepted it."""
    deadline = time.monotonic() + 10
    while (owner := socket_owner(port, sock.getsockname()[1], pids)) is None:
        assert time.monotonic() < deadline, "no worker took a connection"
        time.sleep(0.01)
    return owner


def _connection_to(port: int, pid: int, pids: list[int]) -> socket.socket:
    """A connection that worker ``pid`` holds (connections are opened until one lands there)."""
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        if _owner(port, sock, pids) == pid:
            return sock
        sock.close()
    raise AssertionError(f"200 connections did not reach worker {pid}")


def _long_polls_in_each(port: int, pids: list[int], path: str) -> dict[int, list[socket.socket]]:
    """Long-polls on ``path``, opened until each worker holds at least one: worker pid -> its clients' sockets."""
    held: dict[int, list[socket.socket]] = {pid: [] for pid in pids}
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        held[_owner(port, sock, pids)].append(sock)
        if all(held.values()):
            return held
    raise AssertionError(f"200 connections did not reach both workers: { ({p: len(s) for p, s in held.items()}) }")


def test_a_publish_wakes_the_long_polls_of_every_worker(served, tmp_path):
    port, pids = served
    url = f"http://127.0.0.1:{port}"
    held = _long_polls_in_each(port, pids, f"/v1/runs/{RUN}/versions/latest?after=-1&wait_s=60")
    with BulletinClient(url, retries=1) as client:
        upload_version(client, RUN, 0, snapshot_bytes=10)  # taken by one worker
    for pid, socks in held.items():
        for sock in socks:
            answer = b""
            while not answer.endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, f"worker {pid} closed a long-poll unanswered"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 ") and b'"version":0' in answer, (pid, answer[:300])
            sock.close()
    assert (tmp_path / "store").is_dir(), "the workers did not use the store given on the command line"


def test_a_long_poll_whose_client_leaves_ends_in_its_worker(served):
    port, pids = served
    held = _long_polls_in_each(port, pids, f"/v1/runs/{RUN}/versions/latest?after=5&wait_s=60")

    def waiting() -> int:  # each worker's /metrics counts only its own waiters: ask each
        total = 0
        for pid in pids:
            with _connection_to(port, pid, pids) as sock:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                text = b"".join(iter(partial(sock.recv, 65536), b"")).decode()
            line = next(x for x in text.splitlines() if x.startswith("stitch_bulletin_waiters "))
            total += int(float(line.split()[1]))
        return total

    count = sum(len(s) for s in held.values())
    wait_for(lambda: waiting() == count, 30, f"{count} waiters over both workers")
    for socks in held.values():
        for sock in socks:
            sock.close()
    wait_for(lambda: waiting() == 0, 10, "the waiters gone with their clients")
