"""What a request feature is: the hooks the proxy calls, in the features' list order (sidecar process, event loop).

A :class:`RequestFeature` is one power of the request path (per-token spans, routing replay, the
cache salt, the answer-version check...). For every model request the proxy calls each
feature's :meth:`~RequestFeature.open` before admission; a feature the request uses answers a
:class:`RequestUse`, whose hooks the proxy then calls in the list's order:

1. ``open`` (before the gate admits the request): read what the request asks (and take those
   fields out of the body), refuse a malformed ask (4xx), change the body;
2. :meth:`RequestUse.admitted` (admitted under version ``start``): change the body, name the
   ``X-Request-Id`` the engine must see;
3. :meth:`RequestUse.on_answer` (a whole answer, when the engine succeeded: decoded JSON or None),
   or :meth:`RequestUse.on_event` for every event of a stream, then :meth:`RequestUse.at_end`
   when the stream ends; :meth:`RequestUse.on_spans` when the stream's stamp event is made;
4. :meth:`RequestUse.on_release` once, when the request ends (answered, failed or abandoned).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.datastructures import Headers

from ..stamps import SseStamper

#: What a stream event becomes: sent as it came, sent re-encoded (a hook changed it in place),
#: or not sent (the usage chunk only the sidecar asked for).
Verdict = Literal["send", "edited", "drop"]
#: Whether a decoded stream event is an output's final chunk (the stamps go into it); None: none is.
IsFinal = Callable[[dict[str, Any]], bool] | None
#: Called with a stream's output-token spans when its stamp event is made.
OnSpans = Callable[[list[dict[str, int]] | None], None]


@dataclass
class ModelRequest:
    """One model request on its way through the features (changed by their hooks).

    Attributes:
        path: the engine route.
        headers: the client's headers.
        payload: the decoded JSON body (None: not JSON), changed in place by the features.
        request_id: the ``X-Request-Id`` the engine is to see (the client's, unless a feature names another).
        changed: whether the body changed (it is encoded again before it is forwarded).
        want_spans: whether a feature needs the answer's per-token version spans.
    """

    path: str
    headers: Headers
    payload: Any
    request_id: str | None
    changed: bool = False
    want_spans: bool = False


class RequestUse:
    """One feature's part in one admitted request; every hook does nothing unless overridden."""

    #: False once the request needs nothing more of this feature (its later hooks are not called).
    active = True

    def admitted(self, request: ModelRequest, start: int, claims: int) -> None:
        """The request was admitted under version ``start`` with the gate's ``claims`` (its body is not yet sent)."""

    def stamper(
        self, start: int, end: Callable[[], int | None], final: IsFinal, on_spans: OnSpans
    ) -> SseStamper | None:
        """The stream's stamper, when this feature stamps streams its own way (None: the plain one);
        ``on_spans`` is to be called with the stream's spans when its stamp event is made."""
        return None

    async def on_answer(self, answer: Any) -> None:
        """A whole answer the engine gave with success (decoded JSON, None if not JSON), changed in place."""

    async def on_event(self, data: bytes, decoded: Any, stamper: SseStamper) -> Verdict:
        """One stream event's data (``[DONE]`` included) and its decoded JSON (None if none)."""
        return "send"

    async def at_end(self, stamper: SseStamper) -> None:
        """The engine's stream ended (with or without ``[DONE]``), before the stamper's last bytes."""

    def on_spans(self, spans: list[dict[str, int]] | None, stamper: SseStamper) -> None:
        """The stream's stamp event is being made; ``spans`` are its output tokens' version spans."""

    def on_release(self) -> None:
        """The request ended."""


class RequestFeature:
    """One power of the request path (see the module docstring)."""

    async def open(self, request: ModelRequest) -> RequestUse | None:
        """This feature's part in ``request`` (None: the request does not use it).

        Raises:
            SidecarError: the request asks for it in a malformed way (answered 4xx).
        """
        return None
