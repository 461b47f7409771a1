"""The sidecar in front of a real vLLM (CPU build) with the stitchboard worker extension.

Each test runs the real ``stitchboard sidecar run`` process, a bulletin on loopback, and versions
the trainer SDK publishes from real AdamW steps of SmolLM2 (:class:`vllm_fixtures.VllmRun`).
All but the engine-crash tests share the session's engine; those start fresh engines from the
checkpoint, chained so that N crash phases cost N + 1 engine starts (:class:`EngineChain`).
"Verified" below means the engine records the version, idle, and every tensor it holds has the
checksum of that version's manifest (DESIGN.md invariant 1: never a mix of versions).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stitchboard.sidecar.engines.contract import FAULT_ENV, FAULT_PHASES, FAULT_VERSION_ENV
from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
from stitchboard.sidecar.errors import EngineStateError
from stitchboard.sidecar.reconciler import FAULT_EXIT_CODE as SIDECAR_FAULT_EXIT
from tests.sidecar.commit_overlap import LongRequests
from tests.sidecar.sidecar_helpers import corrupted
from tests.support.vllm_server import VllmServer, require_vllm

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(autouse=True)
def _needs_vllm() -> None:
    """Skip without vLLM (fail under CI) before any expensive fixture runs."""
    require_vllm()


@pytest.fixture
def adapter(vllm_run_engine: VllmServer) -> Iterator[VllmEngine]:
    """A :class:`VllmEngine` on the session engine (for checks only; the sidecar drives it)."""
    engine = VllmEngine(vllm_run_engine.url, timeout_s=60)
    yield engine
    engine.close()


def assert_verified(engine_url: str, run, version: int) -> None:
    """The engine records ``version``, idle and not paused, and holds exactly its bits."""
    engine = VllmEngine(engine_url, timeout_s=60)
    try:
        state = engine.state()
        assert (state.version, state.phase) == (version, "idle")
        sums = run.sums(version)
        assert engine.checksums(sorted(sums)) == sums, f"the engine's weights are not version {version}'s"
    finally:
        engine.close()


def complete(url: str, model: str, headers: dict[str, str] | None = None, **body) -> httpx.Response:
    """``POST /v1/completions`` (greedy, 4 tokens unless ``body`` says otherwise)."""
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body},
        headers=headers,
        timeout=600,
    )


def test_held_request_is_served_once_its_version_is_applied(vllm_run_engine, vllm_run, vllm_sidecars):
    """X-Stitch-Min-Version above the applied version: held until it is applied, then stamped with it;
    with a short wait 409 WeightVersionNotReady; an exact pin the engine has passed 409 WeightVersionPassed."""
    sidecar = vllm_sidecars(vllm_run_engine.url)
    v = vllm_run.latest
    sidecar.wait_applied(v)
    early = complete(sidecar.url, vllm_run_engine.model, {"X-Stitch-Min-Version": str(v + 1), "X-Stitch-Wait-S": "0.5"})
    assert (
        early.status_code == 409
        and early.json()["type"] == "WeightVersionNotReady"
        and early.json()["applied_version"] == v
    )
    held: dict[str, httpx.Response] = {}
    waiter = threading.Thread(
        target=lambda: held.update(
            r=complete(
                sidecar.url, vllm_run_engine.model, {"X-Stitch-Min-Version": str(v + 1), "X-Stitch-Wait-S": "300"}
            )
        )
    )
    waiter.start()
    sidecar.wait_status(lambda s: s["requests_waiting"] == 1, "the request for the next version held", 60)
    assert waiter.is_alive() and sidecar.status()["requests_in_flight"] == 0, "the request was not held"
    assert vllm_run.step() == v + 1  # trains for a few seconds, then publishes
    waiter.join(600)
    answer = held["r"]
    assert answer.status_code == 200, answer.text
    assert (answer.json()["weight_version_start"], answer.json()["weight_version_end"]) == (v + 1, v + 1)
    assert (answer.headers["X-Stitch-Version-Start"], answer.headers["X-Stitch-Version-End"]) == (
        str(v + 1),
        str(v + 1),
    )
    assert (
        sidecar.status()["applied_version"] == v + 1 and "stitch_sidecar_requests_held_total 1.0" in sidecar.metrics()
    )
    passed = complete(sidecar.url, vllm_run_engine.model, {"X-Stitch-Exact-Version": str(v)})
    assert passed.status_code == 409 and passed.json()["type"] == "WeightVersionPassed"
    assert (
        complete(sidecar.url, vllm_run_engine.model, {"X-Stitch-Exact-Version": str(v + 1)}).json()[
            "weight_version_end"
        ]
        == v + 1
    )
    assert_verified(vllm_run_engine.url, vllm_run, v + 1)


def _requests_across_a_commit(sidecar, run, model: str) -> int:
    """A streamed and a plain request of 200 tokens through ``sidecar`` overlap the commit of
    the next version v + 1 and complete, whole, stamped start v, end v + 1; returns v + 1.

    The version is encoded and uploaded before the requests start and committed once both
    generate (:mod:`commit_overlap`), so only the sidecar's sync (staging ~0.5 s, pause ~0.1 s)
    overlaps their 200 tokens (~45 s on CI's 2 cores; the version was applied after 8 of them
    there). Should they still end first, the try shows nothing either way and is repeated with
    the next version, at most 3 times.
    """
    tokens = 200
    for attempt in range(3):
        v = run.latest
        sidecar.wait_applied(v)
        run.train()
        held = run.publish_held()
        try:
            held.wait_ready()
            requests = LongRequests(sidecar.url, model, PROMPT, tokens)
            requests.wait_generating(sidecar.status)
        except BaseException:
            held.abort()  # the module's publisher must not stay blocked for the next tests
            raise
        assert held.commit() == v + 1
        sidecar.wait_applied(v + 1)
        overlapped = requests.alive()
        print(f"try {attempt + 1}: version {v + 1} applied after {len(requests.events)} of {tokens} streamed tokens")
        requests.join()
        assert not requests.failures, requests.failures
        if overlapped:
            break
        print(f"try {attempt + 1}: the requests ended first; trying again")
    else:
        pytest.fail(
            f"in 3 tries the requests never overlapped a commit: the sidecar's sync takes longer than {tokens} tokens"
        )
    events = requests.events
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    last = [e for e in events if e.get("choices")][-1]
    assert usage["completion_tokens"] == tokens and last["choices"][0]["finish_reason"] == "length", (
        "the streamed request was cut short"
    )
    assert (events[-1]["weight_version_start"], events[-1]["weight_version_end"]) == (v, v + 1)
    answer = requests.plain.json()
    assert answer["usage"]["completion_tokens"] == tokens and answer["choices"][0]["finish_reason"] == "length"
    assert (answer["weight_version_start"], answer["weight_version_end"]) == (v, v + 1)
    assert sidecar.status()["last_sync"]["to_version"] == v + 1
    return v + 1


def test_requests_in_flight_across_a_commit_complete_with_both_versions(vllm_run_engine, vllm_run, vllm_sidecars):
    """vLLM's pause (mode=keep) keeps running requests through the commit; they are stamped start v, end v + 1."""
    sidecar = vllm_sidecars(vllm_run_engine.url)
    assert_verified(vllm_run_engine.url, vllm_run, _requests_across_a_commit(sidecar, vllm_run, vllm_run_engine.model))


