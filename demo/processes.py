"""Child processes of the demo (bulletin, engines, sidecars): free ports, start, wait for health, stop.

Every process runs in its own session with its output in a log file under the work dir;
:class:`ProcessGroup` stops them all (SIGTERM to the process group, SIGKILL after a grace
period) when its ``with`` block ends, whether normally, on an error or on Ctrl-C.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Self

import httpx

from .errors import DemoError

log = logging.getLogger("stitchboard.demo")
#: Tries at setting an autogroup's niceness (an unprivileged process: one per 100 ms).
AUTOGROUP_TRIES = 5


def free_socket() -> socket.socket:
    """A TCP socket bound to a free port on 127.0.0.1 (``SO_REUSEADDR`` set, not yet listening).

    Hand it to a server in this process (no one else can take the port meanwhile), or close it
    and start a server on its port (:func:`free_port`).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _ephemeral_low() -> int:
    # The kernel hands out ports from ip_local_port_range to every socket bound to port 0 and to
    # every outgoing connection (engines' gloo/NCCL peers among them).
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a server about to start in another process.

    Drawn below the kernel's ephemeral range: a port the kernel picked (``bind(0)``) could be
    handed to another starting process's own sockets (seen: an engine's gloo peer took the port
    a second SGLang server was about to bind) between this call and the server's bind.
    Falls back to a kernel-picked port when no port below the range is free.
    """
    rng = random.Random()
    low = _ephemeral_low()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with free_socket() as sock:
        return sock.getsockname()[1]


def _nice_autogroup(pid: int, nice: int) -> None:
    # The session of ``pid`` (its leader, started with its own session) is an autogroup when the
    # kernel has CONFIG_SCHED_AUTOGROUP on: its CPU share against other sessions follows the
    # autogroup's niceness, not the processes' own. Raising it needs no privilege, but an
    # unprivileged process may set one autogroup's niceness per 100 ms only (EAGAIN): retried.
    path = Path(f"/proc/{pid}/autogroup")
    for attempt in range(AUTOGROUP_TRIES):
        try:
            path.write_text(str(nice))
            return
        except FileNotFoundError:  # no autogroups here (or the process already ended): the process's own niceness holds
            return
        except OSError as exc:
            if exc.errno != errno.EAGAIN or attempt + 1 == AUTOGROUP_TRIES:
                log.warning(
                    "could not set the CPU niceness of process %d's session to %d (%s): "
                    "it competes with other sessions at the default share",
                    pid,
                    nice,
                    exc,
                )
                return
            time.sleep(0.11)


class ManagedProcess:
    """One child process with a log file and a health URL.

    Args:
        name: short name for messages (``bulletin``, ``engine-0``, ``sidecar-0``).
        argv: command line.
        log_path: file receiving stdout and stderr.
        health_url: URL answering 200 once the process is ready.
        env: extra environment variables.
        nice: niceness to run it at (0: unchanged), e.g. an engine serving on the CPU
            (:func:`stitchboard.sidecar.engines.launch.engine_nice`). The process and every thread
            it starts get it (``nice`` runs the command), and so does its session's autogroup
            where the kernel groups sessions (``/proc/<pid>/autogroup``): every process runs in
            a session of its own, and the kernel shares the CPU between sessions first.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        health_url: str,
        env: dict[str, str] | None = None,
        nice: int = 0,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.health_url = health_url
        self._log = open(log_path, "ab")  # noqa: SIM115 - the child writes to it until stop() closes it
        command = ["nice", "-n", str(nice), *argv] if nice else argv
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        if nice:
            _nice_autogroup(self.proc.pid, nice)

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the log (reads only its last ``4 * chars`` bytes)."""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * chars))
            return f.read().decode(errors="replace")[-chars:]

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll the health URL until it answers 200; returns the seconds waited.

        Raises:
            DemoError: the process exited or ``timeout_s`` passed (with the log's tail).
        """
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise DemoError(
                    f"{self.name} exited with status {self.proc.returncode}; log {self.log_path}:\n{self.log_tail()}"
                )
            if (
                "error while attempting to bind on address" in self.log_tail()
            ):  # uvicorn gave up the port; the process may linger
                raise DemoError(
                    f"{self.name} could not bind its port (another process took it); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.health_url, timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise DemoError(f"{self.name} not healthy after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s`` seconds."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(grace_s)
            except ProcessLookupError:
                pass
        self._log.close()


class ProcessGroup:
    """Starts processes and stops every one of them when the ``with`` block exits."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[ManagedProcess] = []

    def start(
        self, name: str, argv: list[str], health_url: str, env: dict[str, str] | None = None, nice: int = 0
    ) -> ManagedProcess:
        """Start a process logging to ``<log_dir>/<name>.log`` (``nice``: see :class:`ManagedProcess`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log", health_url, env, nice)
        self.processes.append(proc)
        return proc

    def stop(self, proc: ManagedProcess) -> None:
        """Stop one process before the group ends."""
        proc.stop()
        self.processes.remove(proc)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
