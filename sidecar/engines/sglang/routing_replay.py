"""Routing replay on SGLang: the engine's own ``routed_experts``, tagged with weight versions (sidecar process).

The request fields and the answer's format are those of :mod:`...routed_experts` (the vLLM path).
On SGLang the routing is SGLang's own: the request's ``return_routed_experts`` and
``routed_experts_start_len`` go to the engine, whose scheduler captures the rows during
generation (on the CPU through stitchboard's capturer, :mod:`.routing`) and
answers ``sglext.routed_experts`` (a stream: in a final chunk of its own), passed on as it came.
The sidecar adds, top-level (a stream: in its stamp event), ``routed_experts_weight_versions``
over those rows and ``routed_experts_start_len``, from the answer's per-token ``weight_versions``
(:mod:`...spans`, asked for on the client's behalf, so the answer carries them too): the row that
made output token ``o`` is row ``prompt_tokens - 1 + o`` and the prompt rows were routed by the
prefill pass, which made output token 0, so a request that crossed no commit has all its rows
under the version of its one span. SGLang's radix cache keys
on ``cache_salt``: a request that wants rows of its prompt gets a salt unique to it (a client's
own salt kept in front), so that its prompt is computed in this request, not read from the
cache (rows of cached positions are not routed in this request). Only a prompt of token ids
with ``routed_experts_start_len >= len(prompt)`` keeps the cache.

A request running across a commit is retracted in the pause and, on resume, computes its whole
sequence again under the new weights (:mod:`.adapter`); stitchboard's loader keeps
the first routing of every position through that recompute (:mod:`.routing`), so
the rows before the engine's count at the pause are the old version's, the routing those tokens
were sampled from, and carry its version, as on vLLM.
"""

from __future__ import annotations

import uuid
from typing import Any

from ...routed_experts import ERROR_FIELD, START_LEN_FIELD, VERSIONS_FIELD, WANT_FIELD

SALT_MARK = "stitch-routing"


def row_versions(
    spans: list[dict[str, int]] | None, prompt_tokens: int, completion_tokens: int, start_len: int
) -> list[dict[str, int]] | None:
    """``[{"version", "start", "end"}]`` over the rows ``[start_len, prompt_tokens +
    completion_tokens - 1)`` (row ``r`` = position ``start_len + r``) from the output tokens'
    spans (None without spans): span ``[s, e)`` of output tokens covers positions
    ``[prompt_tokens - 1 + s, prompt_tokens - 1 + e)``, the first span the prompt's positions too."""
    if not spans:
        return None
    end, shift = prompt_tokens + completion_tokens - 1, prompt_tokens - 1
    start_len = min(start_len, max(end, 0))
    rows = []
    for i, span in enumerate(spans):
        lo, hi = max(0 if i == 0 else shift + span["start"], start_len), min(shift + span["end"], end)
        if hi > lo:
            rows.append({"version": span["version"], "start": lo - start_len, "end": hi - start_len})
    return rows


class SglangRoutedExperts:
    """The routing of one admitted SGLang request that asked for it (proxy side; event-loop only).

    Args:
        start_len: ``routed_experts_start_len`` (from :func:`...routed_experts.wants_routing`).
        payload: the decoded request body: gets the two fields back for SGLang, and a unique
            ``cache_salt`` when the prompt must be routed in this request.
    """

    def __init__(self, start_len: int, payload: dict[str, Any]) -> None:
        self.start_len = start_len
        self.usage: tuple[int, int] | None = None
        payload[WANT_FIELD] = True
        if start_len:
            payload[START_LEN_FIELD] = start_len
        prompt = payload.get("prompt")
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and start_len >= len(prompt)):
            own, salt = payload.get("cache_salt"), f"{SALT_MARK}-{uuid.uuid4().hex}"
            payload["cache_salt"] = f"{own}|{salt}" if isinstance(own, str) and own else salt

    def see_event(self, event: Any) -> None:
        """Read one decoded stream event (the usage chunk gives the lengths)."""
        usage = event.get("usage") if isinstance(event, dict) else None
        if (
            isinstance(usage, dict)
            and isinstance(usage.get("prompt_tokens"), int)
            and isinstance(usage.get("completion_tokens"), int)
        ):
            self.usage = usage["prompt_tokens"], usage["completion_tokens"]

    def fields(self, spans: list[dict[str, int]] | None) -> dict[str, Any]:
        """The top-level routing fields for the output tokens' ``spans`` (after the stream's usage)."""
        fields: dict[str, Any] = {START_LEN_FIELD: self.start_len, VERSIONS_FIELD: None}
        if self.usage is None or not spans:
            fields[ERROR_FIELD] = (
                "the engine did not report the answer's length"
                if self.usage is None
                else "the answer carries no weight versions"
            )
            return fields
        fields[VERSIONS_FIELD] = row_versions(spans, *self.usage, self.start_len)
        return fields

    def attach(self, answer: Any) -> None:
        """Add the routing fields to a decoded JSON answer carrying ``weight_versions`` (in place)."""
        if not isinstance(answer, dict):
            return
        self.see_event(answer)
        answer.update(self.fields(answer.get("weight_versions")))
        sglext = answer.get("sglext")
        if not (isinstance(sglext, dict) and sglext.get("routed_experts")):
            answer["sglext"] = {**(sglext if isinstance(sglext, dict) else {}), "routed_experts": None}
            answer.setdefault(
                ERROR_FIELD,
                "the engine returned no routed_experts (was it started without stitchboard's loader, or before the "
                "sidecar's first call?)",
            )
