"""uvicorn's HTTP protocol with a connection's writes of one event-loop pass sent together (bulletin process).

uvicorn writes an answer's status line and headers as soon as the app sends
``http.response.start``, and its body in a second ``transport.write`` at
``http.response.body``: two system calls, and with ``TCP_NODELAY`` (which uvicorn sets) two TCP
segments per answer. When a publish wakes thousands of long-polls, the fan-out sends every
answer in one pass of the event loop, so this doubled the kernel's work per answer; on loopback
the receiving side's TCP processing runs in the sender's system call too. Measured with
``tests/benchmarks/bench_bulletin.py --clients 5000`` on a 2-core host: 74 us of bulletin CPU per
answer and p99 291 ms with two writes, 56 us and p99 239 ms with one.

:class:`CoalescingHttpToolsProtocol` (uvicorn's httptools protocol, passed as its ``http``
class) gives the protocol a :class:`CoalescingTransport`: a write is kept back until the next
one, which goes out joined to it at once (an answer's head is kept, its body sends both), or
until the event loop's next pass (a head with no body yet, a lone chunk); a large write (over
64 KiB: blob downloads) goes out as it is, after what is kept. Closing or ending the
stream sends what is kept first; an abort drops it, as the transport's own would. Reading, flow
control and connection details are the transport's own. (Keeping every write of a pass until
the pass ended also made one write per answer, but a fan-out's first answer then left only once
its last was built: p99 333 ms.)

The protocol also offers each request a whole-answer send (the scope extension
``whole_answer.WHOLE_ANSWER``, :func:`send_whole`): a fixed answer's bytes, head and body, written at
once with the request's cycle completed as uvicorn's own ``send`` completes it, without the two
ASGI messages through the middlewares. The long-poll fan-out (``longpoll.py``) answers thousands
of waiters this way in one pass: its Python cost per answer was ~30 % of the fan-out (the rest
is the kernel's write), measured with ``bench_bulletin.py --clients 5000``.

It offers each request, too, the future of its connection's loss (the scope extension
``hangup.CONNECTION_CLOSED``, :func:`connection_closed`), done when the client hangs up: a
long-poll ends its wait then (:mod:`.hangup`) with a callback, not a task per waiter.
"""

from __future__ import annotations

import asyncio
import weakref
from functools import partial
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string
from uvicorn.server import ServerState

from .hangup import CONNECTION_CLOSED
from .whole_answer import WHOLE_ANSWER, WholeAnswer

#: Writes up to this size are joined (an answer's head, a JSON body); larger ones (blob chunks) go out as they are.
JOIN_MAX_BYTES = 64 * 1024


