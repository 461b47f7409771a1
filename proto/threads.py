"""The codec's threads: how many a process uses, and the pools it keeps (any process that encodes or decodes).

The C coders (``_condcoder``, ``_bitdiff``) and xxhash release the GIL while they run, so tensors and parts are
coded on threads, one per CPU the process may run on (``os.sched_getaffinity``: a rank pinned to 4 cores of a
64-core host gets 4), at most :data:`MAX_THREADS`.

A :class:`SharedPool` is started on first use and kept for the process's life (the part threads, the trainer's
stream workers). A process forked after its start does not have the parent's threads: every shared pool is
forgotten in the child (``os.register_at_fork``), and the child's first use starts its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["MAX_THREADS", "SharedPool", "cpu_threads", "thread_map"]

A = TypeVar("A")
B = TypeVar("B")

#: The most threads the codec runs at once in one process.
MAX_THREADS = 8


def cpu_threads() -> int:
    """Threads the codec runs at once: one per CPU this process may run on, at least 1, at most :data:`MAX_THREADS`."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, usable))


def thread_map(fn: Callable[[A], B], items: Iterable[A], threads: int | None = None) -> list[B]:
    """``[fn(x) for x in items]`` on a pool of ``threads`` threads (default :func:`cpu_threads`) made for this call;
    raises the first error in ``items``' order, after every call has finished."""
    with ThreadPoolExecutor(max_workers=threads or cpu_threads()) as pool:
        return list(pool.map(fn, items))


class SharedPool:
    """A process's pool of :func:`cpu_threads` threads named ``prefix``, started on first use and kept (a forked
    child starts its own). Never submit to it from one of its own tasks: a task waiting for another could hold the
    last thread.

    Args:
        prefix: the threads' name prefix (``stitch-parts_0``...), as seen by py-spy and in tracebacks.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _SHARED.append(self)

    def __call__(self) -> ThreadPoolExecutor:
        """The pool (started now if this process has none yet)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=cpu_threads(), thread_name_prefix=self.prefix)
            return self._pool


#: Every shared pool of this process, for :func:`_forget_shared_pools`.
_SHARED: list[SharedPool] = []


def _forget_shared_pools() -> None:
    """In a forked child: the parent's threads do not exist there; each pool starts afresh on its next use."""
    for shared in _SHARED:
        shared._pool, shared._lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_shared_pools)
