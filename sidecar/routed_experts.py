"""Routing replay: the experts each token was routed to, returned with the answer (sidecar process, vLLM).

A request asks with the body field ``return_routed_experts: true`` (SGLang's name) or the
header ``X-Stitch-Return-Routed-Experts: 1``, on ``/v1/completions`` or ``/v1/chat/completions``,
one output per request (``n`` 1, one prompt). ``routed_experts_start_len`` (SGLang's name and
meaning; default 0) is the first position returned. Both fields are removed before the request is
forwarded. The answer carries, as SGLang's OpenAI server does, ``sglext.routed_experts``: base64
of the int32 expert ids, C order, shape ``[prompt_tokens + completion_tokens - 1 -
routed_experts_start_len, num_hidden_layers, num_experts_per_tok]``: row ``r`` is the routing of
the forward pass that read the token at position ``routed_experts_start_len + r`` (prompt
tokens, then output tokens; the last output token is never read). Next to it, top-level:

* ``routed_experts_weight_versions``: ``[{"version", "start", "end"}]`` over those rows (half-open,
  in order): the weight version the engine held when it routed them, per forward pass;
* ``routed_experts_start_len``; ``routed_experts_error`` (only when the routing could not be had:
  then ``sglext.routed_experts`` is null).

A stream carries all of it in its stamp event (the last event before ``[DONE]``, ``choices: []``),
as SGLang's streams send ``sglext`` in a final chunk of their own. The sidecar asks for the
stream's usage (``stream_options.include_usage``) to learn the output's length; a usage chunk
the client did not ask for is not sent on.

The routing is captured inside vLLM during generation (:mod:`.engines.vllm.routing`; the
request is marked in its ``X-Request-Id``) and collected from the worker when the answer is
complete; it is never recomputed. Prompt tokens served from the prefix cache were not routed in
this request, so a request that wants rows of its prompt gets a ``cache_salt`` unique to it (a
client's own salt is kept in front): its prompt is computed, not read from the cache. Only a
prompt of token ids with ``routed_experts_start_len >= len(prompt) - 1`` keeps the cache (vLLM
always computes a prompt's last token). A model without MoE layers is refused (400 naming it).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable, Mapping
from typing import Any

from stitchboard.proto.sidecar_wire import ROUTING_ERROR_FIELD as ERROR_FIELD  # the wire's names (RoutingReplay)
from stitchboard.proto.sidecar_wire import ROUTING_START_LEN_FIELD as START_LEN_FIELD
from stitchboard.proto.sidecar_wire import ROUTING_VERSIONS_FIELD as VERSIONS_FIELD
from stitchboard.proto.sidecar_wire import ROUTING_WANT_FIELD as WANT_FIELD
from stitchboard.proto.sidecar_wire import ROUTING_WANT_HEADER as WANT_HEADER

from .engines.contract import new_routing_mark
from .errors import RoutedExpertsRefusedError

log = logging.getLogger("stitchboard.sidecar.routed_experts")

ROUTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def wants_routing(headers: Mapping[str, str], payload: Any, path: str) -> int | None:
    """``routed_experts_start_len`` when the request asks for its routing (header or body field),
    else None; removes both fields from ``payload`` (a decoded JSON body, changed in place).

    Raises:
        RoutedExpertsRefusedError: a malformed field or header, a route without routing, or
            several outputs in one request.
    """
    body = payload if isinstance(payload, dict) else {}
    value, start_len = body.pop(WANT_FIELD, None), body.pop(START_LEN_FIELD, None)
    if value is not None and not isinstance(value, bool):
        raise RoutedExpertsRefusedError(f"{WANT_FIELD} must be true or false, got {value!r}")
    header = headers.get(WANT_HEADER)
    if header is not None and header.strip().lower() not in _FLAGS:
        raise RoutedExpertsRefusedError(f"X-Stitch-Return-Routed-Experts must be 1 or 0, got {header!r}")
    if not (value or (header is not None and _FLAGS[header.strip().lower()])):
        return None
    if start_len is None:
        start_len = 0
    if type(start_len) is not int or start_len < 0:
        raise RoutedExpertsRefusedError(f"{START_LEN_FIELD} must be an integer >= 0, got {start_len!r}")
    if not isinstance(payload, dict):
        raise RoutedExpertsRefusedError(f"{WANT_FIELD} needs a JSON request body")
    if path not in ROUTED_PATHS:
        raise RoutedExpertsRefusedError(f"{WANT_FIELD} is served on {', '.join(sorted(ROUTED_PATHS))}, not on {path}")
    prompt = body.get("prompt")
    if body.get("n", 1) not in (1, None) or (
        isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)
    ):
        raise RoutedExpertsRefusedError(
            f"{WANT_FIELD}: one output per request (n 1, one prompt); send the prompts as separate requests"
        )
    return start_len


class RoutingSource:
    """The engine's routing, fetched for the proxy (one per app).

    Args:
        fetch: the adapter's ``routed_experts(marks)`` (blocking; run in a thread).
        timeout_s: how long one fetch may take, seconds.
    """

    def __init__(self, fetch: Callable[[list[str]], dict[str, Any]], timeout_s: float) -> None:
        self.fetch, self.timeout_s = fetch, timeout_s
        self._moe: tuple[bool, str] | None = None

    async def _call(self, marks: list[str]) -> dict[str, Any]:
        return await asyncio.wait_for(asyncio.to_thread(self.fetch, marks), self.timeout_s)

    async def require_moe(self) -> None:
        """Refuse routing for a model without MoE layers (asked of the engine once).

        Raises:
            RoutedExpertsRefusedError: the served model has no MoE router.
            EngineUnavailableError, EngineRequestError: the engine could not be asked.
        """
        if self._moe is None:
            report = await self._call([])
            self._moe = (bool(report.get("moe")), str(report.get("model")))
        moe, model = self._moe
        if not moe:
            raise RoutedExpertsRefusedError(
                f"the model {model!r} has no mixture-of-experts layers: {WANT_FIELD} is served only for MoE models",
                model=model,
            )

    async def take(self, mark: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The engine's report and the routing of request ``mark`` (None: none captured)."""
        report = await self._call([mark])
        return report, (report.get("requests") or {}).get(mark)


