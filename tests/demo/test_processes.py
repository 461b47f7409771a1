"""demo/processes.py: ports for child servers, and a server that lost its port fails at once."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from stitchboard.demo.errors import DemoError
from stitchboard.demo.processes import ManagedProcess, _ephemeral_low, free_port


def test_free_port_is_bindable_and_below_the_kernels_ephemeral_range():
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_process_that_could_not_bind_fails_before_its_timeout(tmp_path: Path):
    # uvicorn's message when its port is taken; the process itself lingers (as SGLang's does).
    script = "import sys, time; print('ERROR:    [Errno 98] error while attempting to bind on address', flush=True); time.sleep(60)"
    proc = ManagedProcess("lingerer", [sys.executable, "-c", script], tmp_path / "p.log", "http://127.0.0.1:9/health")
    try:
        with pytest.raises(DemoError, match="could not bind its port"):
            proc.wait_healthy(30)
    finally:
        proc.stop(grace_s=2)
