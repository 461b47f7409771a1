"""Per-token version spans: which weight version produced each output token of an answer (sidecar process).

A request asks for them with the body field ``return_weight_versions: true`` (vLLM's name) or
the header ``X-Stitch-Return-Weight-Versions: 1``; the field is removed before the request is
forwarded. Its answer then carries ``weight_versions: [{"version", "start", "end"}]`` over its
output tokens (half-open ``[start, end)``, in order, covering ``0..n``), next to
``weight_version_start`` / ``weight_version_end``: top-level in a JSON answer, in the stamp event
of an OpenAI stream, in the final chunk of SGLang's ``/generate`` stream.

Where they come from:

* **SGLang** reports its own spans (``meta_info.weight_versions`` / ``metadata.weight_versions``,
  versions as strings) for an output that crossed an update: they are passed on with integer
  versions; an output that reports no spans was made under one version, its ``weight_version``.
* **vLLM** (0.32 has no spans): the sidecar marks the request (``X-Request-Id`` holding
  ``stitch-<32 hex>``) and, at every commit, reads inside the paused engine how many output
  tokens each marked request has generated (:mod:`.engines.vllm.token_counts`); that count is
  the boundary of the new version's span. A request the engine has not started counts 0.

A flip (an empty delta: the same bits under a new number) adds no boundary: the span names the
version whose bits made the tokens. One output per request (``n`` 1, one prompt) when asking for
spans on vLLM; SGLang's OpenAI streams report no versions, so a stream that crossed a commit
there carries ``weight_versions: null``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .answer_versions import parse_version
from .errors import InvalidVersionConstraintError
from .stamps import SseStamper

WANT_FIELD = "return_weight_versions"
WANT_HEADER = "x-stitch-return-weight-versions"
SPANS_FIELD = "weight_versions"
_TRUE = {"1", "true", "yes", "on"}


def wants_spans(headers: Mapping[str, str], payload: Any, counted: bool) -> bool:
    """Whether a request asks for spans (header or body field); removes the field from ``payload``.

    Args:
        headers: the request's headers.
        payload: its decoded JSON body (changed in place) or None.
        counted: the spans come from the engine's counts (vLLM): one output per request only.

    Raises:
        InvalidVersionConstraintError: the field is not a boolean, the header not a flag, or a
            counted request asks for several outputs.
    """
    value = payload.pop(WANT_FIELD, None) if isinstance(payload, dict) else None
    if value is not None and not isinstance(value, bool):
        raise InvalidVersionConstraintError(f"{WANT_FIELD} must be true or false, got {value!r}")
    header = headers.get(WANT_HEADER)
    if header is not None and header.strip().lower() not in _TRUE | {"0", "false", "no", "off"}:
        raise InvalidVersionConstraintError(f"X-Stitch-Return-Weight-Versions must be 1 or 0, got {header!r}")
    want = bool(value) or (header is not None and header.strip().lower() in _TRUE)
    if want and counted and not single_output(payload):
        raise InvalidVersionConstraintError(f"{WANT_FIELD}: one output per request (n 1, one prompt); send the prompts as separate requests")
    return want


def single_output(payload: Any) -> bool:
    """Whether an OpenAI request body asks for one output (``n`` 1 and one prompt)."""
    if not isinstance(payload, dict) or payload.get("n", 1) not in (1, None):
        return False
    prompt = payload.get("prompt")
    return not (isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt))


def build_spans(start: int, boundaries: list[tuple[int, int]], n: int) -> list[dict[str, int]]:
    """Spans over ``n`` output tokens of a request admitted at version ``start``.

    Args:
        start: the version applied at admission.
        boundaries: ``(version, count)`` per commit while the request ran, in order: from
            output token ``count`` on, tokens were made under ``version``.
        n: the number of output tokens of the answer.
    """
    spans: list[dict[str, int]] = []
    version, begin = start, 0
    for new, count in boundaries:
        cut = max(begin, min(count, n))
        if cut > begin:
            spans.append({"version": version, "start": begin, "end": cut})
        version, begin = new, cut
    if n > begin or not spans:
        spans.append({"version": version, "start": begin, "end": n})
    return spans


def engine_spans(info: Any, n: int | None) -> list[dict[str, int]] | None:
    """SGLang's spans of one output (its ``meta_info`` / ``metadata``) as integer versions; or one
    span of its ``weight_version`` over ``n`` tokens; None when it names no version."""
    if not isinstance(info, dict):
        return None
    spans = info.get(SPANS_FIELD)
    if isinstance(spans, list) and spans:
        out: list[dict[str, int]] = []
        for span in spans:
            version = parse_version(span.get("version")) if isinstance(span, dict) else None
            if version is None or not isinstance(span.get("start"), int) or not isinstance(span.get("end"), int):
                return None
            out.append({"version": version, "start": span["start"], "end": span["end"]})
        return out
    version = parse_version(info.get("weight_version"))
    if version is None or n is None:
        return None
    return [{"version": version, "start": 0, "end": n}]


def completion_tokens(answer: Any) -> int | None:
    """``usage.completion_tokens`` of an OpenAI answer or chunk, else ``meta_info.completion_tokens``."""
    if not isinstance(answer, dict):
        return None
    for info in (answer.get("usage"), answer.get("meta_info")):
        if isinstance(info, dict) and isinstance(info.get("completion_tokens"), int):
            return int(info["completion_tokens"])
    return None


@dataclass
class _Open:
    start: int
    boundaries: list[tuple[int, int]] = field(default_factory=list)


class SpanLedger:
    """The marked requests in flight and the commits they crossed (one per app; event-loop only)."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}

    def open(self, start: int, client_id: str | None = None) -> str:
        """Register a request admitted at ``start``; returns the ``X-Request-Id`` to send the engine
        (the client's own id, if any, with the mark appended)."""
        mark = f"stitch-{uuid.uuid4().hex}"
        self._open[mark] = _Open(start)
        return f"{client_id}-{mark}" if client_id else mark

    def wanted(self) -> bool:
        """Whether any marked request is in flight (the commit then reads the engine's counts)."""
        return bool(self._open)

    def commit(self, version: int, counts: Mapping[str, int] | None) -> None:
        """Record a commit to ``version``: each open request's output-token count at the pause
        (``counts`` by mark; absent: not started, 0; None: the engine could not count, and the
        open requests get no spans)."""
        for mark, entry in self._open.items():
            entry.boundaries.append((version, -1 if counts is None else counts.get(mark, 0)))

    def close(self, request_id: str, n: int | None) -> list[dict[str, int]] | None:
        """Forget the request; its spans over ``n`` output tokens (None: ``n`` unknown)."""
        entry = self._open.pop(request_id[-39:], None)
        if entry is None or n is None or any(count < 0 for _, count in entry.boundaries):
            return None
        return build_spans(entry.start, entry.boundaries, n)


