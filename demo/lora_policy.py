"""The LoRA policy of ``stitchboard demo --lora`` and ``bench_lora``: real PEFT LoRA on the demo's SmolLM2.

The base model's float32 master weights are loaded and frozen; PEFT (``peft.get_peft_model``) wraps
the attention projections with LoRA (:data:`LORA_RANK`, :data:`LORA_ALPHA`, :data:`LORA_TARGETS`),
whose A and B matrices are the only trainable parameters (float32, trained with AdamW at
:data:`LORA_LR`: LoRA's learning rates are 10-100x a full fine-tune's). PEFT initialises A
(Kaiming-uniform, drawn from torch's seeded generator) and B = 0, so version 0 is the base model's
behaviour and the first step moves only B.

Sizes on SmolLM2-135M (30 layers, hidden 576, 3 KV heads of 64): A is (8, 576) on every target,
B is (576, 8) for q/o and (192, 8) for k/v: 240 tensors, 921,600 parameters, 1.84 MB as bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: LoRA rank r (vLLM's ``--max-lora-rank`` must be at least this).
LORA_RANK = 8
#: LoRA alpha (the update is scaled by alpha / r; PEFT types it int).
LORA_ALPHA = 16
#: The modules LoRA wraps (every attention projection of every layer).
LORA_TARGETS = ("k_proj", "o_proj", "q_proj", "v_proj")
#: AdamW learning rate of the adapter's parameters.
LORA_LR = 1e-4


def lora_policy(model_dir: Path, seed: int = 0) -> Any:
    """SmolLM2 (float32 masters, frozen) wrapped by PEFT with a fresh LoRA adapter ``default``.

    Args:
        model_dir: the bf16 HF checkpoint (:func:`stitchboard.demo.smollm2.build_smollm2_checkpoint`).
        seed: torch's seed before the adapter is initialised (A is drawn from it).

    Returns:
        a ``peft.PeftModel``; its trainable parameters are the float32 lora_A/lora_B weights.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)
    return get_peft_model(base, config)


def lora_optimizer(policy: Any, lr: float = LORA_LR) -> torch.optim.Optimizer:
    """AdamW over the adapter's trainable parameters only (weight decay 0)."""
    return torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)


def adapter_tensors(policy: Any) -> dict[str, torch.Tensor]:
    """The adapter's served view: PEFT's saved names (``get_peft_model_state_dict``, as in
    ``adapter_model.safetensors``) -> the bf16 cast of each float32 weight (round to nearest even)."""
    from peft import get_peft_model_state_dict

    return {name: t.detach().to(torch.bfloat16).contiguous() for name, t in get_peft_model_state_dict(policy).items()}
