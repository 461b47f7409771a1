"""Holding SGLang's paused scheduler loop while the stager writes (runs in the scheduler process).

Why: a paused SGLang scheduler does not sleep. Every event loop of SGLang 0.5.23
(``Scheduler.event_loop_normal`` / ``event_loop_overlap``, and the disaggregation and MLX ones)
runs ``ingest_requests()`` and then, paused, ``_record_scheduler_state_for_paused_engine()``
and loops again at once: a Python loop that keeps the GIL. The stager's write (:mod:`.loader`,
numpy gathers and scatters that release the GIL for each chunk) then waits up to Python's
switch interval (5 ms) for the GIL after every chunk: one real step's patch took 0.78 s to
write beside the spinning loop, against ~0.03 s inside an update call (the scheduler's own
thread). :func:`install` wraps ``_record_scheduler_state_for_paused_engine``, which SGLang calls
only in the paused branch of each loop, between two ingests (after a ``retract`` pause, the
only mode the sidecar uses, with no batch in flight): from
:func:`hold` to :func:`release` the scheduler thread waits there (the GIL released; the stager
releases it once its answer is sent, since every system call of the answer would wait for the
GIL too). While it waits there, :func:`flush_cache` runs the scheduler's own flush, as
``/flush_cache`` does in the scheduler (the route's tokenizer-side part, a multimodal
preprocessing cache, holds no weight-dependent state), without that call's round trip. Reaching that
point is also what tells the stager that the scheduler has paused: ``/pause_generation``'s
answer comes once the request is passed on to the scheduler, not once the scheduler paused.
When no hold is asked for, each paused iteration sleeps :data:`PAUSED_POLL_S` instead, so that
the spinning loop leaves its core (one of two on the CPU hosts measured) to the sidecar's calls
and the engine's other processes for the rest of the pause.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("stitchboard.sidecar.engines.sglang.paused_hold")

#: The SGLang method wrapped: called once per paused iteration of every scheduler event loop.
PAUSED_HOOK = "_record_scheduler_state_for_paused_engine"
#: How long each paused iteration sleeps when no hold is asked for, seconds: the paused loop then
#: looks for requests (the pause's own control calls) every millisecond instead of spinning a core.
PAUSED_POLL_S = 0.001

_wanted = threading.Event()  # a hold is asked for
_parked = threading.Event()  # the scheduler thread waits in its paused loop
_release = threading.Event()  # the hold is over
_installed = False
_scheduler: Any = None  # the held scheduler, during a hold


def _park(scheduler: Any) -> None:
    # In the scheduler thread, paused: wait while a hold is asked for, else sleep a little.
    global _scheduler
    if _wanted.is_set():
        _scheduler = scheduler
        _parked.set()
        _release.wait()
    else:
        time.sleep(PAUSED_POLL_S)


def install() -> bool:
    """Wrap SGLang's paused-loop method (once per process); whether the hold is available
    (False without SGLang, or when this SGLang has no such method). Never raises."""
    global _installed
    if _installed:
        return True
    try:
        from sglang.srt.managers.scheduler import Scheduler
    except ImportError:
        return False
    original = getattr(Scheduler, PAUSED_HOOK, None)
    if original is None:
        log.warning("stitchboard: SGLang's Scheduler has no %s: the stager does not write in the pause", PAUSED_HOOK)
        return False

    def paused(self: Any) -> Any:
        _park(self)
        return original(self)

    setattr(Scheduler, PAUSED_HOOK, paused)
    _installed = True
    return True


def hold(timeout_s: float) -> bool:
    """Ask the scheduler thread to wait in its paused loop until :func:`release`; whether it is
    waiting there within ``timeout_s`` seconds (False: the engine is not paused, or the hook is
    not installed; nothing may be written then). Call :func:`release` after either answer."""
    _release.clear()
    _parked.clear()
    _wanted.set()
    return _installed and _parked.wait(timeout_s)


def flush_cache() -> bool:
    """During a hold: empty the held scheduler's radix cache and KV pools with SGLang's own
    ``Scheduler.flush_cache``, the method its ``/flush_cache`` runs at the same point of the
    paused loop (it refuses while requests run: a retracted pause leaves none); whether it did."""
    return _scheduler is not None and _parked.is_set() and bool(_scheduler.flush_cache())


def release() -> None:
    """End the hold (the scheduler thread goes on); harmless when none is held."""
    global _scheduler
    _scheduler = None
    _wanted.clear()
    _release.set()
