"""The engine's lease: which sidecar owns the engine (runs inside the engine's processes).

Engine-neutral and free of engine imports: vLLM's worker extension (:mod:`.vllm.worker`, one per
TP rank), SGLang's loader and stager (:mod:`.sglang.loader`, one per TP rank's scheduler process)
and the tests' fake engine each hold one :class:`Lease`. A sidecar takes or renews it
(:meth:`Lease.take`) with its owner id and a TTL; while that lease is live no other owner can
take it, and every state-changing call of the engine's stitchboard code names its owner and is
refused without a live lease (:meth:`Lease.require`). The expiry is kept on this process's own
monotonic clock, so neither the caller's clock nor a wall-clock step can move it. A lease that
lapsed is anyone's: its holder takes it again as any other owner would (nothing else can have
changed the engine meanwhile without taking it first). See ``docs/reference/engine-lease.md``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import LeaseNotHeldError

#: The longest TTL a caller may ask for, seconds (a lease that outlives its sidecar by more than
#: this blocks every replacement: a typo such as 5000 for 5 is refused instead).
MAX_TTL_S = 3600.0


def parse_owner(args: dict[str, Any]) -> str:
    """The ``owner`` of a call's JSON arguments.

    Raises:
        ValueError: missing, not a string, empty or longer than 256 characters.
    """
    owner = args.get("owner")
    if not isinstance(owner, str) or not 0 < len(owner) <= 256:
        raise ValueError(f"owner must be the caller's lease owner id (1-256 characters), got {owner!r}")
    return owner


def parse_ttl(args: dict[str, Any]) -> float:
    """The ``ttl_s`` of a take's JSON arguments, seconds.

    Raises:
        ValueError: not a number in (0, :data:`MAX_TTL_S`].
    """
    ttl = args.get("ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:g}], got {ttl!r}")
    return float(ttl)


class Lease:
    """One engine process's lease record: the owner, its expiry and the TTL it asked for.

    Thread-safe (SGLang's stager threads and scheduler thread share one).

    Args:
        clock: seconds of a monotonic clock (tests give their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._owner: str | None = None
        self._expires = 0.0
        self._ttl_s = 0.0

    def _live(self, now: float) -> str | None:
        return self._owner if self._owner is not None and now < self._expires else None

    def _refusal(self, owner: str, now: float, what: str) -> LeaseNotHeldError:
        holder = self._live(now)
        if holder is None:
            return LeaseNotHeldError(
                f"{what} refused: {owner!r} holds no live lease on this engine (take the lease first)",
                holder=None,
                expires_in_s=None,
                owner=owner,
            )
        left = self._expires - now
        return LeaseNotHeldError(
            f"{what} refused: the engine's lease is held by {holder!r} for {left:.3f} s more unless renewed",
            holder=holder,
            expires_in_s=left,
            owner=owner,
        )

    def take(self, owner: str, ttl_s: float) -> dict[str, Any]:
        """Take the lease for ``owner`` (or renew it) for ``ttl_s`` seconds from now.

        Returns:
            :meth:`view` after the take.

        Raises:
            LeaseNotHeldError: another owner's lease is live (details ``holder``, ``expires_in_s``);
                nothing changed.
        """
        with self._lock:
            now = self._clock()
            holder = self._live(now)
            if holder is not None and holder != owner:
                raise self._refusal(owner, now, "taking the engine's lease")
            self._owner, self._ttl_s, self._expires = owner, ttl_s, now + ttl_s
            return self._view(now)

    def release(self, owner: str) -> dict[str, Any]:
        """End ``owner``'s lease at once (a clean stop: the next sidecar need not wait out the
        TTL); another owner's lease is left as it is. Returns :meth:`view`."""
        with self._lock:
            if self._owner == owner:
                self._owner, self._expires = None, 0.0
            return self._view(self._clock())

    def require(self, owner: str, what: str) -> None:
        """Check that ``owner`` holds a live lease before the state-changing call ``what``.

        Raises:
            LeaseNotHeldError: it does not (another owner's is live, or its own lapsed).
        """
        with self._lock:
            now = self._clock()
            if self._live(now) != owner:
                raise self._refusal(owner, now, what)

    def holds(self, owner: str) -> bool:
        """Whether ``owner``'s lease is live now."""
        with self._lock:
            return self._live(self._clock()) == owner

    def extend(self, owner: str) -> None:
        """At the end of a call ``owner`` made while its lease was live (:meth:`holds`): if it still
        holds the record (live, or lapsed during that call and taken by no one since), its lease
        runs its TTL again from now. A call that kept the engine busy past the TTL (a snapshot
        load) then does not hand the engine to the next caller in the queue."""
        with self._lock:
            if self._owner == owner:
                self._expires = max(self._expires, self._clock() + self._ttl_s)

    def _view(self, now: float) -> dict[str, Any]:
        holder = self._live(now)
        return {"holder": holder, "expires_in_s": self._expires - now if holder is not None else 0.0}

    def view(self) -> dict[str, Any]:
        """``{"holder": owner id or None, "expires_in_s": seconds left (0.0 when none is live)}``."""
        with self._lock:
            return self._view(self._clock())
