"""An ASGI app served by uvicorn in a thread of the test process, on a free loopback port.

Shared by the bulletin and sidecar tests and the benchmarks (``from tests.support.app_server
import AppServer``). The port comes from :func:`stitchboard.demo.processes.free_socket`, held
bound until uvicorn listens on it.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from stitchboard.demo.processes import free_socket


class AppServer:
    """Serve ``app`` in a daemon thread until :meth:`stop`.

    Args:
        app: the ASGI app (its lifespan runs).
        log_level: uvicorn's log level.
        graceful_shutdown_s: how long :meth:`stop` lets open connections finish, seconds.
        http: uvicorn's HTTP protocol (its ``http`` setting: a name or a protocol class).

    Raises:
        RuntimeError: the server did not start within 60 s.
    """

    def __init__(
        self, app, log_level: str = "warning", graceful_shutdown_s: float = 0.2, http: str | type = "auto"
    ) -> None:
        sock = free_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, log_level=log_level, timeout_graceful_shutdown=graceful_shutdown_s, lifespan="on", http=http
            )
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Ask the server to exit and wait up to 10 s for its thread."""
        self.server.should_exit = True
        self.thread.join(10)
