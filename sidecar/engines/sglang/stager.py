"""The loader's control socket in each SGLang scheduler process (the engine's lease, and staging
while SGLang serves), and its client.

Why: SGLang runs every update call (the only way into its scheduler process) under its
model-update writer lock, which waits for every request in flight and holds new ones unless the
engine is paused, so nothing can be staged, nor the engine's lease renewed, through a call while
the engine serves. The loader (:mod:`.loader`) therefore starts a :class:`StageServer` thread at
its first call in every TP rank's scheduler process (the sidecar's first contact makes one). It
listens on a Unix socket with an abstract address named by SGLang's HTTP port and the rank
(:func:`control_address`), so that any sidecar of that engine finds it without a call, and
answers one JSON request per connection, each in a thread of its own (a lease renewal never
waits behind a staging): ``lease`` (take, renew or release the engine's lease, at any TP size);
``stage`` (TP = 1: decode and check a patch on the live weights, reads only, and keep the
result); ``commit`` (TP = 1, the engine paused: write that result in place, so that the pause
holds no update call: SGLang's write session costs ~30 ms). At TP > 1 staging needs collectives
over the TP group (whole-tensor checksums, ``cond`` decodes on the gathered tensor), which the
scheduler runs itself between forward passes, so the apply stages in the pause.

:func:`ask` is the sidecar's side (runs in the sidecar process). An abstract socket has no file
and no permissions: like the engine's own HTTP routes on loopback, it is reachable by the
processes of the host (or pod) that shares the engine's network namespace.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("stitchboard.sidecar.engines.sglang.stager")

#: The largest request or answer, bytes.
MAX_MESSAGE_BYTES = 1 << 20


def control_address(port: int, rank: int) -> str:
    """Where TP rank ``rank``'s control socket of the SGLang server on HTTP port ``port`` listens:
    an abstract Unix socket address (leading NUL), the same for the loader and every sidecar."""
    return f"\0stitchboard-sglang-{port}-rank{rank}"


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
    """A daemon thread accepting connections on ``address``; each is answered in a thread of its
    own: one JSON line, ``handle(request) -> answer`` (``handle`` must not raise; it serialises
    what must not run at once), then ``after(request)`` (if given; must not raise) once the answer
    is sent or has failed.

    Raises:
        OSError: the address cannot be bound (at construction).
    """

    def __init__(
        self,
        address: str,
        handle: Callable[[dict[str, Any]], dict[str, Any]],
        after: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        super().__init__(name="stitchboard-stager", daemon=True)
        self.address = address
        self._handle = handle
        self._after = after
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(address)
        self._sock.listen(16)

    def run(self) -> None:
        while True:  # for the life of the process
            try:
                conn, _ = self._sock.accept()
            except OSError:
                log.exception("stitchboard stager: accept failed")
                time.sleep(0.1)  # e.g. out of file descriptors: try again, without spinning
                continue
            threading.Thread(target=self._answer, args=(conn,), name="stitchboard-stager-call", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        request: dict[str, Any] = {}
        with conn:
            try:
                line = json.loads(_read_line(conn))
                request = line if isinstance(line, dict) else {}
                answer = self._handle(request)
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except Exception:  # never raise in the engine: the next request gets its answer
                log.exception("stitchboard stager: a request failed")
            finally:
                if self._after is not None:
                    self._after(request)


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
