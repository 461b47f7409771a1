"""An engine has one owner: the lease's state machine with two sidecars over one fake engine.

Real sidecars, a real bulletin over loopback, the real lease record inside the fake engine
(:class:`stitchboard.sidecar.engines.lease.Lease`); the second sidecar reaches the same engine
through its own adapter seam (:meth:`FakeEngine.seam`). The real-engine versions of these tests
are in test_sidecar_vllm.py and test_sglang_sidecar.py.
"""

from __future__ import annotations

import json
import threading

import httpx

from tests.sidecar.fake_engine import FakeEngine, fingerprint
from tests.sidecar.sidecar_helpers import assert_at, make_view, wait_for

#: A short lease, so that a takeover after a lapse takes seconds (renewed 10 times per TTL).
FAST = {"lease_ttl_s": 2.0, "lease_renew_interval_s": 0.2}


def _health(sidecar) -> tuple[int, dict]:
    r = sidecar.http.get("/health")
    return r.status_code, r.json()


def _standby(sidecar, holder: str) -> dict:
    """Wait until ``sidecar`` answers /health 503 standby naming ``holder``; returns the body."""
    return wait_for(
        lambda: (
            (h := _health(sidecar))[0] == 503
            and h[1]["status"] == "standby"
            and h[1]["lease"]["holder"] == holder
            and h[1]
        ),
        30,
        f"{holder} named as the engine's holder",
    )


def _stream(sidecar, tokens: int, out: dict) -> threading.Thread:
    """A streamed completion of ``tokens`` tokens through ``sidecar`` in a thread; its SSE text goes to ``out``."""

    def run() -> None:
        with httpx.stream(
            "POST",
            f"{sidecar.url}/v1/completions",
            json={"prompt": "x", "max_tokens": tokens, "stream": True},
            timeout=120,
        ) as r:
            out["status"] = r.status_code
            out["text"] = "".join(r.iter_text())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _versions_of_tokens(text: str, fps: dict[str, int]) -> tuple[list[int], dict]:
    """The version each streamed token was produced with (from its weights' fingerprint), and the stamp event."""
    events = [json.loads(e.strip()[6:]) for e in text.split("\n\n") if e.strip() and e.strip() != "data: [DONE]"]
    tokens = [e["choices"][0]["text"] for e in events if e.get("choices")]
    (stamp,) = [e for e in events if "weight_version_start" in e]
    return [fps[t.split("@")[1]] for t in tokens], stamp


def test_two_sidecars_on_one_engine_one_commits_and_the_other_takes_over_after_the_ttl(sc_publisher, sc_start):
    """Exactly one sidecar holds the lease; the other's /health and metrics name the holder, its
    gate stays closed and it makes no state-changing call; the holder's answers are stamped with
    the versions their tokens came from across commits. Killed (no release), the holder's lease
    lapses after the TTL and the other takes the engine over with no manual step, bit-exact."""
    sc_publisher.publish(make_view(0))
    engine = FakeEngine(token_delay_s=0.02)
    first = sc_start(engine, **FAST)
    first.wait_applied(0)
    winner = _health(first)[1]["lease"]
    assert winner["held"] and winner["holder"] == winner["owner"]
    second = sc_start(engine.seam(), **FAST)
    body = _standby(second, winner["owner"])
    assert (
        not body["lease"]["held"]
        and body["applied_version"] is None
        and 0 < body["lease"]["holder_expires_in_s"] <= 2.0
    )
    assert winner["owner"] in body["reason"]
    metrics = second.http.get("/metrics").text
    assert "stitch_sidecar_lease_held 0.0" in metrics and f'holder="{winner["owner"]}"' in metrics
    refused = second.http.post("/v1/completions", json={"prompt": "x"}, headers={"X-Stitch-Wait-S": "0.2"})
    assert refused.status_code == 503 and refused.json()["type"] == "NotReady"

    out: dict = {}
    stream = _stream(first, 60, out)
    wait_for(lambda: engine.first_tokens >= 1, 30, "the streamed request generating")
    sc_publisher.step(1)
    first.wait_applied(1)
    sc_publisher.step(2)
    assert_at(first, sc_publisher, 2)
    stream.join(120)
    versions, stamp = _versions_of_tokens(out["text"], {fingerprint(v): i for i, v in enumerate(sc_publisher.views)})
    assert out["status"] == 200 and len(versions) == 60
    assert (stamp["weight_version_start"], stamp["weight_version_end"]) == (versions[0], versions[-1]) == (0, 2)
    assert {owner for _, owner in engine.changes} == {winner["owner"]} and engine.lease_refusals == []
    assert second.status()["applied_version"] is None and _health(second)[1]["status"] == "standby"

    first.app.state.reconciler.lease.release = lambda: None  # a kill -9 releases nothing
    first.stop()
    assert engine.lease.view()["holder"] == winner["owner"], "the stopped sidecar's lease lapsed before its TTL"
    changed = len(engine.changes)
    sc_publisher.step(3)
    assert_at(second, sc_publisher, 3)
    taker = _health(second)[1]["lease"]
    assert taker["held"] and taker["owner"] != winner["owner"]
    assert {owner for _, owner in engine.changes[changed:]} == {taker["owner"]} and engine.lease_refusals == []
    assert engine.count("load_snapshot") == 1, "the engine was loaded from the anchor again on takeover"


def test_a_clean_stop_releases_the_lease_and_the_next_sidecar_takes_the_engine_at_once(sc_publisher, sc_start):
    """With a 60 s TTL, the second sidecar holds the engine (not waiting out the TTL) once the
    first stops cleanly, and finds the engine as the first left it (nothing applied again)."""
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    engine = FakeEngine()
    first = sc_start(engine, lease_ttl_s=60.0)
    assert_at(first, sc_publisher, 1)
    second = sc_start(engine.seam(), lease_ttl_s=60.0)
    _standby(second, _health(first)[1]["lease"]["owner"])
    calls = len(engine.calls)
    first.stop()
    status = second.wait_applied(1, timeout_s=30)  # well inside the 60 s TTL
    assert status["last_sync"] is None and [m for m, _ in engine.calls[calls:] if m != "health"] == ["checksums"]
    sc_publisher.step(2)
    assert_at(second, sc_publisher, 2)


def test_a_lost_lease_drops_the_claim_until_the_engine_can_be_taken_again(sc_publisher, sc_start):
    """Another owner takes the engine under a running sidecar (its lease was released behind it):
    the sidecar claims no version and commits nothing while that lease is live, says so in /health
    and the metrics, and once it lapses takes the engine back at its verified version, unchanged."""
    sc_publisher.publish(make_view(0))
    engine = FakeEngine()
    sidecar = sc_start(engine, **FAST)
    sidecar.wait_applied(0)
    owner = _health(sidecar)[1]["lease"]["owner"]
    engine.lease.release(owner)
    engine.lease.take("intruder", 3.0)
    _standby(sidecar, "intruder")
    assert sidecar.status()["applied_version"] is None
    metrics = sidecar.http.get("/metrics").text
    assert "stitch_sidecar_leases_lost_total 1.0" in metrics and "stitch_sidecar_claims_dropped_total 1.0" in metrics
    changed = len(engine.changes)
    sc_publisher.step(1)
    assert_at(sidecar, sc_publisher, 1)  # once the intruder's lease lapsed
    assert engine.changes[changed:] and {o for _, o in engine.changes[changed:]} == {owner}
    assert engine.count("load_snapshot") == 1 and engine.count("checksums") == 0, (
        "the engine was not taken back as it was"
    )
    assert engine.lease_refusals == []
