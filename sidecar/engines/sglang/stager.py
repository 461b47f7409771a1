"""Staging while SGLang serves: a socket thread in the scheduler process, and its client.

Why: SGLang runs every update call (the only way into its scheduler process) under its
model-update writer lock, which waits for every request in flight and holds new ones unless the
engine is paused, so nothing can be staged through a call while the engine serves. The loader
(:mod:`.loader`) therefore starts a :class:`StageServer` thread at its first call in a TP = 1
scheduler process (the sidecar's boot makes one): it listens on a Unix socket, whose address
every rank record carries (``stage_socket``), and answers one JSON request per connection with
the loader's handler, which decodes and checks a patch on the live weights (reads only) and
keeps the result; once the sidecar has paused the engine, a ``commit`` request has it write
that result in place, so that the pause holds no update call (SGLang's write session costs
~30 ms). At TP > 1 staging needs collectives over the TP
group (whole-tensor checksums, ``cond`` decodes on the gathered tensor), which the scheduler
runs itself between forward passes, so no thread is started and the apply stages in the pause.

:func:`ask` is the sidecar's side (runs in the sidecar process).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("stitchboard.sidecar.engines.sglang.stager")

#: The longest filesystem path a Unix socket address may have (sun_path is 108 bytes on Linux).
MAX_SOCKET_PATH = 100
#: The largest request or answer, bytes.
MAX_MESSAGE_BYTES = 1 << 20


def socket_address(record_dir: str, rank: int, instance: str) -> str:
    """Where rank ``rank``'s stager listens: a socket file in ``record_dir`` (shared with the
    sidecar), or an abstract address (leading NUL, named by ``instance``) when that path is too
    long for a Unix socket."""
    path = os.path.join(record_dir, f"stage-rank{rank}.sock")
    return path if len(path.encode()) <= MAX_SOCKET_PATH else f"\0stitchboard-stage-{instance}-{rank}"


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"message over {MAX_MESSAGE_BYTES} bytes")
    return data


class StageServer(threading.Thread):
    """A daemon thread answering one JSON line per connection on ``address`` with
    ``handle(request) -> answer`` (``handle`` must not raise; one connection at a time), then
    calling ``after()`` (if given; must not raise) once the answer is sent or has failed.

    Raises:
        OSError: the address cannot be bound (at construction).
    """

    def __init__(
        self, address: str, handle: Callable[[dict[str, Any]], dict[str, Any]], after: Callable[[], None] | None = None
    ) -> None:
        super().__init__(name="stitchboard-stager", daemon=True)
        self.address = address
        self._handle = handle
        self._after = after
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not address.startswith("\0"):
            os.makedirs(os.path.dirname(address), exist_ok=True)
            if os.path.exists(address):
                os.unlink(address)  # a socket file left by a process that is gone
        self._sock.bind(address)
        self._sock.listen(4)

    def close(self) -> None:
        """Stop listening (the thread ends at its next accept)."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def run(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                log.exception("stitchboard stager: accept failed")
                continue
            with conn:
                try:
                    request = json.loads(_read_line(conn))
                    answer = self._handle(request if isinstance(request, dict) else {})
                    conn.sendall(json.dumps(answer).encode() + b"\n")
                except Exception:  # never end the thread: the next request gets its answer
                    log.exception("stitchboard stager: a request failed")
                finally:
                    if self._after is not None:
                        self._after()


def ask(address: str, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Send ``request`` to the stager at ``address`` and return its answer (sidecar side).

    Raises:
        OSError: nothing listens there, the connection broke or ``timeout_s`` passed.
        ValueError: the answer is not a JSON object.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(address)
        conn.sendall(json.dumps(request).encode() + b"\n")
        answer = json.loads(_read_line(conn))
    if not isinstance(answer, dict):
        raise ValueError(f"the stager answered {str(answer)[:200]}")  # noqa: TRY004 - a malformed answer, like bad JSON
    return answer
