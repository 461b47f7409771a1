"""The tiny MoE checkpoints (stitchboard.demo.moe_models) and their served view in the trainer SDK."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file

from stitchboard.demo.errors import ModelBuildError
from stitchboard.demo.moe_models import PRESETS, build_moe_checkpoint, moe_preset_checkpoint, preset_dir
from stitchboard.trainer_client.served_view import served_view
from tests.support.training import CpuTrainer

EXPERT_NAMES = {
    "qwen3_moe": ("model.layers.1.mlp.experts.7.gate_proj.weight", "model.layers.1.mlp.experts.7.up_proj.weight",
                  "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate.weight"),
    "mixtral": ("model.layers.1.block_sparse_moe.experts.3.w1.weight",
                "model.layers.1.block_sparse_moe.experts.3.w3.weight",
                "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                "model.layers.0.block_sparse_moe.gate.weight"),
}  # fmt: skip


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_build_is_deterministic_and_per_expert(arch: str, tmp_path: Path, smollm2_dir: Path) -> None:
    a = build_moe_checkpoint(arch, tmp_path / "a", seed=3)
    b = build_moe_checkpoint(arch, tmp_path / "b", seed=3)
    c = build_moe_checkpoint(arch, tmp_path / "c", seed=4)
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors") != _sha(c / "model.safetensors")
    tensors = load_file(str(a / "model.safetensors"))
    gate, up, down, router = EXPERT_NAMES[arch]
    width = 80 if arch == "qwen3_moe" else 256
    assert tensors[gate].shape == tensors[up].shape == (width, 256) and tensors[down].shape == (256, width)
    assert tensors[router].shape == ((8 if arch == "qwen3_moe" else 4), 256)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert (a / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()
    with pytest.raises(ModelBuildError, match="exists"):
        build_moe_checkpoint(arch, a)


def test_unknown_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelBuildError, match="unknown MoE architecture 'llama'"):
        build_moe_checkpoint("llama", tmp_path / "x")
    with pytest.raises(ModelBuildError, match="unknown MoE preset 'tiny-dense'"):
        preset_dir("tiny-dense")


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_trainer_publishes_checkpoint_names_and_steps_touch_every_class(preset: str) -> None:
    """The served view of a transformers 5 model (experts fused in memory) is the checkpoint
    bit for bit under its names; one real AdamW step changes experts, router, attention and
    embedding; the model answers different prompts differently."""
    folder = moe_preset_checkpoint(preset)
    assert moe_preset_checkpoint(preset) == folder
    trainer = CpuTrainer(folder, batch_size=2, seq_len=32, lr=1e-5)
    on_disk = load_file(str(folder / "model.safetensors"))
    view = served_view(trainer.model)
    assert sorted(view) == sorted(on_disk)
    assert all(view[n].bits.tobytes() == on_disk[n].view(torch.int16).numpy().tobytes() for n in on_disk)
    with torch.no_grad():
        last = [trainer.model(torch.tensor([ids])).logits[0, -1] for ids in ([1, 200, 300], [1, 5000, 17])]
    assert not torch.equal(last[0], last[1]) and last[0].argmax() != last[1].argmax()
    assert set(EXPERT_NAMES[PRESETS[preset][0]]) <= set(view)
    before = trainer.served_view()
    trainer.step()
    after = trainer.served_view()
    changed = {n for n in before if not torch.equal(before[n].view(torch.int16), after[n].view(torch.int16))}
    classes = {
        "expert": (".experts.",),
        "router": (".gate.weight",),
        "attention": (".self_attn.",),
        "embedding": ("embed_tokens",),
    }
    for what, marks in classes.items():
        assert any(any(m in n for m in marks) for n in changed), f"no {what} tensor changed"
