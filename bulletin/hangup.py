"""A request's client hanging up ends its long-poll's wait (bulletin process).

A long-poll (the latest version: :mod:`.longpoll`, its fast path :mod:`.longpoll_asgi`; the
fleet's: :mod:`.fleet_watch`) waits up to ``wait_s`` for something that may not come, and its
client may leave long before: without this its waiter stayed until the next version or
``wait_s`` (5,000 waiters were held 23 s after their clients left). A :class:`Hangup` learns
when the request's connection closes and ends the wait it bounds (:meth:`Hangup.within`) then:

* under the bulletin's own server protocol (:mod:`.http_protocol`), from the scope extension
  :data:`CONNECTION_CLOSED`: a future the protocol completes when the connection is lost. A
  callback on it costs no task per waiter (the long-poll fan-out is tuned for thousands);
* under any other ASGI server, from the request's ``receive``: a task that waits for the
  ``http.disconnect`` message (a long-poll is a GET: there is no body to read first).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self

from starlette.types import Receive, Scope

#: The ASGI scope extension (``scope["extensions"][CONNECTION_CLOSED]``): a callable returning a
#: future that is done once the request's connection is lost (offered by :mod:`.http_protocol`).
CONNECTION_CLOSED = "stitchboard.connection_closed"


class Hangup:
    """Whether a request's client hung up; ends the waits it bounds when it does.

    Use it as a context manager around the request's wait (it watches the connection only
    inside), and bound each wait with :meth:`within` instead of ``asyncio.timeout``.

    Args:
        scope, receive: the request's ASGI scope and receive.

    Attributes:
        gone: True once the client hung up.
    """

    __slots__ = ("_closed", "_listener", "_receive", "_timeout", "gone")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.gone = False
        closed = scope.get("extensions", {}).get(CONNECTION_CLOSED)
        self._closed: asyncio.Future[None] | None = closed() if closed is not None else None
        self._receive = receive
        self._listener: asyncio.Future[None] | None = None
        self._timeout: asyncio.Timeout | None = None

    def __enter__(self) -> Self:
        if self._closed is None:
            self._listener = asyncio.ensure_future(self._listen())
        elif self._closed.done():
            self.gone = True
        else:
            self._closed.add_done_callback(self._hung_up)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._closed is not None:
            self._closed.remove_done_callback(self._hung_up)
        if self._listener is not None:
            self._listener.cancel()

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._hung_up()

    def _hung_up(self, _: object = None) -> None:
        self.gone = True
        if self._timeout is not None and not self._timeout.expired():
            self._timeout.reschedule(0)  # ends the wait now, as its time running out would

    def within(self, delay_s: float) -> _Bounded:
        """An ``asyncio.timeout(delay_s)`` that also runs out (``TimeoutError``) when the client hangs up
        (check :attr:`gone` after it)."""
        return _Bounded(self, delay_s)


class _Bounded:
    """``asyncio.timeout`` whose :class:`Hangup` can end it early."""

    __slots__ = ("_hangup", "_timeout")

    def __init__(self, hangup: Hangup, delay_s: float) -> None:
        self._hangup = hangup
        self._timeout = asyncio.timeout(0 if hangup.gone else delay_s)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()
        self._hangup._timeout = self._timeout

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self._hangup._timeout = None
        await self._timeout.__aexit__(exc_type, exc, tb)  # raises TimeoutError for the wait it ended
        return None
