"""prime-rl's LoRA routes and TRL's adapter names on a sidecar following an adapter run
(``sidecar/admin_prime_rl_lora.py``, ``sidecar/adapter_alias.py``).

A real sidecar over the fake engine (its ServesAdapters seam) and a real bulletin, over loopback HTTP. The adapter
run's versions record the trainer's step in their manifests, as prime-rl's broadcast folders are published; prime-rl
sends ``POST /load_lora_adapter {lora_name, lora_path}`` then requests naming ``lora_name``, and
``POST /v1/unload_lora_adapter {lora_name}``; TRL's AsyncGRPOTrainer asks for ``trl-policy-v{N}``.
"""

from __future__ import annotations

import httpx

from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import mutate, wait_for
from tests.sidecar.test_admin_prime_rl import ON, publish_step
from tests.sidecar.test_sidecar_adapters import BASE, AdapterPublisher, _lora_view, _spec


def _complete(sidecar, model: str) -> httpx.Response:
    return sidecar.http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2})


def _in_use(sidecar) -> dict:
    return sidecar.http.get("/health").json()["adapters"]["in_use"]


def test_prime_rl_loads_pins_and_unloads_a_steps_version(sc_publisher, sc_start) -> None:
    lora = AdapterPublisher(sc_publisher, _spec(BASE))
    run = lora.run
    publish_step(lora, _lora_view(1), 0)
    engine = FakeEngine(BASE)
    sidecar = sc_start(engine, adapter_resident=2, **ON)
    wait_for(lambda: engine.loaded_adapters() == [f"{run}@0"], 30, "version 0 resident")
    publish_step(lora, mutate(lora.views[-1], 1, 0.5), 10)
    wait_for(lambda: engine.loaded_adapters() == [f"{run}@0", f"{run}@1"], 30, "versions 0 and 1 resident")

    r = sidecar.http.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": "/out/broadcasts/step_10"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'policy' added successfully.", r.text
    answer = _complete(sidecar, "policy")
    assert answer.status_code == 200, answer.text
    assert answer.json()["echo_body"]["model"] == f"{run}@1" and answer.json()["weight_version_start"] == 1
    assert _in_use(sidecar) == {f"{run}@1": 1}  # the pin

    # TRL's name for version 0 is version 0; the base's name passes ungated.
    trl = _complete(sidecar, "trl-policy-v0")
    assert trl.status_code == 200 and trl.json()["echo_body"]["model"] == f"{run}@0", trl.text
    assert _complete(sidecar, "fake").json()["echo_body"]["model"] == "fake"

    # Two newer versions: version 1 is retired, but stays loaded while prime-rl's pin holds it.
    publish_step(lora, mutate(lora.views[-1], 2, 0.5), 20)
    publish_step(lora, mutate(lora.views[-1], 3, 0.5), 30)
    wait_for(lambda: engine.loaded_adapters() == [f"{run}@1", f"{run}@2", f"{run}@3"], 30, "v1 held by the pin")
    retired = lambda: sidecar.http.get("/health").json()["adapters"]["retired"] == [f"{run}@1"]
    wait_for(retired, 30, "v1 retired (after v3 loaded)")
    assert engine.loaded_adapters() == [f"{run}@1", f"{run}@2", f"{run}@3"]
    r = sidecar.http.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": "/out/broadcasts/step_30"})
    assert r.status_code == 200, r.text  # loaded again: the name and its pin move to version 3
    assert _complete(sidecar, "policy").json()["echo_body"]["model"] == f"{run}@3"
    wait_for(lambda: engine.loaded_adapters() == [f"{run}@2", f"{run}@3"], 30, "v1 unloaded once unpinned")
    assert _in_use(sidecar) == {f"{run}@3": 1}

    r = sidecar.http.post("/v1/unload_lora_adapter", json={"lora_name": "policy"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'policy' removed successfully.", r.text
    assert _in_use(sidecar) == {}
    gone = _complete(sidecar, "policy")  # no longer an alias: not this run's name, passed to the engine as is
    assert gone.status_code == 404, gone.text
    r = sidecar.http.post("/v1/unload_lora_adapter", json={"lora_name": "policy"})
    assert r.status_code == 404 and r.json()["type"] == "AdapterNotLoaded" and r.json()["loaded"] == [], r.text

    # A step whose version is no longer resident never comes back; bad bodies name their field.
    r = sidecar.http.post("/load_lora_adapter", json={"lora_name": "old", "lora_path": "/out/broadcasts/step_0"})
    assert r.status_code == 409 and r.json()["type"] == "WeightVersionPassed", r.text
    assert r.json()["resident"] == [f"{run}@2", f"{run}@3"]
    r = sidecar.http.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/out/latest"})
    assert r.status_code == 422 and r.json()["field"] == "lora_path", r.text
    r = sidecar.http.post("/load_lora_adapter", json={"lora_path": "/out/broadcasts/step_30"})
    assert r.status_code == 422 and r.json()["field"] == "lora_name", r.text
    assert _in_use(sidecar) == {} and engine.count("pause") == 0


def test_a_step_not_published_in_time_is_503(sc_publisher, sc_start) -> None:
    lora = AdapterPublisher(sc_publisher, _spec(BASE))
    publish_step(lora, _lora_view(1), 0)
    engine = FakeEngine(BASE)
    sidecar = sc_start(engine, adapter_resident=2, admin_update_wait_s=0.5, **ON)
    wait_for(lambda: engine.loaded_adapters() == [f"{lora.run}@0"], 30, "version 0 resident")
    r = sidecar.http.post("/load_lora_adapter", json={"lora_name": "p", "lora_path": "/out/broadcasts/step_5"})
    assert r.status_code == 503 and r.json()["type"] == "StepNotApplied" and r.json()["step"] == 5, r.text
    assert _in_use(sidecar) == {}
