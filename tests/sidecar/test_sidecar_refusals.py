"""A version the engine refuses, and anchor routes staged while serving (fake engine, real HTTP).

A refused plan (nothing written) must not take the replica out of service: the held version
keeps serving, requests that need the refused version get 409 after their wait, the same plan
is retried only after ``refused_retry_s`` (a newer version ends the wait), and the refusal is
reported in ``/health``, status and metrics. An anchor route on an engine that holds a verified
version is staged while it serves: the pause writes only the tensors that differ. The fake
engine can make every tensor write cost ``write_s_per_tensor``, so pause figures show what
each route writes inside the pause (figures of the fake engine, not of vLLM).
"""

from __future__ import annotations

import time

import httpx

from tests.sidecar.fake_engine import FakeEngine, copy_view
from tests.sidecar.sidecar_helpers import make_view, same_bits, wait_for


def _complete(sidecar, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{sidecar.url}/v1/completions", json={"prompt": "p", "max_tokens": 1}, headers=headers, timeout=30
    )


def _one_tensor_step(view, seed: int):
    """A copy of ``view`` with one tensor (the first) changed."""
    out = copy_view(view)
    name = min(out)
    out[name].bits[seed::97] ^= 1
    return out


def test_a_refused_version_keeps_the_held_version_serving(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    engine = FakeEngine()
    sidecar = sc_start(engine, refused_retry_s=30)
    sidecar.wait_applied(0)
    pauses = engine.count("pause")
    engine.refuse_versions, engine.refuse_cause = {1}, "BaseMismatch"  # transient: retried later
    sc_publisher.step(1)
    status = wait_for(lambda: (s := sidecar.status())["refused"] and s, what="the refusal reported")
    refused = status["refused"]
    assert (
        refused["from_version"],
        refused["to_version"],
        refused["route"],
        refused["held_version"],
        refused["type"],
    ) == (0, 1, "delta", 0, "ApplyRefused")
    assert "BaseMismatch" in refused["message"] and refused["retry_at"] > refused["at"] + 29
    assert refused["permanent"] is False
    assert (
        status["applied_version"] == 0 and status["healthy"] is True and status["last_error"]["type"] == "PlanRefused"
    )
    health = httpx.get(f"{sidecar.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["refused"]["to_version"] == 1
    served = _complete(sidecar)
    assert served.status_code == 200 and (
        served.json()["weight_version_start"],
        served.json()["weight_version_end"],
    ) == (0, 0)
    start = time.monotonic()
    wanted = _complete(sidecar, **{"X-Stitch-Min-Version": "1", "X-Stitch-Wait-S": "0.5"})
    assert (
        wanted.status_code == 409
        and wanted.json()["type"] == "WeightVersionNotReady"
        and time.monotonic() - start >= 0.5
    )
    time.sleep(1.0)  # the old backoff (0.05 s doubling to 0.2 s) would have retried ~5 times by now
    assert engine.count("stage_patches") == 1 and engine.count("pause") == pauses, (
        "the refused plan was retried (or the engine paused) before refused_retry_s"
    )
    metrics = httpx.get(f"{sidecar.url}/metrics", timeout=30).text
    assert (
        'stitch_sidecar_refusals_total{route="delta"} 1.0' in metrics
        and "stitch_sidecar_refused_version 1.0" in metrics
    )
    assert same_bits(engine.weights, sc_publisher.views[0])
    sc_publisher.step(2)  # a newer version ends the wait: plan 0 -> 2 is another plan
    sidecar.wait_applied(2, timeout_s=20)
    assert same_bits(engine.weights, sc_publisher.views[2])
    status = sidecar.status()
    assert (
        status["refused"] is None
        and "stitch_sidecar_refused_version -1.0" in httpx.get(f"{sidecar.url}/metrics", timeout=30).text
    )


def _engine_calls(engine: FakeEngine) -> int:
    return sum(engine.count(m) for m in ("pause", "stage_patches", "load_snapshot", "apply_patch", "commit_staged"))


def test_a_permanent_refusal_is_never_retried_and_its_tensor_set_never_reaches_the_engine(sc_publisher, sc_start):
    """A tensor the engine has no place for is refused for good: the held version serves on, the
    same plan is not tried again after refused_retry_s, and a newer version with the same tensor set
    is refused without an engine call; a version with another tensor set is tried."""
    sc_publisher.publish(make_view(0, tensors=3))
    engine = FakeEngine()
    sidecar = sc_start(engine, refused_retry_s=0.2)
    sidecar.wait_applied(0)
    engine.refuse_versions = {1, 2}  # cause UnmappedTensor
    before = _engine_calls(engine)
    sc_publisher.step(1)
    refused = wait_for(lambda: sidecar.status()["refused"], what="the refusal reported")
    assert refused["permanent"] is True and refused["retry_at"] is None and "UnmappedTensor" in refused["message"]
    assert sidecar.status()["last_error"]["message"].count("not tried again") == 1
    time.sleep(1.0)  # five times refused_retry_s: a transient refusal would have been retried
    assert _engine_calls(engine) == before + 1, "the permanently refused plan went to the engine again"
    sc_publisher.step(2)  # a delta: the same tensor set
    wait_for(lambda: sidecar.status()["refused"]["to_version"] == 2, what="version 2 refused")
    assert _engine_calls(engine) == before + 1, "a version of the refused tensor set reached the engine"
    assert sidecar.status()["applied_version"] == 0 and _complete(sidecar).json()["weight_version_end"] == 0
    smaller = {n: t for n, t in sc_publisher.views[-1].items() if n != max(sc_publisher.views[-1])}
    sc_publisher.publish(smaller, anchor=True)  # another tensor set: tried
    wait_for(lambda: _engine_calls(engine) > before + 1, what="the new tensor set tried on the engine")


def test_a_fresh_engine_that_refuses_the_run_is_paused_once_not_in_a_loop(sc_publisher, sc_start):
    """Booting a fresh engine on a run whose tensors it has no place for (another model's run, a
    tied lm_head published beside its embedding): one attempt, then the sidecar waits for a version
    with another tensor set, reporting why; the engine is not paused again."""
    sc_publisher.publish(make_view(0))
    engine = FakeEngine()
    engine.refuse_versions = {0, 1}
    sidecar = sc_start(engine, refused_retry_s=0.2, max_backoff_s=0.1)
    refused = wait_for(lambda: sidecar.status()["refused"], what="the refusal reported")
    assert refused["permanent"] is True and refused["held_version"] is None
    time.sleep(1.5)
    assert engine.count("pause") == 1 and engine.count("load_snapshot") == 1 and not engine.paused
    health = httpx.get(f"{sidecar.url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["refused"]["permanent"] is True
    sc_publisher.step(1)
    wait_for(lambda: sidecar.status()["refused"]["to_version"] == 1, what="version 1 refused")
    time.sleep(0.5)
    assert engine.count("pause") == 1 and engine.count("load_snapshot") == 1


def test_after_refused_staging_the_anchor_route_is_staged_and_the_pause_writes_what_differs(
    sc_publisher, sc_start, tmp_path
):
    """Two refused stagings of 0 -> 1 switch to the anchor route; it is staged while serving, as
    one patch of the single tensor version 1 changed, and the pause writes that tensor only."""
    sc_publisher.publish(make_view(0, tensors=8))
    engine = FakeEngine()
    sidecar = sc_start(engine, refused_retry_s=0.3)
    sidecar.wait_applied(0)
    engine.write_s_per_tensor = 0.05
    before = len(engine.calls)
    engine.refuse_stage = 2
    sc_publisher.publish(_one_tensor_step(sc_publisher.views[0], 1))
    status = sidecar.wait_applied(1)
    assert same_bits(engine.weights, sc_publisher.views[1])
    calls = [m for m, _ in engine.calls[before:] if m != "health"]
    assert calls == [
        "stage_patches",
        "stage_patches",
        "checksums",
        "stage_patches",
        "pause",
        "commit_staged",
        "reset_prefix_cache",
        "resume",
    ]
    assert engine.staged_names[-1] == [min(sc_publisher.views[1])], (
        "the staged anchor route writes only the tensor that differs"
    )
    assert status["last_sync"]["route"] == "staged_anchor" and status["last_sync"]["anchor"] is True
    staged_pause = status["pause_seconds_by_route"]["staged_anchor"]
    metrics = httpx.get(f"{sidecar.url}/metrics", timeout=30).text
    assert (
        'stitch_sidecar_pause_seconds_count{route="staged_anchor"} 1.0' in metrics
        and 'stitch_sidecar_refusals_total{route="delta"} 2.0' in metrics
    )
    # the same route applied in the pause (staging anchor routes off) writes all 8 tensors there
    other = FakeEngine()
    unstaged = sc_start(
        other,
        refused_retry_s=0.3,
        stage_anchor_routes=False,
        anchor_after_failures=1,
        handoff_dir=str(tmp_path / "handoff-2"),
    )
    unstaged.wait_applied(1)
    other.write_s_per_tensor = 0.05
    other.refuse_stage = 1
    sc_publisher.publish(_one_tensor_step(sc_publisher.views[1], 2))
    status = unstaged.wait_applied(2)
    assert status["last_sync"]["route"] == "anchor" and same_bits(other.weights, sc_publisher.views[2])
    anchor_pause = status["pause_seconds_by_route"]["anchor"]
    assert anchor_pause > 0.4 and staged_pause < anchor_pause / 3, (staged_pause, anchor_pause)
    print(
        f"pause of the anchor route, fake engine at 50 ms per tensor written: staged {staged_pause:.3f} s (1 tensor), "
        f"in the pause {anchor_pause:.3f} s (8 tensors + 1 delta)"
    )


def test_an_anchor_route_that_changes_nothing_only_flips(sc_publisher, sc_start):
    """Staging keeps failing until the anchor route, whose target equals what the engine holds
    (an empty delta after a refused one): the version flips, nothing is paused or written."""
    sc_publisher.publish(make_view(0))
    engine = FakeEngine()
    sidecar = sc_start(engine, refused_retry_s=0.2, anchor_after_failures=1)
    sidecar.wait_applied(0)
    pauses = engine.count("pause")
    engine.refuse_versions, engine.refuse_cause = {1}, "BaseMismatch"  # transient: the route escalates
    sc_publisher.step(1)
    wait_for(lambda: sidecar.status()["refused"], what="version 1 refused")
    sc_publisher.publish(sc_publisher.views[0])  # version 2: version 0's bits again (a revert)
    sidecar.wait_applied(2)
    assert same_bits(engine.weights, sc_publisher.views[2]) and engine.version == 2
    assert (
        sidecar.status()["last_sync"]["route"] == "flip"
        and engine.count("pause") == pauses
        and engine.calls[-1] == ("set_version", (2,))
    )


def test_a_commit_refused_before_writing_keeps_the_held_version(sc_publisher, sc_start):
    """The engine refuses the staged update inside the pause, before writing: the held version
    is resumed and kept (no anchor reload), and the plan is staged again after refused_retry_s."""
    sc_publisher.publish(make_view(0))
    engine = FakeEngine()
    sidecar = sc_start(engine, refused_retry_s=0.3)
    sidecar.wait_applied(0)
    engine.refuse_commit = 1
    sc_publisher.step(1)
    sidecar.wait_applied(1)
    assert same_bits(engine.weights, sc_publisher.views[1])
    assert (
        engine.count("load_snapshot") == 1 and engine.count("commit_staged") == 2 and engine.count("stage_patches") == 2
    )
    metrics = httpx.get(f"{sidecar.url}/metrics", timeout=30).text
    assert (
        'stitch_sidecar_refusals_total{route="delta"} 1.0' in metrics
        and "stitch_sidecar_recoveries_total"
        not in metrics.replace("# HELP stitch_sidecar_recoveries_total", "").replace(
            "# TYPE stitch_sidecar_recoveries_total", ""
        )
    )
