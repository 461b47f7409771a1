"""The engine's lease for tests and benchmarks that drive an engine adapter themselves, without a
sidecar (``docs/reference/engine-lease.md``): a state-changing call is refused without one."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

from stitchboard.sidecar.errors import LeaseNotHeldError

#: The TTL of a test's lease, seconds: short, so that a test that dies holding one blocks the next
#: sidecar on its engine for seconds at most (the adapter renews it before each state change).
TEST_TTL_S = 10.0
#: How long :func:`take` waits for a lease another owner holds to lapse (a sidecar a test killed
#: holds the engine for its TTL, 5 s by default), seconds.
WAIT_S = 60.0


def take(adapter: Any, what: str = "adapter") -> str:
    """Take the engine's lease for a new test owner (``tests-<what>-<random>``), waiting up to
    :data:`WAIT_S` for another owner's to lapse; returns the owner.

    Raises:
        LeaseNotHeldError: another owner still holds it after :data:`WAIT_S`.
    """
    owner = f"tests-{what}-{uuid.uuid4().hex[:6]}"
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            adapter.take_lease(owner, TEST_TTL_S)
            return owner
        except LeaseNotHeldError as exc:
            left = exc.details.get("expires_in_s") or 0.5
            if time.monotonic() + left > deadline:
                raise
            time.sleep(left + 0.05)


@contextlib.contextmanager
def holding(adapter: Any, what: str = "adapter") -> Iterator[str]:
    """Hold the engine's lease for a new test owner (yielded) while the block runs (see
    :func:`take`); released after (best effort: the engine may be gone)."""
    owner = take(adapter, what)
    try:
        yield owner
    finally:
        with contextlib.suppress(Exception):
            adapter.release_lease(owner)
