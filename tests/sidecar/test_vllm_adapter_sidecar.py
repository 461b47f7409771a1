"""The sidecar's adapter mode in front of a real vLLM (CPU build) started with ``--enable-lora`` and 3 slots.

One engine start. An adapter run's versions (a real PEFT LoRA on SmolLM2, r 8 on q/k/v/o, random
A and B, then two small changes of its bf16 bits) are published to a real bulletin on loopback;
the sidecar (in process, real HTTP) rebuilds each version, writes its PEFT folder and has vLLM load
and verify it, with two versions resident (K = 2). Checked: the base view checksum the sidecar
computes from the engine is the checkpoint's; an older resident version, pinned, answers exactly
as it did before the newer one loaded (greedy logprobs, bitwise); a base-model stream in flight
while a version is loaded completes, with the engine never paused; the evicted version is 409.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.engines import greedy
from stitchboard.proto.adapter import AdapterSpec, view_checksum
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor, read_safetensors
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.sidecar_helpers import FAST_SIDECAR, AppServer, Publisher, wait_for
from tests.sidecar.test_sidecar_adapters import AdapterPublisher
from tests.support.vllm_server import VllmServer, require_vllm

pytestmark = pytest.mark.slow

#: K + 1 adapter slots for K = 2 resident versions.
SLOTS = 3
PROMPTS = ("The capital of France is", "def fibonacci(n):")


@pytest.fixture(scope="module")
def adapter_engine(smollm2_dir: Path) -> Iterator[VllmServer]:
    """One vLLM server with the worker extension and ``--enable-lora`` (:data:`SLOTS` slots) on SmolLM2."""
    require_vllm()
    folder = Path(tempfile.mkdtemp(prefix="stitch-adapter-engine-"))
    server = VllmServer(smollm2_dir, folder / "engine.log", max_loras=SLOTS)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _peft_version_0(model_dir: Path, folder: Path) -> tuple[dict[str, RawTensor], dict]:
    """A real PEFT LoRA of the base (r 8, alpha 16, q/k/v/o, random A and B: it changes the answers),
    saved by PEFT: its tensors (bf16 bits, PEFT's names) and its adapter_config.json."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0,
        init_lora_weights=False,
    )  # fmt: skip
    get_peft_model(base, config, autocast_adapter_dtype=False).save_pretrained(folder)  # bf16, the served dtype
    tensors = read_safetensors(folder / "adapter_model.safetensors")[1]
    owned = {n: RawTensor(t.dtype, t.shape, np.array(t.bits, copy=True)) for n, t in tensors.items()}
    return owned, json.loads((folder / "adapter_config.json").read_text())


def _nudged(view: dict[str, RawTensor], seed: int) -> dict[str, RawTensor]:
    # A small step: 30 % of each tensor's elements move by their lowest bit (stays finite).
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in view.items():
        bits = np.array(t.bits, copy=True)
        idx = rng.choice(bits.size, max(1, bits.size * 3 // 10), replace=False)
        bits[idx] ^= 1
        out[name] = RawTensor(t.dtype, t.shape, bits)
    return out


def _wait_resident(url: str, names: list[str], timeout_s: float) -> dict:
    # /health once ``names`` are the resident versions; on time-out, the last /health and status say why.
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(f"{url}/health", timeout=60).json()
        if health.get("adapters", {}).get("resident") == names:
            return health
        if time.monotonic() > deadline:
            status = httpx.get(f"{url}/v1/stitch/status", timeout=60).json()
            raise AssertionError(f"{names} not resident after {timeout_s} s: health {health}, status {status}")
        time.sleep(0.5)


def _stream_base(url: str, model: str, out: dict) -> None:
    # A long greedy base-model stream; the arrival time of every event.
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}
    times: list[float] = out.setdefault("times", [])
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())


