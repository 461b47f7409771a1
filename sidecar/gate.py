"""Request gating: weight-version constraints, holding requests, and the commit barrier.

A request may say which versions it accepts, by headers or by a body field (stripped before
forwarding)::

    X-Stitch-Min-Version: 12        body: {"weight_version": {"min_version": 12}}
    X-Stitch-Exact-Version: 12      body: {"weight_version": {"exact_version": 12}}
    X-Stitch-Wait-S: 5.0            body: {"weight_version": {"wait_s": 5.0}}

A request is admitted when a verified version is applied, no commit is under way, the engine
is not slow to answer the sidecar's check of its state, and the applied version satisfies its
constraint; otherwise it is held until that happens or its wait (seconds) runs out. The
:class:`Gate` lives in the event loop of the sidecar's app: every method must be called from
that loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from stitchboard.proto import sidecar_wire as wire

from .errors import (
    InvalidVersionConstraintError,
    NotReadyError,
    WeightVersionError,
    WeightVersionNotReadyError,
    WeightVersionPassedError,
)

# Header lookups are case-insensitive; the wire spells them as :mod:`stitchboard.proto.sidecar_wire` does.
MIN_HEADER = wire.MIN_HEADER.lower()
EXACT_HEADER = wire.EXACT_HEADER.lower()
WAIT_HEADER = wire.WAIT_HEADER.lower()
BODY_FIELD = wire.BODY_FIELD


@dataclass(frozen=True)
class VersionConstraint:
    """Which applied versions a request accepts, and how long it may be held (seconds; None: the default)."""

    min_version: int | None = None
    exact_version: int | None = None
    wait_s: float | None = None

    def verdict(self, applied: int) -> str:
        """``ok`` (admit), ``wait`` (a later version may satisfy it) or ``passed`` (never again)."""
        if self.exact_version is not None:
            if applied == self.exact_version:
                return "ok"
            return "passed" if applied > self.exact_version else "wait"
        if self.min_version is not None and applied < self.min_version:
            return "wait"
        return "ok"

    def details(self) -> dict[str, Any]:
        """The constraint as error-body details."""
        return {"min_version": self.min_version, "exact_version": self.exact_version}


def _version(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise InvalidVersionConstraintError(f"{what} must be a non-negative integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidVersionConstraintError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _wait(value: Any, what: str) -> float | None:
    if value is None:
        return None
    try:
        wait = float(value)
    except (TypeError, ValueError):
        raise InvalidVersionConstraintError(f"{what} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not wait >= 0:
        raise InvalidVersionConstraintError(f"{what} must be a number of seconds >= 0, got {value!r}")
    return wait


def _merge(a: Any, b: Any, what: str) -> Any:
    if a is not None and b is not None and a != b:
        raise InvalidVersionConstraintError(
            f"{what} given twice with different values ({a} in the header, {b} in the body)"
        )
    return a if a is not None else b


def parse_constraint(headers: Mapping[str, str], body: Any) -> VersionConstraint:
    """Read the constraint of a request from its headers and JSON body; removes ``weight_version`` from ``body``.

    Args:
        headers: request headers (case-insensitive mapping).
        body: the decoded JSON body (a dict is modified in place), or None.

    Raises:
        InvalidVersionConstraintError: a value is not a non-negative integer (versions) or
            number (wait), ``weight_version`` has unknown keys, header and body disagree, or
            ``exact_version < min_version``.
    """
    field: Any = body.pop(BODY_FIELD, None) if isinstance(body, dict) else None
    if field is None:
        field = {}
    if not isinstance(field, dict) or set(field) - {"min_version", "exact_version", "wait_s"}:
        raise InvalidVersionConstraintError(
            f"{BODY_FIELD} must be an object with min_version, exact_version and/or wait_s, got {field!r}"
        )
    low = _merge(
        _version(headers.get(MIN_HEADER), "X-Stitch-Min-Version"),
        _version(field.get("min_version"), "weight_version.min_version"),
        "min_version",
    )
    exact = _merge(
        _version(headers.get(EXACT_HEADER), "X-Stitch-Exact-Version"),
        _version(field.get("exact_version"), "weight_version.exact_version"),
        "exact_version",
    )
    wait = _merge(
        _wait(headers.get(WAIT_HEADER), "X-Stitch-Wait-S"),
        _wait(field.get("wait_s"), "weight_version.wait_s"),
        "wait_s",
    )
    if low is not None and exact is not None and exact < low:
        raise InvalidVersionConstraintError(
            f"exact_version {exact} is below min_version {low}: no version satisfies both"
        )
    return VersionConstraint(low, exact, wait)


class Admission(NamedTuple):
    """An admitted request: ``start`` (the applied version, its start stamp), whether it was
    ``held``, and the gate's ``claims`` count then."""

    start: int
    held: bool
    claims: int