def test_restarted_sidecar_does_not_reapply(vllm_run_engine, vllm_run, vllm_sidecars):
    """A new sidecar asks the engine what it holds (DESIGN.md invariant 7): nothing is applied again."""
    first = vllm_sidecars(vllm_run_engine.url)
    v = vllm_run.latest
    first.wait_applied(v)
    first.stop()
    second = vllm_sidecars(vllm_run_engine.url, boot_version=0)  # ignored: the engine records its version
    second.proc.wait_healthy(120)
    status = second.status()
    assert (status["applied_version"], status["target_version"], status["state"], status["last_sync"]) == (
        v,
        v,
        "idle",
        None,
    )
    metrics = second.metrics()
    assert "stitch_sidecar_commits_total{" not in metrics and not re.search(
        r"stitch_sidecar_pause_seconds_count\{route=\"\w+\"\} [1-9]", metrics
    )
    assert "engine at version" not in second.proc.log_tail(100_000)
    assert_verified(vllm_run_engine.url, vllm_run, v)


def test_two_sidecars_on_one_engine_only_the_lease_holder_changes_it(vllm_run_engine, vllm_run, vllm_sidecars):
    """Issue #27 part B on a real engine. Of two sidecars on one engine exactly one holds the
    lease: the other answers /health 503 ``standby`` naming the holder (metrics too), its gate
    stays closed and none of its commits reaches the engine (it makes none) while the holder's
    requests across a commit are stamped start v, end v + 1. Killed (-9: nothing released), the
    holder's lease lapses after the TTL and the other takes the engine over with no manual step
    (the engine's record checked against the manifest, nothing applied again), then syncs bit-exact."""
    first = vllm_sidecars(vllm_run_engine.url)
    first.wait_applied(vllm_run.latest)
    holder = first.lease()
    assert holder["held"] and holder["holder"] == holder["owner"]
    second = vllm_sidecars(vllm_run_engine.url)
    body = second.wait_standby(holder["owner"])
    assert body["applied_version"] is None and not body["lease"]["held"]
    assert 0 < body["lease"]["holder_expires_in_s"] <= 5.0  # the default TTL
    metrics = second.metrics()
    assert "stitch_sidecar_lease_held 0.0" in metrics and f'holder="{holder["owner"]}"' in metrics
    refused = complete(second.url, vllm_run_engine.model, {"X-Stitch-Wait-S": "0.5"})
    assert refused.status_code == 503 and refused.json()["type"] == "NotReady"

    v = _requests_across_a_commit(first, vllm_run, vllm_run_engine.model)
    assert_verified(vllm_run_engine.url, vllm_run, v)
    status = second.status()
    assert (status["applied_version"], status["last_sync"]) == (None, None)
    assert "stitch_sidecar_commits_total{" not in second.metrics() and "engine at version" not in second.proc.log_tail(
        100_000
    )
    assert second.wait_standby(holder["owner"])["lease"]["holder"] == holder["owner"]

    os.kill(first.proc.proc.pid, signal.SIGKILL)
    first.proc.proc.wait(30)
    taken = second.wait_applied(v)  # once the killed sidecar's lease lapsed
    assert taken["last_sync"] is None, "the engine's version was applied again on takeover"
    lease = second.lease()
    assert lease["held"] and lease["owner"] != holder["owner"]
    assert vllm_run.step() == v + 1
    second.wait_applied(v + 1)
    assert_verified(vllm_run_engine.url, vllm_run, v + 1)
    assert (
        complete(second.url, vllm_run_engine.model, {"X-Stitch-Exact-Version": str(v + 1)}).json()["weight_version_end"]
        == v + 1
    )


