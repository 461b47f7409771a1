"""Per-expert checkpoint tensors inside vLLM's fused MoE parameters, in the layout the backend holds.

A MoE checkpoint names each expert's matrices (``model.layers.L.mlp.experts.E.gate_proj.weight``
[I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]; Mixtral ``block_sparse_moe.experts.E.w1|w3|w2``);
vLLM holds one ``RoutedExperts`` module per layer with ``w13_weight`` [E_local, 2P, H] (gate
rows, then up rows) and ``w2_weight`` [E_local, H, P]. This module maps one onto the other,
seen from one TP rank (DESIGN.md invariant 10):

* names: the module's own loader mapping (``get_expert_mapping``: checkpoint ``experts.E.<proj>.``
  -> physical expert and shard ``w1`` / ``w3`` / ``w2``), the expert's local index from the
  module's ``expert_map`` (all local without expert parallelism);
* TP: as vLLM's loader slices them, rank r holds rows ``[r * I/tp, (r + 1) * I/tp)`` of gate and
  up (at rows 0 and P of ``w13``) and those columns of down; ``P`` is the per-rank width after
  the backend's zero padding (vLLM's CPU kernels round it up to 32: 80 -> 96, 40 -> 64);
* layout: vLLM's CPU experts (``CPUUnquantizedExperts`` and its ``amx`` / ``neon`` / ``vsx``
  subclasses) keep no unpacked copy: after padding they replace each parameter by
  ``cpu_prepack_moe_weight(w, isa)``, which differs per ``isa``. Rather than a formula per ISA,
  the map is derived from that very function: one expert's worth of digit-encoded bf16 values
  (base-256 digits of each element's flat index, plus one, so every value 1..256 is exact and
  0 would mark a padded slot) is packed once per digit, which gives, for every packed slot,
  the unpacked index it came from. The map is accepted only if it is a permutation and it
  reproduces the live parameter bit for bit (the live bits, unpacked through the map and packed
  again by the backend, equal the live bits, and every padding slot holds zero); otherwise the
  tensor is refused by name. Other backends (zentorch, GPU kernels, e.g. FlashInfer CUTLASS /
  TRT-LLM, whose ``load_weights`` on a loaded model writes ``[w1; w3]`` into a buffer the
  kernel holds as ``w31`` or permuted: silent garbage) are refused by name: they were never
  run here, so their layout is unknown.

An :class:`ExpertPlacement` is a :class:`~.layout.Placement` whose block is gathered through
the map (a copy, in checkpoint coordinates, so checksums and ``cond`` decodes see the checkpoint
tensor) and written back through it (:meth:`ExpertPlacement.write_bits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import UnmappedTensorError
from ..write_core import Gather, Scatter, bit_accessors
from .layout import BITS_TORCH, TORCH_DTYPE_NAMES, Placement

#: Experts classes whose packing is derived from ``cpu_prepack_moe_weight`` (vLLM CPU build).
CPU_PREPACKED = (
    "CPUUnquantizedExperts",
    "X86CPUUnquantizedExperts",
    "ArmCPUUnquantizedExperts",
    "PowerCPUUnquantizedExperts",
)
#: Why other backends are refused (the message of every refused expert tensor).
WHY_REFUSED = (
    "only vLLM's CPU prepacked experts are mapped (their packing is derived from cpu_prepack_moe_weight and checked on "
    "the live weights); other MoE backends hold their own layouts (FlashInfer CUTLASS/TRT-LLM keep w13 as w31 or "
    "permuted, so writes in checkpoint layout give silent garbage) and were never run here"
)


@dataclass(frozen=True)
class ExpertPlacement(Placement):
    """One expert tensor on this rank: ``flat`` maps the block's flat index (checkpoint
    coordinates, ``block_shape``) to the flat index of the element inside ``param`` (packed)."""

    flat: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64), repr=False)

    def _bits(self, data: torch.Tensor | None) -> torch.Tensor:
        whole = self.param.data if data is None else data
        return whole.reshape(-1).view(BITS_TORCH[self.param.element_size()])

    def block(self, data: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's block in checkpoint coordinates, gathered through the map (a copy)."""
        whole = self.param.data if data is None else data
        return whole.reshape(-1)[self.flat.to(whole.device)].reshape(self.block_shape)

    def block_bits(self, data: torch.Tensor | None = None) -> torch.Tensor:
        """The block's raw bits, flat (a copy: write with :meth:`write_bits`)."""
        return self._bits(data)[self.flat.to(self.param.device)]

    def write_bits(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Write raw bits at flat block indices ``index`` into the packed parameter."""
        self._bits(None)[self.flat.to(self.param.device)[index]] = values

    def accessors(self) -> tuple[Scatter, Gather]:
        """``(scatter, gather)`` at flat block indices, through the map into the packed parameter."""
        scatter, gather = bit_accessors(self._bits(None))
        to_param = self.flat.cpu().numpy()
        return (lambda index, values: scatter(to_param[index], values)), (lambda index: gather(to_param[index]))

    def write_block(self, values: torch.Tensor) -> None:
        """Write the whole block (``block_shape``, any dtype of the parameter's element size)."""
        self._bits(None)[self.flat.to(self.param.device)] = (
            values.reshape(-1).view(BITS_TORCH[self.param.element_size()]).to(self.param.device)
        )


@dataclass
class _ExpertModule:
    """One ``RoutedExperts`` module: its names, widths, TP/EP position and derived packing."""

    module: Any
    prefix: str  # runtime name of the module (``...mlp.experts.routed_experts``)
    hidden: int
    width: int  # I / tp: unpadded rows of gate (and of up) per rank
    padded: int  # P: rows per shard in w13, columns of w2
    tp_rank: int
    tp_size: int
    perms: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # param attr -> [N*K] unpacked flat -> packed flat (one expert)

    def local_expert(self, expert: int) -> int | None:
        expert_map = self.module.expert_map
        if expert_map is None:
            return expert
        local = int(expert_map[expert])
        return local if local >= 0 else None


def _experts_impl(module: Any) -> Any:
    """The experts kernel object a ``RoutedExperts`` module runs (None when there is none)."""
    kernel = getattr(module.quant_method, "moe_kernel", None)
    impl = getattr(kernel, "impl", None)
    return getattr(impl, "fused_experts", None)


def _backend(module: Any, name: str) -> tuple[Any, str]:
    """``(pack function, isa)`` of a module whose experts are vLLM's CPU prepacked ones; else refuse by name."""
    experts = _experts_impl(module)
    kind = type(experts).__name__ if experts is not None else type(module.quant_method).__name__
    isa = getattr(experts, "isa", None)
    if kind not in CPU_PREPACKED or getattr(experts, "_use_zentorch", False) or not isinstance(isa, str):
        backend = f"{kind} (isa {isa!r}{', zentorch' if getattr(experts, '_use_zentorch', False) else ''})"
        raise UnmappedTensorError(f"tensor {name!r}: the MoE backend {backend} is not mapped: {WHY_REFUSED}", name=name)
    from vllm import _custom_ops

    return (lambda w: _custom_ops.cpu_prepack_moe_weight(w, isa)), f"{kind} (isa {isa!r})"


def _derive_perm(pack: Any, rows: int, cols: int) -> torch.Tensor | None:
    """Unpacked flat -> packed flat index of one expert ``[rows, cols]`` under ``pack``; None
    when ``pack`` is not a permutation of the elements (a value left 0, or not an integer digit)."""
    total = rows * cols
    index = torch.arange(total, dtype=torch.int64)
    source = torch.zeros(total, dtype=torch.int64)
    shift = 0
    while shift == 0 or (total - 1) >> shift:
        digits = ((index >> shift) & 255) + 1
        packed = pack(digits.to(torch.bfloat16).reshape(1, rows, cols)).reshape(-1).to(torch.float32)
        values = packed.to(torch.int64)
        if (
            packed.numel() != total
            or not torch.equal(values.to(torch.float32), packed)
            or values.min() < 1
            or values.max() > 256
        ):
            return None
        source |= (values - 1) << shift
        shift += 8
    if not torch.equal(torch.sort(source).values, index):
        return None
    perm = torch.empty(total, dtype=torch.int64)
    perm[source] = index
    return perm


class ExpertLayout:
    """Checkpoint expert name -> :class:`ExpertPlacement` for one loaded vLLM model on one rank.

    Args:
        model: the vLLM ``nn.Module``.
        tp_rank: this rank (of the model's TP group).
    """

    def __init__(self, model: torch.nn.Module, tp_rank: int) -> None:
        self._names: dict[str, tuple[_ExpertModule, int, str]] = {}
        for prefix, module in model.named_modules():
            if type(module).__name__ != "RoutedExperts" or not hasattr(module, "w13_weight"):
                continue
            cfg = module.moe_config
            par = cfg.moe_parallel_config
            info = _ExpertModule(
                module, prefix, int(module.hidden_size), int(module.intermediate_size_per_partition),
                int(module.w2_weight.shape[-1]),
                int(par.tp_rank) if par.tp_size > 1 else 0, int(par.tp_size),
            )  # fmt: skip
            base = module.layer_name.removesuffix("experts")
            for _param, weight_name, expert, shard in module.get_expert_mapping():
                if weight_name.count(".") == 3 and shard in ("w1", "w2", "w3"):  # experts.E.<proj>.
                    self._names[f"{base}{weight_name}weight"] = (info, int(expert), shard)
        self.tp_rank = tp_rank

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def place(self, name: str) -> ExpertPlacement:
        """Where expert tensor ``name`` lives on this rank.

        Raises:
            UnmappedTensorError: naming the tensor and the backend (experts class, isa) when the
                backend is not one whose packing is derived here, the derived map does not
                reproduce the live weights, or the expert is held by another rank (expert
                parallelism).
        """
        info, expert, shard = self._names[name]
        par = info.module.moe_config.moe_parallel_config
        if par.ep_size > 1:
            raise UnmappedTensorError(
                f"tensor {name!r}: expert parallelism (ep_size {par.ep_size}) is not mapped in place; start vLLM "
                "without --enable-expert-parallel",
                name=name,
            )
        local = info.local_expert(expert)
        if local is None:
            raise UnmappedTensorError(
                f"tensor {name!r}: expert {expert} is held by another rank (expert parallelism is not mapped in place)",
                name=name,
            )
        attr = "w2_weight" if shard == "w2" else "w13_weight"
        param = getattr(info.module, attr)
        perm = self._perm(info, attr, name)
        rows, cols = param.shape[1], param.shape[2]
        if shard == "w2":  # down_proj [H, I]: this rank's columns of it
            shape, split = (info.hidden, info.width * info.tp_size), 1
            block = torch.arange(info.hidden).view(-1, 1) * cols + torch.arange(info.width).view(1, -1)
        else:  # gate (rows 0..) / up (rows P..) [I, H]: this rank's rows of it
            shape, split = (info.width * info.tp_size, info.hidden), 0
            first = 0 if shard == "w1" else info.padded
            block = (first + torch.arange(info.width)).view(-1, 1) * cols + torch.arange(info.hidden).view(1, -1)
        flat = local * rows * cols + perm[block.reshape(-1)]
        spans = tuple(((r if info.tp_size > 1 else 0) * info.width, info.width) for r in range(info.tp_size))
        return ExpertPlacement(
            name=name, runtime_name=f"{info.prefix}.{attr}", dtype=TORCH_DTYPE_NAMES[param.dtype], shape=shape,
            split_dim=split,
            spans=spans, tp_rank=self.tp_rank, row_offset=0, param=param, packed_by=(), flat=flat,
        )  # fmt: skip

    def _perm(self, info: _ExpertModule, attr: str, name: str) -> torch.Tensor:
        """The derived packing of ``attr`` (one expert), checked on the live parameter once."""
        if attr in info.perms:
            return info.perms[attr]
        pack, backend = _backend(info.module, name)
        param = getattr(info.module, attr).data
        experts, rows, cols = param.shape
        perm = _derive_perm(pack, rows, cols)
        if perm is None:
            raise UnmappedTensorError(
                f"tensor {name!r}: the packing of {backend} is not a permutation of one expert's elements; not "
                "written in place",
                name=name,
            )
        bits = param.reshape(experts, -1).view(BITS_TORCH[param.element_size()])
        unpacked = bits[:, perm].reshape(experts, rows, cols)  # checkpoint-side layout (padded) of the live bits
        pad = torch.ones(rows, cols, dtype=torch.bool)
        if attr == "w2_weight":
            pad[:, : info.width] = False
        else:
            pad[: info.width] = False
            pad[info.padded : info.padded + info.width] = False
        repacked = pack(unpacked.view(param.dtype)).reshape(experts, -1).view(bits.dtype)
        if bool(unpacked[:, pad].any()) or not torch.equal(repacked, bits):
            raise UnmappedTensorError(
                f"tensor {name!r}: the map derived from {backend} does not reproduce the live {attr} of "
                f"{info.prefix}; not written in place",
                name=name,
            )
        info.perms[attr] = perm
        return perm
