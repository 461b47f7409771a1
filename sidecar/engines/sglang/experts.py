"""Where a per-expert checkpoint tensor lives inside SGLang's fused MoE parameters, on one TP rank.

Checkpoints name each expert's matrices (``...mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``;
Mixtral ``...block_sparse_moe.experts.{e}.w1|w3|w2.weight``: gate, up, down); SGLang's
``FusedMoE`` layer (``...experts``) holds them fused, per rank:

* ``w13_weight`` [E, 2 P, H]: expert ``e``'s gate rows at ``[0, P)``, its up rows at ``[P, 2 P)``;
* ``w2_weight`` [E, H, P]: expert ``e``'s down-projection columns at ``[0, P)``;

where ``P`` is the rank's share of the expert width. On the CPU SGLang zero-pads the width
before loading (``adjust_config_with_unaligned_cpu_tp``: to a multiple of 32 x TP, the original
kept as the config's ``original_<field>``) and splits the padded width evenly, so rank ``r``
holds the checkpoint rows (gate, up) or columns (down) ``[r P, r P + P)`` clipped to the real
width ``I``, then zeros; the zeros are never addressed.

Everything is derived from the loaded layer: ``P`` from ``intermediate_size_per_partition`` and
the parameter shapes, the TP split from ``moe_tp_size`` / ``moe_tp_rank``, ``I`` from the
model's config (the field whose value is the padded width ``P x TP``, or its ``original_``
twin). Checked at first use of each slot: the layer is the plain ``FusedMoE`` with the
unquantized method holding the checkpoint layout (no AMX prepacking, no Triton-kernels
transpose, no interleaved gate/up rows, no expert parallelism), the shapes agree, and the
slot's padding rows or columns hold zeros (a map whose ``P`` or ``I`` were wrong would not
find them there). The per-tensor base checksums that :mod:`.inplace` checks, gathered through
this map in checkpoint coordinates, check the rest before any write. Anything else is refused
by name (:class:`~stitchboard.sidecar.errors.UnmappedTensorError`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import UnmappedTensorError
from .slot import BITS, DTYPE_NAMES, Slot

#: ``<layer prefix>.experts.<e>.<matrix>.weight`` of a per-expert checkpoint tensor.
EXPERT_NAME = re.compile(
    r"^(?P<prefix>.+)\.experts\.(?P<expert>\d+)\.(?P<matrix>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
#: Checkpoint matrix name -> its part of the fused layer (Mixtral: w1 gate, w3 up, w2 down).
PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
#: Config fields that hold the expert width, in the order they are tried.
WIDTH_FIELDS = ("moe_intermediate_size", "intermediate_size")


@dataclass(frozen=True)
class ExpertSlot(Slot):
    """A :class:`Slot` inside a 3-D fused expert parameter, seen as its 2-D matrix
    ``[E x rows, cols]`` (``w13`` [E 2P, H], ``w2`` [E H, P]): ``row_offset`` is where the
    expert's block starts (``e x rows`` plus ``P`` for up rows), ``col_offset`` is 0."""

    def flat_index(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Flat int64 indices into :meth:`flat_bits` of this rank's block elements."""
        return (rows + self.row_offset) * self.param.shape[-1] + (cols + self.col_offset)

    def bits(self) -> torch.Tensor:
        """This rank's block of the live parameter as raw integer bits [rows, cols] (a view)."""
        data = self.param.data.view(BITS[self.param.element_size()])
        rows, cols = self.block_shape
        return data.view(-1, data.shape[-1]).narrow(0, self.row_offset, rows).narrow(1, self.col_offset, cols)


def expert_slot(model: torch.nn.Module, tp_rank: int, tp_size: int, name: str) -> ExpertSlot | None:
    """The slot of per-expert checkpoint tensor ``name`` on TP rank ``tp_rank`` of ``tp_size``
    holding the live ``model`` (None: ``name`` is not a per-expert tensor name, the dense rules
    apply).

    Raises:
        UnmappedTensorError: naming the tensor, when the model has no fused expert layer at its
            prefix, the layer's layout is not the checkpoint layout this map addresses (named),
            the expert does not exist, or the derived map does not fit the live parameters.
    """
    match = EXPERT_NAME.match(name)
    if match is None:
        return None
    try:
        layer: Any = model.get_submodule(f"{match['prefix']}.experts")
    except AttributeError:
        return None
    if not hasattr(layer, "w13_weight"):
        return None  # not a fused expert layer: per-expert linears, which the dense rules address
    prefix, expert, part = match["prefix"], int(match["expert"]), PART[match["matrix"]]
    _refuse_other_layouts(name, layer)
    w13, w2 = layer.w13_weight, layer.w2_weight
    experts, width = int(layer.num_experts), int(layer.intermediate_size_per_partition)
    hidden = int(w2.shape[1]) if w2.ndim == 3 else -1
    if (
        w13.shape != (experts, 2 * width, hidden)
        or w2.shape != (experts, hidden, width)
        or w13.dtype != w2.dtype
        or w13.dtype not in DTYPE_NAMES
    ):
        raise UnmappedTensorError(
            f"tensor {name!r}: {prefix}.experts holds w13 {w13.dtype}{list(w13.shape)} and w2 "
            f"{w2.dtype}{list(w2.shape)}, not [E, 2P, H] / [E, H, P] with "
            f"E = {experts}, P = {width} (the checkpoint layout this map addresses)",
            name=name,
        )
    if expert >= experts:
        raise UnmappedTensorError(
            f"tensor {name!r}: {prefix}.experts holds {experts} experts, not expert {expert}", name=name
        )
    model_tp_rank, model_tp_size = tp_rank, tp_size
    tp_size, tp_rank = int(layer.moe_tp_size), int(layer.moe_tp_rank)
    if (tp_size, tp_rank) != (model_tp_size, model_tp_rank):
        raise UnmappedTensorError(
            f"tensor {name!r}: {prefix}.experts splits over {tp_size} ranks (this is rank {tp_rank}), the model over "
            f"{model_tp_size}",
            name=name,
        )
    real = _real_width(model, name, width * tp_size)
    spans = tuple(
        (min(r * width, real), max(0, min(width, real - r * width))) for r in range(tp_size)
    )  # [r P, r P + P) clipped to I
    runtime = f"{prefix}.experts.{'w2' if part == 'down' else 'w13'}_weight"
    if part == "down":
        slot = ExpertSlot(
            name, runtime, DTYPE_NAMES[w2.dtype], (hidden, real), 1, spans, tp_rank, expert * hidden, 0, w2
        )
    else:
        row = expert * 2 * width + (width if part == "up" else 0)
        slot = ExpertSlot(name, runtime, DTYPE_NAMES[w13.dtype], (real, hidden), 0, spans, tp_rank, row, 0, w13)
    _check_padding(slot, width)
    return slot


def _refuse_other_layouts(name: str, layer: Any) -> None:
    # Raises UnmappedTensorError naming what the layer holds when it is not the unpacked
    # checkpoint layout (one rank's experts, every expert local).
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    what = None
    method = getattr(layer, "quant_method", None)
    if type(layer) is not FusedMoE:
        what = f"is a {type(layer).__name__}, not the plain FusedMoE"
    elif type(method) is not UnquantizedFusedMoEMethod:
        what = f"runs {type(method).__name__} (quantized or another backend's experts)"
    elif getattr(layer, "use_intel_amx_backend", False):
        what = "holds its experts prepacked for the AMX kernels (use_intel_amx_backend)"
    elif getattr(layer, "use_triton_kernels", False) or getattr(method, "use_triton_kernels", False):
        what = "holds its experts transposed for the Triton kernels"
    elif getattr(method, "w13_swiglu_interleaved", False):
        what = "holds gate and up rows interleaved (SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED)"
    elif int(getattr(layer, "moe_ep_size", 1)) != 1 or int(layer.num_local_experts) != int(layer.num_experts):
        what = (
            f"holds {layer.num_local_experts} of {layer.num_experts} experts (expert parallelism over "
            f"{getattr(layer, 'moe_ep_size', '?')} ranks, or fused shared experts)"
        )
    if what is not None:
        raise UnmappedTensorError(
            f"tensor {name!r}: its expert layer {what}; only the unpacked checkpoint layout is addressed in place",
            name=name,
        )


def _real_width(model: torch.nn.Module, name: str, padded: int) -> int:
    # The checkpoint's expert width: the config field holding the padded width, or its original.
    config = getattr(model, "config", None)
    for field in WIDTH_FIELDS:
        if getattr(config, field, None) == padded:
            real = int(getattr(config, f"original_{field}", padded))
            if 0 < real <= padded:
                return real
    raise UnmappedTensorError(
        f"tensor {name!r}: no config field {WIDTH_FIELDS} holds the expert layer's padded width {padded}; the "
        "checkpoint width is unknown",
        name=name,
    )


def _check_padding(slot: ExpertSlot, width: int) -> None:
    # Raises UnmappedTensorError when the rows (columns) past this rank's real share hold nonzero bits.
    length = slot.spans[slot.tp_rank][1]
    data = slot.param.data.view(BITS[slot.param.element_size()])
    flat = data.view(-1, data.shape[-1]).narrow(
        0, slot.row_offset, slot.block_shape[0] if slot.split_dim == 1 else width
    )
    padding = flat.narrow(slot.split_dim, length, width - length)
    if padding.numel() and bool(padding.any()):
        raise UnmappedTensorError(
            f"tensor {slot.name!r}: the padding of {slot.runtime_name} past its {length} real "
            f"{'columns' if slot.split_dim else 'rows'} is not zero: the derived map does not fit",
            name=slot.name,
        )
