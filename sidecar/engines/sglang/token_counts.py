"""Output-token counts of the requests inside SGLang, read by the loader at a pause (SGLang scheduler processes).

SGLang reports its own per-token version spans in native ``/generate`` answers and in
non-streamed OpenAI answers, but its OpenAI streams carry none. For a stream that asks for
spans the sidecar marks the request with a mark (``stitch-`` and 32 hex digits, :data:`MARK`):

* one output: its body's ``rid`` (SGLang's request id) ends in the mark;
* several outputs (``n`` > 1, or several prompts): SGLang 0.5.23 gives every output a fresh random
  rid (``regenerate_rid()``), so the mark goes into ``custom_params`` under :data:`MARK_PARAM`
  instead, which SGLang copies into every output's ``SamplingParams``. (``custom_params`` is read
  only by a custom logit processor, which needs ``--enable-custom-logit-processor`` and is not
  used here, and under SGLang's own reasoning keys: it changes no sampling and no cache key.)
  The tokenizer manager sends the outputs of a request to the scheduler one by one, in choice
  order (output ``j`` of prompt ``i`` is choice ``i * n + j``, the ``index`` of its stream
  chunks), over one socket; before them it sends one non-streamed prefill-only request per prompt
  (``max_new_tokens`` 0) that is not an output. :func:`number_samples` wraps the scheduler's
  request intake (``Scheduler._create_generation_req``) and numbers the streamed requests of
  each mark as they arrive: the ``k``-th is choice ``k``, counted under ``<mark>:<k // n>:<k % n>``.
  (Data-parallel attention, which spreads the outputs over several schedulers, would break this
  order; stitchboard starts SGLang with TP only.)

At a commit, while the engine is paused (nothing decodes; running requests retracted to the
waiting queue keep their ``output_ids``), the loader's ``output_counts`` call reads the length of
each marked request's ``output_ids``: the number of output tokens generated under the weights
held before the commit, under the key ``<mark>:<prompt>:<choice>`` (the sidecar's
:class:`~stitchboard.sidecar.spans.SpanLedger` keys).

The requests are read from the process's ``Scheduler``, found on the call stack of the update
call that runs the loader (SGLang 0.5.23 runs it on the scheduler's own thread). A request that
finished inside the engine is gone from the scheduler, possibly before its answer reaches the
sidecar: :func:`track_finished` (installed when the loader is first imported, at the sidecar's
first call, as is :func:`number_samples`) keeps the final count of the last
:data:`FINISHED_KEPT` finished marked requests, taken when their last output is streamed out, so
such a request counts as finished (all its tokens before the boundary) rather than as not
started (none).
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from typing import Any

from ..contract import MARK, MARK_PARAM

#: How many finished marked requests' final counts (and marks being numbered) are kept.
FINISHED_KEPT = 4096
#: The ``Req`` attribute holding the output key :func:`number_samples` gave it.
_KEY_ATTR = "_stitch_output_key"

_CHOICE = re.compile(r"_([0-9]+)$")
_finished: OrderedDict[str, int] = OrderedDict()
_numbered: OrderedDict[str, int] = OrderedDict()  # mark -> outputs of it seen so far


def output_key(rid: object) -> str | None:
    """``<mark>:0:<choice>`` of an SGLang request id holding a mark, else None."""
    if not isinstance(rid, str):
        return None
    marks = list(MARK.finditer(rid))
    if not marks:
        return None
    choice = _CHOICE.search(rid[marks[-1].end() :])
    return f"{marks[-1].group(0)}:0:{int(choice.group(1)) if choice else 0}"


def sample_key(mark: object, ordinal: int, n: object) -> str | None:
    """``<mark>:<prompt>:<choice>`` of the ``ordinal``-th streamed output (from 0) of a request
    with ``n`` outputs per prompt marked ``mark`` in its ``custom_params``; None when ``mark`` is no mark."""
    if not isinstance(mark, str) or MARK.fullmatch(mark) is None:
        return None
    per_prompt = n if isinstance(n, int) and n > 0 else 1
    return f"{mark}:{ordinal // per_prompt}:{ordinal % per_prompt}"


def _number(req: Any, recv_req: Any) -> None:
    # Number the streamed outputs of a mark in arrival order (the prefill-only request is not streamed).
    params = getattr(recv_req, "sampling_params", None)
    custom = getattr(params, "custom_params", None)
    mark = custom.get(MARK_PARAM) if isinstance(custom, dict) else None
    if mark is None or not getattr(recv_req, "stream", False):
        return
    ordinal = _numbered.get(mark, 0)
    key = sample_key(mark, ordinal, getattr(params, "n", 1))
    if key is None:
        return
    setattr(req, _KEY_ATTR, key)
    _numbered[mark] = ordinal + 1
    _numbered.move_to_end(mark)
    while len(_numbered) > FINISHED_KEPT:
        _numbered.popitem(last=False)


def number_samples() -> None:
    """Wrap SGLang's ``Scheduler._create_generation_req`` so that every streamed output of a request
    marked in ``custom_params`` gets its output key (choice order = arrival order). No-op without
    SGLang or when already wrapped."""
    try:
        from sglang.srt.managers.scheduler import Scheduler
    except ImportError:
        return
    original = Scheduler._create_generation_req
    if getattr(original, "_stitch_numbers_samples", False):
        return

    def _create_generation_req(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        req = original(self, recv_req, *args, **kwargs)
        _number(req, recv_req)
        return req

    _create_generation_req._stitch_numbers_samples = True  # type: ignore[attr-defined]
    Scheduler._create_generation_req = _create_generation_req


def _key(req: Any) -> str | None:
    key = getattr(req, _KEY_ATTR, None)
    return key if isinstance(key, str) else output_key(getattr(req, "rid", None))


def _remember(reqs: Any) -> None:
    for req in reqs or ():
        key = _key(req)
        if key is not None and req.finished():
            _finished[key] = len(req.output_ids)
            _finished.move_to_end(key)
            while len(_finished) > FINISHED_KEPT:
                _finished.popitem(last=False)


def track_finished() -> None:
    """Wrap SGLang's ``SchedulerOutputStreamer.stream_output`` so that the final count of every
    finished marked request is kept. No-op without SGLang or when already wrapped."""
    try:
        from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    except ImportError:
        return
    original = SchedulerOutputStreamer.stream_output
    if getattr(original, "_stitch_tracks_finished", False):
        return

    def stream_output(self: Any, reqs: Any, *args: Any, **kwargs: Any) -> Any:
        _remember(reqs)
        return original(self, reqs, *args, **kwargs)

    stream_output._stitch_tracks_finished = True  # type: ignore[attr-defined]
    SchedulerOutputStreamer.stream_output = stream_output


def find_scheduler() -> Any | None:
    """This process's SGLang ``Scheduler``, found on the call stack (the loader runs on the
    scheduler's own thread inside an update call); None when it is not there."""
    from sglang.srt.managers.scheduler import Scheduler

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Scheduler):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _scheduler() -> Any:
    scheduler = find_scheduler()
    if scheduler is None:
        raise RuntimeError(
            "no SGLang Scheduler on the call stack of the loader (is it called from an update call on the scheduler's "
            "thread?)"
        )
    return scheduler


def output_counts() -> dict[str, int]:
    """Output key -> output tokens generated so far, of every marked request (or output) the scheduler holds
    (running, retracted or waiting) and of the last finished ones; call it from the loader while
    the engine is paused.

    Raises:
        RuntimeError: no Scheduler on the call stack.
    """
    scheduler = _scheduler()
    live = {*scheduler.collect_inflight_reqs(), *scheduler.waiting_queue}
    if getattr(scheduler, "chunked_req", None) is not None:
        live.add(scheduler.chunked_req)
    counts = dict(_finished)
    for req in live:
        key = _key(req)
        if key is not None:
            counts[key] = len(req.output_ids)
    return counts
