"""Output-token counts of the requests inside SGLang, read by the loader at a pause (SGLang scheduler processes).

SGLang reports its own per-token version spans in native ``/generate`` answers and in
non-streamed OpenAI answers, but its OpenAI streams carry none. For a stream that asks for
spans the sidecar marks the request: its body's ``rid`` (SGLang's request id) ends in a mark
(``stitch-`` and 32 hex digits, :data:`MARK`; with ``n`` > 1 SGLang names the outputs
``<rid>_<choice>``). At a commit, while the engine is paused (nothing decodes; running requests
retracted to the waiting queue keep their ``output_ids``), the loader's ``output_counts`` call
reads the length of each marked request's ``output_ids``: the number of output tokens generated
under the weights held before the commit, under the key ``<mark>:0:<choice>`` (the sidecar's
:class:`~stitchboard.sidecar.spans.SpanLedger` keys).

The requests are read from the process's ``Scheduler``, found on the call stack of the update
call that runs the loader (SGLang 0.5.23 runs it on the scheduler's own thread). A request that
finished inside the engine is gone from the scheduler, possibly before its answer reaches the
sidecar: :func:`track_finished` (installed when the loader is first imported, at the sidecar's
first call) keeps the final count of the last :data:`FINISHED_KEPT` finished marked requests,
taken when their last output is streamed out, so such a request counts as finished (all its
tokens before the boundary) rather than as not started (none).
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from typing import Any

#: The mark the sidecar puts into the request ids it wants counts of.
MARK = re.compile(r"stitch-[0-9a-f]{32}")
#: How many finished marked requests' final counts are kept.
FINISHED_KEPT = 4096

_CHOICE = re.compile(r"_([0-9]+)$")
_finished: OrderedDict[str, int] = OrderedDict()


def output_key(rid: object) -> str | None:
    """``<mark>:0:<choice>`` of an SGLang request id holding a mark, else None."""
    if not isinstance(rid, str):
        return None
    marks = list(MARK.finditer(rid))
    if not marks:
        return None
    choice = _CHOICE.search(rid[marks[-1].end() :])
    return f"{marks[-1].group(0)}:0:{int(choice.group(1)) if choice else 0}"


def _remember(reqs: Any) -> None:
    for req in reqs or ():
        key = output_key(getattr(req, "rid", None))
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
        raise RuntimeError("no SGLang Scheduler on the call stack of the loader (is it called from an update call on the scheduler's thread?)")
    return scheduler


def output_counts() -> dict[str, int]:
    """Output key -> output tokens generated so far, of every marked request the scheduler holds
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
        key = output_key(getattr(req, "rid", None))
        if key is not None:
            counts[key] = len(req.output_ids)
    return counts
