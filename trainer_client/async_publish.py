"""The background worker behind ``Publisher.publish_async``: one thread, bounded, never silent.

* One worker thread runs publishes in submission order (versions stay consecutive).
* At most ``max_pending`` publishes are in flight (running + queued); :meth:`BoundedWorker.admit`
  blocks the training loop until one finishes. The caller takes its slot *before* it copies the
  served view, so at most ``max_pending`` view copies exist besides the kept one.
* A failure is kept and raised by the next :meth:`admit`, :meth:`flush` or :meth:`close`
  (exactly once); publishes still queued behind it are not run (their futures fail with
  :class:`PublishError`), since they would meet the same failure.
* ``lockstep`` (the ranks of a sharded publisher, one worker each): a failure is raised by
  :meth:`BoundedWorker.admit` only once it is settled, i.e. once every rank must know it too:
  job ``n - max_pending`` or an earlier one failed when job ``n`` is admitted (the slot taken
  proves it ended, and the ranks agree on every outcome). A rank never raises where another
  goes on into a collective.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from .errors import PublisherClosedError, PublishError

T = TypeVar("T")


class BoundedWorker:
    """Runs submitted jobs on one background thread with at most ``max_pending`` in flight.

    Args:
        max_pending: jobs admitted and not finished, >= 1.
        name: thread name prefix (shows in stack dumps).
        lockstep: :meth:`admit` raises only settled failures (see the module docstring).

    Raises:
        ValueError: ``max_pending < 1``.
    """

    def __init__(self, max_pending: int = 2, name: str = "stitchboard-publish", lockstep: bool = False) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._max_pending = max_pending
        self._lockstep = lockstep
        self._slots = threading.BoundedSemaphore(max_pending)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._futures: list[Future[Any]] = []  # each job's own result type
        self._submitted = 0
        self._error: BaseException | None = None
        self._failed_job: int | None = None  # the index of the job that failed with self._error
        self._closed = False

    def raise_error(self) -> None:
        """Raise (once) the error of a failed background job, if any."""
        with self._lock:
            error, self._error, self._failed_job = self._error, None, None
        if error is not None:
            raise error

    def _raise_settled_error(self) -> None:
        """Lockstep: once a slot is taken for job ``n``, raise the failure of job ``n - max_pending``
        or earlier, after the jobs queued behind it were skipped (as on every other rank)."""
        with self._lock:
            settled = self._failed_job is not None and self._failed_job <= self._submitted - self._max_pending
        if settled:
            self.flush()

    def admit(self) -> None:
        """Take a slot for one job, blocking while ``max_pending`` are in flight.

        Raises:
            PublisherClosedError: after :meth:`close`.
            the error of an earlier failed job (the slot is not taken then).
        """
        if self._closed:
            raise PublisherClosedError("the publisher is closed")
        if not self._lockstep:
            self.raise_error()
        self._slots.acquire()
        try:
            if self._lockstep:
                self._raise_settled_error()
            else:
                self.raise_error()  # a job may have failed while we waited
        except BaseException:
            self._slots.release()
            raise

    def release(self) -> None:
        """Give back a slot taken by :meth:`admit` without submitting a job."""
        self._slots.release()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run ``job`` on the worker thread, in order; call after :meth:`admit` (the slot is
        released when the job ends)."""
        with self._lock:
            index, self._submitted = self._submitted, self._submitted + 1

        def run() -> T:
            try:
                with self._lock:
                    if self._error is not None:
                        raise PublishError(f"not run: an earlier background publish failed ({self._error!r})")
                try:
                    return job()
                except BaseException as exc:
                    with self._lock:
                        if self._error is None:
                            self._error, self._failed_job = exc, index
                    raise
            finally:
                self._slots.release()

        future = self._executor.submit(run)
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [future]
        return future

    def flush(self) -> None:
        """Wait for every admitted job, then raise the first failure, if any."""
        with self._lock:
            pending = list(self._futures)
        for f in pending:
            f.exception()  # waits; the error itself is kept in self._error
        self.raise_error()

    def close(self) -> None:
        """Flush, then stop the thread. Idempotent; raises a pending failure like :meth:`flush`."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._executor.shutdown(wait=True)
