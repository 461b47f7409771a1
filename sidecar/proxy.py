"""The gated, stamping proxy in front of the engine's HTTP server.

* Model routes (answers depend on the weights; per engine kind, its descriptor's route table,
  :mod:`.engines.registry`) pass the
  :class:`~.gate.Gate` and are stamped (:mod:`.stamps`): JSON answers get
  ``weight_version_start`` / ``weight_version_end`` fields and ``X-Stitch-Version-Start`` /
  ``X-Stitch-Version-End`` headers; streamed (SSE) answers get the start header and the stamps
  at their end. Events are forwarded as soon as they are complete: nothing else is buffered.
* What else a model request gets is a list of request features (:mod:`.features`), whose
  hooks are called in the list's order: where the engine's answers name its own weight version
  (the kind's ``reports_versions``: SGLang), each answer is checked against what the sidecar
  held while the request ran before it is sent (:mod:`.answer_versions`; a mismatch is answered
  503 ``AnswerVersionMismatch`` instead); per-token version spans (:mod:`.spans`); routing
  replay (:mod:`.routed_experts`); the cache salt (:mod:`.salt`).
* An adapter run (:mod:`.adapter_set`, set once the run is known to be one: :attr:`Proxy.adapters`):
  a request whose ``model`` names the run (``<run>`` or ``<run>@<N>``) is admitted against the
  resident adapter versions instead of the gate, its ``model`` rewritten to the resident
  ``<run>@<N>`` it got, and stamped with N (start and end: an adapter version never changes under
  a request); any other ``model`` (the base's served name) is forwarded ungated and unstamped.
  ``GET /v1/models`` lists the engine's base model and the resident versions (not the retired ones).
* Read routes (models, tokenizer, model info) are forwarded as they are; every other path is
  refused (the app answers 403 :class:`~.errors.RouteForbiddenError`); the engine's
  ``/metrics`` is served under ``/engine/metrics`` by the app.
* Paths are matched, and forwarded, as :func:`~.routes.normalise_path` makes them. Bodies are
  read whole, after the app's body rule (``bulletin/body_caps.py``) has cut any over
  ``max_body_bytes`` (413 :class:`~.errors.BodyTooLargeError`) and bounded the bytes of all
  bodies in flight by ``body_budget_bytes`` (503 :class:`~.errors.BodyBudgetError`). The
  ``weight_version`` body field is read whenever the engine would read the body as JSON (no
  media type, or ``application/json`` / ``application/*+json`` in any letter case, as FastAPI does).
* An engine that breaks off a stream (killed, restarted) ends the client's stream with the stamp
  event and then an error event (``data: {"error": {...}}``, which the OpenAI clients raise as
  ``APIError``); no ``[DONE]`` follows.

A client that disconnects, while held or while the engine works, aborts its upstream request
(the connection to the engine is closed, which makes vLLM and SGLang abort it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from stitchboard.proto.adapter import adapter_name
from stitchboard.proto.sidecar_wire import END_HEADER, START_HEADER

from .adapter_set import ResidentAdapters
from .answer_versions import AnswerVersionCheck
from .engines.registry import lookup
from .errors import AnswerVersionMismatchError, EngineUnavailableError
from .features import ModelRequest, RequestUse, request_features
from .gate import BODY_FIELD, Gate, parse_constraint
from .metrics import SidecarMetrics
from .routed_experts import RoutingSource
from .salt import CacheSalter
from .settings import SidecarSettings
from .spans import WANT_FIELD, SpanLedger
from .stamps import SseStamper, event_data, stamp_answer

T = TypeVar("T")
#: The OpenAI model list (rewritten for an adapter run: the base and the resident versions).
MODELS_PATH = "/v1/models"
log = logging.getLogger("stitchboard.sidecar")
_HOP = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
    "trailer",
    "accept-encoding",
    "content-encoding",
    "date",
    "server",
}


def is_json_body(content_type: str | None) -> bool:
    """Whether the engine (FastAPI) reads a body of this ``Content-Type`` as JSON: none given, or
    ``application/json`` / ``application/*+json``, media types compared case-insensitively."""
    if not content_type:
        return True
    main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _stamp(v: int | None) -> str:
    return "none" if v is None else str(v)


def _finished_output(event: dict[str, Any]) -> bool:
    # An SGLang /generate stream chunk that ends its output.
    info = event.get("meta_info")
    return isinstance(info, dict) and info.get("finish_reason") is not None


class ClientGone(Exception):
    """The client disconnected before its answer was ready (internal: nothing is sent)."""


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


@dataclass(frozen=True)
class _Admitted:
    """One admitted model request, as its answer needs it: the start stamp, ``release`` (ends the
    admission once; returns the end stamp), and the parts of the request features it uses."""

    start: int
    release: Callable[[], int | None]
    uses: list[RequestUse]
    end: Callable[[], int | None]


class Proxy:
    """Forwards requests to the engine at ``settings.engine_url`` (one per app; event-loop only).

    Args:
        settings: engine kind and URL, waits and timeouts.
        gate: the app's gate.
        metrics: held/rejected/in-flight figures.
        check_engine: the claim's engine check (returns why the claim was dropped, or None);
            answers of engines that report their own weight version are checked with it.
        spans: the span ledger shared with the reconciler (default: a new one).
        salter: the cache salter shared with the reconciler (default: one for the settings).
        routing: the routing the engine's workers capture (an adapter that ``ReplaysRouting``), or None.
    """

    def __init__(
        self,
        settings: SidecarSettings,
        gate: Gate,
        metrics: SidecarMetrics,
        check_engine: Callable[[], Awaitable[str | None]] | None = None,
        spans: SpanLedger | None = None,
        salter: CacheSalter | None = None,
        routing: RoutingSource | None = None,
    ) -> None:
        self.settings = settings
        self.kind = lookup(settings.engine)  # the engine kind's descriptor (:mod:`.engines.registry`)
        self.spans = spans or SpanLedger()  # shared with the reconciler (per-token version spans, :mod:`.spans`)
        self.salter = salter or CacheSalter(settings.salt_cache, settings.engine)  # the cache salt (:mod:`.salt`)
        self.gate = gate
        self.metrics = metrics
        self.routes = self.kind.routes
        versions = (
            AnswerVersionCheck(gate, check_engine, settings.engine_call_timeout_s)
            if self.kind.reports_versions and check_engine is not None
            else None
        )
        #: The request features, in the order their hooks are called (:mod:`.features`).
        self.features = request_features(self.kind, self.spans, self.salter, routing, versions)
        #: An adapter run's resident versions (None: a full-model run, or not known yet).
        self.adapters: ResidentAdapters | None = None
        timeout = httpx.Timeout(settings.engine_timeout_s, connect=settings.engine_call_timeout_s, pool=None)
        self.http = httpx.AsyncClient(
            base_url=settings.engine_url.rstrip("/"),
            timeout=timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

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
        headers = [
            (k, v)
            for k, v in request.headers.items()
            if k.lower() not in _HOP and not k.lower().startswith("x-stitch-")
        ]
        headers.append(("accept-encoding", "identity"))  # bytes pass through as they are
        return self.http.build_request(
            request.method, path, params=list(request.query_params.multi_items()), headers=headers, content=body
        )

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
                raise EngineUnavailableError(
                    f"the engine at {self.settings.engine_url} broke off its answer: {exc!r}"
                ) from None
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
            content = response.content
            if self.adapters is not None and path == MODELS_PATH and request.method == "GET" and response.is_success:
                answer = _json_or_none(content)
                if self.adapters.list_models(answer):
                    content = json.dumps(answer).encode()
            return Response(content, status_code=response.status_code, headers=self._headers(response))
        return _ProxyStream(
            response.aiter_raw(), response.aclose, status_code=response.status_code, headers=self._headers(response)
        )

    async def forward_model(self, request: Request, path: str, body: bytes) -> Response:
        """Gate, forward and stamp a request whose answer depends on the weights (``path`` on the
        engine, ``body`` the request's, within its cap); the request features (:mod:`.features`)
        take their part in it, in their list's order.

        Raises:
            InvalidVersionConstraintError: bad ``X-Stitch-*`` header or ``weight_version`` field (400).
            WeightVersionError: the constraint is not met within the wait, or has passed (409).
            NotReadyError, EngineUnavailableError: no verified version / engine down (503).
            RoutedExpertsRefusedError: a malformed routing replay ask (400), or no MoE model (422).
        """
        payload: Any = None
        if body and is_json_body(request.headers.get("content-type")):
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None  # the engine answers the malformed body itself
        had_field = isinstance(payload, dict) and (BODY_FIELD in payload or WANT_FIELD in payload)
        constraint = parse_constraint(request.headers, payload)
        adapters = self.adapters
        ask = adapters.ask_of(payload, constraint) if adapters is not None else None
        if adapters is not None and ask is None:  # the base model of an adapter run: ungated
            return await self.forward_plain(request, path, json.dumps(payload).encode() if had_field else body)
        client_id = request.headers.get("x-request-id")
        asked = ModelRequest(path, request.headers, payload, client_id, changed=had_field)
        uses = [use for feature in self.features if (use := await feature.open(asked)) is not None]
        wait_s = min(
            constraint.wait_s if constraint.wait_s is not None else self.settings.request_wait_s,
            self.settings.max_request_wait_s,
        )
        try:
            if adapters is not None and ask is not None:
                start, held = await self._unless_gone(request, adapters.admit(ask, wait_s))
                claims = self.gate.claims
                payload["model"] = adapter_name(adapters.run, start)  # the resident version it got
                asked.changed = True
            else:
                start, held, claims = await self._unless_gone(request, self.gate.admit(constraint, wait_s))
        except ClientGone:
            return Response(status_code=499)
        self.metrics.in_flight.set(self.gate.in_flight)
        if held:
            self.metrics.requests_held.inc()
        for use in uses:
            use.admitted(asked, start, claims)
        uses = [use for use in uses if use.active]
        if asked.changed:
            body = json.dumps(payload).encode()
        released = False

        def end_stamp() -> int | None:  # an adapter request ends on its version; others on the applied one
            return start if ask is not None else self.gate.applied

        def release() -> int | None:
            nonlocal released
            if released:
                return end_stamp()
            released = True
            for use in uses:
                use.on_release()
            if adapters is not None and ask is not None:
                adapters.release(start)
                end: int | None = start
            else:
                end = self.gate.release()
            self.metrics.in_flight.set(self.gate.in_flight)
            return end

        try:
            upstream = self._upstream_request(request, path, body)
            if asked.request_id is not None and asked.request_id != client_id:
                upstream.headers["x-request-id"] = asked.request_id
            response = await self._unless_gone(request, self._open(upstream))
        except ClientGone:
            release()
            return Response(status_code=499)
        except BaseException:
            release()
            raise
        headers = self._headers(response)
        headers[START_HEADER] = _stamp(start)
        admitted = _Admitted(start, release, uses, end_stamp)
        if response.is_stream_consumed:
            try:
                return await self._plain_answer(response, headers, admitted)
            except BaseException:
                release()
                raise
        return self._streamed_answer(response, headers, path, admitted)

    async def _plain_answer(self, response: httpx.Response, headers: dict[str, str], admitted: _Admitted) -> Response:
        content = response.content
        answer: Any = None
        if response.is_success and "json" in response.headers.get("content-type", ""):
            try:
                answer = json.loads(content)
            except ValueError:
                answer = None
        if response.is_success:
            for use in admitted.uses:
                await use.on_answer(answer)
        end = admitted.release()
        headers[END_HEADER] = _stamp(end)
        if stamp_answer(answer, admitted.start, end):
            content = json.dumps(answer).encode()
        return Response(content, status_code=response.status_code, headers=headers)

    def _streamed_answer(
        self, response: httpx.Response, headers: dict[str, str], path: str, admitted: _Admitted
    ) -> Response:
        start, release, uses = admitted.start, admitted.release, admitted.uses
        final = _finished_output if path in self.kind.final_in_place else None
        applied = admitted.end

        def on_spans(spans: list[dict[str, int]] | None) -> None:
            for use in uses:
                use.on_spans(spans, stamper)

        stamper = next(
            (s for use in uses if (s := use.stamper(start, applied, final, on_spans)) is not None), None
        ) or SseStamper(start, applied, final)

        async def passed(event: bytes) -> bytes:
            # The bytes to send for ``event``, once every feature has read it (and any check passed).
            data = event_data(event)
            if data is None or not uses:
                return stamper.emit(event)
            decoded = None if data == b"[DONE]" else _json_or_none(data)
            verdicts = [await use.on_event(data, decoded, stamper) for use in uses]
            if "drop" in verdicts:
                return b""  # the usage chunk only the sidecar asked for (the client did not)
            if "edited" in verdicts:
                event = b"data: " + json.dumps(decoded, separators=(",", ":")).encode() + b"\n\n"
            return stamper.emit(event, decoded)

        async def events() -> AsyncIterator[bytes]:
            out: list[bytes] = []
            try:
                async for chunk in response.aiter_raw():
                    for event in stamper.split(chunk):
                        out.append(await passed(event))
                    if out:
                        yield b"".join(out)
                        out = []
                for use in uses:
                    await use.at_end(stamper)
            except httpx.TransportError as exc:  # the engine broke off: the stamp, an error event, no [DONE]
                log.warning("the engine broke off a streamed answer: %r", exc)
                message = (
                    f"the engine at {self.settings.engine_url} broke off the stream ({type(exc).__name__}): "
                    "the answer is incomplete; retry the request"
                )
                yield stamper.error(message, EngineUnavailableError.type, EngineUnavailableError.status)
                return
            except AnswerVersionMismatchError as exc:  # the events before the mismatch went out; then the error
                log.warning("a streamed answer was withheld: %s", exc)
                self.metrics.requests_rejected.labels(exc.type).inc()
                yield b"".join(out) + stamper.error(exc.message, exc.type, exc.status)
                return
            yield stamper.finish()

        async def close() -> None:
            release()
            await response.aclose()

        return _ProxyStream(events(), close, status_code=response.status_code, headers=headers)


def _json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
