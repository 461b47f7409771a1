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

* **SGLang's OpenAI streams** carry no versions in their chunks: a streamed ``/v1/completions``
  or ``/v1/chat/completions`` request is counted like vLLM's, the counts read by stitchboard's
  loader inside the paused engine (:mod:`.engines.sglang.token_counts`). One with one output is
  marked by its body's ``rid`` (the client's own rid kept in front). One with several outputs
  (``n`` > 1, or several prompts: SGLang 0.5.23 gives each output a fresh random rid) is marked
  in its body's ``custom_params`` (:data:`~.engines.sglang.token_counts.MARK_PARAM`, the client's
  own params kept), which SGLang copies to every output; the engine tells the outputs apart by
  the order they reach its scheduler, which is the choice order.

A request with several outputs (``n`` > 1, or several prompts of one completion) gets spans per
output: each choice carries its own ``weight_versions`` (the answer's top-level one is then
null; a stream's stamp event carries ``choices: [{"index", "weight_versions"}]``). On vLLM each
output is a request of its own in the engine, counted on its own; the sidecar asks for
``return_token_ids`` to learn each choice's length (and takes them out again unless the client
asked for them).

A flip (an empty delta: the same bits under a new number) adds no boundary: the span names the
version whose bits made the tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stitchboard.proto.sidecar_wire import SPANS_FIELD  # the wire's names (VersionSpan)
from stitchboard.proto.sidecar_wire import SPANS_WANT_FIELD as WANT_FIELD
from stitchboard.proto.sidecar_wire import SPANS_WANT_HEADER as WANT_HEADER

from .answer_versions import parse_version
from .engines.contract import MARK_PARAM, new_mark
from .errors import InvalidVersionConstraintError
from .stamps import SseStamper

#: SGLang routes whose streams are counted (the engine's own spans are not in their chunks).
COUNTED_SGLANG_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_TRUE = {"1", "true", "yes", "on"}


def wants_spans(headers: Mapping[str, str], payload: Any) -> bool:
    """Whether a request asks for spans (header or body field); removes the field from ``payload``.

    Args:
        headers: the request's headers.
        payload: its decoded JSON body (changed in place) or None.

    Raises:
        InvalidVersionConstraintError: the field is not a boolean or the header not a flag.
    """
    value = payload.pop(WANT_FIELD, None) if isinstance(payload, dict) else None
    if value is not None and not isinstance(value, bool):
        raise InvalidVersionConstraintError(f"{WANT_FIELD} must be true or false, got {value!r}")
    header = headers.get(WANT_HEADER)
    if header is not None and header.strip().lower() not in _TRUE | {"0", "false", "no", "off"}:
        raise InvalidVersionConstraintError(f"X-Stitch-Return-Weight-Versions must be 1 or 0, got {header!r}")
    return bool(value) or (header is not None and header.strip().lower() in _TRUE)


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
    choices: int  # outputs per prompt (``n``)
    boundaries: list[tuple[int, dict[str, int] | None]] = field(default_factory=list)


class SpanLedger:
    """The marked requests in flight and the commits they crossed (one per app; event-loop only).

    The engine counts each output of a marked request under ``<mark>:<prompt>:<choice>``
    (:func:`~.engines.vllm.token_counts.output_key`); an OpenAI answer's choice ``i`` is the
    output ``(i // n, i % n)``.
    """

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}

    def open(self, start: int, client_id: str | None = None, choices: int = 1) -> str:
        """Register a request admitted at ``start`` with ``choices`` outputs per prompt; returns the
        ``X-Request-Id`` to send the engine (the client's own id, if any, with the mark appended)."""
        mark = new_mark()
        self._open[mark] = _Open(start, max(1, choices))
        return f"{client_id}-{mark}" if client_id else mark

    def wanted(self) -> bool:
        """Whether any marked request is in flight (the commit then reads the engine's counts)."""
        return bool(self._open)

    def commit(self, version: int, counts: Mapping[str, int] | None) -> None:
        """Record a commit to ``version``: each open request's output-token counts at the pause
        (``counts`` by output key; an output absent: not started, 0; None: the engine could not
        count, and the open requests get no spans)."""
        mine: dict[str, dict[str, int]] = {mark: {} for mark in self._open}
        for key, count in (counts or {}).items():
            mark, _, output = key.partition(":")
            if mark in mine:
                mine[mark][output] = count
        for mark, entry in self._open.items():
            entry.boundaries.append((version, None if counts is None else mine[mark]))

    def close(self, request_id: str, lengths: Mapping[int, int] | None) -> dict[int, list[dict[str, int]]] | None:
        """Forget the request; the spans of each of its outputs, by choice index, over
        ``lengths`` (choice index -> output tokens; None: unknown, no spans)."""
        entry = self._open.pop(request_id[-39:], None)
        if entry is None or lengths is None or any(counts is None for _, counts in entry.boundaries):
            return None
        out = {}
        for index, n in lengths.items():
            key = f"{index // entry.choices}:{index % entry.choices}"
            out[index] = build_spans(
                entry.start, [(v, counts.get(key, 0)) for v, counts in entry.boundaries if counts is not None], n
            )
        return out