def test_control_routes_are_forbidden_through_the_proxy(vllm_run_engine, vllm_run, vllm_sidecars):
    """The engine's control and dev routes answer 403 through the sidecar, and the engine is untouched."""
    sidecar = vllm_sidecars(vllm_run_engine.url)
    v = vllm_run.latest
    sidecar.wait_applied(v)
    rpc = {"method": "stitch_set_version", "args": [json.dumps({"version": v + 7})]}
    routes = [
        ("POST", "/pause", {"mode": "abort"}, None), ("POST", "/resume", None, None), ("GET", "/is_paused", None, None),
        ("POST", "/collective_rpc", None, rpc), ("POST", "/reset_prefix_cache", None, None),
        ("POST", "/sleep", None, None),
        ("POST", "/wake_up", None, None), ("POST", "/update_weights", None, {}),
        ("POST", "/start_weight_update", None, {}),
        ("POST", "/abort_requests", None, {}), ("POST", "/update_weight_version", None, {}),
    ]  # fmt: skip
    engine_routes = httpx.get(f"{vllm_run_engine.url}/openapi.json", timeout=30).json()["paths"]
    assert {path for _, path, _, _ in routes} <= set(engine_routes), "the engine serves every one of them"
    for method, path, params, body in routes:
        r = httpx.request(method, f"{sidecar.url}{path}", params=params, json=body, timeout=30)
        assert r.status_code == 403 and r.json()["type"] == "RouteForbidden", (path, r.text)
    assert not httpx.get(f"{vllm_run_engine.url}/is_paused", timeout=30).json()["is_paused"]
    assert_verified(vllm_run_engine.url, vllm_run, v)
    assert complete(sidecar.url, vllm_run_engine.model).status_code == 200


