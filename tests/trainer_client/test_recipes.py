"""Served-view recipes (bf16, fp8, fp8-block, nvfp4): format compliance, bits equal to
compressed-tensors' compressors, dequantization bounds, patch round trips, and a published run
(anchor + deltas) equal to the recipe applied to the final master weights."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.apply import apply_patch
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from stitchboard.trainer_client import Publisher
from stitchboard.trainer_client.recipes import RECIPE_NAMES, RECIPES, get_recipe, is_quantized
from stitchboard.trainer_client.recipes.fp8 import block_expand, block_quantize, channel_quantize
from stitchboard.trainer_client.recipes.nvfp4 import global_scale, nvfp4_quantize
from stitchboard.trainer_client.resume import pull_version
from stitchboard.trainer_client.served_view import from_raw, served_view, to_raw

#: SmolLM2-135M's layer shapes (576 and 192 are not multiples of 128: partial blocks).
SHAPES = {
    "self_attn.q_proj": (576, 576),
    "self_attn.k_proj": (192, 576),
    "self_attn.v_proj": (192, 576),
    "self_attn.o_proj": (576, 576),
    "mlp.gate_proj": (1536, 576),
    "mlp.up_proj": (1536, 576),
    "mlp.down_proj": (576, 1536),
}
#: What replaces one quantized ``X.weight`` [N, K]: suffix -> (dtype, shape).
LAYOUTS = {
    "bf16": lambda n, k: {".weight": ("BF16", (n, k))},
    "fp8": lambda n, k: {".weight": ("F8_E4M3", (n, k)), ".weight_scale": ("F32", (n, 1))},
    "fp8-block": lambda n, k: {
        ".weight": ("F8_E4M3", (n, k)),
        ".weight_scale_inv": ("F32", (-(-n // 128), -(-k // 128))),
    },
    "nvfp4": lambda n, k: {
        ".weight_packed": ("U8", (n, k // 2)),
        ".weight_scale": ("F8_E4M3", (n, k // 16)),
        ".weight_global_scale": ("F32", (1,)),
    },
}


def bf16(t: torch.Tensor) -> RawTensor:
    return to_raw(t.to(torch.bfloat16).contiguous())


def layer_view(seed: int = 0, layers: int = 1) -> dict[str, RawTensor]:
    """A SmolLM2-shaped bf16 view: embedding, norms, the seven projections per layer, with a zero
    row, negative zeros and outliers so that scale edge cases occur."""
    g = torch.Generator().manual_seed(seed)
    view = {
        "model.embed_tokens.weight": bf16(torch.randn(256, 576, generator=g) * 0.02),
        "model.norm.weight": bf16(torch.ones(576)),
    }
    for i in range(layers):
        view[f"model.layers.{i}.input_layernorm.weight"] = bf16(torch.rand(576, generator=g))
        for module, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=g) * 0.05
            w[7] = 0.0
            w[9, :40] = -0.0
            w[11, 3] = 3.0
            w[13, :16] = 1e-30
            view[f"model.layers.{i}.{module}.weight"] = bf16(w)
    return view


def f32(t: RawTensor) -> torch.Tensor:
    return from_raw(t).to(torch.float32)


def same_bits(a: RawTensor, b: RawTensor) -> bool:
    return (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)) and np.array_equal(a.bits, b.bits)


@pytest.fixture(scope="module")
def base() -> dict[str, RawTensor]:
    return layer_view()


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_layout_names_dtypes_shapes(name: str, base: dict[str, RawTensor]):
    view = get_recipe(name).apply(base)
    want: dict[str, tuple[str, tuple[int, ...]]] = {}
    for n, t in base.items():
        if is_quantized(n, t):
            module = n.removesuffix(".weight")
            want.update({module + suffix: spec for suffix, spec in LAYOUTS[name](*t.shape).items()})
        else:
            want[n] = (t.dtype, tuple(t.shape))
    assert {n: (t.dtype, tuple(t.shape)) for n, t in view.items()} == want
    assert list(view) == sorted(view)
    for kept in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert view[kept] is base[kept]  # embeddings and norms stay bf16, untouched


def test_routers_and_lm_head_stay_bf16():
    t = bf16(torch.ones(8, 64))
    assert not is_quantized("model.layers.0.mlp.gate.weight", t)
    assert not is_quantized("lm_head.weight", t)
    assert not is_quantized("model.layers.0.mlp.shared_expert_gate.weight", t)
    assert is_quantized("model.layers.0.mlp.experts.3.down_proj.weight", t)


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_deterministic_and_a_function_of_the_bf16_cast(name: str, base: dict[str, RawTensor]):
    recipe = get_recipe(name)
    first, second = recipe.apply(base), recipe.apply(layer_view())
    assert first.keys() == second.keys() and all(same_bits(first[n], second[n]) for n in first)
    master = {
        n: f32(t) * (1 + 2**-12) for n, t in base.items()
    }  # fp32 masters a quarter ulp off: their bf16 cast is base
    from_master = recipe.apply(served_view(master))
    assert all(same_bits(first[n], from_master[n]) for n in first)


def test_fp8_bits_equal_compressed_tensors(base: dict[str, RawTensor]):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor  # type: ignore[import-untyped]
    from compressed_tensors.quantization import preset_name_to_scheme  # type: ignore[import-untyped]
    from compressed_tensors.quantization.utils import calculate_qparams  # type: ignore[import-untyped]

    assert ct is not None
    channel, block = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]), preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    for module in ("self_attn.k_proj", "mlp.down_proj"):
        w = f32(base[f"model.layers.0.{module}.weight"])
        codes, scale = channel_quantize(w)
        ct_scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), channel.weights)
        ct_codes = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": ct_scale}, channel)["weight"]
        assert torch.equal(scale.view(torch.int32), ct_scale.view(torch.int32))
        assert torch.equal(codes.view(torch.uint8), ct_codes.view(torch.uint8))
        codes, scale = block_quantize(w)
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128)).reshape(-(-n // 128), 128, -(-k // 128), 128)
        ct_scale, _ = calculate_qparams(padded.amin(dim=(1, 3)), padded.amax(dim=(1, 3)), block.weights)
        ct_codes = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": ct_scale}, block)["weight"]
        assert torch.equal(scale.view(torch.int32), ct_scale.view(torch.int32))
        assert torch.equal(codes.view(torch.uint8), ct_codes.view(torch.uint8))


@pytest.mark.slow  # torch's inductor compiles in processes of its own (docs/testing.md, the slow tier)
def test_nvfp4_bits_equal_compressed_tensors(base: dict[str, RawTensor]):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # type: ignore[import-untyped]
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    w = f32(base["model.layers.0.self_attn.k_proj.weight"])
    g, ct_g = global_scale(w.abs().max()), generate_gparam(w.amin(), w.amax())
    groups = w.reshape(w.shape[0], -1, 16)
    ct_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=ct_g)
    out = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": ct_scale, "weight_global_scale": ct_g}, scheme)
    packed, scale = nvfp4_quantize(w, g)
    assert torch.equal(g.view(torch.int32), ct_g.view(torch.int32))
    assert torch.equal(scale.view(torch.uint8), out["weight_scale"].view(torch.uint8))
    assert torch.equal(packed, out["weight_packed"])


def test_quantization_configs_are_the_engines_formats():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    for name, preset, fmt in (("fp8", "FP8_DYNAMIC", "float-quantized"), ("nvfp4", "NVFP4A16", "nvfp4-pack-quantized")):
        qc = RECIPES[name].quantization_config()
        parsed = QuantizationConfig.model_validate(qc)
        want = preset_name_to_scheme(preset, ["Linear"])
        assert (
            parsed.format == fmt
            and parsed.quant_method == "compressed-tensors"
            and parsed.quantization_status == "compressed"
        )
        assert parsed.config_groups["group_0"].model_dump() == want.model_dump()
        assert "lm_head" in parsed.ignore
    assert RECIPES["fp8-block"].quantization_config() == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert RECIPES["bf16"].quantization_config() is None
    config = json.loads(RECIPES["fp8"].config_json(b'{"model_type": "llama", "torch_dtype": "bfloat16"}'))
    assert config["model_type"] == "llama" and config["quantization_config"]["format"] == "float-quantized"


def _fp8_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_dequantization_within_the_formats_bound(name: str, base: dict[str, RawTensor]):
    recipe = get_recipe(name)
    view = recipe.apply(base)
    for module in SHAPES:
        prefix = f"model.layers.0.{module}"
        w, got = f32(base[f"{prefix}.weight"]), recipe.dequantize(view, prefix)
        err = (got - w).abs()
        if name == "bf16":
            assert torch.equal(got, w)
        elif name == "fp8":
            assert (err <= _fp8_bound(w, f32(view[f"{prefix}.weight_scale"]))).all()
        elif name == "fp8-block":
            assert (err <= _fp8_bound(w, block_expand(f32(view[f"{prefix}.weight_scale_inv"]), tuple(w.shape)))).all()
        else:
            s = (f32(view[f"{prefix}.weight_scale"]) / f32(view[f"{prefix}.weight_global_scale"])).repeat_interleave(
                16, dim=1
            )
            ratio = w.abs() / s
            step = torch.where(ratio < 2, 0.25, torch.where(ratio < 4, 0.5, 1.0))
            clipped = ratio > 6
            assert (err[~clipped] <= (s * step * (1 + 1e-6))[~clipped]).all()
            assert torch.equal(got.abs()[clipped], (6 * s)[clipped])
        assert (got[7] == 0).all()  # the zero row stays zero


def _stepped(view: dict[str, RawTensor], seed: int) -> dict[str, RawTensor]:
    """A bf16 view after a small update of every weight (about 1 % of the elements move)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in view.items():
        w = f32(t)
        out[n] = bf16(w + torch.randn(w.shape, generator=g) * w.abs().mean() * 0.005)
    return out


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_patches_round_trip_codes_and_scales(name: str, base: dict[str, RawTensor]):
    recipe = get_recipe(name)
    old, new = recipe.apply(base), recipe.apply(_stepped(base, 1))
    for encoding in ("cond", "xor", "overwrite"):
        diff = diff_views(old, new, encoding)
        assert diff.changed_elements > 0
        target = {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in old.items()}
        apply_patch(target, read_patch(diff.patch))
        assert all(same_bits(target[n], new[n]) for n in new), encoding


