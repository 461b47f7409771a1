"""FP8 (e4m3) served views: ``fp8`` (per output channel) and ``fp8-block`` (128 x 128 blocks).

``fp8``: the compressed-tensors ``float-quantized`` format of the ``FP8_DYNAMIC`` scheme (what
vLLM loads as ``CompressedTensorsW8A8Fp8``, dynamic per-token activations). Per quantized
weight ``X.weight`` [N, K] (bf16):

* ``X.weight`` F8_E4M3 [N, K]: ``clamp(w / s, -448, 448)`` cast to e4m3 (round to nearest even);
* ``X.weight_scale`` F32 [N, 1]: ``s = amax(|w[n, :]|) / 448`` in float32, a zero row taking
  float32 eps (compressed-tensors' rule for a zero scale).

``fp8-block``: the layout of DeepSeek-V3 / Qwen3-FP8 checkpoints (``quant_method: fp8``,
``weight_block_size: [128, 128]``). Per weight [N, K]:

* ``X.weight`` F8_E4M3 [N, K], each element divided by its block's scale, as above;
* ``X.weight_scale_inv`` F32 [ceil(N / 128), ceil(K / 128)]: the block's ``amax / 448``. The
  last block row and column are partial (SmolLM2's 576 = 4 x 128 + 64): a partial block's scale
  covers only the elements it holds, and dequantization multiplies each element by the scale of
  the block it falls in (``w[n, k] ~ code[n, k] * scale_inv[n // 128, k // 128]``), as the
  format's dequantization kernels read it.

Both are element-wise bit-equal to compressed-tensors' ``calculate_qparams`` + compressor on the
same float32 input (channel and block strategies; ``tests/trainer_client/test_recipes.py``).
Dequantization error bound, per element: ``|w - code * s| <= max(2**-4 |w|, 2**-10 s)`` (half an
e4m3 step: 3 mantissa bits; below 2**-6 the subnormal step 2**-9 s).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from stitchboard.proto.container import RawTensor

from ..served_view import from_raw
from .base import CT_IGNORE, ServedRecipe, as_float, raw

#: Largest finite e4m3 value.
E4M3_MAX = 448.0
#: The block edge of ``fp8-block``.
BLOCK = 128


def nonzero_scale(scale: torch.Tensor) -> torch.Tensor:
    """Replace zero scales (an all-zero row or block) by float32 eps, as compressed-tensors does."""
    return torch.where(scale == 0, torch.tensor(torch.finfo(torch.float32).eps), scale)


def to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scale -> float8_e4m3fn (clamped to +-448, RNE)."""
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def channel_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [N, K] -> (e4m3 codes [N, K], float32 scales [N, 1])."""
    scale = nonzero_scale(w.abs().amax(dim=1, keepdim=True) / E4M3_MAX)
    return to_e4m3(w / scale), scale


def block_expand(scale: torch.Tensor, shape: tuple[int, ...], block: int = BLOCK) -> torch.Tensor:
    """Per-block scales [ceil(N/b), ceil(K/b)] -> per-element scales [N, K]."""
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


def block_quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [N, K] -> (e4m3 codes [N, K], float32 block scales [ceil(N/b), ceil(K/b)])."""
    n, k = w.shape
    rows, cols = math.ceil(n / block), math.ceil(k / block)
    padded = torch.nn.functional.pad(w.abs(), (0, cols * block - k, 0, rows * block - n))
    amax = padded.reshape(rows, block, cols, block).amax(dim=(1, 3))
    scale = nonzero_scale(amax / E4M3_MAX)
    return to_e4m3(w / block_expand(scale, (n, k), block)), scale


class Fp8ChannelRecipe(ServedRecipe):
    """``fp8``: e4m3 weights with one float32 scale per output channel (compressed-tensors)."""

    name = "fp8"
    suffixes = (".weight", ".weight_scale")
    on_device = True

    def quantize(self, name: str, t: RawTensor, view: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """``X.weight`` (F8_E4M3 [N, K]) and ``X.weight_scale`` (F32 [N, 1])."""
        return {k: raw(v) for k, v in self.quantize_tensor(name, from_raw(t)).items()}

    def quantize_tensor(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`quantize` on a torch tensor where it lives (float32 math: exact upcast, amax, IEEE division)."""
        codes, scale = channel_quantize(t.to(torch.float32))
        module = name.removesuffix(".weight")
        return {f"{module}.weight": codes, f"{module}.weight_scale": scale}

    def dequantize(self, view: Mapping[str, RawTensor], module: str) -> torch.Tensor:
        """``code * weight_scale`` row by row, float32 [N, K]."""
        return as_float(view[f"{module}.weight"]) * as_float(view[f"{module}.weight_scale"])

    def quantization_config(self) -> dict[str, Any]:
        """compressed-tensors ``float-quantized``, scheme FP8_DYNAMIC on every ``Linear``."""
        fp8 = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "group_size": None,
            "block_structure": None,
            "actorder": None,
            "scale_dtype": None,
            "zp_dtype": None,
            "observer_kwargs": {},
        }
        weights = {**fp8, "strategy": "channel", "dynamic": False, "observer": "memoryless_minmax"}
        activations = {**fp8, "strategy": "token", "dynamic": True, "observer": None}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": activations,
                    "output_activations": None,
                    "format": None,
                }
            },
            "ignore": list(CT_IGNORE),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }


class Fp8BlockRecipe(ServedRecipe):
    """``fp8-block``: e4m3 weights with a float32 ``weight_scale_inv`` per 128 x 128 block."""

    name = "fp8-block"
    suffixes = (".weight", ".weight_scale_inv")
    on_device = True

    def quantize(self, name: str, t: RawTensor, view: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """``X.weight`` (F8_E4M3 [N, K]) and ``X.weight_scale_inv`` (F32 [ceil(N/128), ceil(K/128)])."""
        return {k: raw(v) for k, v in self.quantize_tensor(name, from_raw(t)).items()}

    def quantize_tensor(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`quantize` on a torch tensor where it lives (float32 math: exact upcast, amax, IEEE division)."""
        codes, scale = block_quantize(t.to(torch.float32))
        module = name.removesuffix(".weight")
        return {f"{module}.weight": codes, f"{module}.weight_scale_inv": scale}

    def dequantize(self, view: Mapping[str, RawTensor], module: str) -> torch.Tensor:
        """``code * weight_scale_inv`` of each element's block, float32 [N, K]."""
        codes = as_float(view[f"{module}.weight"])
        return codes * block_expand(as_float(view[f"{module}.weight_scale_inv"]), tuple(codes.shape))

    def quantization_config(self) -> dict[str, Any]:
        """The DeepSeek-V3 / Qwen3-FP8 ``quant_method: fp8`` block config (dynamic activations)."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        }
