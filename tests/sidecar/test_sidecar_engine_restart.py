"""An engine that restarts, changes its record or stops answering under a running sidecar.

The sidecar must never claim (report, admit under, stamp) a version the engine no longer holds
(DESIGN.md invariant 1): it checks the engine's instance id and record on a timer, at every
``/health`` and before every commit, drops the claim at once when they changed, and boots again.
The fake engine's tokens name a fingerprint of the weights that produced them, so an answer
shows which bits served it.
"""

from __future__ import annotations

import threading

import httpx

from tests.sidecar.fake_engine import FakeEngine, fingerprint
from tests.sidecar.sidecar_helpers import assert_at, make_view, wait_for


def _complete(sidecar, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{sidecar.url}/v1/completions",
        json={"model": "fake", "prompt": "p", "max_tokens": 2},
        headers=headers,
        timeout=60,
    )


def test_engine_restarted_under_a_running_sidecar_is_never_served_under_the_old_version(sc_publisher, sc_start):
    """The engine restarts from its boot checkpoint (version 0) while the sidecar claims version 3:
    /health answers 503 at once, a request pinned to 3 is held (never served by version 0's bits),
    and the sidecar checks the engine's bits against version 0 before it claims anything, then
    catches up to 3 and serves the request with version 3's bits."""
    sc_publisher.publish(make_view(0))
    for seed in (1, 2, 3):
        sc_publisher.step(seed)
    engine = FakeEngine(sc_publisher.views[0])
    sidecar = sc_start(engine, boot_version=0, engine_check_interval_s=3600)  # the timer stays out of it
    assert_at(sidecar, sc_publisher, 3)
    checks = engine.count("checksums")
    engine.restart(sc_publisher.views[0])
    health = httpx.get(f"{sidecar.url}/health", timeout=30)
    assert (
        health.status_code == 503
        and health.json()["status"] == "engine_changed"
        and "restarted" in health.json()["reason"]
    )
    answer = _complete(sidecar, **{"X-Stitch-Exact-Version": "3", "X-Stitch-Wait-S": "30"})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["weight_version_start"], answer.json()["weight_version_end"]) == (3, 3)
    assert f"@{fingerprint(sc_publisher.views[3])}" in answer.json()["choices"][0]["text"], (
        "served by other bits than version 3's"
    )
    assert_at(sidecar, sc_publisher, 3)
    assert (
        engine.count("checksums") == checks + 1 and engine.count("load_snapshot") == 0
    )  # version 0 checked, then deltas
    status = sidecar.status()
    assert (
        status["last_error"]["type"] == "EngineChanged"
        and "stitch_sidecar_claims_dropped_total 1.0" in httpx.get(f"{sidecar.url}/metrics").text
    )


def test_the_timer_notices_a_restart_without_any_request(sc_publisher, sc_start):
    """With nobody polling /health, the periodic check drops the claim within its interval."""
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    engine = FakeEngine(sc_publisher.views[0])
    sidecar = sc_start(engine, boot_version=0, engine_check_interval_s=0.05)
    assert_at(sidecar, sc_publisher, 1)
    engine.restart(sc_publisher.views[0])
    wait_for(
        lambda: sidecar.status()["applied_version"] != 1 or engine.count("checksums") == 2, 10, "the claim dropped"
    )
    assert_at(sidecar, sc_publisher, 1)
    assert engine.count("checksums") == 2, "the restarted engine's bits were not checked"


def test_restart_then_an_empty_delta_then_a_one_tensor_delta_never_relabels_the_engine(sc_publisher, sc_start):
    """The restarted engine (version 0's bits, no record) must not have an empty delta's version
    written onto it, nor a one-tensor delta applied on top: the commit's own check sees the new
    instance (the timer is off here), the sidecar boots again, and the engine ends with every bit
    of the last version."""
    v0 = make_view(0)
    sc_publisher.publish(v0)
    first = {**v0}
    name_a, name_b = sorted(v0)[:2]
    first[name_a] = make_view(7)[name_a]  # version 1 changes tensor A only
    sc_publisher.publish(first)
    engine = FakeEngine(v0)
    sidecar = sc_start(engine, boot_version=0, engine_check_interval_s=3600)
    assert_at(sidecar, sc_publisher, 1)
    engine.restart(v0)
    sc_publisher.same()  # version 2: no patch file (a flip)
    third = {**sc_publisher.views[-1], name_b: make_view(8)[name_b]}  # version 3: tensor B, unchanged since version 0
    sc_publisher.publish(third)
    assert_at(sidecar, sc_publisher, 3)
    assert engine.count("checksums") == 2, "the restarted engine's bits were not checked before a version was recorded"


