"""BoundedWorker: where a background failure surfaces, alone and in lockstep (one worker per rank)."""

from __future__ import annotations

import threading

import pytest

from stitchboard.trainer_client.async_publish import BoundedWorker
from stitchboard.trainer_client.errors import PublishError


class Boom(Exception):
    pass


def fail() -> None:
    raise Boom("job 0 failed")


@pytest.mark.parametrize("lockstep", [False, True])
def test_a_failure_surfaces_once_and_skips_the_jobs_queued_behind_it(lockstep):
    worker = BoundedWorker(max_pending=2, lockstep=lockstep)
    release = threading.Event()
    worker.admit()
    first = worker.submit(lambda: release.wait(60) and fail())
    worker.admit()  # job 1 is admitted while job 0 still runs
    second = worker.submit(lambda: "ran")
    release.set()
    with pytest.raises(Boom):
        first.result(60)
    with pytest.raises(PublishError, match="not run"):
        second.result(60)
    with pytest.raises(Boom):
        worker.admit()  # job 2: in lockstep too, since job 0 = 2 - max_pending is settled
    worker.admit()  # raised once
    assert worker.submit(lambda: "ran").result(60) == "ran"
    worker.close()


def test_alone_a_failure_is_raised_at_the_next_admission():
    worker = BoundedWorker(max_pending=2)
    worker.admit()
    with pytest.raises(Boom):
        worker.submit(fail).result(60)
    with pytest.raises(Boom):
        worker.admit()
    worker.close()


def test_in_lockstep_a_failure_is_raised_once_every_rank_must_know_it():
    """Job 1 may be admitted on a rank where job 0 still runs: no rank raises there. Job 2 is
    admitted only once job 0 = 2 - max_pending ended, on every rank: all raise."""
    worker = BoundedWorker(max_pending=2, lockstep=True)
    worker.admit()
    with pytest.raises(Boom):
        worker.submit(fail).result(60)
    worker.admit()  # job 1: admitted, as on a rank that has not seen the failure yet
    with pytest.raises(PublishError, match="not run"):
        worker.submit(lambda: "ran").result(60)  # skipped on every rank: it comes after job 0
    with pytest.raises(Boom):
        worker.admit()  # job 2
    worker.admit()
    assert worker.submit(lambda: "ran").result(60) == "ran"
    worker.close()
