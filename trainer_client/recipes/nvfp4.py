"""The ``nvfp4`` served view: e2m1 codes packed in pairs, an e4m3 scale per 16 elements, a global scale.

The compressed-tensors ``nvfp4-pack-quantized`` format, weight-only (the ``NVFP4A16`` scheme:
no activation scale, which would need calibration data and would not be a pure function of the
weights). Per quantized weight ``X.weight`` [N, K] (bf16, K divisible by 16):

* ``X.weight_global_scale`` F32 [1]: ``g = 448 * 6 / amax`` over the layer's fused group (the
  q, k and v projections share one, gate and up share one, as vLLM fuses them and requires one
  global scale per fused layer; any other weight: its own amax);
* ``X.weight_scale`` F8_E4M3 [N, K / 16]: per group of 16 consecutive elements of a row,
  ``e4m3(g * amax_group / 6)``, a zero becoming 0.125 (compressed-tensors' rule);
* ``X.weight_packed`` U8 [N, K / 2]: each element ``w / (scale / g)`` clamped to +-6 and rounded
  to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the even code), its 3-bit
  magnitude index plus a sign bit (a negative value rounding to 0 keeps its sign: 0x8);
  element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high nibble.

Bit-equal to compressed-tensors' ``generate_gparam`` + ``calculate_qparams`` +
``NVFP4PackedCompressor`` on the same float32 input. Dequantization: ``w ~ e2m1(code) * scale / g``;
per element, with ``s = scale / g``: ``|w - w'| <= s * (0.25 if |w|/s < 2, 0.5 if < 4, else 1)``,
or the element was clipped (``|w| > 6 s``, dequantized to ``+-6 s``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stitchboard.proto.container import RawTensor

from ..errors import ServedViewError
from .base import CT_IGNORE, ServedRecipe, as_float, is_quantized, module_of, raw

#: Elements per scale group.
GROUP = 16
#: The e2m1 magnitudes, by 3-bit index.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: Fused projections: one global scale per group of sibling modules present.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


def fused_members(name: str, view: Mapping[str, RawTensor]) -> list[str]:
    """The quantized weights sharing ``name``'s global scale (itself included), sorted."""
    parent, leaf = module_of(name).rsplit(".", 1) if "." in module_of(name) else ("", module_of(name))
    for group in FUSED:
        if leaf in group:
            members = [f"{parent}.{m}.weight" if parent else f"{m}.weight" for m in group]
            return sorted(m for m in members if m in view and is_quantized(m, view[m]))
    return [name]


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 [1]: ``448 * 6 / amax`` (amax clamped to the smallest normal; inf/nan -> 1)."""
    g = (448.0 * 6.0) / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def e2m1_index(mag: torch.Tensor) -> torch.Tensor:
    """Magnitudes in [0, 6] -> e2m1 indices 0-7 (uint8), nearest value, ties to the even index."""
    index = torch.zeros(mag.shape, dtype=torch.uint8)
    for edge, inclusive in (
        (0.25, False),
        (0.75, True),
        (1.25, False),
        (1.75, True),
        (2.5, False),
        (3.5, True),
        (5.0, False),
    ):
        index += mag >= edge if inclusive else mag > edge
    return index


def nvfp4_quantize(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [N, K] and global scale [1] -> (packed uint8 [N, K/2], e4m3 scales [N, K/16])."""
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    local = (groups.abs().amax(dim=-1) / 6.0) * g
    scale = local.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.where(scale == 0, torch.tensor(0.125), scale)
    scaled = (groups / (scale / g).unsqueeze(-1)).clamp(-6.0, 6.0)
    codes = (e2m1_index(scaled.abs()) | ((scaled < 0).to(torch.uint8) << 3)).reshape(n, k // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, scale.to(torch.float8_e4m3fn)


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(uint8 [N, K/2], e4m3 [N, K/16], float32 [1]) -> float32 [N, K]."""
    n = packed.shape[0]
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(n, -1).long()
    values = E2M1[nibbles & 0x7] * torch.where((nibbles & 0x8) != 0, -1.0, 1.0)
    per_element = (scale.to(torch.float32) / g).repeat_interleave(GROUP, dim=1)
    return values * per_element


class Nvfp4Recipe(ServedRecipe):
    """``nvfp4``: weight-only NVFP4 (compressed-tensors ``nvfp4-pack-quantized``, NVFP4A16)."""

    name = "nvfp4"
    suffixes = (".weight_packed", ".weight_scale", ".weight_global_scale")
    per_tensor = False  # q/k/v and gate/up share one global scale (fused_members)

    def quantize(self, name: str, t: RawTensor, view: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """``X.weight_packed`` (U8 [N, K/2]), ``X.weight_scale`` (F8_E4M3 [N, K/16]),
        ``X.weight_global_scale`` (F32 [1]).

        Raises:
            ServedViewError: K is not a multiple of 16.
        """
        if t.shape[1] % GROUP:
            raise ServedViewError(
                f"tensor {name!r} has {t.shape[1]} columns; the nvfp4 view needs a multiple of {GROUP}"
            )
        amax = torch.stack([as_float(view[m]).abs().max() for m in fused_members(name, view)]).max()
        g = global_scale(amax)
        packed, scale = nvfp4_quantize(as_float(t), g)
        module = name.removesuffix(".weight")
        return {
            f"{module}.weight_packed": raw(packed),
            f"{module}.weight_scale": raw(scale),
            f"{module}.weight_global_scale": raw(g),
        }

    def dequantize(self, view: Mapping[str, RawTensor], module: str) -> torch.Tensor:
        """float32 [N, K] from the packed codes, group scales and global scale."""
        from ..served_view import from_raw

        return nvfp4_dequantize(
            from_raw(view[f"{module}.weight_packed"]),
            from_raw(view[f"{module}.weight_scale"]),
            as_float(view[f"{module}.weight_global_scale"]),
        )

    def quantization_config(self) -> dict[str, Any]:
        """compressed-tensors ``nvfp4-pack-quantized``, scheme NVFP4A16 on every ``Linear``."""
        weights = {
            "num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP, "strategy": "tensor_group",
            "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": "torch.float8_e4m3fn",
            "zp_dtype": None, "observer": "memoryless_minmax", "observer_kwargs": {},
        }  # fmt: skip
        return {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                    "format": None,
                }
            },
            "ignore": list(CT_IGNORE),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
        }
