"""Response stamps (DESIGN.md invariant 8): JSON answers and SSE streams.

``weight_version_start`` is the applied version when the request was admitted,
``weight_version_end`` the applied version when it completed.

* A JSON object answer gets both as top-level fields; a JSON list answer (SGLang's batched
  ``/generate``) gets them in each of its objects.
* A stream is forwarded event by event as soon as each is complete (nothing else is buffered)
  and stamped once at its end: one extra event just before ``data: [DONE]`` (shaped like the
  stream's chunks: ``id``, ``object``, ``created``, ``model`` and ``choices: []`` when they
  have them) carrying both stamps. Streams whose chunks say when an output is finished
  (SGLang's native ``/generate``: ``meta_info.finish_reason`` set) get the stamps in that
  final chunk instead, and no extra event (their clients read every event as an output).
* A stream the engine broke off, or whose answer the sidecar cannot vouch for, ends with the
  stamp event (unless sent) and an error event ``data: {"error": {...}}`` (which the OpenAI
  clients raise as ``APIError``); no ``[DONE]`` follows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from stitchboard.proto.sidecar_wire import END_FIELD, START_FIELD

_EVENT_END = re.compile(rb"\r?\n\r?\n")


def stamp_answer(answer: Any, start: int, end: int | None) -> bool:
    """Add both stamps to a decoded JSON answer (an object, or each object of a list) in place;
    returns whether anything was stamped."""
    items = answer if isinstance(answer, list) else [answer]
    stamped = False
    for item in items:
        if isinstance(item, dict):
            item[START_FIELD], item[END_FIELD] = start, end
            stamped = True
    return stamped


def event_data(event: bytes) -> bytes | None:
    """The payload of one SSE ``data:`` event (``b"[DONE]"`` included), or None for other events."""
    data = event.strip()
    return data[5:].strip() if data.startswith(b"data:") else None


def _loads(data: bytes | None) -> Any:
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SseStamper:
    """Splits an SSE stream into complete events and stamps it (see the module docstring).

    Args:
        start: the start stamp.
        end: returns the end stamp (the applied version now).
        is_final: when given, a decoded event for which it is true is stamped in place (and the
            stream gets no extra stamp event).
    """

    def __init__(
        self, start: int, end: Callable[[], int | None], is_final: Callable[[dict[str, Any]], bool] | None = None
    ) -> None:
        self.start, self.end, self.is_final = start, end, is_final
        self.buf = b""
        self.last_data: bytes | None = None
        self.stamped = False
        self.extra: dict[str, Any] = {}  # more fields for the stamp event (set before it is made)

    def split(self, chunk: bytes) -> list[bytes]:
        """The events ``chunk`` completes (each with its terminator); the rest is kept."""
        self.buf += chunk
        out = []
        while (m := _EVENT_END.search(self.buf)) is not None:
            out.append(self.buf[: m.end()])
            self.buf = self.buf[m.end() :]
        return out

    def emit(self, event: bytes, decoded: Any = None) -> bytes:
        """Bytes to send for one complete event (``decoded``: its payload as JSON, if the caller
        decoded it already)."""
        data = event_data(event)
        if data == b"[DONE]":
            return (b"" if self.stamped else self._stamp_event()) + event
        if data is None:
            return event
        self.last_data = data
        if self.is_final is not None:
            obj = decoded if decoded is not None else _loads(data)
            if isinstance(obj, dict) and self.is_final(obj):
                obj[START_FIELD], obj[END_FIELD] = self.start, self.end()
                self.stamped = True
                return _event(obj)
        return event

    def _stamp_event(self) -> bytes:
        self.stamped = True
        last = _loads(self.last_data)
        shape: dict[str, Any] = {}
        if isinstance(last, dict):
            shape = {k: last[k] for k in ("id", "object", "created", "model") if k in last}
            if "choices" in last:
                shape["choices"] = []
        return _event({**shape, **self.extra, START_FIELD: self.start, END_FIELD: self.end()})

    def finish(self) -> bytes:
        """Bytes to send at the end of the stream (the rest, and the stamp if none was sent)."""
        rest, self.buf = self.buf, b""
        return rest + (
            b"" if self.stamped else (b"\n\n" if rest and not rest.endswith(b"\n\n") else b"") + self._stamp_event()
        )

    def error(self, message: str, type_: str, code: int) -> bytes:
        """Bytes that end the stream with an error: the stamp (unless sent), then an error event
        shaped as OpenAI's (clients raise it); an incomplete event is dropped."""
        self.buf = b""
        stamp = b"" if self.stamped else self._stamp_event()
        return stamp + _event({"error": {"message": message, "type": type_, "code": code}})
