"""The engine's lease record (sidecar/engines/lease.py) and what the adapters read of it
(sidecar/engines/rpc.py, base.LeaseGuard), on a clock the test moves."""

from __future__ import annotations

import pytest

from stitchboard.sidecar.engines.base import LeaseGrant, LeaseGuard
from stitchboard.sidecar.engines.lease import Lease, parse_owner, parse_ttl
from stitchboard.sidecar.engines.rpc import lease_grant, parse_answers, raise_if_failed
from stitchboard.sidecar.errors import LeaseNotHeldError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_owner_at_a_time_until_its_lease_lapses():
    clock = Clock()
    lease = Lease(clock)
    assert lease.take("a", 5.0) == {"holder": "a", "expires_in_s": 5.0}
    clock.now += 2
    with pytest.raises(LeaseNotHeldError) as refused:
        lease.take("b", 5.0)
    assert refused.value.details == {"holder": "a", "expires_in_s": 3.0, "owner": "b"}
    with pytest.raises(LeaseNotHeldError, match="held by 'a'"):
        lease.require("b", "committing")
    lease.require("a", "committing")
    assert lease.take("a", 5.0)["expires_in_s"] == 5.0  # a renewal runs the TTL from now
    clock.now += 5.0
    assert lease.view() == {"holder": None, "expires_in_s": 0.0}  # lapsed: anyone's
    with pytest.raises(LeaseNotHeldError) as lapsed:
        lease.require("a", "committing")
    assert lapsed.value.details["holder"] is None
    assert lease.take("b", 1.0)["holder"] == "b"
    lease.extend("a")  # a call by the old holder renews nothing of b's
    assert lease.view() == {"holder": "b", "expires_in_s": 1.0}


def test_a_call_that_outlasts_the_ttl_keeps_its_owners_lease():
    clock = Clock()
    lease = Lease(clock)
    lease.take("a", 5.0)
    assert lease.holds("a") and not lease.holds("b")
    clock.now += 30  # a snapshot load: no other call could run meanwhile
    assert not lease.holds("a")
    lease.extend("a")
    assert lease.view() == {"holder": "a", "expires_in_s": 5.0}


def test_release_ends_only_the_callers_lease():
    lease = Lease(Clock())
    lease.take("a", 60.0)
    assert lease.release("b")["holder"] == "a"
    assert lease.release("a") == {"holder": None, "expires_in_s": 0.0}
    assert lease.take("b", 60.0)["holder"] == "b"


@pytest.mark.parametrize(
    "args",
    [{}, {"owner": ""}, {"owner": 3}, {"owner": "x" * 257}, {"owner": "a", "ttl_s": 0}, {"owner": "a", "ttl_s": True}],
)
def test_malformed_owners_and_ttls_are_refused(args):
    with pytest.raises(ValueError):
        parse_owner(args)
        parse_ttl(args)


def _answer(holder: str | None, left: float, error: dict | None = None) -> dict:
    answer = {"ok": error is None, "state": {"version": 1, "phase": "idle", "instance": "i"}}
    answer["lease"] = {"holder": holder, "expires_in_s": left}
    return {**answer, **({"error": error} if error else {})}


def test_a_grant_is_the_least_time_any_rank_has_left_from_the_send():
    answers = parse_answers("m", [_answer("a", 4.0), _answer("a", 3.5)])
    assert lease_grant(answers, "a", 10.0) == LeaseGrant("a", 13.5)
    assert lease_grant(parse_answers("m", [_answer("a", 4.0), _answer("b", 3.0)]), "a", 10.0) is None
    assert (
        lease_grant(parse_answers("m", [{k: v for k, v in _answer("a", 4.0).items() if k != "lease"}]), "a", 10.0)
        is None
    )


def test_a_rank_refused_for_want_of_the_lease_raises_lease_not_held():
    refusal = {"type": "LeaseNotHeld", "message": "held by 'b'", "holder": "b", "expires_in_s": 2.0, "owner": "a"}
    answers = parse_answers(
        "m", [_answer("b", 2.0, refusal), _answer("b", 2.0, {"type": "TpRankFailed", "message": "rank 0"})]
    )
    with pytest.raises(LeaseNotHeldError) as raised:
        raise_if_failed("stitch_commit", answers)
    assert raised.value.details == {"holder": "b", "expires_in_s": 2.0, "owner": "a"}


def test_the_guard_calls_nothing_without_a_lease_and_renews_past_half_the_ttl(monkeypatch):
    guard = LeaseGuard()
    with pytest.raises(LeaseNotHeldError, match="take_lease first"):
        guard.ensure("POST /pause", lambda owner, ttl: pytest.fail("renewed without a lease"))
    now = [100.0]
    monkeypatch.setattr("stitchboard.sidecar.engines.base.time.monotonic", lambda: now[0])
    takes: list[tuple[str, float]] = []

    def take(owner: str, ttl_s: float) -> LeaseGrant:
        takes.append((owner, ttl_s))
        grant = LeaseGrant(owner, now[0] + ttl_s)
        guard.taken(grant, ttl_s)
        return grant

    guard.taken(LeaseGrant("a", 105.0), 5.0)
    assert guard.ensure("POST /pause", take) == "a" and takes == []
    now[0] = 102.6  # less than half the TTL left: renewed first
    assert guard.ensure("POST /resume", take) == "a" and takes == [("a", 5.0)]
    guard.refused("a")
    now[0] = 102.7
    guard.ensure("POST /resume", take)  # nothing known after a refusal: renewed again
    assert len(takes) == 2
    guard.released("a")
    with pytest.raises(LeaseNotHeldError):
        guard.ensure("POST /resume", take)
