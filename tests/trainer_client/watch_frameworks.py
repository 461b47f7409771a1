"""Checkpoint folders written the way each framework writes them, for the ``stitchboard watch`` tests.

* prime-rl (``transports/weights/filesystem.py``, ``utils/weights.py``): ``broadcasts/step_N/`` holds
  the bf16 state dict as ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards
  (``{"format": "pt"}`` metadata) and, when sharded, ``model.safetensors.index.json`` written after the
  shards (``indent=2, sort_keys=True``); then the master touches ``STABLE``. A tied model's gathered state
  holds ``lm_head.weight`` as a tensor of its own.
* NeMo-RL (remote vLLM path, as the issue describes it): a full export moved into place as
  ``version_NNNNNNNN/`` by an atomic rename.
* HF Trainer: ``checkpoint-N/`` from ``save_pretrained`` (the test also runs the real ``Trainer``),
  ``trainer_state.json`` last.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from stitchboard.proto.checkpoint import shard_groups
from stitchboard.trainer_client.served_view import to_raw

INDEX = "model.safetensors.index.json"


def tiny_llama(seed: int = 0, tied: bool = True):
    """A float32 ``LlamaForCausalLM`` of ~30 k parameters (2 layers, hidden 32), embeddings tied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def llama_step(model, seed: int) -> None:
    """One AdamW step (a fresh optimizer, lr 1e-2) of ``model`` on a fixed random batch."""
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def write_shards(folder: Path, state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    """``state`` as ``model.safetensors``, or as numbered shards then the index (``max_shard_bytes``)."""
    folder.mkdir(parents=True, exist_ok=True)
    raws = {n: to_raw(t.contiguous()) for n, t in state.items()}
    groups = shard_groups(raws, max_shard_bytes) if max_shard_bytes else [sorted(state)]
    weight_map = {}
    for i, names in enumerate(groups, start=1):
        name = "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state[n].contiguous() for n in names}, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, name))
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(r.nbytes for r in raws.values())}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def bf16_state(model: torch.nn.Module, *, with_head: bool = False) -> dict[str, torch.Tensor]:
    """The state prime-rl gathers: every tensor cast to bf16 (fresh copies); ``with_head``: a tied
    ``lm_head.weight`` kept as a tensor of its own, as a gathered FSDP state holds it."""
    state = {n: t.detach().to(torch.bfloat16, copy=True) for n, t in model.state_dict().items()}
    if not with_head:
        state.pop("lm_head.weight", None)
    return state


def write_prime_rl(root: Path, step: int, state: dict[str, torch.Tensor], max_shard_bytes: int | None = None) -> Path:
    """prime-rl's filesystem broadcast of ``state`` for ``step`` under ``root`` (its ``broadcasts``),
    ``STABLE`` last."""
    folder = root / f"step_{step}"
    write_shards(folder, state, max_shard_bytes)
    (folder / "STABLE").touch()
    return folder


def write_nemo_rl(root: Path, version: int, state: dict[str, torch.Tensor]) -> Path:
    """A full export written under a temporary name, then renamed to ``version_NNNNNNNN``."""
    tmp = root / f".tmp-version_{version:08d}"
    write_shards(tmp, state, None)
    folder = root / f"version_{version:08d}"
    os.rename(tmp, folder)
    return folder


def write_hf_checkpoint(root: Path, step: int, model, max_shard_size: str | None = None) -> Path:
    """``checkpoint-N`` as ``Trainer._save_checkpoint`` leaves it: ``save_pretrained`` (fp32 weights,
    config), the optimizer's pickle, then ``trainer_state.json`` last."""
    folder = root / f"checkpoint-{step}"
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    torch.save({"state": {}}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder
