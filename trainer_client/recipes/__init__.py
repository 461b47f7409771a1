"""Served-view recipes: the weight formats a run can publish (``Publisher(served=...)``).

================  ==========================================================================
``bf16``          the bf16 cast of the masters (default; what every earlier run published)
``fp8``           e4m3 + float32 scale per output channel (compressed-tensors
                  ``float-quantized``, FP8_DYNAMIC); served for real by vLLM here
``fp8-block``     e4m3 + float32 ``weight_scale_inv`` per 128 x 128 block (DeepSeek-V3 /
                  Qwen3-FP8 layout); checked at the codec level only
``nvfp4``         e2m1 pairs in U8 + e4m3 scale per 16 + float32 global scale (weight-only,
                  compressed-tensors ``nvfp4-pack-quantized``); codec level only
================  ==========================================================================

Each is a pure, deterministic function of the bf16 served view (see :mod:`.base` for the why
and for which tensors stay bf16). The recipe's name is recorded in every manifest
(``VersionManifest.served``) and its ``quantization_config`` in the run's ``config.json``, so
an anchor pulled with ``stitchboard pull`` is a checkpoint folder the engine loads as it is.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .base import Bf16Recipe, ServedRecipe, is_quantized
from .fp8 import Fp8BlockRecipe, Fp8ChannelRecipe
from .nvfp4 import Nvfp4Recipe

#: Recipe name -> recipe, in the order of the table above.
RECIPES: dict[str, ServedRecipe] = {
    r.name: r for r in (Bf16Recipe(), Fp8ChannelRecipe(), Fp8BlockRecipe(), Nvfp4Recipe())
}
#: The recipe names (``--served`` choices).
RECIPE_NAMES = tuple(RECIPES)


def get_recipe(name: str) -> ServedRecipe:
    """The recipe named ``name``.

    Raises:
        ValueError: an unknown name (lists the known ones).
    """
    if name not in RECIPES:
        raise ValueError(f"unknown served view {name!r}: use one of {', '.join(RECIPE_NAMES)}")
    return RECIPES[name]


def check_served_options(
    served: str, dtypes: Mapping[str, torch.dtype] | None, default_dtype: torch.dtype
) -> ServedRecipe:
    """Validate a publisher's ``served`` / ``dtypes`` / ``default_dtype`` and return the recipe.

    A raw cast to an fp8 dtype is not a format any engine loads (no scales): ``dtypes`` or
    ``default_dtype`` naming ``float8_*`` is refused, pointing at ``served="fp8"``. Other
    per-tensor dtypes (fp16, fp32) stay allowed with ``served="bf16"``; a quantized recipe
    starts from the bf16 cast, so it takes neither.

    Raises:
        ValueError: an unknown recipe, an fp8 cast, or ``dtypes`` combined with a quantized recipe.
    """
    recipe = get_recipe(served)
    casts = [default_dtype, *(dtypes or {}).values()]
    fp8 = [d for d in casts if d.is_floating_point and d.itemsize == 1]
    if fp8:
        raise ValueError(
            f"dtypes/default_dtype cast to {fp8[0]}: a raw fp8 cast has no scales and is not a format an engine "
            "loads; publish served='fp8' (per-channel scales) or 'fp8-block'"
        )
    if recipe.name != "bf16" and (dtypes or default_dtype != torch.bfloat16):
        raise ValueError(f"served={recipe.name!r} quantizes the bf16 cast: leave dtypes and default_dtype unset")
    return recipe


__all__ = ["RECIPES", "RECIPE_NAMES", "ServedRecipe", "check_served_options", "get_recipe", "is_quantized"]
