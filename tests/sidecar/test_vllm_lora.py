"""LoRA adapters on one real vLLM engine (CPU build) started with ``--enable-lora`` and 2 slots:
:class:`~stitchboard.sidecar.engines.base.ServesAdapters` of the vLLM room, and the full-weights
path on the same engine (its runtime names gain ``.base_layer``).

The adapters are made with real PEFT on the SmolLM2 base (``init_lora_weights=False``, so they
change the answers; ``lora_alpha / r`` = 1.5, so vLLM scales ``lora_B`` in place) and saved with
``save_pretrained`` to memory-backed storage. Serving oracle: one folder loaded under two names
answers bitwise alike and unlike the base. A fresh engine given the adapter at start would be the
stronger oracle but costs a second engine start (~20-45 s here); the bits each slot holds are
checked by the load itself against the file's checksums (scaled as vLLM scales them), and an
adapter loaded at run time serving like one given at start is L3's demo oracle.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stitchboard.demo.engines import greedy
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import read_safetensors
from stitchboard.proto.diff import diff_views
from stitchboard.sidecar.engines.base import ServesAdapters
from stitchboard.sidecar.errors import AdapterLoadError
from tests.sidecar.vllm_fixtures import assert_repacked, view_sums
from tests.support import lease
from tests.support.vllm_server import VllmServer, require_vllm

pytestmark = pytest.mark.slow

#: Adapter slots of the engine (``--max-loras`` and ``--max-cpu-loras``).
SLOTS = 2
#: PEFT's LoRA target modules (every linear layer of a Llama block).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ("The capital of France is", "def fibonacci(n):")


def _peft_folder(model_dir: Path, folder: Path, seed: int, rank: int = 8) -> dict[str, str]:
    """Save a PEFT LoRA adapter (rank ``rank``, alpha 1.5 x rank, random A and B from ``seed``, bf16)
    of the base at ``model_dir`` to ``folder``; returns its tensors' xxh3-128 (PEFT name -> hex)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = LoraConfig(
        r=rank, lora_alpha=1.5 * rank, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(folder)
    return {name: checksum(t) for name, t in read_safetensors(folder / "adapter_model.safetensors")[1].items()}


