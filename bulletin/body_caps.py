"""The body rule: every request body is read only up to its route's cap, before the app, and so any token check,
sees it.

One pure ASGI layer, :class:`BodyCaps`, outermost in both services (bulletin and sidecar
processes; the sidecar imports it from here, as it imports the bulletin's client). Each
service names its routes' caps from its settings (:class:`Cap`; ``docs/reference/limits.md``
lists them) and builds its own error answer from a :class:`Refusal` (its package's error type):

* A route's cap is looked up by the route the app's own table matches (first full match, as
  the router picks it); a route the service does not name gets :data:`NO_BODY` (cap 0): it
  takes no body. A route added without a cap therefore refuses every body, and the tests send
  bodies to every route of the table.
* A request whose declared ``Content-Length`` is over its route's cap, or that carries any body
  (a length > 0 or a chunked one) to a route of cap 0, is answered 413 at once: the app never
  runs and no body byte is read.
* A request with a body to a path no route matches, or with a method its route does not take,
  goes to the app, which answers 404 or 405 without reading it (a read is cut at once), and its
  connection is closed after the answer.
* A chunked body is counted as the app receives it; the message that passes the cap is not
  handed over: the layer answers 413 itself and raises :class:`BodyCut` into the app, which
  unwinds (its own answer, if it makes one, is dropped). What the server read is then at most
  the cap plus one of its messages (uvicorn: what it buffered, up to 64 KiB, plus one socket
  read of up to 256 KiB).
* Every refusal closes the connection (``Connection: close``): the server stops reading. So does
  any answer the app starts before it has read the whole body (a token refused before the body
  is read): the server would otherwise read the rest, to throw it away.
* With a :class:`BodyBudget` (the sidecar's proxied bodies), the bytes of all bodies being read
  or held by requests in flight are bounded: a declared body takes its whole length before its
  first byte is read, a chunked one each message as it comes; a body that finds no room within
  the budget's wait is answered by the service's refusal for ``reason="budget"`` (503), and a
  request gives its bytes back when it ends, streamed answers included.
* The bytes read are counted per route (a Prometheus counter of the service's).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import Counter
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The route label of a path no route of the app matches.
UNMATCHED = "unmatched"
#: The method of a cap that applies to every method of its route.
ANY_METHOD = "*"


@dataclass(frozen=True)
class Cap:
    """One route's body cap.

    Attributes:
        limit_bytes: the most body bytes the route reads (0: it takes no body).
        setting: the environment variable that sets it, named in refusals (None: not configurable).
    """

    limit_bytes: int
    setting: str | None = None


#: The cap of routes that take no body.
NO_BODY = Cap(0)


@dataclass(frozen=True)
class Refusal:
    """Why a request's body was refused, for the service's error answer.

    Attributes:
        reason: ``"too_large"`` (over the cap: 413) or ``"budget"`` (no room in the body budget in time: 503).
        method, route: the request's method and its route's path template (:data:`UNMATCHED` for none).
        cap: the route's cap.
        declared_bytes: the declared ``Content-Length`` (None: a chunked body).
        received_bytes: body bytes read before the refusal.
        path_params: the route's path parameters (e.g. ``run``), as the router would pass them.
        budget_bytes, wait_s: the budget and its wait (reason ``"budget"``).
    """

    reason: Literal["too_large", "budget"]
    method: str
    route: str
    cap: Cap
    declared_bytes: int | None
    received_bytes: int
    path_params: Mapping[str, Any]
    budget_bytes: int = 0
    wait_s: float = 0.0

    @property
    def message(self) -> str:
        """What went wrong and what to do, naming the route, the cap and its setting."""
        where = f"{self.method} {self.route}"
        if self.reason == "budget":
            return (
                f"no room for the request body of {where} within {self.wait_s:g} s: the bodies of requests in flight "
                f"hold the whole {self.budget_bytes}-byte budget; retry later"
            )
        if self.cap.limit_bytes == 0:
            return f"{where} takes no request body: send the request without one"
        setting = f" ({self.cap.setting})" if self.cap.setting else ""
        size = (
            f"declares {self.declared_bytes} bytes"
            if self.declared_bytes is not None and self.declared_bytes > self.cap.limit_bytes
            else f"has more than {self.cap.limit_bytes} bytes"
        )
        return (
            f"the request body of {where} {size}, over the route's {self.cap.limit_bytes}-byte "
            f"cap{setting}: send a smaller body"
        )


class BodyCut(BaseException):
    """Raised into the app from ``receive()`` once :class:`BodyCaps` has answered the request itself.

    A ``BaseException``, so that the app's catch-all handlers (which would log it as an internal
    error) and FastAPI's body parsing (which would turn it into a 400) let it pass to the layer.
    """


class BodyBudget:
    """The bytes of request bodies held at once across requests (event-loop thread only).

    Args:
        total_bytes: the most body bytes held at once.
        wait_s: how long a body waits for room before it is refused, seconds.
    """

    def __init__(self, total_bytes: int, wait_s: float) -> None:
        self.total_bytes = total_bytes
        self.wait_s = wait_s
        self.held_bytes = 0
        self._queue: collections.deque[tuple[int, asyncio.Future[bool]]] = collections.deque()

    async def take(self, size_bytes: int) -> bool:
        """Hold ``size_bytes`` more, waiting (first come, first served) up to :attr:`wait_s` for room.

        Returns:
            True once held (give them back with :meth:`give`); False when no room came in time (nothing held).
        """
        if not self._queue and self.held_bytes + size_bytes <= self.total_bytes:
            self.held_bytes += size_bytes
            return True
        loop = asyncio.get_running_loop()
        entry: tuple[int, asyncio.Future[bool]] = (size_bytes, loop.create_future())
        self._queue.append(entry)
        timer = loop.call_later(self.wait_s, _settle, entry[1], False)
        try:
            return await entry[1]
        except BaseException:  # cancelled: give back what was granted meanwhile
            if entry[1].done() and not entry[1].cancelled() and entry[1].result():
                self.give(size_bytes)
            raise
        finally:
            timer.cancel()
            with contextlib.suppress(ValueError):
                self._queue.remove(entry)
            self._grant()  # a body leaving the head of the queue may let the next ones in

    def give(self, size_bytes: int) -> None:
        """Give back ``size_bytes`` held by :meth:`take`, letting waiting bodies in."""
        self.held_bytes -= size_bytes
        self._grant()

    def _grant(self) -> None:
        while self._queue:
            size, granted = self._queue[0]
            if granted.done():
                self._queue.popleft()
            elif self.held_bytes + size <= self.total_bytes:
                self._queue.popleft()
                self.held_bytes += size
                granted.set_result(True)
            else:
                return


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


def _framing(headers: Sequence[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """``(declared Content-Length or None, chunked)`` of a request's headers."""
    declared, chunked = None, False
    for name, value in headers:
        if name == b"content-length" and value.isdigit():
            declared = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    return (None if chunked else declared), chunked