#: What :meth:`Spans.see_event` says of an event: send it as it came, send it re-encoded, or drop it.
SEND, EDITED, DROP = "send", "edited", "drop"
_IDS = ("token_ids", "prompt_token_ids")


class Spans:
    """The spans of one admitted request that asked for them (proxy side; event-loop only).

    Args:
        ledger: the app's ledger (vLLM: the request is registered and marked).
        engine_reports: the engine reports its own spans (SGLang).
        start: the version applied at admission.
        path: the engine route.
        payload: the decoded request body (a stream gets ``stream_options.include_usage`` so the
            sidecar learns the output's length; a request with several outputs gets
            ``return_token_ids``, each choice's length; what the client did not ask for is not sent on).
        client_id: the client's ``X-Request-Id``, kept in front of the mark.
    """

    def __init__(
        self, ledger: SpanLedger, engine_reports: bool, start: int, path: str, payload: Any, client_id: str | None
    ) -> None:
        self.ledger, self.start = ledger, start
        body = payload if isinstance(payload, dict) else {}
        # SGLang's OpenAI streams report no spans: they are counted like vLLM's requests, marked by
        # their rid (one output) or in custom_params (several outputs: each gets a fresh rid).
        counted = engine_reports and bool(body.get("stream")) and path in COUNTED_SGLANG_PATHS
        by_rid = counted and single_output(body) and isinstance(body.get("rid", ""), str)
        by_params = counted and not single_output(body) and isinstance(body.get("custom_params") or {}, dict)
        self.engine_reports = engine_reports and not (by_rid or by_params)
        choices = body["n"] if isinstance(body.get("n"), int) else 1
        self.request_id = (
            None if self.engine_reports else ledger.open(start, body.get("rid") if by_rid else client_id, choices)
        )
        self.multi = not self.engine_reports and not single_output(payload)
        self.changed_body = self.strip_usage = self.strip_ids = False
        self.n: int | None = None
        self.lengths: dict[int, int] = {}
        if by_rid:
            body["rid"] = self.request_id
            self.changed_body = True
        if by_params and self.request_id is not None:
            body["custom_params"] = {**(body.get("custom_params") or {}), MARK_PARAM: self.request_id[-39:]}
            self.changed_body = True
        if not body or not path.startswith("/v1/"):
            return
        if body.get("stream"):
            opts = body.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage")):
                body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                self.strip_usage = self.changed_body = True
        if self.multi and not body.get("return_token_ids"):
            body["return_token_ids"] = True
            self.strip_ids = self.changed_body = True

    def forget(self) -> None:
        """The request ended: drop it from the ledger."""
        if self.request_id is not None:
            self.ledger.close(self.request_id, None)

    def _engine_item(self, item: Any) -> None:
        if isinstance(item, dict):
            info = item.get("meta_info") if isinstance(item.get("meta_info"), dict) else item.get("metadata")
            item[SPANS_FIELD] = engine_spans(info, completion_tokens(item))

    def _strip(self, obj: dict[str, Any]) -> bool:
        # Remove the token ids only the sidecar asked for (the answer's and its choices'); returns whether any were
        # there.
        found = False
        for item in [obj, *(c for c in obj.get("choices") or [] if isinstance(c, dict))]:
            for key in _IDS:
                found = item.pop(key, None) is not None or found
        return found

    def attach(self, answer: Any) -> None:
        """Add ``weight_versions`` to a decoded JSON answer (each output of an SGLang batch; each
        choice of a request with several outputs, the answer's own then None)."""
        if self.engine_reports:
            for item in answer if isinstance(answer, list) else [answer]:
                self._engine_item(item)
            return
        if not isinstance(answer, dict) or self.request_id is None:
            return
        if not self.multi:
            n = completion_tokens(answer)
            spans = self.ledger.close(self.request_id, None if n is None else {0: n})
            answer[SPANS_FIELD] = spans[0] if spans else None
            return
        choices = [c for c in answer.get("choices") or [] if isinstance(c, dict)]
        lengths = {
            c["index"]: len(c["token_ids"])
            for c in choices
            if isinstance(c.get("index"), int) and isinstance(c.get("token_ids"), list)
        }
        per_choice = self.ledger.close(self.request_id, lengths if len(lengths) == len(choices) else None) or {}
        for c in choices:
            c[SPANS_FIELD] = per_choice.get(c.get("index", -1))
        answer[SPANS_FIELD] = None
        if self.strip_ids:
            self._strip(answer)

    def see_event(self, event: Any) -> str:
        """Read one decoded stream event (its length; SGLang's final chunk gets its spans): whether
        it is sent on as it came (:data:`SEND`), changed in place (:data:`EDITED`: token ids only
        the sidecar asked for taken out) or dropped (:data:`DROP`: the usage chunk only it asked for)."""
        if not isinstance(event, dict):
            return SEND
        info = event.get("meta_info")
        if self.engine_reports and isinstance(info, dict) and info.get("finish_reason") is not None:
            self._engine_item(event)
        if isinstance(event.get("usage"), dict) and event.get("choices") == []:
            self.n = completion_tokens(event)
            return DROP if self.strip_usage else SEND
        if self.multi:
            for c in event.get("choices") or []:
                if isinstance(c, dict) and isinstance(c.get("index"), int):
                    ids = c.get("token_ids")
                    self.lengths[c["index"]] = self.lengths.get(c["index"], 0) + (
                        len(ids) if isinstance(ids, list) else 0
                    )
            if self.strip_ids and self._strip(event):
                return EDITED
        return SEND

    def streamed(self, end: int | None) -> tuple[list[dict[str, int]] | None, dict[int, list[dict[str, int]]] | None]:
        """The spans for a stream's stamp event (``end``: the end stamp): the answer's (one
        output), and by choice index (several outputs; else None)."""
        if self.request_id is not None and self.multi:
            return None, self.ledger.close(self.request_id, self.lengths or None) or {}
        if self.request_id is not None:
            spans = self.ledger.close(self.request_id, None if self.n is None else {0: self.n})
            return (spans[0] if spans else None), None
        return (build_spans(self.start, [], self.n) if self.n is not None and end == self.start else None), None


class SpanStamper(SseStamper):
    """An :class:`~.stamps.SseStamper` whose stamp event also carries ``weight_versions`` (and,
    for a request with several outputs, ``choices`` ``[{"index", "weight_versions"}]``);
    ``spans()`` (:meth:`Spans.streamed`) is called when the stamp event is made, at the end of the stream."""

    def __init__(
        self,
        start: int,
        end: Callable[[], int | None],
        is_final: Callable[[dict[str, Any]], bool] | None,
        spans: Callable[[], tuple[list[dict[str, int]] | None, dict[int, list[dict[str, int]]] | None]],
    ) -> None:
        super().__init__(start, end, is_final)
        self.spans = spans

    def _stamp_event(self) -> bytes:
        top, per_choice = self.spans()  # first: it may set ``extra`` (SGLang's routing fields)
        obj = json.loads(super()._stamp_event()[5:])
        obj[SPANS_FIELD] = top
        if per_choice is not None:
            obj["choices"] = [{"index": i, SPANS_FIELD: spans} for i, spans in sorted(per_choice.items())]
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