def test_routing_asked_of_a_dense_model_is_refused_by_name(vllm_run_engine, vllm_run, vllm_sidecars):
    """SmolLM2 has no experts: ``return_routed_experts`` gets 400 RoutedExpertsRefused naming the model."""
    sidecar = vllm_sidecars(vllm_run_engine.url)
    sidecar.wait_applied(vllm_run.latest)
    r = httpx.post(
        f"{sidecar.url}/v1/completions",
        json={"model": vllm_run_engine.model, "prompt": "Hi", "max_tokens": 2, "return_routed_experts": True},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["type"] == "RoutedExpertsRefused", r.text
    assert vllm_run_engine.model in r.json()["message"], r.text


def test_corrupted_bulletin_file_is_rejected_before_touching_the_engine(vllm_run_engine, vllm_run, vllm_sidecars):
    """Wrong bytes stored under a patch's sha256: staging refuses them, the engine is never paused and
    keeps its version and answers; once the store is repaired the sidecar gets through on its own."""
    first = vllm_sidecars(vllm_run_engine.url)
    v = vllm_run.latest
    first.wait_applied(v)
    first.stop()  # so the next version is first seen once its file is corrupted in the store
    before = vllm_run_engine.greedy()
    assert vllm_run.step() == v + 1
    (patch,) = [f for f in vllm_run.client.manifest(vllm_run.run, v + 1).files if f.role == "patch"]
    blob = vllm_run.store / "runs" / vllm_run.run / "blobs" / patch.sha256
    with corrupted(blob):  # bit rot: wrong bytes stored under the sha256; repaired when the block ends
        sidecar = vllm_sidecars(vllm_run_engine.url)
        status = sidecar.wait_status(
            lambda s: (s["last_error"] or {}).get("type") == "BlobMismatch", "the checksum mismatch reported"
        )
        assert (status["applied_version"], status["target_version"]) == (v, v + 1)
        assert not re.search(r"stitch_sidecar_pause_seconds_count\{route=\"\w+\"\} [1-9]", sidecar.metrics()), (
            "the engine was paused"
        )
        assert httpx.get(f"{sidecar.url}/health", timeout=30).status_code == 200  # still serving verified version v
        assert_verified(vllm_run_engine.url, vllm_run, v)
        assert vllm_run_engine.greedy() == before
    sidecar.wait_applied(v + 1)
    assert_verified(vllm_run_engine.url, vllm_run, v + 1)


def test_sidecar_killed_with_the_engine_paused_recovers(vllm_run_engine, vllm_run, vllm_sidecars, adapter):
    """Fault phase ``paused``: the sidecar dies right after pausing the engine, releasing nothing;
    the next one waits out the dead one's lease (TTL 20 s here), then resumes the engine and syncs."""
    # The engine at the run's latest version first: tests run before this one (the engine-crash tests, as
    # make test-left-out orders them) publish versions the session's engine did not apply, and the armed
    # sidecar would pause (and die) catching up instead of at the version this test publishes.
    catch_up = vllm_sidecars(vllm_run_engine.url)
    catch_up.wait_applied(vllm_run.latest)
    catch_up.stop()
    first = vllm_sidecars(vllm_run_engine.url, fault_phase="paused", lease_ttl_s=20)
    v = vllm_run.latest
    first.wait_applied(v)
    dead = first.lease()["owner"]
    assert vllm_run.step() == v + 1
    assert first.proc.proc.wait(300) == SIDECAR_FAULT_EXIT
    assert "sidecar exiting at phase paused" in first.proc.log_tail(100_000)
    assert (adapter.state().version, adapter.state().phase) == (v, "paused")
    second = vllm_sidecars(vllm_run_engine.url)
    standby = second.wait_standby(dead)  # the engine stays paused, untouched, until the dead sidecar's lease lapses
    assert standby["applied_version"] is None and adapter.state().phase == "paused"
    status = second.wait_applied(v + 1)
    assert status["healthy"] and status["last_sync"]["from_version"] == v
    assert not httpx.get(f"{vllm_run_engine.url}/is_paused", timeout=30).json()["is_paused"]
    assert_verified(vllm_run_engine.url, vllm_run, v + 1)
    assert complete(second.url, vllm_run_engine.model, {"X-Stitch-Exact-Version": str(v + 1)}).status_code == 200


class EngineChain:
    """Fresh engines from the checkpoint (version 0) for the engine-crash tests, one at a time.

    An engine is armed (``STITCH_ENGINE_FAULT_PHASE`` and ``STITCH_ENGINE_FAULT_VERSION``) to die at one
    phase of the apply of one version; the engine started to recover from that crash is
    already armed for the next test's phase and version.
    """

    def __init__(self, model_dir: Path, logs: Path) -> None:
        self.model_dir, self.logs = model_dir, logs
        self.server: VllmServer | None = None
        self.armed: tuple[str | None, int] | None = None

    def start(self, phase: str | None, version: int) -> VllmServer:
        """Stop the current engine, start a fresh one armed for ``phase`` (None: unarmed) at ``version``."""
        self.stop()
        env = {FAULT_ENV: phase, FAULT_VERSION_ENV: str(version)} if phase else {}
        self.server = VllmServer(self.model_dir, self.logs / f"engine-{phase}-v{version}.log", env=env)
        self.armed = (phase, version)
        self.server.wait_ready()
        return self.server

    def armed_for(self, phase: str, version: int) -> VllmServer:
        """The current engine if it is armed for ``phase`` at ``version``, else a fresh one that is."""
        return self.server if self.armed == (phase, version) else self.start(phase, version)

    def unarmed(self) -> VllmServer:
        """The current engine if it is not armed to die, else a fresh unarmed one."""
        if self.server is not None and self.armed is not None and self.armed[0] is None:
            return self.server
        return self.start(None, 0)

    def kill_and_restart(self) -> VllmServer:
        """SIGKILL the current engine's process group, then start the same command on the same
        port (from its boot checkpoint, version 0): what a crashed and restarted engine is."""
        assert self.server is not None
        old = self.server
        os.killpg(old.proc.pid, signal.SIGKILL)
        old.proc.wait(60)
        old.stop()
        self.server = VllmServer(
            self.model_dir, self.logs / f"engine-restarted-{old.port}-{time.monotonic_ns()}.log", port=old.port
        )
        self.armed = (None, 0)
        self.server.wait_ready()
        return self.server

    def stop(self) -> None:
        """Stop the current engine, if any."""
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture(scope="module")
def engine_chain(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineChain]:
    """The module's :class:`EngineChain` (its last engine is stopped at the end)."""
    chain = EngineChain(smollm2_dir, tmp_path_factory.mktemp("engine-chain"))
    yield chain
    chain.stop()


@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_engine_killed_mid_apply_recovers_to_a_verified_version(phase, engine_chain, vllm_run, vllm_sidecars):
    """The engine dies at ``phase`` of an apply; the sidecar claims no version while it is down;
    restarted from its boot checkpoint, with a restarted sidecar, it ends verified at the target."""
    v = vllm_run.latest + 1
    engine = engine_chain.armed_for(phase, v)
    first = vllm_sidecars(engine.url, boot_version=0)
    first.wait_applied(v - 1)
    assert vllm_run.step() == v
    engine.proc.wait(300)
    assert f"exiting at phase {phase} of version {v}" in engine.log_tail(500_000)
    status = first.wait_status(lambda s: s["applied_version"] is None, "no version claimed while the engine is down")
    assert not status["healthy"] and httpx.get(f"{first.url}/health", timeout=30).status_code == 503
    first.stop()
    following = FAULT_PHASES.index(phase) + 1
    engine = engine_chain.start(
        FAULT_PHASES[following] if following < len(FAULT_PHASES) else None, v + 1
    )  # restarted from its boot checkpoint
    second = vllm_sidecars(engine.url, boot_version=0)
    status = second.wait_applied(v)
    assert status["healthy"] and status["target_version"] == v
    assert_verified(engine.url, vllm_run, v)
    assert complete(second.url, engine.model, {"X-Stitch-Exact-Version": str(v)}).status_code == 200


def _pinned(url: str, model: str, version: int) -> dict:
    """A greedy completion with logprobs pinned to exactly ``version`` (held up to 300 s)."""
    answer = complete(url, model, {"X-Stitch-Exact-Version": str(version), "X-Stitch-Wait-S": "300"}, logprobs=5)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["weight_version_start"], body["weight_version_end"]) == (version, version)
    return {"text": body["choices"][0]["text"], "logprobs": body["choices"][0]["logprobs"]}