class BodyCaps:
    """ASGI middleware applying the body rule (see the module docstring) to every HTTP request of ``app``.

    Args:
        app: the rest of the app.
        routes: the app's route table (``app.router.routes``), matched as the router matches it.
        caps: ``(method or ANY_METHOD, path template) -> Cap`` for the routes that take a body.
        refuse: the service's answer to a refusal (its package's error type as JSON); the layer
            adds ``Connection: close``.
        body_bytes: a counter with one label, the route's path template: body bytes read.
        budget: the bound on body bytes held at once across requests (None: none).

    Raises:
        ValueError: a cap names a route the table does not have, or is over the budget.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Sequence[BaseRoute],
        caps: Mapping[tuple[str, str], Cap],
        refuse: Callable[[Refusal], Response],
        body_bytes: Counter,
        budget: BodyBudget | None = None,
    ) -> None:
        self.app = app
        self.routes = routes
        self.caps = dict(caps)
        self.refuse = refuse
        self.body_bytes = body_bytes
        self.budget = budget
        paths = {getattr(route, "path", None) for route in routes}
        for (method, path), cap in self.caps.items():
            if path not in paths:
                raise ValueError(f"a body cap names {method} {path}, a route this app does not have")
            if budget is not None and cap.limit_bytes > budget.total_bytes:
                raise ValueError(
                    f"the body cap of {method} {path} ({cap.limit_bytes} bytes) is over the body budget "
                    f"({budget.total_bytes} bytes): such a body could never be read"
                )

    def route(self, scope: Scope) -> tuple[str, Cap | None, Mapping[str, Any]]:
        """``(path template, cap, path parameters)`` of the route the app's router would pick for ``scope``;
        the cap is None where the router answers 405 (a method the route does not take) or 404
        (:data:`UNMATCHED`: a path no route matches)."""
        partial: BaseRoute | None = None
        for route in self.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                path = getattr(route, "path", UNMATCHED)
                cap = self.caps.get((scope["method"], path)) or self.caps.get((ANY_METHOD, path)) or NO_BODY
                return path, cap, child.get("path_params", {})
            if match is Match.PARTIAL and partial is None:
                partial = route
        return getattr(partial, "path", UNMATCHED), None, {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared, chunked = _framing(scope["headers"])
        if not chunked and not declared:  # no body: nothing to cap
            await self.app(scope, receive, send)
            return
        route, cap, params = self.route(scope)
        if cap is None:  # the router answers 404 or 405 without reading the body; the connection closes after it
            await _CappedRequest(self, scope, receive, send, route, NO_BODY, declared, params, close=True).run()
        elif cap.limit_bytes == 0 or (declared is not None and declared > cap.limit_bytes):
            refusal = Refusal("too_large", scope["method"], route, cap, declared, 0, params)
            await self.answer(refusal, scope, receive, send)
        else:
            await _CappedRequest(self, scope, receive, send, route, cap, declared, params).run()

    async def answer(self, refusal: Refusal, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the service's answer to ``refusal``, closing the connection after it."""
        response = self.refuse(refusal)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class _CappedRequest:
    """One request with a body within its cap so far: the app's ``receive`` counts and caps it, its ``send`` is
    dropped once the layer has answered, and an answer started before the whole body was read (or
    any, with ``close``) closes the connection."""

    __slots__ = (
        "_close",
        "_complete",
        "_count",
        "_receive",
        "_send",
        "_started",
        "cap",
        "declared",
        "held",
        "layer",
        "params",
        "pending",
        "received",
        "refused",
        "route",
        "scope",
    )

    def __init__(
        self,
        layer: BodyCaps,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: str,
        cap: Cap,
        declared: int | None,
        params: Mapping[str, Any],
        *,
        close: bool = False,
    ) -> None:
        self.layer, self.scope, self._receive, self._send, self._close = layer, scope, receive, send, close
        self.route, self.cap, self.declared, self.params = route, cap, declared, params
        self._count = layer.body_bytes.labels(route).inc
        self.received = self.held = 0
        self.pending = layer.budget is not None and declared is not None  # a declared body's bytes, taken at once
        self.refused = self._started = self._complete = False

    async def run(self) -> None:
        try:
            await self.layer.app(self.scope, self.receive, self.send)
        except (BodyCut, BaseExceptionGroup, Exception):
            if not self.refused:
                raise  # once answered: BodyCut, or whatever the app made of it while unwinding
        finally:
            if self.held and self.layer.budget is not None:
                self.layer.budget.give(self.held)

    async def receive(self) -> Message:
        budget = self.layer.budget
        if self.pending and budget is not None and self.declared is not None:
            self.pending = False
            if not await budget.take(self.declared):
                await self._refuse("budget")
            self.held = self.declared
        message = await self._receive()
        if message["type"] != "http.request":
            return message
        self._complete = not message.get("more_body", False)
        size = len(message.get("body", b""))
        if size:
            self.received += size
            self._count(size)
            if self.received > self.cap.limit_bytes:
                await self._refuse("too_large")
            if budget is not None and self.declared is None:
                if not await budget.take(size):
                    await self._refuse("budget")
                self.held += size
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return  # the layer has answered; the app's own answer is dropped
        if message["type"] == "http.response.start":
            self._started = True
            if self._close or not self._complete:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await self._send(message)

    async def _refuse(self, reason: Literal["too_large", "budget"]) -> None:
        budget = self.layer.budget
        refusal = Refusal(
            reason,
            self.scope["method"],
            self.route,
            self.cap,
            self.declared,
            self.received,
            self.params,
            budget.total_bytes if budget is not None else 0,
            budget.wait_s if budget is not None else 0.0,
        )
        self.refused = True
        if not self._started:
            await self.layer.answer(refusal, self.scope, self._receive, self._send)
        raise BodyCut(refusal.message)