def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_anchor_then_deltas_equal_the_recipe_of_the_final_master(name: str, bulletin, run, tmp_path):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assets = {"config.json": model.config.to_json_string().encode()}
    with Publisher(bulletin.url, run, served=name, assets=assets, snapshot_every=10) as pub:
        pub.publish(model)
        for _ in range(3):
            model(tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
            result = pub.publish(model)
    assert result.version == 3 and not result.snapshot
    with BulletinClient(bulletin.url) as client:
        pulled = pull_version(client, run, tmp_path / "out")
    want = get_recipe(name).apply(served_view(model))
    got = load_checkpoint(tmp_path / "out")
    assert got.keys() == want.keys() and all(same_bits(got[n], want[n]) for n in want)
    assert pulled.manifest.served == name
    config = json.loads((tmp_path / "out" / "config.json").read_bytes())
    assert config.get("quantization_config") == get_recipe(name).quantization_config()


def test_raw_fp8_casts_are_refused(bulletin, run):
    with pytest.raises(ValueError, match="served='fp8'"):
        Publisher(bulletin.url, run, dtypes={"*": torch.float8_e4m3fn})
    with pytest.raises(ValueError, match="unknown served view"):
        Publisher(bulletin.url, run, served="int3")
    with pytest.raises(ValueError, match="quantizes the bf16 cast"):
        Publisher(bulletin.url, run, served="fp8", dtypes={"model.norm.weight": torch.float32})