def test_two_resident_versions_pinned_answers_and_no_pause(
    adapter_engine: VllmServer, smollm2_dir: Path, sc_bulletin: AppServer, sc_publisher: Publisher, tmp_path: Path
) -> None:
    base_sums = {n: checksum(t) for n, t in load_checkpoint(smollm2_dir).items()}
    tensors, config = _peft_version_0(smollm2_dir, tmp_path / "peft")
    spec = AdapterSpec(
        base_model=adapter_engine.model, base_checksum=view_checksum(base_sums), r=8, lora_alpha=16.0,
        target_modules=sorted(config["target_modules"]), config=config,
    )  # fmt: skip
    lora = AdapterPublisher(sc_publisher, spec)
    run = lora.run
    lora.publish(tensors)
    settings = SidecarSettings(
        **{**FAST_SIDECAR, "request_wait_s": 60.0},
        bulletin=sc_bulletin.url, run=run, engine_url=adapter_engine.url, handoff_dir=str(tmp_path / "handoff"),
        adapter_resident=2, engine_call_timeout_s=60, engine_timeout_s=300,
    )  # fmt: skip
    with BulletinClient(sc_bulletin.url, retries=1, backoff_s=0.01) as client:
        server = AppServer(create_sidecar(settings, client=client))
        try:
            # A sidecar boots to the run's latest version; the next one is loaded beside it (K = 2).
            _wait_resident(server.url, [f"{run}@0"], 240)
            lora.publish(_nudged(tensors, 1))
            health = _wait_resident(server.url, [f"{run}@0", f"{run}@1"], 240)
            assert health["status"] == "ok", health
            before = greedy(server.url, model=f"{run}@0", prompts=PROMPTS)
            base_before = greedy(server.url, model=adapter_engine.model, prompts=PROMPTS)
            assert before != base_before, "the adapter does not change the answers: the test could not tell them apart"

            v1_before = greedy(server.url, model=f"{run}@1", prompts=PROMPTS)

            # A base stream in flight while version 2 is loaded (and version 0 unloaded).
            streamed: dict = {"times": []}
            stream = threading.Thread(target=_stream_base, args=(server.url, adapter_engine.model, streamed))
            stream.start()
            wait_for(lambda: len(streamed["times"]) >= 5, 120, "the base stream's first events")
            lora.publish(_nudged(lora.views[-1], 2))
            _wait_resident(server.url, [f"{run}@1", f"{run}@2"], 240)
            loaded_during = stream.is_alive()
            stream.join(300)
            assert loaded_during, "the base stream ended before version 2 was resident: lengthen it"
            assert streamed["status"] == 200 and len(streamed["times"]) >= 190, streamed.get("status")
            gaps = np.diff(streamed["times"])
            metrics = httpx.get(f"{server.url}/metrics").text
            pauses = [ln for ln in metrics.splitlines() if ln.startswith("stitch_sidecar_pause_seconds_count")]
            assert all(ln.endswith(" 0.0") for ln in pauses), pauses
            print(
                f"base stream across the adapter load: {len(gaps) + 1} events, median gap {np.median(gaps):.3f} s, "
                f"max gap {gaps.max():.3f} s; no pause"
            )

            # Version 1, pinned, answers as before version 2 loaded; version 0 is gone (409 naming the residents).
            assert greedy(server.url, model=f"{run}@1", prompts=PROMPTS) == v1_before
            assert v1_before != before, "versions 0 and 1 answer alike: the pinned check could not fail"
            gone = httpx.post(f"{server.url}/v1/completions", json={"model": f"{run}@0", "prompt": "x"}, timeout=60)
            assert gone.status_code == 409 and gone.json()["resident"] == [f"{run}@1", f"{run}@2"]
            body = {"model": run, "prompt": PROMPTS[0], "max_tokens": 4, "return_weight_versions": True}
            spanned = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
            assert (spanned["weight_version_start"], spanned["weight_version_end"]) == (2, 2)
            assert [s["version"] for s in spanned["weight_versions"]] == [2], spanned["weight_versions"]
            newest = greedy(server.url, model=run, prompts=PROMPTS)
            assert newest == greedy(server.url, model=f"{run}@2", prompts=PROMPTS)
            assert greedy(server.url, model=adapter_engine.model, prompts=PROMPTS) == base_before
            models = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
            assert models == [adapter_engine.model, f"{run}@1", f"{run}@2"]
        finally:
            server.stop()
