"""Python's cyclic garbage collector held off from a publish's arrival until its long-polls are answered.

A bulletin with thousands of waiting long-polls holds hundreds of thousands of long-lived
objects (connections, their requests, tasks and timers). A full (generation 2) collection walks
all of them: ~150 ms of one core for 5,000 waiters, a few times per publish, finding next to no
garbage. A publish's own allocations (the manifest's parse, the fan-out's messages) are what
usually set one off, so without a hold it lands between the publish and the last answer
(``tests/benchmarks/bench_bulletin.py``). Held, the collector runs once the answers are out:
reference counting still frees everything acyclic at once, and cyclic garbage waits for the
hold's end. Holds nest (a publish, then its fan-out, possibly overlapping other runs'); the
collector is on again when the last one ends, and a chain of overlapping holds that has kept it
off for over :data:`MAX_HOLD_S` collects at the next release.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

#: Seconds overlapping holds may keep the collector off before a release collects anyway.
MAX_HOLD_S = 5.0


class CollectorHold:
    """A counted hold on the automatic cyclic collector (process-wide, as the collector is; thread-safe).

    Args:
        max_hold_s: seconds a chain of overlapping holds may keep the collector off before a
            release runs a full collection anyway.
    """

    def __init__(self, max_hold_s: float = MAX_HOLD_S) -> None:
        self.max_hold_s = max_hold_s
        self._lock = threading.Lock()
        self._holders = 0
        self._since = 0.0
        self._resume = False

    @property
    def holders(self) -> int:
        """How many holds are taken now."""
        return self._holders

    def acquire(self) -> None:
        """Take a hold: the automatic collector stays off until every hold is released."""
        with self._lock:
            if self._holders == 0:
                self._resume, self._since = gc.isenabled(), time.monotonic()
                gc.disable()
            self._holders += 1

    def release(self) -> None:
        """Release a hold taken by :meth:`acquire`; the last one turns the collector back on (if it was on before).

        Raises:
            RuntimeError: no hold is taken.
        """
        with self._lock:
            if self._holders == 0:
                raise RuntimeError("CollectorHold.release without a hold: every release follows its own acquire")
            self._holders -= 1
            if self._holders == 0:
                if self._resume:
                    gc.enable()
            elif self._resume and time.monotonic() - self._since > self.max_hold_s:
                gc.collect()
                self._since = time.monotonic()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The collector held off for the ``with`` block."""
        self.acquire()
        try:
            yield
        finally:
            self.release()


#: The process's hold (the collector is one per process).
COLLECTOR = CollectorHold()


def freeze_startup_heap() -> None:
    """Exempt every object alive now from the cyclic collector for good (``gc.freeze``, after one collection).

    For a server process's entry point, once its modules are imported and its app is built:
    full collections then walk only what serving creates, not the ~126,000 objects of the
    imported libraries and the app (~115 ms of one core per collection on its own). Objects
    alive now are never collected afterwards, so a library or a test process must not call it.
    """
    gc.collect()
    gc.freeze()
