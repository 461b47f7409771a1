"""The codec's threads (proto/threads.py): how many, one pool per name for the process's life, a forked child's own
pool, and a per-call map that keeps order and raises the first error."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from stitchboard.proto import parts
from stitchboard.proto.threads import MAX_THREADS, SharedPool, cpu_threads, thread_map


def test_one_thread_per_usable_cpu_at_most_eight() -> None:
    assert cpu_threads() == max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))


def test_a_shared_pool_is_started_once_and_named() -> None:
    shared = SharedPool("stitch-test")
    pool = shared()
    assert shared() is pool
    assert pool.submit(lambda: threading.current_thread().name).result().startswith("stitch-test")


def test_thread_map_keeps_the_order_and_raises_the_first_error() -> None:
    assert thread_map(lambda x: x * x, range(20), threads=3) == [x * x for x in range(20)]

    def fail_on_odd(x: int) -> int:
        if x % 2:
            raise ValueError(f"odd {x}")
        return x

    with pytest.raises(ValueError, match="odd 1"):
        thread_map(fail_on_odd, range(10))


def _map_on_part_threads(queue) -> None:
    queue.put(list(parts.pool().map(lambda x: x + 1, range(4))))


def test_a_process_forked_after_the_part_threads_started_starts_its_own() -> None:
    """Without it the child's tasks would wait for the parent's threads, which do not exist in the child."""
    assert list(parts.pool().map(lambda x: x + 1, range(4))) == [1, 2, 3, 4]
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_map_on_part_threads, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) == [1, 2, 3, 4]
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
