"""A rank's own blocks of the served view, and the layout every rank agrees on (trainer process, each rank).

The shard-local publish (:mod:`.shard_local`) diffs, on every rank, only what the rank holds. This module
says what that is, without moving a tensor between ranks:

* a ``DTensor`` placed ``Shard(0)`` (FSDP2, TP row-parallel) holds the rows ``[start, stop)`` of the
  tensor's 2-D view ``(shape[0], prod(shape[1:]))`` (1-D: ``(n, 1)``): a block ``dim 0``; uneven and
  empty shards (FSDP2 gives the last ranks fewer rows, or none) are blocks like any other; the padding
  FSDP2 keeps past a shard's rows is not part of ``to_local()`` and never read;
* a 2-D ``DTensor`` placed ``Shard(1)`` (TP column-parallel) holds the columns ``[start, stop)``: ``dim 1``;
* ``Replicate()`` and plain tensors without a declared placement are whole on each rank that holds
  them (replicated norms, tied embeddings, a pipeline stage's own layers);
* a plain tensor with a declared :class:`Placement` (Megatron-style callers) is the block it declares.

The parts of the patch format (DESIGN.md, "Patches in parts") are these blocks. The ranks exchange their
:class:`LocalEntry` records (dtype, block, the digest of a whole tensor; a few hundred bytes per tensor)
and :func:`plan_layout` checks them, the same on every rank: the blocks of a tensor tile it exactly
(no gap, no overlap, one ``dim``, the same dtype and trailing shape), a whole tensor held by several
ranks has the same bits on all of them (else :class:`~.errors.ReplicaMismatchError` naming it), and is
published by one of them (largest first to the least loaded holder).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from stitchboard.proto import parts
from stitchboard.proto.codec import EncodedTensor, checksum, encoded_from_parts
from stitchboard.proto.container import RawTensor

from .errors import ReplicaMismatchError, ServedViewError
from .served_view import DtypeMap, cast_served

#: Rows and columns of one FP8 scale block (DeepSeek-V3 / Qwen3-FP8 ``weight_block_size``).
FP8_BLOCK = 128
#: The suffix of a block-scale tensor beside its FP8 weight (``X.weight`` and ``X.weight_scale_inv``).
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Placement:
    """A declared block of a tensor a rank holds: ``dim 0`` = rows ``[start, stop)`` of the 2-D view,
    ``dim 1`` = columns ``[start, stop)`` (2-D tensors only). Megatron-style callers give one per
    sharded parameter; the full shape is what the ranks' blocks together cover."""

    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class LocalEntry:
    """What a rank tells the others of one tensor it holds (plain data, pickled by ``all_gather_object``).

    Attributes:
        dtype: served dtype name (``BF16``...).
        local_shape: shape of the rank's local tensor as the model holds it, not the 2-D block a cast piece is
            shaped as (the whole shape for a whole tensor): the whole tensor's shape is planned from it.
        block: the rows or columns held, or None for a whole tensor.
        digest: xxh3-128 of a whole tensor's served bits (compared across replicas); "" for a block.
    """

    dtype: str
    local_shape: tuple[int, ...]
    block: Placement | None
    digest: str


@dataclass(frozen=True)
class TensorLayoutPlan:
    """One tensor of the version as every rank sees it after :func:`plan_layout`.

    Attributes:
        dtype: served dtype name.
        shape: the whole tensor's shape.
        parts: (rank, block) in block order for a sharded tensor, empty blocks (a rank with no rows) left
            out; empty for a whole one.
        owner: the rank that publishes a whole tensor (-1 for a sharded one).
        digest: a whole tensor's xxh3-128 (its replicas agree on it); "" for a sharded one.
    """

    dtype: str
    shape: tuple[int, ...]
    parts: tuple[tuple[int, Placement], ...]
    owner: int
    digest: str = ""