class Spans:
    """The spans of one admitted request that asked for them (proxy side; event-loop only).

    Args:
        ledger: the app's ledger (vLLM: the request is registered and marked).
        engine_reports: the engine reports its own spans (SGLang).
        start: the version applied at admission.
        path: the engine route.
        payload: the decoded request body (a stream gets ``stream_options.include_usage`` so the
            sidecar learns the output's length; the usage chunk is then not sent on).
        client_id: the client's ``X-Request-Id``, kept in front of the mark.
    """

    def __init__(self, ledger: SpanLedger, engine_reports: bool, start: int, path: str, payload: Any, client_id: str | None) -> None:
        self.ledger, self.engine_reports, self.start = ledger, engine_reports, start
        self.request_id = None if engine_reports else ledger.open(start, client_id)
        self.changed_body = self.strip_usage = False
        self.n: int | None = None
        if isinstance(payload, dict) and payload.get("stream") and path.startswith("/v1/"):
            opts = payload.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage")):
                payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                self.strip_usage = self.changed_body = True

    def forget(self) -> None:
        """The request ended: drop it from the ledger."""
        if self.request_id is not None:
            self.ledger.close(self.request_id, None)

    def _engine_item(self, item: Any) -> None:
        if isinstance(item, dict):
            info = item.get("meta_info") if isinstance(item.get("meta_info"), dict) else item.get("metadata")
            item[SPANS_FIELD] = engine_spans(info, completion_tokens(item))

    def attach(self, answer: Any) -> None:
        """Add ``weight_versions`` to a decoded JSON answer (each output of an SGLang batch)."""
        if self.engine_reports:
            for item in answer if isinstance(answer, list) else [answer]:
                self._engine_item(item)
        elif isinstance(answer, dict) and self.request_id is not None:
            answer[SPANS_FIELD] = self.ledger.close(self.request_id, completion_tokens(answer))

    def see_event(self, event: Any) -> bool:
        """Read one decoded stream event (its length; SGLang's final chunk gets its spans); returns
        whether it is sent on (False: the usage chunk only the sidecar asked for)."""
        if not isinstance(event, dict):
            return True
        info = event.get("meta_info")
        if self.engine_reports and isinstance(info, dict) and info.get("finish_reason") is not None:
            self._engine_item(event)
        if isinstance(event.get("usage"), dict) and event.get("choices") == []:
            self.n = completion_tokens(event)
            return not self.strip_usage
        return True

    def streamed(self, end: int | None) -> list[dict[str, int]] | None:
        """The spans for a stream's stamp event (``end``: the end stamp)."""
        if self.request_id is not None:
            return self.ledger.close(self.request_id, self.n)
        return build_spans(self.start, [], self.n) if self.n is not None and end == self.start else None


class SpanStamper(SseStamper):
    """An :class:`~.stamps.SseStamper` whose stamp event also carries ``weight_versions``
    (``spans()`` is called when the stamp event is made, at the end of the stream)."""

    def __init__(self, start: int, end: Callable[[], int | None], is_final: Callable[[dict[str, Any]], bool] | None, spans: Callable[[], list[dict[str, int]] | None]) -> None:
        super().__init__(start, end, is_final)
        self.spans = spans

    def _stamp_event(self) -> bytes:
        obj = json.loads(super()._stamp_event()[5:])
        obj[SPANS_FIELD] = self.spans()
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
