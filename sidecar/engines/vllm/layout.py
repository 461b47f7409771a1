"""Where each checkpoint (HF) tensor lives inside a live vLLM model, seen from one TP rank.

DESIGN.md invariant 10: patches name checkpoint tensors; this module is the only place that
knows vLLM's runtime layout. The mapping is derived from the loaded model itself:

* names: the model's own loader mapping (``hf_to_vllm_mapper``, e.g. ``.q_proj`` ->
  ``(.qkv_proj, "q")``), else its ``packed_modules_mapping`` (``qkv_proj: [q_proj, k_proj,
  v_proj]``), else the name as is;
* fused row blocks: ``QKVParallelLinear`` shard offsets/sizes (``_get_shard_offset_mapping``,
  KV heads replicated when TP > KV heads), ``MergedColumnParallelLinear`` ``output_sizes``;
* tensor-parallel slices: column-parallel layers hold output rows ``[r * n, (r + 1) * n)`` of
  each shard, row-parallel layers (``o_proj``, ``down_proj``) input columns, vocab-parallel
  embeddings the vocab rows their ``shard_indices`` name (padding rows are never addressed);
* everything else (norms, replicated linears) is held whole by every rank;
* MoE experts: :mod:`.experts` (given to :class:`RuntimeLayout` by the worker).
* an engine started with ``--enable-lora`` wraps each linear layer in a LoRA layer holding the
  original as ``base_layer``: its runtime names gain ``.base_layer`` (``...qkv_proj.base_layer.weight``),
  which the layout drops (:data:`LORA_BASE`), so the full-weights path maps every tensor alike.

A :class:`Placement` describes, for one checkpoint tensor, every TP rank's span along the split
dimension (so any rank can reassemble the full tensor from gathered blocks) and this rank's
block: a contiguous row range of the runtime parameter.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...errors import UnmappedTensorError
from ..write_core import BITS, DTYPE_NAMES, Gather, Scatter, TpSlice, bit_accessors
from .formats import refuse_unservable

#: torch dtype -> safetensors dtype name; element size -> raw-bits integer dtype (:mod:`..write_core`).
TORCH_DTYPE_NAMES, BITS_TORCH = DTYPE_NAMES, BITS
#: The module vLLM's LoRA layers hold the original linear layer in (``--enable-lora``).
LORA_BASE = ".base_layer."


def _unwrapped(runtime: str) -> str:
    """``runtime`` without the ``.base_layer`` of a LoRA-wrapped layer (as without ``--enable-lora``)."""
    return runtime.replace(LORA_BASE, ".")


@dataclass(frozen=True)
class Placement(TpSlice):
    """One checkpoint tensor inside this rank's runtime parameter: a :class:`TpSlice` (name,
    runtime name, dtype, checkpoint shape, split dim, spans, rank, ``row_offset``: the fused
    shard's offset, ``k`` rows start after ``q`` rows in ``qkv_proj``) plus vLLM's transport.

    Attributes:
        param: the runtime parameter (written in place; never reassigned).
        packed_by: modules holding a packed copy of ``param`` for their GEMM (vLLM CPU backend:
            ``cpu_linear``; the tied ``lm_head`` included; :func:`holds_gemm_copy`); re-packed after a write.
        transposed: ``param`` is a 2-D parameter stored column-major (vLLM's FP8 linears: [K, N]
            with stride [1, K]); it is addressed through ``param.t()``, the row-major [N, K]
            tensor of the checkpoint's rows.
    """

    param: torch.nn.Parameter = field(repr=False)
    packed_by: tuple[torch.nn.Module, ...] = field(repr=False)
    transposed: bool = False

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of this rank's block: the checkpoint shape with ``split_dim`` cut to the span."""
        shape = list(self.shape)
        shape[self.split_dim] = self.local_span[1]
        return tuple(shape)

    def block(self, data: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's block: a contiguous view of the runtime parameter, ``block_shape``.

        Args:
            data: a copy of the parameter (same shape) to take the block of instead.
        """
        whole = self.param.data if data is None else data
        return (whole.t() if self.transposed else whole).narrow(0, self.row_offset, self.block_shape[0])

    def block_bits(self, data: torch.Tensor | None = None) -> torch.Tensor:
        """The block's raw bits as a flat integer tensor (int16 for bf16...); a view."""
        return self.block(data).reshape(-1).view(BITS_TORCH[self.param.element_size()])

    def write_bits(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Write raw bits ``values`` at flat indices ``index`` of :meth:`block_bits`, in place."""
        self.block_bits()[index] = values

    def accessors(self) -> tuple[Scatter, Gather]:
        """``(scatter, gather)`` of raw bits at flat indices of :meth:`block_bits` in the live parameter (numpy
        index and bits; :func:`.write_core.bit_accessors`).

        Raises:
            TypeError: :meth:`block_bits` is not a view of the parameter (a subclass that gathers its block must
                override this, or the writes would land in a copy).
        """
        flat = self.block_bits()
        if flat.untyped_storage().data_ptr() != self.param.data.untyped_storage().data_ptr():
            raise TypeError(f"tensor {self.name!r}: {type(self).__name__}.block_bits is a copy; override accessors")
        return bit_accessors(flat)

    def write_block(self, values: torch.Tensor) -> None:
        """Overwrite the whole block with ``values`` (``block_shape``, same element size)."""
        self.block().view(values.dtype).copy_(values)


def holds_gemm_copy(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own CPU GEMM (vLLM CPU backend: ``cpu_linear``) holds a copy of its weight.

    vLLM's ``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py``) gives a linear layer a
    ``cpu_linear(x, weight, bias)`` that either packs the weight once and closes over the packed copy (oneDNN's
    handler, sgl's ``convert_weight_packed``, zentorch's) or, where no packed kernel exists for the host (bf16
    on a CPU without AVX-512 BF16: oneDNN refuses the primitive), is a plain function of its arguments, which
    reads the live parameter at every call. Only the first kind must be re-packed after a write; re-packing
    the second costs a failed primitive creation per layer (~1 ms) and changes nothing. The rule: a
    ``cpu_linear`` that captures nothing (a Python function without a closure or default arguments, or
    ``torch.nn.functional.linear`` itself) reads the live weight; anything else is taken to hold a copy.

    Only the module's own attribute counts: a LoRA layer (``--enable-lora``) forwards unknown attributes to
    its ``base_layer``, whose GEMM is the one called, and must not be packed a second time.
    """
    fn = vars(module).get("cpu_linear")
    if fn is None or fn is torch.nn.functional.linear:
        return False
    captures = not isinstance(fn, types.FunctionType) or fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__
    return bool(captures)


def _span_tiles(spans: tuple[tuple[int, int], ...]) -> int:
    """The extent the distinct spans tile exactly from 0, or -1 when they overlap or leave gaps."""
    end = 0
    for start, length in sorted(set(spans)):
        if start != end:
            return -1
        end = start + length
    return end


class ExpertResolver(Protocol):
    """Places per-expert checkpoint tensors (:class:`.experts.ExpertLayout`)."""

    def __contains__(self, name: str) -> bool: ...

    def place(self, name: str) -> Placement: ...


class _NoExperts:
    def __contains__(self, name: str) -> bool:
        return False

    def place(self, name: str) -> Placement:
        raise KeyError(name)


class RuntimeLayout:
    """Checkpoint name -> :class:`Placement` for one loaded vLLM model on one TP rank.

    Args:
        model: the vLLM ``nn.Module`` (``worker.get_model()``).
        tp_rank, tp_size: this rank and the tensor-parallel world size.
        experts: places MoE expert tensors (checked before the dense mapping); none by default.

    Placements are built lazily and cached (:meth:`place`); :meth:`runtime_params` lists every
    runtime parameter so a snapshot load can check that it covers all of them.
    """

    def __init__(
        self, model: torch.nn.Module, tp_rank: int, tp_size: int, experts: ExpertResolver | None = None
    ) -> None:
        self.model = model
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.params = {_unwrapped(name): param for name, param in model.named_parameters()}
        self._owner: dict[str, torch.nn.Module] = {}
        for mod_name, mod in model.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                self._owner[_unwrapped(f"{mod_name}.{pname}" if mod_name else pname)] = mod
        self._packers: dict[int, list[torch.nn.Module]] = {}
        for mod in model.modules():
            weight = getattr(mod, "weight", None)
            if isinstance(weight, torch.Tensor) and holds_gemm_copy(mod):
                self._packers.setdefault(id(weight), []).append(mod)
        self._cache: dict[str, Placement] = {}
        self._experts: ExpertResolver = experts if experts is not None else _NoExperts()

    def runtime_params(self) -> list[str]:
        """Names of every runtime parameter of the model."""
        return list(self.params)

    def checkpoint_names(self) -> list[str]:
        """The checkpoint names of every runtime parameter, sorted: a fused parameter's parts by the
        model's ``packed_modules_mapping`` (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``), any
        other as named; each checked to :meth:`place` back into its parameter. A tied output head
        shares the embedding's parameter and is not listed (as the served view leaves it out).

        Raises:
            UnmappedTensorError: a runtime parameter whose names do not map back (MoE experts, a
                model whose loader renames checkpoint tensors).
        """
        fused = getattr(self.model, "packed_modules_mapping", {})
        names: list[str] = []
        for runtime in self.params:
            module, _, leaf = runtime.rpartition(".")
            parent, _, last = module.rpartition(".")
            parts = fused.get(last, [])
            candidates = (
                [f"{parent}.{p}.{leaf}" if parent else f"{p}.{leaf}" for p in parts] if len(parts) > 1 else [runtime]
            )
            for name in candidates:
                if self.place(name).runtime_name != runtime:
                    raise UnmappedTensorError(
                        f"runtime parameter {runtime!r}: checkpoint name {name!r} maps elsewhere", name=name
                    )
            names += candidates
        return sorted(names)

    def _runtime_name(self, name: str) -> tuple[str, object]:
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapped = mapper._map_name_with_shard(name)
            if mapped is None:
                raise UnmappedTensorError(
                    f"tensor {name!r}: the model's loader ignores it, so the engine holds no copy", name=name
                )
            runtime, shard = mapped
            if shard is not None or runtime in self.params:
                return runtime, shard
            name = runtime
        for fused, parts in getattr(self.model, "packed_modules_mapping", {}).items():
            for i, part in enumerate(parts):
                if f".{part}." in f".{name}":
                    return f".{name}".replace(f".{part}.", f".{fused}.", 1)[1:], i
        return name, None

    def place(self, name: str) -> Placement:
        """Where checkpoint tensor ``name`` lives on this rank.

        Raises:
            UnmappedTensorError: naming the tensor, when no runtime parameter holds it, it belongs
                to a served-view format this adapter refuses (:mod:`.formats`), the parameter
                was emptied (CPU GEMM dispatch with ``remove_weight=True``: the worker extension
                was imported after the model loaded), or its layer kind is unknown.
        """
        if name not in self._cache:
            refuse_unservable(name)
            expert = name if name in self._experts else self._runtime_name(name)[0]
            self._cache[name] = self._experts.place(expert) if expert in self._experts else self._build(name)
        return self._cache[name]

    def _build(self, name: str) -> Placement:
        from vllm.model_executor.layers.linear import (
            ColumnParallelLinear,
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            VocabParallelEmbedding,
        )

        runtime, shard = self._runtime_name(name)
        param = self.params.get(runtime)
        mod = self._owner.get(runtime)
        fused = isinstance(mod, (QKVParallelLinear, MergedColumnParallelLinear))
        if shard is not None and not (fused and (shard in ("q", "k", "v") or type(shard) is int)):
            raise UnmappedTensorError(
                f"tensor {name!r}: the loader puts it in shard {shard!r} of {runtime!r}, which is not addressed in "
                "place",
                name=name,
            )
        if fused and shard is None and self.tp_size > 1:
            raise UnmappedTensorError(
                f"tensor {name!r}: a pre-fused checkpoint tensor of {runtime!r} is not addressed in place under TP",
                name=name,
            )
        if param is None:
            raise UnmappedTensorError(
                f"tensor {name!r} maps to runtime parameter {runtime!r}, which the engine does not have", name=name
            )
        if param.ndim not in (1, 2) or param.numel() == 0:
            raise UnmappedTensorError(
                f"tensor {name!r}: runtime parameter {runtime!r} has shape {list(param.shape)}; an emptied CPU linear "
                "weight means the stitchboard worker extension was not imported before the model loaded",
                name=name,
            )
        transposed = param.ndim == 2 and not param.is_contiguous() and param.t().is_contiguous()
        data = param.t() if transposed else param  # the checkpoint's row-major orientation
        if param.dtype not in TORCH_DTYPE_NAMES:
            raise UnmappedTensorError(
                f"tensor {name!r}: runtime dtype {param.dtype} has no safetensors name", name=name
            )
        ranks = range(self.tp_size)
        tp = getattr(mod, "tp_size", self.tp_size)
        is_weight = runtime.endswith("weight")
        split, offset = 0, 0
        if isinstance(mod, QKVParallelLinear) and shard is not None:
            key = shard if isinstance(shard, str) else "qkv"[shard % 3]
            offset, size = mod._get_shard_offset_mapping(key), mod._get_shard_size_mapping(key)
            replicas = 1 if key == "q" else mod.num_kv_head_replicas
            spans = [((r if tp > 1 else 0) // replicas * size, size) for r in ranks]
        elif isinstance(mod, MergedColumnParallelLinear) and shard is not None:
            offset, size = sum(mod.output_sizes[:shard]) // tp, mod.output_sizes[shard] // tp
            spans = [((r if tp > 1 else 0) * size, size) for r in ranks]
        elif isinstance(mod, ColumnParallelLinear):
            size = mod.output_size_per_partition
            spans = [((r if tp > 1 else 0) * size, size) for r in ranks]
        elif isinstance(mod, RowParallelLinear) and is_weight:
            split, size = 1, mod.input_size_per_partition
            spans = [((r if tp > 1 else 0) * size, size) for r in ranks]
        elif isinstance(mod, VocabParallelEmbedding):
            if mod.num_added_embeddings:
                raise UnmappedTensorError(
                    f"tensor {name!r}: embeddings with added (LoRA) vocabulary are not addressed in place", name=name
                )
            spans = []
            for r in ranks:
                idx = mod._get_indices(
                    mod.num_embeddings_padded,
                    mod.org_vocab_size_padded,
                    mod.num_embeddings,
                    mod.org_vocab_size,
                    r if tp > 1 else 0,
                    tp,
                )
                spans.append((idx.org_vocab_start_index, idx.num_org_elements))
        else:  # norms, replicated linears, row-parallel biases: every rank holds the whole tensor
            spans = [(0, data.shape[0])] * self.tp_size
        extent = _span_tiles(tuple(spans))
        shape = list(data.shape)
        shape[split] = extent
        local_rows = spans[self.tp_rank][1] if split == 0 else data.shape[0]
        if (
            extent < 0
            or offset + local_rows > data.shape[0]
            or (split == 1 and spans[self.tp_rank][1] != data.shape[1])
        ):
            raise UnmappedTensorError(
                f"tensor {name!r}: derived spans {spans} do not fit runtime parameter {runtime!r} {list(data.shape)}",
                name=name,
            )
        return Placement(
            name=name,
            runtime_name=runtime,
            dtype=TORCH_DTYPE_NAMES[param.dtype],
            shape=tuple(shape),
            split_dim=split,
            spans=tuple(spans),
            tp_rank=self.tp_rank,
            row_offset=offset,
            param=param,
            packed_by=tuple(self._packers.get(id(param), ())),
            transposed=transposed,
        )
