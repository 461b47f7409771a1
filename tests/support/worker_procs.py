"""The worker processes of a multi-process server, and which of them holds a loopback connection (Linux ``/proc``).

Runs in the test or benchmark process. ``stitchboard bulletin serve --workers N`` starts uvicorn's
supervisor, which spawns N worker processes that share one listening socket: the kernel hands
each new connection to one of them. A test or benchmark that must reach every worker (each
counts only its own long-polls) opens connections until :func:`socket_owner` has found one on
each of :func:`worker_pids`.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def worker_pids(supervisor: subprocess.Popen, workers: int, timeout_s: float = 30.0) -> list[int]:
    """The process ids of the ``workers`` processes uvicorn's supervisor (the process ``supervisor``)
    spawned (``multiprocessing``'s spawn; its resource tracker is left out), once all have started.

    Raises:
        RuntimeError: the supervisor exited.
        TimeoutError: they were not all there within ``timeout_s`` seconds.
    """
    deadline, supervisor_pid = time.monotonic() + timeout_s, supervisor.pid
    while True:
        if supervisor.poll() is not None:
            raise RuntimeError(f"the server exited ({supervisor.returncode}) before {workers} workers started")
        children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text().split()
        pids = []
        for child in children:
            try:
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    pids.append(int(child))
            except FileNotFoundError:  # it ended meanwhile
                continue
        if len(pids) == workers:
            return pids
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pids)} of {workers} workers of process {supervisor_pid} after {timeout_s} s")
        time.sleep(0.1)


def socket_owner(port: int, client_port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the server's end of the IPv4 loopback connection from ``client_port``
    to ``port`` (None: none of them, or no such connection)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[1].endswith(f":{port:04X}") and cols[2].endswith(f":{client_port:04X}"):
            inode = f"socket:[{cols[9]}]"
    if inode is None:
        return None
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == inode:
                    return pid
            except FileNotFoundError:  # closed meanwhile
                continue
    return None
