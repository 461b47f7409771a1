"""What a held request gets when its wait runs out: decided by its constraint against the version
held, never by what the sidecar is doing at that instant (a commit, a slow engine, no version)."""

from __future__ import annotations

import asyncio

import pytest

from stitchboard.sidecar.errors import NotReadyError, WeightVersionNotReadyError, WeightVersionPassedError
from stitchboard.sidecar.gate import Gate, VersionConstraint

CLOSED = {
    "open": {},
    "committing": {"committing": True},
    "stalled": {"stalled": True},
}


def _expire(applied: int | None, closed: dict[str, bool], constraint: VersionConstraint) -> BaseException:
    async def run() -> BaseException:
        gate = Gate()
        gate.set_applied(applied)
        gate.set_target(5)
        gate.set_committing(closed.get("committing", False))
        gate.set_stalled(closed.get("stalled", False))
        with pytest.raises((NotReadyError, WeightVersionNotReadyError, WeightVersionPassedError)) as caught:
            await gate.admit(constraint, 0.01)
        assert gate.waiting == 0 and gate.in_flight == 0
        return caught.value

    return asyncio.run(run())


@pytest.mark.parametrize("closed", sorted(CLOSED))
def test_an_unmet_min_version_is_409_whatever_the_gate_is_doing(closed: str) -> None:
    error = _expire(3, CLOSED[closed], VersionConstraint(min_version=5))
    assert isinstance(error, WeightVersionNotReadyError) and error.status == 409
    assert error.details["applied_version"] == 3 and error.details["min_version"] == 5


@pytest.mark.parametrize("closed", ["committing", "stalled"])
def test_an_exact_pin_that_passed_is_409_passed_even_while_closed(closed: str) -> None:
    error = _expire(4, CLOSED[closed], VersionConstraint(exact_version=3))
    assert isinstance(error, WeightVersionPassedError) and error.status == 409


def test_an_unmet_constraint_with_no_version_held_is_409() -> None:
    error = _expire(None, {}, VersionConstraint(min_version=1))
    assert isinstance(error, WeightVersionNotReadyError) and error.details["applied_version"] is None


@pytest.mark.parametrize("closed", ["committing", "stalled"])
@pytest.mark.parametrize("constraint", [VersionConstraint(), VersionConstraint(min_version=3)], ids=["none", "met"])
def test_a_request_held_only_by_a_closed_gate_is_503(closed: str, constraint: VersionConstraint) -> None:
    error = _expire(3, CLOSED[closed], constraint)
    assert isinstance(error, NotReadyError) and error.status == 503


def test_no_version_and_no_constraint_is_503() -> None:
    assert isinstance(_expire(None, {}, VersionConstraint()), NotReadyError)
