"""Where each checkpoint (HF) tensor lives inside a live SGLang model, seen from one TP rank.

DESIGN.md invariant 10: patches name checkpoint tensors; this module is the only place that knows
SGLang's runtime layout. Everything is derived from the loaded model itself:

* names: the model's ``stacked_params_mapping`` (``(".qkv_proj", ".q_proj", "q")``,
  ``(".gate_up_proj", ".gate_proj", 0)``...), else (a model keeping it inside ``load_weights``)
  the fused sibling of :data:`STACKED` the model has, else the name as is; a tied ``lm_head`` is the
  embedding's parameter (the checkpoint lists only ``model.embed_tokens.weight``);
* fused row blocks: ``QKVParallelLinear`` per-rank shard sizes (``q_proj_shard_size``,
  ``kv_proj_shard_size``: q, then k, then v rows), ``MergedColumnParallelLinear``
  ``output_sizes`` split evenly over the ranks;
* head padding: when the TP size does not divide the heads, SGLang pads the head counts
  (SmolLM2 at TP = 2: 9 query / 3 KV heads -> 12 / 4, per rank ``qkv_proj`` [640, 576] and
  ``o_proj`` [576, 384]); padding heads come last, so rank ``r`` holds the checkpoint rows
  ``[r * n, (r + 1) * n)`` clipped to the real ones (``original_num_attention_heads`` /
  ``original_total_num_kv_heads`` of the model's config), and padding rows or columns are
  never addressed;
* tensor-parallel slices: column-parallel layers hold output rows, row-parallel layers
  (``o_proj``, ``down_proj``) input columns, vocab-parallel embeddings the rows their
  ``shard_indices`` name;
* per-expert tensors of a fused MoE layer: :mod:`.experts`;
* everything else (norms) is held whole by every rank.

A :class:`Slot` is one checkpoint tensor on this rank: a 2-D block of the runtime parameter
(a view, written in place: the parameter's address never changes) and every rank's span along the
split dimension, so that the whole tensor can be reassembled from the ranks' blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import UnmappedTensorError
from .slot import DTYPE_NAMES, Slot

#: Checkpoint projection -> (fused sibling, shard) as SGLang's models stack them, for models whose
#: ``stacked_params_mapping`` is local to ``load_weights`` (Qwen3-MoE, Mixtral; Llama keeps it).
STACKED: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class SglangLayout:
    """Checkpoint name -> :class:`Slot` for one loaded SGLang model on one TP rank.

    Args:
        model: the rank's live ``nn.Module`` (what SGLang passes a custom weight loader).
        tp_rank, tp_size: this rank and the tensor-parallel world size.
    """

    def __init__(self, model: torch.nn.Module, tp_rank: int, tp_size: int) -> None:
        self.model = model
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.params = dict(model.named_parameters())  # a tied lm_head is listed once, as the embedding
        self._owner: dict[str, torch.nn.Module] = {}
        for mod_name, mod in model.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                self._owner.setdefault(f"{mod_name}.{pname}" if mod_name else pname, mod)
        config = getattr(model, "config", None)
        self._real_heads = getattr(config, "original_num_attention_heads", None)
        self._real_kv_heads = getattr(config, "original_total_num_kv_heads", None)
        self._cache: dict[str, Slot] = {}

    def runtime_params(self) -> list[str]:
        """Names of every runtime parameter of the model."""
        return list(self.params)

    def _runtime_name(self, name: str) -> tuple[str, str | int | None]:
        for fused, part, shard in getattr(self.model, "stacked_params_mapping", ()):
            if part in name:
                return name.replace(part, fused, 1), shard
        *head, leaf, kind = name.split(".")
        if name not in self.params and leaf in STACKED:  # a model keeping its mapping inside load_weights
            fused, shard = STACKED[leaf]
            if (stacked := ".".join([*head, fused, kind])) in self.params:
                return stacked, shard  # _build checks the fused module's class
        return name, None

    def place(self, name: str) -> Slot:
        """Where checkpoint tensor ``name`` lives on this rank.

        Raises:
            UnmappedTensorError: naming the tensor, when no runtime parameter holds it, or its
                layer kind or dtype is not addressed in place.
        """
        if name not in self._cache:
            self._cache[name] = self._build(name)
        return self._cache[name]

    def _rows(self, per_rank: int, real: int, replicas: int = 1) -> list[tuple[int, int]]:
        # Rank r holds per_rank rows from (r // replicas) * per_rank, clipped to the real rows.
        spans = []
        for r in range(self.tp_size):
            start = (r // replicas) * per_rank
            spans.append((min(start, real), max(0, min(per_rank, real - start))))
        return spans

    def _build(self, name: str) -> Slot:
        from sglang.srt.layers.linear import (
            ColumnParallelLinear,
            MergedColumnParallelLinear,
            QKVParallelLinear,
            ReplicatedLinear,
            RowParallelLinear,
        )
        from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

        from .experts import expert_slot  # fused MoE experts (experts.py): w13 / w2 per expert

        if (expert := expert_slot(self.model, self.tp_rank, self.tp_size, name)) is not None:
            return expert
        runtime, shard = self._runtime_name(name)
        param, mod = self.params.get(runtime), self._owner.get(runtime)
        if param is None or mod is None:
            raise UnmappedTensorError(
                f"tensor {name!r} maps to runtime parameter {runtime!r}, which the engine does not have", name=name
            )
        if param.ndim not in (1, 2) or param.dtype not in DTYPE_NAMES:
            raise UnmappedTensorError(
                f"tensor {name!r}: runtime parameter {runtime!r} is {param.dtype}{list(param.shape)}, not addressed "
                "in place",
                name=name,
            )
        is_weight = runtime.endswith("weight")
        split, row_offset = 0, 0
        cols = param.shape[1] if param.ndim == 2 else 1
        if isinstance(mod, QKVParallelLinear) and shard in ("q", "k", "v"):
            q, kv = mod.q_proj_shard_size, mod.kv_proj_shard_size
            heads = self._real_heads or mod.total_num_heads
            kv_heads = self._real_kv_heads or mod.total_num_kv_heads
            if shard == "q":
                spans = self._rows(q, heads * mod.head_size)
            else:
                row_offset = q if shard == "k" else q + kv
                spans = self._rows(kv, kv_heads * mod.head_size, mod.num_kv_head_replicas)
        elif isinstance(mod, MergedColumnParallelLinear) and type(shard) is int:
            sizes = [s // self.tp_size for s in mod.output_sizes]
            row_offset = sum(sizes[:shard])
            spans = self._rows(sizes[shard], mod.output_sizes[shard])
        elif shard is not None:
            raise UnmappedTensorError(
                f"tensor {name!r}: the loader puts it in shard {shard!r} of {runtime!r}, which is not addressed in "
                "place",
                name=name,
            )
        elif isinstance(mod, ColumnParallelLinear) and not isinstance(mod, ReplicatedLinear):
            spans = self._rows(mod.output_size_per_partition, mod.output_size_per_partition * self.tp_size)
        elif isinstance(mod, RowParallelLinear) and is_weight:
            split = 1
            spans = self._rows(mod.input_size_per_partition, self._row_parallel_inputs(runtime, mod, QKVParallelLinear))
        elif isinstance(mod, VocabParallelEmbedding):
            if mod.num_added_embeddings:
                raise UnmappedTensorError(
                    f"tensor {name!r}: embeddings with added vocabulary are not addressed in place", name=name
                )
            spans = []
            for r in range(self.tp_size):
                idx = mod._get_indices(
                    mod.num_embeddings_padded,
                    mod.org_vocab_size_padded,
                    mod.num_embeddings,
                    mod.org_vocab_size,
                    r,
                    self.tp_size,
                )
                spans.append((idx.org_vocab_start_index, idx.num_org_elements))
        else:  # norms, replicated linears, row-parallel biases: every rank holds the whole tensor
            spans = [(0, param.shape[0])] * self.tp_size
        extent = _tiles(spans)
        if extent < 0:
            raise UnmappedTensorError(
                f"tensor {name!r}: derived spans {spans} of {runtime!r} overlap or leave gaps", name=name
            )
        shape = (extent, cols) if split == 0 else (param.shape[0], extent)
        length = spans[self.tp_rank][1]
        if (split == 0 and row_offset + length > param.shape[0]) or (split == 1 and length > cols):
            raise UnmappedTensorError(
                f"tensor {name!r}: derived spans {spans} do not fit runtime parameter {runtime!r} {list(param.shape)}",
                name=name,
            )
        return Slot(
            name,
            runtime,
            DTYPE_NAMES[param.dtype],
            shape if param.ndim == 2 else (shape[0],),
            split,
            tuple(spans),
            self.tp_rank,
            row_offset,
            0,
            param,
        )

    def _row_parallel_inputs(self, runtime: str, mod: Any, qkv_kind: type) -> int:
        # The real input columns of a row-parallel layer: an attention output projection
        # (its sibling is the fused qkv_proj) takes the real heads only; others all inputs.
        sibling = self._owner.get(runtime.rsplit(".", 2)[0] + ".qkv_proj.weight")
        if isinstance(sibling, qkv_kind):
            return int((self._real_heads or getattr(sibling, "total_num_heads")) * getattr(sibling, "head_size"))  # noqa: B009 - typed as object after the check
        return int(getattr(mod, "input_size", mod.input_size_per_partition * self.tp_size))


def _tiles(spans: list[tuple[int, int]]) -> int:
    """The extent the distinct non-empty spans tile from 0, or -1 when they overlap or leave gaps."""
    end = 0
    for start, length in sorted({s for s in spans if s[1] > 0}):
        if start != end:
            return -1
        end = start + length
    return end
