"""demo/processes.py: ports for child servers, a server that lost its port fails at once, and niced children."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from stitchboard.demo.errors import DemoError
from stitchboard.demo.processes import ManagedProcess, _ephemeral_low, free_port

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow


def test_free_port_is_bindable_and_below_the_kernels_ephemeral_range():
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_process_that_could_not_bind_fails_before_its_timeout(tmp_path: Path):
    # uvicorn's message when its port is taken; the process itself lingers (as SGLang's does).
    script = (
        "import sys, time; print('ERROR:    [Errno 98] error while attempting to bind on address', "
        "flush=True); time.sleep(60)"
    )
    proc = ManagedProcess("lingerer", [sys.executable, "-c", script], tmp_path / "p.log", "http://127.0.0.1:9/health")
    try:
        with pytest.raises(DemoError, match="could not bind its port"):
            proc.wait_healthy(30)
    finally:
        proc.stop(grace_s=2)


def test_a_niced_process_and_every_thread_it_starts_run_at_that_niceness(tmp_path: Path):
    # The child starts a thread after it began: the niceness is set before its command runs, so
    # the thread inherits it; where the kernel groups sessions, the session's autogroup gets it too.
    script = (
        "import os, threading, time; threading.Thread(target=time.sleep, args=(60,), "
        "daemon=True).start(); print('up', flush=True); time.sleep(60)"
    )
    proc = ManagedProcess(
        "niced", [sys.executable, "-c", script], tmp_path / "p.log", "http://127.0.0.1:9/health", nice=7
    )
    try:
        deadline = time.monotonic() + 30
        while "up" not in (tmp_path / "p.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        tasks = list(Path(f"/proc/{proc.proc.pid}/task").iterdir())
        assert len(tasks) >= 2
        assert {os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in tasks} == {
            min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
        }
        autogroup = Path(f"/proc/{proc.proc.pid}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == "7", autogroup.read_text()
    finally:
        proc.stop(grace_s=2)
    plain = ManagedProcess(
        "plain", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "q.log", "http://127.0.0.1:9/health"
    )
    try:
        assert os.getpriority(os.PRIO_PROCESS, plain.proc.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        plain.stop(grace_s=2)