class Gate:
    """Admission of requests against the applied version (one per app; event-loop only).

    Attributes:
        applied: the verified version the engine holds, or None (nothing verified).
        target: the newest version the sidecar knows of, or None.
        committing: True while a commit is under way: new requests are held, in-flight ones run on.
        stalled: True while the engine is slow to answer a check of its state (a long step or a
            first-use kernel compile holds its control calls): new requests are held, in-flight
            ones run on.
        in_flight: admitted requests not yet completed.
        waiting: requests held now, waiting for their version (or the end of a commit).
        claims: how many claims have been dropped so far (the applied version went to None):
            a request that sees it change between admission and completion ran across a drop.
    """

    def __init__(self) -> None:
        self.applied: int | None = None
        self.target: int | None = None
        self.committing = False
        self.stalled = False
        self.in_flight = 0
        self.waiting = 0
        self.claims = 0
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def set_applied(self, version: int | None) -> None:
        """Record the verified version (None: the engine holds no verified version) and wake held requests."""
        if version is None and self.applied is not None:
            self.claims += 1
        self.applied = version
        self._notify()

    def set_target(self, version: int | None) -> None:
        """Record the newest version known at the bulletin."""
        self.target = version
        self._notify()

    def set_committing(self, committing: bool) -> None:
        """Close (True) or reopen (False) admission around a commit."""
        self.committing = committing
        self._notify()

    def set_stalled(self, stalled: bool) -> None:
        """Close (True) or reopen (False) admission while the engine is slow to answer a state check."""
        self.stalled = stalled
        self._notify()

    async def admit(self, constraint: VersionConstraint, wait_s: float) -> Admission:
        """Wait until the request may run; count it in flight (call :meth:`release` when it completes).

        Args:
            constraint: what the request accepts.
            wait_s: longest hold, seconds.

        Returns:
            the applied version at admission, whether the request was held, the claims count.

        Raises:
            WeightVersionPassedError: an exact pin below the applied version.
            WeightVersionNotReadyError: the constraint was not met within ``wait_s`` (whatever
                else held the request: a commit, a slow engine, no version yet).
            NotReadyError: the request accepts the applied version (or has no constraint) but
                admission stayed closed (no verified version, a commit or a stall) for ``wait_s``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        held = False
        try:
            while True:
                changed = self._changed
                if self.applied is not None and not self.committing and not self.stalled:
                    verdict = constraint.verdict(self.applied)
                    if verdict == "ok":
                        self.in_flight += 1
                        return Admission(self.applied, held, self.claims)
                    if verdict == "passed":
                        raise WeightVersionPassedError(
                            f"exact version {constraint.exact_version} has passed: the engine holds version "
                            f"{self.applied}",
                            applied_version=self.applied,
                            target_version=self.target,
                            **constraint.details(),
                        )
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                if not held:
                    held = True
                    self.waiting += 1
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    pass
        finally:
            if held:
                self.waiting -= 1
        raise self._expired(constraint, wait_s)

    def _expired(self, constraint: VersionConstraint, wait_s: float) -> WeightVersionError | NotReadyError:
        """The answer to a hold that ran out: decided by the constraint against the version held,
        never by what the sidecar is doing at that instant (a commit, a slow engine): a constraint
        the held version does not meet is 409 (``WeightVersionPassed`` for an exact pin below it,
        ``WeightVersionNotReady`` otherwise); a request that accepts the held version, or has no
        constraint, was held only because admission was closed: 503 ``NotReady``."""
        constrained = constraint.min_version is not None or constraint.exact_version is not None
        verdict = constraint.verdict(self.applied) if self.applied is not None else "wait"
        if constrained and verdict == "passed":
            return WeightVersionPassedError(
                f"exact version {constraint.exact_version} has passed: the engine holds version {self.applied}",
                applied_version=self.applied,
                target_version=self.target,
                **constraint.details(),
            )
        if constrained and verdict == "wait":
            return WeightVersionNotReadyError(
                f"weight version not ready after {wait_s:g} s: applied {self.applied}, target {self.target}, wanted "
                f"{constraint.details()}",
                applied_version=self.applied,
                target_version=self.target,
                **constraint.details(),
            )
        why = (
            "a commit is under way"
            if self.committing
            else "no verified weight version is applied yet"
            if self.applied is None
            else "the engine is slow to answer its state check"
        )
        return NotReadyError(f"{why} (held {wait_s:g} s)", applied_version=self.applied, target_version=self.target)

    async def wait_applied(self, version: int, timeout_s: float) -> None:
        """Wait until the applied version is ``version`` or later (a commit or flip the engine has
        recorded but the sidecar not yet): through any commit under way, plus at most
        ``timeout_s`` seconds outside commits; returns either way."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.applied is not None and self.applied < version:
            remaining = deadline - loop.time()
            if remaining <= 0 and not self.committing:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), None if self.committing else remaining)
            except TimeoutError:
                return

    def release(self) -> int | None:
        """Mark one admitted request completed; returns the applied version now (its end stamp)."""
        self.in_flight -= 1
        return self.applied