@pytest.fixture(scope="module")
def lora_folder() -> Iterator[Path]:
    """A folder on memory-backed storage (the sidecar's hand-off folder is one)."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    folder = Path(tempfile.mkdtemp(prefix="stitch-lora-", dir=base))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def lora_engine(smollm2_dir: Path, lora_folder: Path) -> Iterator[VllmServer]:
    """One vLLM server with the worker extension and ``--enable-lora`` (:data:`SLOTS` slots) on SmolLM2."""
    require_vllm()
    server = VllmServer(smollm2_dir, lora_folder / "engine.log", max_loras=SLOTS)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def adapters(smollm2_dir: Path, lora_folder: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """PEFT adapters ``x``, ``y`` (rank 8) and ``wide`` (rank 32, above the engine's 16): key -> (folder, sums)."""
    out = {}
    for key, seed, rank in (("x", 1, 8), ("y", 2, 8), ("wide", 3, 32)):
        folder = lora_folder / f"adapter-{key}"
        out[key] = (str(folder), _peft_folder(smollm2_dir, folder, seed, rank))
    return out


@pytest.fixture
def engine(lora_engine: VllmServer):
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine

    adapter = VllmEngine(lora_engine.url, timeout_s=60)
    with lease.holding(adapter):
        yield adapter
    adapter.close()


def _answers(server: VllmServer, model: str) -> list[dict]:
    return greedy(server.url, model=model, prompts=PROMPTS, max_tokens=4)


def _listed(server: VllmServer) -> set[str]:
    return {m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}


def test_adapter_loads_verified_and_pinned_and_serves(lora_engine, engine, adapters):
    assert isinstance(engine, ServesAdapters)
    assert engine.adapter_slots() == SLOTS and engine.loaded_adapters() == []
    folder, sums = adapters["x"]
    engine.load_adapter("x@1", folder, sums)
    engine.load_adapter("x@1-again", folder, sums)
    held = engine._adapters()["loaded"]
    assert sorted(held) == ["x@1", "x@1-again"] and all(entry["pinned"] for entry in held.values())
    assert {"x@1", "x@1-again"} <= _listed(lora_engine)
    base, tuned = _answers(lora_engine, lora_engine.model), _answers(lora_engine, "x@1")
    assert tuned != base
    assert _answers(lora_engine, "x@1-again") == tuned
    engine.unload_adapter("x@1-again")
    assert engine.loaded_adapters() == ["x@1"] and "x@1-again" not in _listed(lora_engine)
    engine.unload_adapter("x@1-again")  # an unknown name: no-op


def test_wrong_checksum_is_refused_and_unloaded_while_another_keeps_serving(lora_engine, engine, adapters):
    before = _answers(lora_engine, "x@1")
    folder, sums = adapters["y"]
    wrong = "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
    with pytest.raises(AdapterLoadError) as refused:
        engine.load_adapter("y@bad", folder, {**sums, wrong: "0" * 32})
    assert (refused.value.details["cause"], refused.value.details["name"]) == ("ChecksumMismatch", wrong)
    assert engine.loaded_adapters() == ["x@1"] and "y@bad" not in _listed(lora_engine)
    with pytest.raises(AdapterLoadError) as missing:
        engine.load_adapter("y@short", folder, {n: s for n, s in sums.items() if n != wrong})
    assert missing.value.details["cause"] == "TensorSetMismatch"
    with pytest.raises(AdapterLoadError) as wide:  # rank 32 > --max-lora-rank 16: vLLM's loader refuses it
        engine.load_adapter("wide@1", *adapters["wide"])
    assert wide.value.details["cause"] == "EngineRefused" and wide.value.details["status"] != 200
    assert engine.loaded_adapters() == ["x@1"] and "wide@1" not in _listed(lora_engine)
    assert _answers(lora_engine, "x@1") == before


def test_a_load_beyond_the_slots_is_refused_never_an_eviction(lora_engine, engine, adapters):
    x_answers = _answers(lora_engine, "x@1")
    folder, sums = adapters["y"]
    engine.load_adapter("y@1", folder, sums)
    assert engine.loaded_adapters() == ["x@1", "y@1"]
    with pytest.raises(AdapterLoadError) as full:
        engine.load_adapter("y@2", folder, sums)
    assert full.value.details["cause"] == "NoFreeSlot" and full.value.details["loaded"] == ["x@1", "y@1"]
    # vLLM itself, asked past the adapter's check, refuses too (the pins) instead of evicting x@1
    raw = httpx.post(f"{lora_engine.url}/v1/load_lora_adapter", json={"lora_name": "y@2", "lora_path": folder})
    assert raw.status_code != 200, raw.text
    assert engine.loaded_adapters() == ["x@1", "y@1"] and "y@2" not in _listed(lora_engine)
    assert _answers(lora_engine, "x@1") == x_answers
    engine.unload_adapter("y@1")  # frees the slot: the next load fits
    engine.load_adapter("y@2", folder, sums)
    assert engine.loaded_adapters() == ["x@1", "y@2"]
    for name in ("x@1", "y@2"):
        engine.unload_adapter(name)
    assert engine.loaded_adapters() == [] and engine._adapters()["slots"] == SLOTS


def test_base_view_and_a_full_weights_patch_on_the_lora_engine(lora_engine, engine, vllm_views, lora_folder):
    names = engine.base_names()
    assert len(names) == 272 and set(names) == set(vllm_views[0])  # SmolLM2: 30 x 9 + embedding + norm
    assert engine.checksums(names) == view_sums(vllm_views[0])
    patch = lora_folder / "v1.patch"
    patch.write_bytes(diff_views(vllm_views[0], vllm_views[1], "cond").patch)
    engine.set_version(0)
    engine.pause()
    try:
        report = engine.apply_patch(str(patch), 0, 1)
    finally:
        engine.reset_prefix_cache()
        engine.resume()
    assert report["tensors"] > 0
    assert_repacked(report["repacked_modules"])
    assert engine.state().version == 1
    assert engine.checksums(names) == view_sums(vllm_views[1])