def test_engine_restarted_under_a_running_sidecar_is_never_served_under_the_old_version(
    engine_chain, vllm_run, vllm_sidecars
):
    """Reliability, part A, on a real engine. (1) The engine is killed (-9) and started again on
    the same port from its boot checkpoint while a sidecar claims version v: a request pinned to v
    is answered only once the engine holds v again, bit for bit the same answer as before the
    restart. (2) With the periodic check off, a restart followed by an empty delta (a flip) and a
    one-tensor delta: the flip is never recorded on the restarted engine (its record is not the
    flip's base), and the engine ends with every bit of the last version."""
    engine = engine_chain.unarmed()
    first = vllm_sidecars(engine.url, boot_version=0)
    v = vllm_run.step()
    first.wait_applied(v)
    before = _pinned(first.url, engine.model, v)
    engine = engine_chain.kill_and_restart()
    assert _pinned(first.url, engine.model, v) == before, "answered by other weights than version v's"
    first.wait_applied(v)
    assert "stitch_sidecar_claims_dropped_total 1.0" in first.metrics()
    assert_verified(engine.url, vllm_run, v)
    first.stop()

    second = vllm_sidecars(engine.url, boot_version=0, engine_check_interval_s=3600)
    second.wait_applied(v)
    owner = second.lease()["owner"]  # before the restart: /health checks the engine too
    engine = engine_chain.kill_and_restart()
    adapter = VllmEngine(engine.url, timeout_s=60)
    try:
        adapter.take_lease(owner, 10.0)  # acting for the sidecar, which renews its lease on the new engine
        with pytest.raises(EngineStateError):
            adapter.set_version(v + 1, v)  # the restarted engine does not record v: no flip onto it
        # None, or 0 once the sidecar (whose lease renewal can reach the new engine first) has
        # verified the boot checkpoint's bits against version 0's manifest and recorded it
        assert adapter.state().version in (None, 0)
    finally:
        adapter.close()
    vllm_run.trainer.steps += 1  # a new step (the same step and weights again would be a no-op: bulletin/steps.py)
    assert vllm_run.publish() == v + 1  # the same weights again: an empty delta
    v0, now = vllm_run.sums(0), vllm_run.sums(v)
    untouched = sorted(n for n in v0 if v0[n] == now[n] and n in dict(vllm_run.trainer.model.named_parameters()))
    assert untouched, "every tensor changed since version 0"
    import torch

    with torch.no_grad():
        param = dict(vllm_run.trainer.model.named_parameters())[untouched[0]]
        param.view(-1)[0] += max(1.0, float(param.view(-1)[0].abs()))  # one element of one tensor, far past a bf16 step
    vllm_run.trainer.steps += 1  # a new step (the same step with other weights is refused)
    assert vllm_run.publish() == v + 2
    second.wait_applied(v + 2)
    assert "stitch_sidecar_claims_dropped_total 1.0" in second.metrics(), "the commit did not notice the restart"
    assert_verified(engine.url, vllm_run, v + 2)