class CoalescingTransport:
    """An asyncio transport that sends a write joined to the one after it (see the module docstring).

    Args:
        transport: the connection's transport.
        loop: the event loop it runs on.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._kept: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` joined to the write kept back, if one is; else keep it (copied: a caller
        may reuse its buffer) until the next write or the loop's next pass. A write of more than
        :data:`JOIN_MAX_BYTES` is neither kept nor copied: it goes out at once, after what is kept."""
        if len(data) > JOIN_MAX_BYTES:
            self.flush()
            self._send(data)
            return
        if self._kept is None:
            self._kept = bytes(data)
            self._loop.call_soon(self.flush)
            return
        kept, self._kept = self._kept, None
        self._send(kept + bytes(data))

    def writelines(self, lines: Any) -> None:
        """Write each of ``lines`` as :meth:`write` does."""
        for line in lines:
            self.write(line)

    def _send(self, data: bytes | bytearray | memoryview) -> None:
        if not self._transport.is_closing():  # a connection closing (client gone) takes no more
            self._transport.write(data)

    def write_now(self, data: bytes) -> None:
        """Send what is kept, then ``data``, at once (a whole answer: nothing is to be joined to it)."""
        self.flush()
        self._send(data)

    def flush(self) -> None:
        """Send the write kept back, if any."""
        kept, self._kept = self._kept, None
        if kept is not None:
            self._send(kept)

    def get_write_buffer_size(self) -> int:
        """Bytes not yet sent: the transport's buffer and the write kept back."""
        return self._transport.get_write_buffer_size() + len(self._kept or b"")

    def write_eof(self) -> None:
        """Send what is kept, then end the stream."""
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        """Send what is kept, then close."""
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        """Drop what is kept and abort the connection."""
        self._kept = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def send_whole(cycle_ref: weakref.ref[RequestResponseCycle], state: ServerState, answer: WholeAnswer) -> bool:
    """Write ``answer`` on the connection of the cycle ``cycle_ref`` refers to at once and complete
    the cycle, as uvicorn's ``send`` would after the answer's start and body messages. The cycle is
    held weakly: the scope holding this send is the cycle's own, and a strong reference would make
    every request a reference cycle, freed only by the cyclic collector. The server's default
    headers are taken from ``state`` at the time of the send (one list per second for every
    request, so ``answer``'s bytes are built once per second; uvicorn's ``send`` dates an answer
    when its request arrived).

    Returns:
        False, having written nothing, where the ASGI ``send`` must be used instead: the cycle
        gone, a response already started, the client gone, writing paused (the peer reads slowly), a connection
        that closes after this answer, or a ``HEAD`` request.
    """
    cycle = cycle_ref()
    if cycle is None:
        return False
    scope = cycle.scope
    if (
        cycle.response_started
        or cycle.disconnected
        or cycle.flow.write_paused
        or not cycle.keep_alive
        or scope["method"] == "HEAD"
    ):
        return False
    cycle.response_started, cycle.waiting_for_100_continue = True, False
    if cycle.access_log:
        cycle.access_logger.info(
            '%s - "%s %s HTTP/%s" %d',
            get_client_addr(scope),
            scope["method"],
            get_path_with_query_string(scope),
            scope["http_version"],
            answer.status,
        )
    cycle.transport.write_now(answer.wire(state.default_headers))  # type: ignore[attr-defined]  # a CoalescingTransport
    cycle.response_complete = True
    cycle.message_event.set()
    cycle.on_response()
    return True


def connection_closed(
    protocol_ref: weakref.ref[CoalescingHttpToolsProtocol], cycle_ref: weakref.ref[RequestResponseCycle]
) -> asyncio.Future[None]:
    """A future done once the connection of the cycle ``cycle_ref`` refers to is lost (the client hung up,
    or the server closed it): at once when it already was. Made when first asked for, one per request;
    both references are weak, as in :func:`send_whole`."""
    protocol, cycle = protocol_ref(), cycle_ref()
    if protocol is None or cycle is None or cycle.disconnected or protocol.transport.is_closing():
        lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lost.set_result(None)
        return lost
    if protocol.lost is None or protocol.lost[0] is not cycle:
        protocol.lost = (cycle, protocol.loop.create_future())
    return protocol.lost[1]


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through a :class:`CoalescingTransport`, and offering each
    request :func:`send_whole` as the scope extension ``WHOLE_ANSWER`` (:mod:`.whole_answer`) and
    :func:`connection_closed` as ``CONNECTION_CLOSED`` (:mod:`.hangup`) (``uvicorn.run(..., http=...)``).

    Attributes:
        lost: the request cycle asked for its connection's loss, and that future (None: not asked).
    """

    lost: tuple[RequestResponseCycle, asyncio.Future[None]] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        lost, self.lost = self.lost, None
        super().connection_lost(exc)
        if lost is not None and not lost[1].done():
            lost[1].set_result(None)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # an upgrade request made no cycle
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[WHOLE_ANSWER] = partial(send_whole, weakref.ref(cycle), self.server_state)
            extensions[CONNECTION_CLOSED] = partial(connection_closed, weakref.ref(self), weakref.ref(cycle))
