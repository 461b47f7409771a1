"""The served view: checkpoint names, tied weights, the bf16 cast and dtype maps, host copies."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch

from stitchboard.trainer_client.errors import CheckpointNameError, ServedViewError
from stitchboard.trainer_client.served_view import checkpoint_name, checkpoint_state, from_raw, served_view, to_raw


class TiedLM(torch.nn.Module):
    """A tiny HF-shaped model: ``model.embed_tokens`` tied to ``lm_head``, a persistent and a
    non-persistent buffer."""

    _tied_weights_keys: ClassVar[list[str]] = ["lm_head.weight"]

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(10, 4)
        self.model.norm = torch.nn.LayerNorm(4)
        self.model.register_buffer("steps", torch.tensor([3], dtype=torch.int64))
        self.model.register_buffer("inv_freq", torch.ones(2), persistent=False)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


@pytest.mark.parametrize(
    ("wrapped", "name"),
    [
        ("module.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        ("_orig_mod.model.norm.weight", "model.norm.weight"),
        ("module._orig_mod.lm_head.weight", "lm_head.weight"),
        (
            "model.layers.3._fsdp_wrapped_module._checkpoint_wrapped_module.self_attn.q_proj.weight",
            "model.layers.3.self_attn.q_proj.weight",
        ),
        ("model.module_list.0.weight", "model.module_list.0.weight"),
    ],
)
def test_checkpoint_names_strip_wrappers(wrapped, name):
    assert checkpoint_name(wrapped) == name


def test_tied_weights_are_published_once_under_the_loader_name():
    model = TiedLM()
    view = served_view(model)
    assert set(view) == {"model.embed_tokens.weight", "model.norm.weight", "model.norm.bias", "model.steps"}
    # wrapped (DDP-style and compiled) and as a plain state dict: same names
    wrapper = torch.nn.Module()
    wrapper.module = model
    assert set(served_view(wrapper)) == set(view)
    plain = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    assert set(checkpoint_state(plain)) == set(view)


def test_bf16_cast_is_round_to_nearest_even_and_a_copy():
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        # halfway cases between two bf16 values: ties go to the even mantissa
        model.weight[0, :4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1.0 + 2**-8 + 2**-20])
    view = served_view(model)
    w = view["weight"]
    assert w.dtype == "BF16" and w.shape == (64, 64)
    expected = model.weight.detach().to(torch.bfloat16)
    assert np.array_equal(w.bits, expected.view(torch.int16).numpy().reshape(-1).view(np.uint16))
    assert [float(x) for x in from_raw(w)[0, :4]] == [1.0, 1.015625, -1.0, 1.0078125]
    with torch.no_grad():
        model.weight.add_(1.0)  # the next optimizer step must not change the snapshot
    assert np.array_equal(w.bits, expected.view(torch.int16).numpy().reshape(-1).view(np.uint16))


def test_dtype_map_by_name_and_pattern():
    model = TiedLM()
    view = served_view(
        model,
        dtypes={"model.norm.*": torch.float32, "model.embed_tokens.weight": torch.float8_e4m3fn},
        default=torch.float16,
    )
    assert {n: t.dtype for n, t in view.items()} == {
        "model.embed_tokens.weight": "F8_E4M3",
        "model.norm.weight": "F32",
        "model.norm.bias": "F32",
        "model.steps": "I64",
    }
    assert view["model.steps"].bits.tolist() == [3]


def test_raw_round_trip_shares_memory():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    raw = to_raw(t)
    assert raw.dtype == "BF16" and raw.shape == (2, 3) and raw.bits.dtype == np.uint16
    back = from_raw(raw)
    assert torch.equal(back, t)
    back[0, 0] = 7
    assert t[0, 0] == 7


def test_bad_state_is_refused():
    with pytest.raises(ServedViewError, match="not a torch.Tensor"):
        served_view({"a": [1, 2]})
    with pytest.raises(CheckpointNameError, match="'w'"):
        checkpoint_state({"module.w": torch.zeros(2), "_orig_mod.w": torch.ones(2)})
    with pytest.raises(ServedViewError, match="no safetensors name"):
        served_view({"c": torch.zeros(2, dtype=torch.complex64)})
