"""An adapter run served beside a base model (issue #31): the fake engine's ServesAdapters seam, a real bulletin.

Versions of an adapter run (PEFT-named bf16 tensors, manifests carrying an ``AdapterSpec``) are
published to a real bulletin on loopback; the sidecar rebuilds each version in its memory, writes
the PEFT folder, and the fake engine loads it, checking every tensor's checksum and keeping a
copy, so what the engine serves is compared bit for bit with what was published. Requests go
through the sidecar over real HTTP.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import NotFoundError
from stitchboard.proto.adapter import AdapterSpec, view_checksum
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor
from stitchboard.proto.schema import VersionManifest
from stitchboard.sidecar.adapter_set import ResidentAdapters
from stitchboard.sidecar.engines.base import ServesAdapters
from stitchboard.sidecar.engines.sglang import ADAPTERS_UNSUPPORTED
from stitchboard.sidecar.errors import InvalidVersionConstraintError
from stitchboard.sidecar.gate import Gate, VersionConstraint
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import Publisher, make_view, mutate, same_bits, wait_for

BASE = make_view(seed=7)
TARGETS = ["k_proj", "q_proj"]


def _lora_view(seed: int, r: int = 4) -> dict[str, RawTensor]:
    # PEFT's saved names: lora_A [r, in], lora_B [out, r], bf16 bits.
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(2):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            out[f"{prefix}.lora_A.weight"] = RawTensor("BF16", (r, 64), rng.integers(0, 1 << 16, r * 64, np.uint16))
            out[f"{prefix}.lora_B.weight"] = RawTensor("BF16", (64, r), rng.integers(0, 1 << 16, 64 * r, np.uint16))
    return out


def _spec(base: dict[str, RawTensor]) -> AdapterSpec:
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8.0,
        "use_rslora": False,
        "target_modules": TARGETS,
        "base_model_name_or_path": "fake",
        "task_type": "CAUSAL_LM",
        "lora_dropout": 0.0,
    }
    checksums = {n: checksum(t) for n, t in base.items()}
    return AdapterSpec(
        base_model="fake", base_checksum=view_checksum(checksums), r=4, lora_alpha=8.0, target_modules=TARGETS,
        config=config,
    )  # fmt: skip


class AdapterPublisher(Publisher):
    """Publishes versions of an adapter run: the test publisher's manifests with the run's ``adapter``."""

    def __init__(self, publisher: Publisher, spec: AdapterSpec) -> None:
        super().__init__(publisher.client, publisher.run, publisher.workdir)
        self.spec = spec

    def prepare(self, view, *, anchor=False, patch_files=1) -> VersionManifest:
        manifest = super().prepare(view, anchor=anchor, patch_files=patch_files)
        return VersionManifest.model_validate({**manifest.model_dump(), "adapter": self.spec.model_dump()})


@pytest.fixture
def lora(sc_publisher: Publisher) -> AdapterPublisher:
    pub = AdapterPublisher(sc_publisher, _spec(BASE))
    pub.publish(_lora_view(1))
    return pub


def _health(sidecar) -> dict:
    return sidecar.http.get("/health").json()


def _resident(sidecar, names: list[str], timeout_s: float = 30.0) -> dict:
    return wait_for(
        lambda: (h := _health(sidecar)).get("adapters", {}).get("resident") == names and h,
        timeout_s,
        f"resident {names} (health {_health(sidecar)})",
    )


def _complete(sidecar, model: str, **extra) -> httpx.Response:
    return sidecar.http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2, **extra})


def _stream_in_thread(sidecar, model: str, tokens: int) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def go() -> None:
        body = {"model": model, "prompt": "x", "max_tokens": tokens, "stream": True}
        out["response"] = sidecar.http.post("/v1/completions", json=body, timeout=60)

    thread = threading.Thread(target=go)
    thread.start()
    return thread, out


def test_fake_engine_serves_adapters() -> None:
    assert isinstance(FakeEngine(BASE), ServesAdapters)


def test_resident_set_routing_eviction_and_held_unload(sc_start, lora: AdapterPublisher, tmp_path: Path) -> None:
    """Two versions resident (K = 2, 3 slots): a booting sidecar loads the last two published, oldest first;
    eviction oldest first, requests by run@N and by run + min_version, 409 listing the residents, the base
    ungated, /v1/models; a version in use stays loaded until its request ends, and a load waits while every
    slot is held."""
    run = lora.run
    engine = FakeEngine(BASE, token_delay_s=0.05)
    lora.publish(mutate(lora.views[-1], 1, 0.5))
    lora.publish(mutate(lora.views[-1], 2, 0.5))
    sidecar = sc_start(engine, adapter_resident=2, engine_check_interval_s=0.2)
    _resident(sidecar, [f"{run}@1", f"{run}@2"])  # versions 0, 1, 2 published: the last K = 2 loaded at boot
    for v in (1, 2):
        assert same_bits(engine.adapters[f"{run}@{v}"], lora.views[v])
    assert engine.adapter_configs[f"{run}@1"] == lora.spec.config
    assert not list((tmp_path / "handoff").rglob("adapter_model.safetensors")), "the PEFT folder was not removed"

    lora.publish(mutate(lora.views[-1], 3, 0.5))
    _resident(sidecar, [f"{run}@2", f"{run}@3"])
    wait_for(lambda: engine.loaded_adapters() == [f"{run}@2", f"{run}@3"], 10, "v1 unloaded")
    loads = [a[0] for m, a in engine.calls if m == "load_adapter"]
    unloads = [a[0] for m, a in engine.calls if m == "unload_adapter"]
    assert loads == [f"{run}@1", f"{run}@2", f"{run}@3"] and unloads == [f"{run}@1"]
    assert engine.calls.index(("load_adapter", (f"{run}@3",))) < engine.calls.index(("unload_adapter", (f"{run}@1",)))
    for v in (2, 3):
        assert same_bits(engine.adapters[f"{run}@{v}"], lora.views[v])
    assert engine.count("pause") == 0, "an adapter update paused the engine"

    pinned = _complete(sidecar, f"{run}@2")
    assert pinned.status_code == 200, pinned.text
    body = pinned.json()
    assert body["echo_body"]["model"] == f"{run}@2"
    assert (body["weight_version_start"], body["weight_version_end"]) == (2, 2)
    assert f"+{run}@2:" in body["choices"][0]["text"]
    newest = _complete(sidecar, run).json()
    assert newest["echo_body"]["model"] == f"{run}@3" and newest["weight_version_start"] == 3
    at_least = _complete(sidecar, run, weight_version={"min_version": 2}).json()
    assert at_least["echo_body"]["model"] == f"{run}@3"
    future = _complete(sidecar, run, weight_version={"min_version": 4, "wait_s": 0.3})
    assert future.status_code == 409 and future.json()["type"] == "WeightVersionNotReady"
    gone = _complete(sidecar, f"{run}@1")
    assert gone.status_code == 409, gone.text
    assert gone.json()["type"] == "WeightVersionPassed"
    assert gone.json()["resident"] == [f"{run}@2", f"{run}@3"]
    exact_gone = _complete(sidecar, run, weight_version={"exact_version": 0})
    assert exact_gone.status_code == 409 and exact_gone.json()["type"] == "WeightVersionPassed"
    conflict = _complete(sidecar, f"{run}@2", weight_version={"exact_version": 3})
    assert conflict.status_code == 400 and conflict.json()["type"] == "InvalidVersionConstraint"
    base = _complete(sidecar, "fake", weight_version={"min_version": 99})
    assert base.status_code == 200 and "x-stitch-version-start" not in base.headers
    assert "+" not in base.json()["choices"][0]["text"] and base.json()["echo_body"]["model"] == "fake"
    models = [m["id"] for m in sidecar.http.get("/v1/models").json()["data"]]
    assert models == ["fake", f"{run}@2", f"{run}@3"]

    # A request on v2 and one on v3 hold them; v4 loads into the free slot and v2 is retired, not unloaded.
    on_2, out_2 = _stream_in_thread(sidecar, f"{run}@2", 40)
    on_3, out_3 = _stream_in_thread(sidecar, f"{run}@3", 40)
    wait_for(lambda: _health(sidecar)["adapters"]["in_use"] == {f"{run}@2": 1, f"{run}@3": 1}, 10, "both in use")
    lora.publish(mutate(lora.views[-1], 4, 0.5))
    health = _resident(sidecar, [f"{run}@3", f"{run}@4"])
    assert health["adapters"]["retired"] == [f"{run}@2"] and f"{run}@2" in engine.loaded_adapters()
    retired = _complete(sidecar, f"{run}@2")
    assert retired.status_code == 409 and retired.json()["resident"] == [f"{run}@3", f"{run}@4"]
    on_4, out_4 = _stream_in_thread(sidecar, f"{run}@4", 40)
    wait_for(lambda: _health(sidecar)["adapters"]["in_use"].get(f"{run}@4") == 1, 10, "v4 in use")
    # Every slot holds a version in use: v5 waits, and /health says so.
    lora.publish(mutate(lora.views[-1], 5, 0.5))
    waiting = wait_for(lambda: _health(sidecar)["adapters"]["waiting_load"], 10, "the waiting load on /health")
    assert "slots" in waiting and engine.loaded_adapters() == [f"{run}@2", f"{run}@3", f"{run}@4"]
    for thread in (on_2, on_3, on_4):
        thread.join(60)
    for out, v in ((out_2, 2), (out_3, 3), (out_4, 4)):
        text = out["response"].text
        assert out["response"].status_code == 200 and text.count(f"+{run}@{v}:") == 40, text[-300:]
        assert f'"weight_version_start":{v},"weight_version_end":{v}' in text, text[-300:]
    health = _resident(sidecar, [f"{run}@4", f"{run}@5"])
    assert health["adapters"]["waiting_load"] is None
    wait_for(lambda: engine.loaded_adapters() == [f"{run}@4", f"{run}@5"], 10, "v2 and v3 unloaded")
    assert health["status"] == "ok" and health["applied_version"] == 5
    fleet = lambda: httpx.get(f"{lora.client.url}/v1/runs/{run}/replicas").json()["replicas"]
    wait_for(lambda: [r["report"]["adapters"] for r in fleet()] == [[f"{run}@4", f"{run}@5"]], 10, "the fleet report")


class _GoneVersion(BulletinClient):
    """A bulletin client that finds no route to one version (as after gc), at our seam."""

    gone = 1

    def plan(self, run, from_version, to_version, *args, **kwargs):
        if to_version == self.gone:
            raise NotFoundError(f"run {run!r} has no route to version {to_version} (test)")
        return super().plan(run, from_version, to_version, *args, **kwargs)


def test_an_older_version_without_a_route_is_skipped_at_boot(sc_start, sc_bulletin, lora: AdapterPublisher) -> None:
    run = lora.run
    lora.publish(mutate(lora.views[-1], 1, 0.5))
    lora.publish(mutate(lora.views[-1], 2, 0.5))
    with _GoneVersion(sc_bulletin.url, retries=1, backoff_s=0.01) as client:
        sidecar = sc_start(FakeEngine(BASE), client=client, adapter_resident=2, engine_check_interval_s=0.2)
        _resident(sidecar, [f"{run}@2"])
        assert [a[0] for m, a in sidecar.engine.calls if m == "load_adapter"] == [f"{run}@2"]
        sidecar.stop()


def test_failed_load_keeps_previous_and_restart_reloads(sc_start, lora: AdapterPublisher) -> None:
    run = lora.run
    engine = FakeEngine(BASE)
    sidecar = sc_start(engine, adapter_resident=2, engine_check_interval_s=0.2)
    _resident(sidecar, [f"{run}@0"])
    lora.publish(mutate(lora.views[-1], 1, 0.5))
    _resident(sidecar, [f"{run}@0", f"{run}@1"])

    engine.fail_adapter_loads = 10**6
    lora.publish(mutate(lora.views[-1], 2, 0.5))
    failed = wait_for(lambda: _health(sidecar)["adapters"]["last_failed_load"], 10, "the failed load on /health")
    assert failed["type"] == "AdapterLoadFailed" and f"{run}@2" in failed["message"]
    health = _health(sidecar)
    assert health["adapters"]["resident"] == [f"{run}@0", f"{run}@1"] and health["status"] == "ok"
    assert _complete(sidecar, run).json()["echo_body"]["model"] == f"{run}@1"
    engine.fail_adapter_loads = 0
    health = _resident(sidecar, [f"{run}@1", f"{run}@2"])
    assert health["adapters"]["last_failed_load"] is None

    # The lease is lost to another owner for a moment (same engine instance): taken back, the
    # versions the engine verified and pinned are kept, not loaded again.
    loads = engine.count("load_adapter")
    engine.lease.release(engine._owner)
    engine.lease.take("intruder", 1.0)
    wait_for(lambda: not _health(sidecar)["lease"]["held"], 10, "the lease lost")
    wait_for(lambda: _health(sidecar)["lease"]["held"] and _health(sidecar)["status"] == "ok", 20, "the lease back")
    assert engine.count("load_adapter") == loads and engine.loaded_adapters() == [f"{run}@1", f"{run}@2"]

    # The engine restarts (a new instance holding only its base): the resident versions are loaded
    # again and verified before an adapter request is admitted.
    # (The sidecar sees the new instance at its next engine check, engine_check_interval_s.)
    loads = engine.count("load_adapter")
    engine.restart(BASE)
    assert engine.loaded_adapters() == []
    wait_for(lambda: engine.loaded_adapters() == [f"{run}@1", f"{run}@2"], 20, "the resident versions loaded again")
    assert engine.count("load_adapter") == loads + 2
    answer = _complete(sidecar, f"{run}@1", weight_version={"wait_s": 20})
    assert answer.status_code == 200, answer.text
    for v in (1, 2):
        assert same_bits(engine.adapters[f"{run}@{v}"], lora.views[v])
    assert f"+{run}@1:" in answer.json()["choices"][0]["text"]


def test_adapter_run_for_another_base_is_refused(sc_start, lora: AdapterPublisher) -> None:
    other = FakeEngine(make_view(seed=8))
    sidecar = sc_start(other)
    health = wait_for(lambda: (h := _health(sidecar))["status"] == "unhealthy" and h, 20, "the refusal on /health")
    assert lora.spec.base_checksum in health["reason"] and "base model 'fake'" in health["reason"]
    assert view_checksum({n: checksum(t) for n, t in other.weights.items()}) in health["reason"]
    assert other.loaded_adapters() == [] and other.count("load_adapter") == 0
    assert _complete(sidecar, lora.run, weight_version={"wait_s": 0.2}).status_code in (409, 503)


class NoAdapterPower(FakeEngine):
    """An engine room without the ServesAdapters power (as SGLang's)."""

    adapter_slots = base_names = load_adapter = unload_adapter = loaded_adapters = None  # type: ignore[assignment]


def test_sglang_refuses_adapter_runs_with_its_reason(sc_start, lora: AdapterPublisher) -> None:
    engine = NoAdapterPower(BASE)
    assert not isinstance(engine, ServesAdapters)
    sidecar = sc_start(engine, engine="sglang")
    health = wait_for(lambda: (h := _health(sidecar))["status"] == "unhealthy" and h, 20, "the refusal on /health")
    assert ADAPTERS_UNSUPPORTED in health["reason"] and "the sglang engine cannot serve" in health["reason"]


def test_too_few_adapter_slots_are_refused(sc_start, lora: AdapterPublisher) -> None:
    engine = FakeEngine(BASE)
    engine.adapter_slots_n = 2
    sidecar = sc_start(engine, adapter_resident=2)
    health = wait_for(lambda: (h := _health(sidecar))["status"] == "unhealthy" and h, 20, "the refusal on /health")
    assert "holds 2 adapters at once" in health["reason"] and "needs 3" in health["reason"]
    assert engine.count("load_adapter") == 0


def test_resident_set_verdicts() -> None:
    """Resolution of ``<run>@<N>`` and ``<run>`` + constraint against the resident versions."""
    resident = ResidentAdapters("r", Gate())
    for v in (3, 5):
        resident.add(v)
    resident.retire(3)
    resident.add(6)

    def verdict(model: str, **constraint):
        ask = resident.ask_of({"model": model}, VersionConstraint(**constraint))
        return None if ask is None else resident.verdict(ask)

    assert verdict("base-model") is None and verdict("rr@1") is None
    assert verdict("r") == ("ok", 6) and verdict("r@5") == ("ok", 5)
    assert verdict("r", min_version=6) == ("ok", 6) and verdict("r", min_version=7) == ("wait", None)
    assert verdict("r@3") == ("passed", None), "a retired version is gone for good"
    assert verdict("r@4") == ("passed", None) and verdict("r@9") == ("wait", None)
    assert verdict("r", exact_version=5) == ("ok", 5)
    assert verdict("trl-policy-v5") == ("ok", 5) and verdict("trl-policy-v3") == ("passed", None)
    with pytest.raises(InvalidVersionConstraintError):
        verdict("r@5", min_version=6)
    with pytest.raises(InvalidVersionConstraintError):
        verdict("r@x")
    assert resident.names() == ["r@5", "r@6"] and resident.unused_retired() == [3]
    assert resident.gate.applied == 6
