"""The gated, stamping proxy in front of the engine's OpenAI-compatible server.

* :data:`MODEL_ROUTES` (answers depend on the weights) pass the :class:`~.gate.Gate` and are
  stamped: ``weight_version_start`` is the applied version when the request was admitted,
  ``weight_version_end`` the applied version when it completed. Non-streaming JSON answers get
  both as top-level fields and as ``X-Stitch-Version-Start`` / ``X-Stitch-Version-End``
  headers; streamed (SSE) answers get the start header, and one extra event just before
  ``data: [DONE]`` carrying both stamps (shaped like the stream's chunks, with no choices).
  Events are forwarded as soon as they are complete: nothing else is buffered.
* :data:`READ_ROUTES` (models, tokenizer, version) are forwarded as they are.
* Every other path is refused with 403 :class:`~.errors.RouteForbiddenError` (engine control
  and dev routes: only the sidecar changes weights); the engine's ``/metrics`` is served
  under ``/engine/metrics`` by the app.
* Paths are matched, and forwarded, as :func:`normalise_path` makes them (percent-decoded,
  repeated slashes collapsed); a path with a dot segment (``..``, ``%2e%2e``) is refused with
  400 :class:`~.errors.InvalidPathError`, never resolved into another route. Bodies are read up
  to ``max_body_bytes`` (413 :class:`~.errors.BodyTooLargeError` beyond). The ``weight_version``
  body field is read whenever the engine would read the body as JSON (no media type, or
  ``application/json`` / ``application/*+json`` in any letter case, as FastAPI does).
* An engine that breaks off a stream (killed, restarted) ends the client's stream with the stamp
  event and then an error event (``data: {"error": {...}}``, which the OpenAI clients raise as
  ``APIError``); no ``[DONE]`` follows.

A client that disconnects, while held or while the engine works, aborts its upstream request
(the connection to the engine is closed, which makes vLLM abort it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import unquote

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from stitchboard.proto.sidecar_wire import (
    END_FIELD,
    END_HEADER,
    START_FIELD,
    START_HEADER,
)

from .errors import BodyTooLargeError, EngineUnavailableError, InvalidPathError
from .gate import BODY_FIELD, Gate, parse_constraint
from .metrics import SidecarMetrics
from .settings import SidecarSettings

T = TypeVar("T")
log = logging.getLogger("stitchboard.sidecar")

#: POST routes whose answers depend on the weights: gated and stamped.
MODEL_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/invocations",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    }
)
#: (method, path) forwarded without gate or stamps; ``/v1/models/<id>`` too.
READ_ROUTES = frozenset({("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/ping"), ("GET", "/load")})
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-authorization", "proxy-authenticate", "trailer", "accept-encoding", "content-encoding", "date", "server"}
_EVENT_END = re.compile(rb"\r?\n\r?\n")


def normalise_path(path: str) -> str:
    """The route a request path names: percent-decoded (again, for double encoding) segment by
    segment, repeated slashes collapsed, a trailing slash kept.

    Raises:
        InvalidPathError: a segment is ``.`` or ``..`` (percent-encoded or not): the request is
            refused rather than resolved, so no path reaches a route the allow-list does not name.
    """
    segments = unquote(path).split("/")
    if any(unquote(seg) in (".", "..") for seg in segments):
        raise InvalidPathError(f"path {path!r} has a dot segment ('.' or '..'): name the route itself", path=path)
    kept = [seg for seg in segments if seg]
    return "/" + "/".join(kept) + ("/" if kept and path.endswith("/") else "")


def is_json_body(content_type: str | None) -> bool:
    """Whether the engine (FastAPI) reads a body of this ``Content-Type`` as JSON: none given, or
    ``application/json`` / ``application/*+json``, media types compared case-insensitively."""
    if not content_type:
        return True
    main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The request's body, read up to ``limit_bytes``.

    Raises:
        BodyTooLargeError: the declared ``Content-Length`` or the bytes received exceed the limit
            (reading stops there).
    """
    declared = request.headers.get("content-length", "")
    too_large = f"request body over {limit_bytes} bytes (the max_body_bytes setting): send a smaller request"
    if declared.isdigit() and int(declared) > limit_bytes:
        raise BodyTooLargeError(too_large, limit_bytes=limit_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise BodyTooLargeError(too_large, limit_bytes=limit_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def is_read_route(method: str, path: str) -> bool:
    """Whether ``method path`` is forwarded as a read-only route."""
    return (method, path) in READ_ROUTES or (method == "GET" and path.startswith("/v1/models/"))


def _stamp(v: int | None) -> str:
    return "none" if v is None else str(v)


class ClientGone(Exception):
    """The client disconnected before its answer was ready (internal: nothing is sent)."""


class _SseStamper:
    """Forwards complete SSE events; injects the stamp event before ``data: [DONE]`` (or at the end,
    or before the error event of a broken-off stream)."""

    def __init__(self, start: int, end: Callable[[], int | None]) -> None:
        self.start, self.end = start, end
        self.buf = b""
        self.last_data: bytes | None = None
        self.stamped = False

    def _stamp_event(self) -> bytes:
        self.stamped = True
        shape: dict[str, Any] = {}
        try:
            last = json.loads(self.last_data) if self.last_data else {}
            shape = {k: last[k] for k in ("id", "object", "created", "model") if k in last}
            if "choices" in last:
                shape["choices"] = []
        except (ValueError, TypeError):
            pass
        event = {**shape, START_FIELD: self.start, END_FIELD: self.end()}
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send now for ``chunk`` (every event it completes)."""
        self.buf += chunk
        out = []
        while (m := _EVENT_END.search(self.buf)) is not None:
            event, self.buf = self.buf[: m.end()], self.buf[m.end() :]
            data = event.strip()
            if data == b"data: [DONE]" and not self.stamped:
                out.append(self._stamp_event())
            elif data.startswith(b"data:"):
                self.last_data = data[5:].strip()
            out.append(event)
        return b"".join(out)

    def finish(self) -> bytes:
        """Bytes to send at the end of the stream (the rest, and the stamp if no ``[DONE]`` came)."""
        rest, self.buf = self.buf, b""
        return rest + (b"" if self.stamped else (b"\n\n" if rest and not rest.endswith(b"\n\n") else b"") + self._stamp_event())

    def broken_off(self, message: str) -> bytes:
        """Bytes to send when the engine broke off the stream: the stamp (unless sent), then an
        error event shaped as OpenAI's (clients raise it); an incomplete event is dropped."""
        self.buf = b""
        error = {"error": {"message": message, "type": EngineUnavailableError.type, "code": EngineUnavailableError.status}}
        stamp = b"" if self.stamped else self._stamp_event()
        return stamp + b"data: " + json.dumps(error, separators=(",", ":")).encode() + b"\n\n"


class _ProxyStream(StreamingResponse):
    """A streamed answer that watches for the client's disconnect and always runs ``on_close``."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
            if stream in done and not isinstance(stream.exception(), OSError):  # OSError: the client left mid-send
                stream.result()
        finally:
            for task in (stream, gone):
                task.cancel()
            await asyncio.gather(stream, gone, return_exceptions=True)
            await self._on_close()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Proxy:
    """Forwards requests to the engine at ``settings.engine_url`` (one per app; event-loop only).

    Args:
        settings: engine URL, waits and timeouts.
        gate: the app's gate.
        metrics: held/rejected/in-flight figures.
    """

    def __init__(self, settings: SidecarSettings, gate: Gate, metrics: SidecarMetrics) -> None:
        self.settings = settings
        self.gate = gate
        self.metrics = metrics
        timeout = httpx.Timeout(settings.engine_timeout_s, connect=settings.engine_call_timeout_s, pool=None)
        self.http = httpx.AsyncClient(base_url=settings.engine_url.rstrip("/"), timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()

    async def _unless_gone(self, request: Request, work: Awaitable[T]) -> T:
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            gone.cancel()
        if task.cancelled():
            raise ClientGone()
        return task.result()

    def _upstream_request(self, request: Request, path: str, body: bytes) -> httpx.Request:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP and not k.lower().startswith("x-stitch-")]
        headers.append(("accept-encoding", "identity"))  # bytes pass through as they are
        return self.http.build_request(request.method, path, params=list(request.query_params.multi_items()), headers=headers, content=body)

    async def _open(self, upstream: httpx.Request) -> httpx.Response:
        # Sends the request; reads the whole answer unless it is an SSE stream.
        try:
            response = await self.http.send(upstream, stream=True)
        except httpx.TransportError as exc:
            raise EngineUnavailableError(f"the engine at {self.settings.engine_url} does not answer: {exc!r}") from None
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                await response.aread()
            except httpx.TransportError as exc:
                raise EngineUnavailableError(f"the engine at {self.settings.engine_url} broke off its answer: {exc!r}") from None
            finally:
                await response.aclose()
        return response

    @staticmethod
    def _headers(response: httpx.Response) -> dict[str, str]:
        return {k: v for k, v in response.headers.items() if k.lower() not in _HOP}

    async def forward_plain(self, request: Request, path: str, body: bytes = b"") -> Response:
        """Forward a read-only request as it is (``path`` on the engine, with ``body``).

        Raises:
            EngineUnavailableError: the engine does not answer.
        """
        try:
            response = await self._unless_gone(request, self._open(self._upstream_request(request, path, body)))
        except ClientGone:
            return Response(status_code=499)
        if response.is_stream_consumed:
            return Response(response.content, status_code=response.status_code, headers=self._headers(response))
        return _ProxyStream(response.aiter_raw(), response.aclose, status_code=response.status_code, headers=self._headers(response))

    async def forward_model(self, request: Request, path: str, body: bytes) -> Response:
        """Gate, forward and stamp a request whose answer depends on the weights (``path`` on the
        engine, ``body`` as read by :func:`read_body`).

        Raises:
            InvalidVersionConstraintError: bad ``X-Stitch-*`` header or ``weight_version`` field (400).
            WeightVersionError: the constraint is not met within the wait, or has passed (409).
            NotReadyError, EngineUnavailableError: no verified version / engine down (503).
        """
        payload: Any = None
        if body and is_json_body(request.headers.get("content-type")):
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None  # the engine answers the malformed body itself
        had_field = isinstance(payload, dict) and BODY_FIELD in payload
        constraint = parse_constraint(request.headers, payload)
        if had_field:
            body = json.dumps(payload).encode()
        wait_s = min(constraint.wait_s if constraint.wait_s is not None else self.settings.request_wait_s, self.settings.max_request_wait_s)
        try:
            start, held = await self._unless_gone(request, self.gate.admit(constraint, wait_s))
        except ClientGone:
            return Response(status_code=499)
        self.metrics.in_flight.set(self.gate.in_flight)
        if held:
            self.metrics.requests_held.inc()
        released = False

        def release() -> int | None:
            nonlocal released
            if released:
                return self.gate.applied
            released = True
            end = self.gate.release()
            self.metrics.in_flight.set(self.gate.in_flight)
            return end

        try:
            response = await self._unless_gone(request, self._open(self._upstream_request(request, path, body)))
        except ClientGone:
            release()
            return Response(status_code=499)
        except BaseException:
            release()
            raise
        headers = self._headers(response)
        headers[START_HEADER] = _stamp(start)
        if response.is_stream_consumed:
            end = release()
            headers[END_HEADER] = _stamp(end)
            content = response.content
            if response.is_success and "json" in response.headers.get("content-type", ""):
                try:
                    answer = json.loads(content)
                except ValueError:
                    answer = None
                if isinstance(answer, dict):
                    answer[START_FIELD], answer[END_FIELD] = start, end
                    content = json.dumps(answer).encode()
            return Response(content, status_code=response.status_code, headers=headers)
        stamper = _SseStamper(start, lambda: self.gate.applied)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    if out := stamper.feed(chunk):
                        yield out
            except httpx.TransportError as exc:  # the engine broke off: the stamp, an error event, no [DONE]
                log.warning("the engine broke off a streamed answer: %r", exc)
                yield stamper.broken_off(f"the engine at {self.settings.engine_url} broke off the stream ({type(exc).__name__}): the answer is incomplete; retry the request")
                return
            yield stamper.finish()

        async def close() -> None:
            release()
            await response.aclose()

        return _ProxyStream(events(), close, status_code=response.status_code, headers=headers)