def test_an_engine_that_stops_answering_loses_the_claim_and_gets_it_back_unchanged(sc_publisher, sc_start):
    """No answer: no claim (503, requests held). The same engine instance back at the version the
    sidecar verified on it is taken as it is, without another pass over its weights."""
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    engine = FakeEngine(sc_publisher.views[0])
    sidecar = sc_start(engine, boot_version=0, engine_check_interval_s=0.05)
    assert_at(sidecar, sc_publisher, 1)
    checks = engine.count("checksums")
    engine.unreachable = True
    wait_for(lambda: sidecar.status()["applied_version"] is None, 10, "the claim dropped")
    assert httpx.get(f"{sidecar.url}/health", timeout=30).status_code == 503
    assert _complete(sidecar, **{"X-Stitch-Wait-S": "0.2"}).json()["type"] == "NotReady"
    engine.unreachable = False
    assert_at(sidecar, sc_publisher, 1)
    assert engine.count("checksums") == checks and engine.count("load_snapshot") == 0


def test_an_engine_slow_to_answer_keeps_the_claim_while_requests_wait_for_it(sc_publisher, sc_start):
    """An engine that keeps the state call waiting (a real one does behind a long step or a
    first-use kernel compile) has not gone away: past engine_call_timeout_s new requests are held
    (503 NotReady naming the slow engine when their wait runs out, else served once it answers),
    a request in flight ends stamped with the version, and the claim stands (no drop, no checksum
    pass). Kept waiting past engine_stall_timeout_s, the claim is dropped; the same instance back
    at the version is then taken as it is."""
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    engine = FakeEngine(sc_publisher.views[0])
    sidecar = sc_start(
        engine, boot_version=0, engine_check_interval_s=0.05, engine_call_timeout_s=0.3, engine_stall_timeout_s=3.0
    )
    assert_at(sidecar, sc_publisher, 1)
    checks = engine.count("checksums")
    engine.state_delay_s, engine.token_delay_s = 1.5, 0.5
    in_flight: dict[str, httpx.Response] = {}
    runner = threading.Thread(target=lambda: in_flight.update(r=_complete(sidecar)))
    runner.start()

    def held_answer() -> bool:
        answer = _complete(sidecar, **{"X-Stitch-Wait-S": "0.05"})
        return answer.status_code == 503 and "slow to answer its state check" in answer.json()["message"]

    wait_for(held_answer, 10, "a request held while the engine is slow to answer")
    unmet = _complete(sidecar, **{"X-Stitch-Wait-S": "0.05", "X-Stitch-Min-Version": "2"})
    assert unmet.status_code == 409 and unmet.json()["type"] == "WeightVersionNotReady", "one constraint, one answer"
    assert httpx.get(f"{sidecar.url}/health", timeout=30).json()["status"] in ("engine_slow", "ok")
    engine.token_delay_s = 0.01
    served = _complete(sidecar, **{"X-Stitch-Wait-S": "5"})
    assert served.status_code == 200 and (
        served.json()["weight_version_start"],
        served.json()["weight_version_end"],
    ) == (1, 1)
    runner.join(30)
    assert (in_flight["r"].json()["weight_version_start"], in_flight["r"].json()["weight_version_end"]) == (1, 1)
    assert "stitch_sidecar_claims_dropped_total 0.0" in httpx.get(f"{sidecar.url}/metrics").text

    engine.state_delay_s = 5.0  # past engine_stall_timeout_s
    wait_for(lambda: sidecar.status()["applied_version"] is None, 15, "the claim dropped")
    assert "does not answer" in sidecar.status()["last_error"]["message"]
    engine.state_delay_s = 0.0
    assert_at(sidecar, sc_publisher, 1)
    assert engine.count("checksums") == checks and engine.count("load_snapshot") == 0
