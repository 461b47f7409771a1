"""Output-token counts of the requests inside vLLM, read in the worker at a pause (vLLM worker processes).

The sidecar tags a request that asks for per-token version spans with an ``X-Request-Id``
holding a mark (``stitch-`` and 32 hex digits, :data:`MARK`); vLLM 0.32 builds its engine
request ids from it: ``cmpl-<id>-<prompt index>-<8 random>`` per prompt of a completion,
``chatcmpl-<id>-<8 random>`` for a chat, and with ``n`` > 1 one child request per choice,
``<choice>_`` in front. Each output is counted under the key ``<mark>:<prompt>:<choice>``
(:func:`output_key`; ``<mark>:0:0`` for a request with one output). While the engine is paused
no step runs, so the length of each request's ``output_token_ids`` in the model runner is the
number of output tokens generated under the weights held before the commit: the boundary of its spans.

A request that finished inside the engine is dropped from the runner's state at the next step,
possibly before its answer reaches the sidecar: :func:`track_finished` (installed when this
module is imported, as the worker extension does) keeps the final count of the last
:data:`FINISHED_KEPT` finished marked requests, so that such a request counts as finished (all its
tokens before the boundary) rather than as not started (none).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from ..contract import MARK

#: How many finished marked requests' final counts are kept.
FINISHED_KEPT = 4096

_CHILD = re.compile(r"([0-9]+)_")
_finished: OrderedDict[str, int] = OrderedDict()


def output_key(req_id: str) -> str | None:
    """``<mark>:<prompt>:<choice>`` of a vLLM engine request id holding a mark, else None."""
    marks = list(MARK.finditer(req_id))
    if not marks:
        return None
    mark = marks[-1]
    child = _CHILD.match(req_id)
    choice = int(child.group(1)) if child is not None else 0
    base = req_id[child.end() :] if child is not None else req_id
    tail = req_id[mark.end() :].split("-")[1:]  # completions: [prompt index, random]; chat: [random]
    prompt = int(tail[0]) if base.startswith("cmpl-") and tail and tail[0].isdigit() else 0
    return f"{mark.group(0)}:{prompt}:{choice}"


def _remember_finished(runner: Any, scheduler_output: Any) -> None:
    for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
        state = runner.requests.get(req_id)
        key = output_key(req_id)
        if state is not None and key is not None:
            _finished[key] = len(state.output_token_ids)
            _finished.move_to_end(key)
            while len(_finished) > FINISHED_KEPT:
                _finished.popitem(last=False)


def track_finished() -> None:
    """Wrap vLLM's ``GPUModelRunner._update_states`` (the CPU runner inherits it) so that the final
    count of every finished marked request is kept. No-op without vLLM or when already wrapped."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return
    original = GPUModelRunner._update_states
    if getattr(original, "_stitch_tracks_finished", False):
        return

    def update_states(self: Any, scheduler_output: Any) -> Any:
        _remember_finished(self, scheduler_output)
        return original(self, scheduler_output)

    update_states._stitch_tracks_finished = True  # type: ignore[attr-defined]
    GPUModelRunner._update_states = update_states  # type: ignore[method-assign]


def output_counts(runner: Any) -> dict[str, int]:
    """Output key (:func:`output_key`) -> output tokens generated so far, of every marked request
    the model runner holds (running, preempted or waiting for its next step) and of the last finished ones.

    Args:
        runner: the worker's model runner (``worker.model_runner``), read while the engine is paused.
    """
    counts = dict(_finished)
    for req_id, state in runner.requests.items():
        key = output_key(req_id)
        if key is not None:
            counts[key] = len(state.output_token_ids)
    return counts