def _usage(answer: Any) -> tuple[int, int] | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if (
        isinstance(usage, dict)
        and isinstance(usage.get("prompt_tokens"), int)
        and isinstance(usage.get("completion_tokens"), int)
    ):
        return usage["prompt_tokens"], usage["completion_tokens"]
    return None


def routed_fields(
    report: dict[str, Any], routing: dict[str, Any] | None, start_len: int, usage: tuple[int, int] | None
) -> dict[str, Any]:
    """The answer's fields (see the module docstring) from the worker's capture of one request.

    Args:
        report: the worker's answer (``num_layers``, ``top_k``).
        routing: the request's capture (``start``, ``rows`` base64 int32 [n, layers, top_k] from
            position ``start``, ``versions`` ``[version, start, end]`` position spans), or None.
        start_len: the first position asked for.
        usage: the answer's ``(prompt_tokens, completion_tokens)``.
    """
    fields: dict[str, Any] = {"sglext": {"routed_experts": None}, START_LEN_FIELD: start_len, VERSIONS_FIELD: None}
    if usage is None or routing is None or "error" in routing:
        fields[ERROR_FIELD] = (
            "the engine did not report the answer's length"
            if usage is None
            else (routing or {}).get("error", "the engine captured no routing for this request")
        )
        return fields
    end = sum(usage) - 1  # rows [start_len, end): the last output token is never read
    start_len = fields[START_LEN_FIELD] = min(start_len, max(end, 0))
    first, row_bytes = int(routing["start"]), 4 * int(report["num_layers"]) * int(report["top_k"])
    rows = base64.b64decode(routing["rows"])
    if first > start_len or first + len(rows) // row_bytes < end:
        fields[ERROR_FIELD] = (
            f"the engine routed positions {first}..{first + len(rows) // row_bytes - 1} in this request, not all of "
            f"{start_len}..{end - 1}"
        )
        return fields
    fields["sglext"]["routed_experts"] = base64.b64encode(
        rows[(start_len - first) * row_bytes : (end - first) * row_bytes]
    ).decode()
    spans = []
    for version, begin, stop in routing["versions"]:
        lo, hi = max(begin, start_len), min(stop, end)
        if hi > lo:
            spans.append({"version": version, "start": lo - start_len, "end": hi - start_len})
    fields[VERSIONS_FIELD] = spans
    return fields


class RoutedExperts:
    """The routing of one admitted request that asked for it (proxy side; event-loop only).

    Args:
        source: the app's :class:`RoutingSource`.
        start_len: ``routed_experts_start_len``.
        payload: the decoded request body (gets a unique ``cache_salt`` when the prompt must be
            routed in this request, and ``stream_options.include_usage`` for a stream).
        client_id: the client's ``X-Request-Id``, kept in front of the mark.
    """

    def __init__(self, source: RoutingSource, start_len: int, payload: dict[str, Any], client_id: str | None) -> None:
        self.source, self.start_len = source, start_len
        self.mark = new_routing_mark()
        self.request_id = f"{client_id}-{self.mark}" if client_id else self.mark
        self.strip_usage = False
        self.usage: tuple[int, int] | None = None
        prompt = payload.get("prompt")
        cached_ok = (
            isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and start_len >= len(prompt) - 1
        )
        if not cached_ok:
            own = payload.get("cache_salt")
            payload["cache_salt"] = f"{own}|{self.mark}" if isinstance(own, str) and own else self.mark
        if payload.get("stream"):
            opts = payload.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage")):
                payload["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
                self.strip_usage = True

    def see_event(self, event: Any) -> bool:
        """Read one decoded stream event; returns whether it is sent on (False: the usage chunk
        only the sidecar asked for)."""
        if isinstance(event, dict) and isinstance(event.get("usage"), dict) and event.get("choices") == []:
            self.usage = _usage(event)
            return not self.strip_usage
        return True

    async def fields(self, answer: Any = None) -> dict[str, Any]:
        """The routing fields of the answer (``answer``: a JSON answer; None: a stream, whose usage
        chunk was seen); the worker forgets the request's routing."""
        usage = _usage(answer) if answer is not None else self.usage
        try:
            report, routing = await self.source.take(self.mark)
        except Exception as exc:  # noqa: BLE001 - the answer still goes out, saying why it has no routing
            log.warning("routed experts of %s not collected: %r", self.mark, exc)
            return {
                "sglext": {"routed_experts": None},
                START_LEN_FIELD: self.start_len,
                VERSIONS_FIELD: None,
                ERROR_FIELD: f"the engine's routing could not be collected: {exc}",
            }
        return routed_fields(report, routing, self.start_len, usage)

    async def attach(self, answer: Any) -> None:
        """Add the routing fields to a decoded JSON answer (in place)."""
        if isinstance(answer, dict):
            sglext = answer.get("sglext")
            own: dict[str, Any] = sglext if isinstance(sglext, dict) else {}
            extra = await self.fields(answer)
            answer.update(extra)
            answer["sglext"] = {**own, **extra["sglext"]}