def _dtensor_block(name: str, t: torch.Tensor) -> tuple[torch.Tensor, Placement | None]:
    """The local tensor of a DTensor and its block (None: replicated on every rank of its mesh)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = t.placements  # type: ignore[attr-defined]
    shards = [p for p in placements if isinstance(p, Shard)]
    if any(not isinstance(p, Shard | Replicate) for p in placements) or len(shards) > 1:
        raise ServedViewError(
            f"tensor {name!r} is placed {list(placements)}: the shard-local publish takes Shard(0), Shard(1) "
            "(2-D) or Replicate() on one mesh dimension; reduce partial tensors, or use ShardedPublisher"
        )
    local = t.to_local()  # type: ignore[attr-defined]
    if not shards:
        return local, None
    dim = shards[0].dim
    if dim not in (0, 1) or (dim == 1 and t.ndim != 2):
        raise ServedViewError(
            f"tensor {name!r} ({list(t.shape)}) is sharded on dim {dim}: parts are rows of the 2-D view or columns "
            "of a 2-D tensor; use ShardedPublisher for it"
        )
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)  # type: ignore[attr-defined]
    extent = int(t.shape[dim])
    start = min(int(offset[dim]), extent)  # an empty shard's offset may point past the end
    return local, Placement(dim, start, start + int(local.shape[dim]))


def local_pieces(
    state: Mapping[str, torch.Tensor], placements: Mapping[str, Placement] | None = None
) -> dict[str, tuple[torch.Tensor, Placement | None]]:
    """Checkpoint name -> (this rank's local tensor, its block or None for a whole tensor), names sorted.

    Args:
        state: checkpoint name -> live tensor (a ``DTensor`` or a plain tensor), as
            :func:`~.served_view.checkpoint_state` gives it.
        placements: the declared block of each plain tensor that is a shard (Megatron-style); plain
            tensors not named are whole.

    Raises:
        ServedViewError: a placement this publish cannot take (partial, two sharded mesh dimensions,
            a sharded dim other than 0 or 1 of a 2-D tensor), a declared placement on a DTensor, or a
            declared block whose extent differs from the local tensor's.
    """
    out: dict[str, tuple[torch.Tensor, Placement | None]] = {}
    declared = placements or {}
    for name in sorted(state):
        t = state[name]
        if hasattr(t, "to_local"):
            if name in declared:
                raise ServedViewError(f"tensor {name!r} is a DTensor: its placement is its own, do not declare one")
            out[name] = _dtensor_block(name, t)
            continue
        block = declared.get(name)
        if block is not None:
            if block.dim not in (0, 1) or (block.dim == 1 and t.ndim != 2) or t.ndim == 0:
                raise ServedViewError(f"tensor {name!r} ({list(t.shape)}): declared dim {block.dim} is not a part dim")
            if not 0 <= block.start <= block.stop or block.stop - block.start != t.shape[block.dim]:
                raise ServedViewError(
                    f"tensor {name!r}: declared {block} does not match the local shape {list(t.shape)}"
                )
        out[name] = (t, block)
    return out


def cast_piece(
    name: str, local: torch.Tensor, block: Placement | None, dtypes: DtypeMap | None, default: torch.dtype
) -> RawTensor:
    """A host copy of a rank's piece in its served dtype, shaped as its block of the 2-D view.

    A ``dim 0`` block of a tensor ``[n, a, b]`` is ``[stop - start, a * b]``; a ``dim 1`` block of ``[n, m]``
    is ``[n, stop - start]``; a whole tensor keeps its shape.
    """
    raw = cast_served(name, local, dtypes, default)
    if block is None:
        return raw
    rows, cols = (int(raw.shape[0]), math.prod(raw.shape[1:])) if block.dim == 0 else tuple(raw.shape)
    return RawTensor(raw.dtype, (rows, cols), raw.bits)


def entry_of(raw: RawTensor, block: Placement | None) -> LocalEntry:
    """The record a rank shares of one piece (a whole tensor's digest is computed here)."""
    return LocalEntry(raw.dtype, tuple(raw.shape), block, checksum(raw) if block is None else "")


def _check_tiling(name: str, pieces: list[tuple[int, LocalEntry]]) -> TensorLayoutPlan:
    blocks = [(rank, e) for rank, e in pieces]
    first = blocks[0][1]
    assert first.block is not None
    dim = first.block.dim
    tails = {(e.dtype, e.local_shape[1:] if dim == 0 else e.local_shape[:1]) for _, e in blocks}
    if any(e.block is None or e.block.dim != dim for _, e in blocks) or len(tails) != 1:
        raise ServedViewError(
            f"tensor {name!r}: the ranks hold it as {[(r, e.dtype, e.local_shape, e.block) for r, e in blocks]}; "
            "its blocks must share one dim, dtype and the other dimension"
        )
    ordered = sorted(blocks, key=lambda b: (b[1].block.start, b[1].block.stop, b[0]))  # type: ignore[union-attr]
    at = 0
    for rank, e in ordered:
        assert e.block is not None
        if e.block.start != at:
            raise ServedViewError(
                f"tensor {name!r}: rank {rank}'s block {e.block} leaves a gap or overlaps at {at}; the blocks of "
                "the ranks must tile the tensor"
            )
        at = e.block.stop
    if dim == 0:
        shape: tuple[int, ...] = (at, *first.local_shape[1:])
    else:
        shape = (first.local_shape[0], at)
    kept = tuple((r, e.block) for r, e in ordered if e.block and e.block.stop > e.block.start)  # no empty parts
    return TensorLayoutPlan(first.dtype, shape, kept, -1)


def _check_fp8_scales(layout: Mapping[str, TensorLayoutPlan]) -> None:
    """Refuse an FP8 weight whose shard edge cuts through a 128 x 128 scale block (see :func:`plan_layout`)."""
    for scale_name in layout:
        if not scale_name.endswith(SCALE_SUFFIX):
            continue
        weight = layout.get(scale_name[: -len(SCALE_SUFFIX)])
        if weight is None or not weight.dtype.startswith("F8"):
            continue
        for _, block in weight.parts:
            cut = [edge for edge in (block.start, block.stop) if edge % FP8_BLOCK and edge != weight.shape[block.dim]]
            if cut:
                raise ServedViewError(
                    f"tensor {scale_name[: -len(SCALE_SUFFIX)]!r}: its shard edge {cut[0]} (dim {block.dim}) cuts a "
                    f"{FP8_BLOCK} x {FP8_BLOCK} block whose scale {scale_name!r} covers both ranks' elements; align "
                    f"the shards to {FP8_BLOCK} or quantize before sharding"
                )


def plan_layout(by_rank: Sequence[Mapping[str, LocalEntry]]) -> dict[str, TensorLayoutPlan]:
    """The version's layout from every rank's records (rank order); the same result on every rank.

    A tensor is either sharded (every holder has a block; the blocks tile it) or whole (every holder
    has the same bits; published by one holder). FP8 weights with a ``*_scale_inv`` beside them must be
    cut on multiples of 128 (a block's scale covers 128 rows and columns: a cut through it would make
    two ranks' pieces depend on one scale).

    Returns:
        Checkpoint name -> its plan, names sorted.

    Raises:
        ReplicaMismatchError: the holders of a whole tensor disagree on its bits (names it and the ranks).
        ServedViewError: a tensor whole on some ranks and sharded on others, blocks that do not tile,
            an FP8 scale block across a shard edge.
    """
    holders: dict[str, list[tuple[int, LocalEntry]]] = {}
    for rank, entries in enumerate(by_rank):
        for name, e in entries.items():
            holders.setdefault(name, []).append((rank, e))
    load = [0] * len(by_rank)
    layout: dict[str, TensorLayoutPlan] = {}
    whole: dict[str, list[tuple[int, LocalEntry]]] = {}
    for name in sorted(holders):
        pieces = holders[name]
        kinds = {e.block is None for _, e in pieces}
        if len(kinds) > 1:
            raise ServedViewError(
                f"tensor {name!r} is whole on rank(s) {[r for r, e in pieces if e.block is None]} and a shard on "
                f"rank(s) {[r for r, e in pieces if e.block is not None]}"
            )
        if kinds == {False}:
            layout[name] = _check_tiling(name, pieces)
            continue
        variants = {(e.dtype, e.local_shape, e.digest) for _, e in pieces}
        if len(variants) > 1:
            raise ReplicaMismatchError(
                f"tensor {name!r} is replicated on ranks {[r for r, _ in pieces]} but their served bits differ "
                f"({len(variants)} variants); nothing was published: make the replicas equal (e.g. sync the tied "
                "or replicated weights) before publishing",
                name=name,
                ranks=[r for r, _ in pieces],
            )
        whole[name] = pieces
    for name in sorted(whole, key=lambda n: (-math.prod(whole[n][0][1].local_shape), n)):
        rank = min((r for r, _ in whole[name]), key=lambda r: (load[r], r))
        e = whole[name][0][1]
        load[rank] += math.prod(e.local_shape)
        layout[name] = TensorLayoutPlan(e.dtype, e.local_shape, (), rank, e.digest)
    _check_fp8_scales(layout)
    return dict(sorted(layout.items()))


#: (dim, start, stop, base digest, target digest) of one rank's block of a tensor, as the ranks exchange it.
PartDigests = tuple[int, int, int, str, str]


def ordered_digests(name: str, by_rank: Iterable[Mapping[str, PartDigests]]) -> list[PartDigests]:
    """Every rank's :data:`PartDigests` of tensor ``name`` (ranks holding no block of it have none), in block order."""
    return sorted((digests[name] for digests in by_rank if name in digests), key=lambda d: d[1])


def digests_checksum(ordered: Sequence[PartDigests], target: bool) -> str:
    """The tensor's ``xxh3_128_parts`` before (``target`` False) or after, from its blocks' digests in order."""
    return parts.parts_checksum([(d[0], d[1], d[2], d[4] if target else d[3]) for d in ordered])


def entry_of_blocks(
    name: str,
    t: TensorLayoutPlan,
    ordered: Sequence[PartDigests],
    encoded: Mapping[tuple[str, int], parts.EncodedBlock],
) -> EncodedTensor:
    """A sharded tensor's patch entry, assembled on its writer rank: each block's encoding from ``encoded`` (by
    ``(name, start)``), a part with no change (count 0, its digests) for a block absent from it.

    Raises:
        ValueError: no block has a change.
    """
    blocks = [
        encoded.get((name, d[1])) or parts.EncodedBlock(parts.Part(d[0], d[1], d[2], 0, d[3], d[4], 0), b"", b"")
        for d in ordered
    ]
    return encoded_from_parts(name, t.dtype, t.shape, blocks)
