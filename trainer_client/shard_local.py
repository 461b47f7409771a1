"""Shard-local publish: every rank diffs only the blocks it holds; no tensor is gathered for a delta.

:class:`ShardLocalPublisher` takes on each rank its own pieces of the served view (:mod:`.local_shards`:
FSDP2/TP ``DTensor`` shards, declared Megatron-style blocks, whole tensors), diffs each block against its
kept copy of that block and encodes it as a part of the tensor's patch (:func:`stitchboard.proto.parts.encode_part`:
positions in the block's own order, its own stream). What the ranks exchange, over the publishers' gloo group:

* the pieces they hold (dtype, block, a whole tensor's digest; :func:`.local_shards.plan_layout` checks them):
  the records themselves at the first publish and whenever a rank's layout changes, otherwise only a key of
  each rank's layout and its whole tensors' digests (what grows with the world size is sent once);
* every part's base and target digests, so each tensor's ``xxh3_128_parts`` (the manifest's checksum of a
  sharded tensor, with its ``parts`` layout) is known on every rank without a gather;
* the encoded streams of the changed blocks, sent point to point to the tensor's writer rank (the least loaded,
  largest first), which assembles the tensor's patch entry (:func:`~stitchboard.proto.codec.encoded_from_parts`:
  one entry holds all of a tensor's parts) into its own patch file ``patch-v{N}-r{rank}.safetensors`` and
  uploads it: a delta's traffic is the encoded change (~0.5-2 bytes per changed element), never tensor bits;
* what each rank uploaded; rank 0 commits the manifest (:class:`~.sharded.ShardedPublisher`'s exchanges).

A tensor held whole by several ranks (replicated norms, a tied embedding on the first and last pipeline
stages) is compared by digest and published once, by one holder, as an ordinary (unparted) tensor; holders
that disagree are refused by name on every rank (:class:`~.errors.ReplicaMismatchError`) before anything is
encoded or uploaded. Pipeline stages publish their own layers the same way (whole tensors on one holder).

Anchors: a snapshot must be a plain checkpoint (DESIGN.md invariant 6), one file per tensor, so in an anchor
version each sharded tensor's blocks are sent to its writer point to point, one tensor at a time, and that rank
writes it into its snapshot shard (the anchor's only tensor traffic, once per ``snapshot_every`` versions).

Memory per rank: its pieces of the new view, its kept blocks, and one whole tensor while an anchor is written.
``publish_async`` takes the pieces at once (no collective in the caller's thread) and compares the layouts in
publish order. Squashes (``squash_depths``): each rank squashes its own pieces and a sharded tensor's parts meet at
its writer (:mod:`.shard_squash`); a publish with squashes casts the pieces when it takes the view instead of
streaming them (memory per rank: its kept pieces and its new ones). Resume: ``"rebuild"``
rebuilds the last version on every rank and each cuts its blocks from it at the first publish (any world size;
each rank holds the whole view for that publish), ``"anchor"`` makes the next version an anchor; a layout that
changes between versions without a resume is refused naming the tensor.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar, Unpack

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from stitchboard.proto import parts
from stitchboard.proto.checkpoint import shard_groups, write_shards_streaming
from stitchboard.proto.codec import EncodedTensor, build_patch, encode_tensor
from stitchboard.proto.container import RawTensor
from stitchboard.proto.dtypes import DTYPE_SIZES, bits_type
from stitchboard.proto.schema import XXH3_128, FileRef, TensorSpec

from .encode_version import BaseTensor, EncodedPart, bytes_ref, file_ref
from .errors import PublishError
from .local_shards import (
    LocalEntry,
    PartDigests,
    Placement,
    TensorLayoutPlan,
    cast_piece,
    digests_checksum,
    entry_of,
    entry_of_blocks,
    local_pieces,
    ordered_digests,
    plan_layout,
)
from .publish_result import PublishResult
from .publisher_core import PublisherOptions
from .served_view import TORCH_DTYPE_NAMES, checkpoint_state, served_dtype
from .shard_squash import ShardSquasher
from .sharded import ShardedPublisher
from .stream import StreamedView, TensorChange
from .uploads import upload_assets, upload_files
from .version_parts import EncodeReport, PublishedVersion, RankPart, ViewPart

K = TypeVar("K")
S = TypeVar("S")

#: A rank's piece of a tensor: cast to its served form, or the live tensor (a streamed publish casts it later).
Piece = RawTensor | torch.Tensor


@dataclass(frozen=True)
class ShardView(ViewPart):
    """A rank's pieces of the new view and the layout the ranks agreed on.

    Attributes (besides :class:`~.version_parts.ViewPart`'s; ``tensors`` holds this rank's blocks, shaped as
    blocks of the 2-D view, and the whole tensors it publishes):
        plan: checkpoint name -> :class:`~.local_shards.TensorLayoutPlan` of every tensor of the version.
        pieces: checkpoint name -> (this rank's piece, its block or None for a whole tensor).
        shapes: checkpoint name -> the shape of this rank's local tensor as the model holds it (a cast block is
            shaped as a block of the 2-D view, so the whole tensor's shape is planned from these).
    """

    pieces: Mapping[str, tuple[Piece, Placement | None]] = field(default_factory=dict)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


def _layout_key(entries: Mapping[str, LocalEntry]) -> str:
    """xxh3-128 of a rank's layout records without the whole tensors' digests (which change every version)."""
    text = repr(sorted((n, e.dtype, e.local_shape, e.block) for n, e in entries.items()))
    return xxhash.xxh3_128_hexdigest(text.encode())


class _Agreed(Exception):
    """An error every rank raises alike at the same point (a refused layout): raised as ``error`` on every rank."""

    def __init__(self, error: Exception) -> None:
        super().__init__(repr(error))
        self.error = error


def _wait(works: list[Any]) -> None:
    """Wait for every posted send or receive (``torch.distributed`` returns None for a rank outside the group)."""
    for work in works:
        if work is not None:
            work.wait()


def _layout(t: TensorLayoutPlan) -> _Layout:
    return _Layout(t.dtype, t.shape, math.prod(t.shape) * DTYPE_SIZES[t.dtype])


#: What a rank encodes of a version: its whole tensors' deltas, its changed blocks, its parts' digests, and the
#: changed elements of its streamed pieces.
_Own = tuple[
    list[EncodedTensor], dict[tuple[str, int], parts.EncodedBlock], dict[str, PartDigests], dict[str, TensorChange]
]


@dataclass(frozen=True)
class _Now:
    """The version being published, from its encoding to its adoption (one at a time: the publisher's lock).

    Attributes:
        plan: the layout the ranks agreed on.
        mine: this rank's pieces it publishes (non-empty blocks, whole tensors it owns): cast host copies, or
            the live tensors of a streamed publish (cast one at a time; their changes kept in ``changes``).
        sums: name -> target checksum of every tensor (``xxh3_128``, or ``xxh3_128_parts`` of a sharded one).
        changes: name -> changed elements of a streamed piece against its kept bits (written in after the commit).
        kept: the kept view the version is a delta from (None: none).
    """

    plan: dict[str, TensorLayoutPlan]
    mine: dict[str, Piece]
    sums: dict[str, str]
    changes: dict[str, TensorChange]
    kept: Mapping[str, RawTensor] | None


@dataclass(frozen=True)
class _Layout:
    """A tensor's dtype, shape and size (the snapshot plan's view of a tensor this rank writes)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class ShardLocalPublisher(ShardedPublisher):
    """Publishes one version from all ranks; each rank diffs and uploads its own blocks (module docstring).

    Every rank makes the publisher and calls each method in the same order, as with
    :class:`~.sharded.ShardedPublisher` (same arguments, results and errors), and:

    Args:
        placements: the block each rank's plain tensors are (Megatron-style callers: checkpoint name ->
            :class:`~.local_shards.Placement` of this rank); DTensors carry their own; unnamed plain
            tensors are whole.
        exchange_timeout_s: as :class:`~.sharded.ShardedPublisher`.

    Raises:
        ValueError: ``exchange_timeout_s`` not positive, or a squash depth below 2.
    """

    _kept_blocks: dict[str, Placement]
    _now: _Now

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        placements: Mapping[str, Placement] | None = None,
        exchange_timeout_s: float = 1800.0,
        **options: Unpack[PublisherOptions],
    ) -> None:
        self.placements = dict(placements or {})
        self._kept_blocks = {}  # name -> the block this rank keeps of it (a resumed view is whole: none)
        self._streaming = False  # inside publish(): pieces stay live until encoded
        self._layout_keys: list[str | None] | None = None  # every rank's layout key at the last publish
        self._records: list[dict[str, LocalEntry]] = []  # every rank's layout records at the last publish
        #: How many publishes exchanged the ranks' full layout records (the first, and one whose layout changed);
        #: the others exchanged a key per rank and the digests of whole tensors only.
        self.layout_exchanges = 0
        super().__init__(url, run, token, group=group, exchange_timeout_s=exchange_timeout_s, **options)
        self._squasher = ShardSquasher(
            self.client, self.run, self.rank, self._squasher.depths, self.encoding,
            gather=self._gather, swap=self._swap, layout=lambda: (self._now.plan, self._writers(self._now.plan)),
        )  # fmt: skip

    # -- the view: this rank's pieces ---------------------------------------------------------

    def _take_view(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> ShardView:
        """This rank's pieces in their served form (host copies); no collective (the ranks' layouts are compared
        when the version is encoded, in publish order, so a background publish never interleaves with it)."""
        pieces: dict[str, tuple[Piece, Placement | None]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        try:
            state = checkpoint_state(model_or_state_dict)
            for name, (local, block) in local_pieces(state, self.placements).items():
                pieces[name] = (local if self._streaming else self._cast(name, local, block), block)
                shapes[name] = tuple(int(d) for d in local.shape)
        except Exception as exc:  # noqa: BLE001 - raised on every rank once the ranks compare (_plan)
            return ShardView({}, frozenset(), exc, True)
        return ShardView({}, frozenset(pieces), None, True, pieces, shapes)

    def publish(
        self,
        model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        step: int | None = None,
        anchor: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> PublishResult:
        """As :meth:`ShardedPublisher.publish`, streamed: a delta casts each piece when it is diffed and keeps only
        its changed elements (memory: the kept blocks, one piece, the changes); the changes are written into the
        kept blocks after the commit. The model must not change until this returns. With squashes the pieces are
        cast when the view is taken (the squashes' records need the kept pieces as they were)."""
        self._streaming = not self._squasher.depths
        try:
            return super().publish(model_or_state_dict, step, anchor, metadata)
        finally:
            self._streaming = False

    def _cast(self, name: str, piece: Piece, block: Placement | None) -> RawTensor:
        """A piece in its served form: a live tensor cast (a fresh host copy), a cast one as it is."""
        if isinstance(piece, RawTensor):
            return piece
        return cast_piece(name, piece, block, self.dtypes, self.default_dtype)

    def _entry(self, name: str, piece: Piece, block: Placement | None, shape: tuple[int, ...]) -> LocalEntry:
        """What this rank tells the others of a piece (``shape``: its local tensor's, :attr:`ShardView.shapes`); a
        live block is not cast for it (dtype and shape suffice)."""
        if block is None:
            return entry_of(self._cast(name, piece, block), block)  # a whole tensor's digest: cast, hashed, dropped
        if isinstance(piece, RawTensor):
            return LocalEntry(piece.dtype, shape, block, "")
        dtype = TORCH_DTYPE_NAMES.get(served_dtype(name, piece, self.dtypes, self.default_dtype), "U8")
        return LocalEntry(dtype, shape, block, "")

    def _own_view(self, view: Mapping[str, RawTensor]) -> ShardView:
        """A whole view given on every rank: every tensor is whole (compared across ranks, published once)."""
        pieces = {n: (view[n], None) for n in sorted(view)}
        return ShardView({}, frozenset(view), None, False, pieces, {n: tuple(view[n].shape) for n in view})

    def _plan(self, view: ShardView) -> tuple[dict[str, TensorLayoutPlan], dict[str, Piece]]:
        """The layout every rank agrees on, and this rank's pieces it publishes (its non-empty blocks, the whole
        tensors it owns).

        Raises (on every rank alike, as :class:`_Agreed`): PublishError naming the ranks whose view failed;
        the errors of :func:`.local_shards.plan_layout` (ReplicaMismatchError...).
        """
        entries = (
            None
            if view.error is not None
            else {n: self._entry(n, t, b, view.shapes[n]) for n, (t, b) in view.pieces.items()}
        )
        whole = None if entries is None else {n: e.digest for n, e in entries.items() if e.block is None}
        key = None if entries is None else _layout_key(entries)
        gathered = self._gather((None if view.error is None else repr(view.error), key, whole))
        failed = [r for r, (e, _, _) in enumerate(gathered) if e is not None]
        if failed:
            raise _Agreed(
                PublishError(
                    f"taking the served view for run {self.run!r} failed on rank(s) {failed}: "
                    f"{gathered[failed[0]][0]}; nothing was published",
                    ranks=failed,
                )
            )
        keys = [k for _, k, _ in gathered]
        if keys != self._layout_keys:  # the first publish, or a rank's layout changed: the records themselves
            self._records = self._gather(entries)
            self.layout_exchanges += 1
        else:  # the same layout on every rank: only the whole tensors' digests are new
            self._records = [
                {n: replace(e, digest=digests[n]) if e.block is None else e for n, e in records.items()}
                for records, (_, _, digests) in zip(self._records, gathered, strict=True)
            ]
        self._layout_keys = keys
        try:
            plan = plan_layout(self._records)  # the same records: the same result or error on every rank
        except Exception as exc:
            raise _Agreed(exc) from exc
        mine = {
            n: raw
            for n, (raw, block) in view.pieces.items()
            if (block is not None and block.stop > block.start) or plan[n].owner == self.rank
        }
        return plan, dict(sorted(mine.items()))

    def _exchange(self, what: str, work: Callable[[], tuple[K, S]]) -> tuple[K, list[S]]:
        """:meth:`ShardedPublisher._exchange`, but an error every rank raised alike (:class:`_Agreed`: a refused
        layout, a replica mismatch) is raised as it is, on every rank, without another exchange."""
        try:
            return super()._exchange(what, work)
        except PublishError as exc:
            if isinstance(exc.__cause__, _Agreed):
                raise exc.__cause__.error from None
            raise

    # -- encode: parts of this rank's blocks --------------------------------------------------

    def _base_block(self, name: str, t: TensorLayoutPlan, block: Placement, kept: Mapping[str, RawTensor]) -> RawTensor:
        """This rank's kept bits of ``block`` of tensor ``name``: the kept block, or cut from a whole kept tensor."""
        old = kept.get(name)
        rows, cols = parts.grid(t.shape)
        want = (block.stop - block.start, cols) if block.dim == 0 else (rows, block.stop - block.start)
        if (
            old is not None
            and old.dtype == t.dtype
            and tuple(old.shape) == want
            and self._kept_blocks.get(name) == block
        ):
            return old
        if old is not None and old.dtype == t.dtype and tuple(old.shape) == t.shape and name not in self._kept_blocks:
            return RawTensor(t.dtype, want, parts.block(old.bits, t.shape, block.dim, block.start, block.stop))
        raise PublishError(
            f"run {self.run}: tensor {name!r}: rank {self.rank} holds block {block} but kept "
            f"{self._kept_blocks.get(name, 'no copy of it')}; the layout changed since the last version: "
            "resume with resume='rebuild' (every rank cuts its blocks from the rebuilt view) or 'anchor'",
            name=name,
        )

    def _encode(
        self, view: ViewPart | StreamedView, last: PublishedVersion | None, version: int
    ) -> tuple[EncodedPart, EncodeReport]:
        if not isinstance(view, ShardView):
            raise PublishError(f"run {self.run}: ShardLocalPublisher publishes models and whole views, not streams")
        plan, mine = self._plan(view)
        changed_set = last is not None and (
            set(last.tensors) != set(plan)
            or any((last.tensors[n].dtype, last.tensors[n].shape) != (t.dtype, t.shape) for n, t in plan.items())
        )
        kept = None if last is None or changed_set else last.view
        writers = self._writers(plan)
        error: str | None = None
        local: _Own = ([], {}, {}, {})
        try:
            if kept is None:  # no delta: the new pieces become the kept view, cast now
                mine = {n: self._cast(n, p, self._block_of(plan[n])) for n, p in mine.items()}
            local = self._encode_own(mine, plan, last if kept is not None else None)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange below, then all raise
            error = repr(exc)
        whole, changed, digests, changes = local
        outgoing: dict[int, dict[tuple[str, int], parts.EncodedBlock]] = {}
        for key, enc in changed.items():
            if writers[key[0]] != self.rank:
                outgoing.setdefault(writers[key[0]], {})[key] = enc
        payloads = {dst: pickle.dumps(blocks) for dst, blocks in sorted(outgoing.items())}
        every = self._gather((error, digests, {dst: len(data) for dst, data in payloads.items()}))
        failed = [r for r, (e, _, _) in enumerate(every) if e is not None]
        if failed:
            raise PublishError(f"rank(s) {failed}: {every[failed[0]][0]}", ranks=failed)
        for data in self._swap(payloads, [sizes.get(self.rank, 0) for _, _, sizes in every]):
            changed.update(pickle.loads(data))  # this job's own ranks, over its own gloo group
        sums = {n: t.digest for n, t in plan.items() if t.owner >= 0}
        for name, t in plan.items():
            if t.owner >= 0:
                continue
            ordered = ordered_digests(name, (ds for _, ds, _ in every))
            sums[name] = digests_checksum(ordered, target=True)
            if writers[name] == self.rank and any(d[3] != d[4] for d in ordered):
                whole.append(entry_of_blocks(name, t, ordered, changed))
        self._now = _Now(plan, mine, sums, changes, kept)
        patch = None if last is None else build_patch(whole, self.encoding, self._patch_metadata(version))
        part = EncodedPart(
            patch,
            self.encoding,
            {n: sums[n] for n in sorted(sums)},
            sum(e.entry.count for e in whole),
            sum(math.prod(plan[n].shape) for n in plan if writers[n] == self.rank),
            sorted(e.entry.name for e in whole),
            changed_set,
        )
        written = {n: _layout(plan[n]) for n in plan if writers[n] == self.rank}
        report = EncodeReport(
            changed_set, shard_groups(written, self.max_shard_bytes), sum(m.nbytes for m in written.values())
        )
        return part, report

    def _encode_own(
        self, mine: Mapping[str, Piece], plan: Mapping[str, TensorLayoutPlan], last: PublishedVersion | None
    ) -> _Own:
        """This rank's share of the delta: the whole tensors it owns (encoded), its changed blocks (encoded as
        parts, by (name, start)), every block's digests, and the changed elements of each live piece (cast here
        one at a time and dropped); ``last`` None: no delta (only digests)."""
        whole: list[EncodedTensor] = []
        changed: dict[tuple[str, int], parts.EncodedBlock] = {}
        digests: dict[str, PartDigests] = {}
        changes: dict[str, TensorChange] = {}
        kept = last.view if last is not None else None
        for name, t in plan.items():
            piece = mine.get(name)
            if piece is None:
                continue
            new = self._cast(name, piece, self._block_of(t))
            if t.owner == self.rank:
                if kept is not None and last is not None:
                    old = self._kept_piece(name, t, kept)
                    enc = encode_tensor(name, old, new, self.encoding, base_checksum=last.tensors[name].checksum)
                    whole += [enc] if enc is not None else []
                    if enc is not None and not isinstance(piece, RawTensor):
                        changes[name] = TensorChange.between(old, new)
                continue
            block = next(b for r, b in t.parts if r == self.rank)
            if kept is None:
                d = parts.digest(new.bits)
                digests[name] = (block.dim, block.start, block.stop, d, d)
                continue
            base = self._base_block(name, t, block, kept)
            enc_block = parts.encode_part(base, new, block.dim, block.start, block.stop, self.encoding)
            p = enc_block.part
            digests[name] = (p.dim, p.start, p.stop, p.base, p.target)
            if p.count:
                changed[(name, p.start)] = enc_block
                if not isinstance(piece, RawTensor):
                    changes[name] = TensorChange.between(base, new)
        return whole, changed, digests, changes

    def _block_of(self, t: TensorLayoutPlan) -> Placement | None:
        """This rank's block of a tensor (None: a whole tensor)."""
        return None if t.owner >= 0 else next((b for r, b in t.parts if r == self.rank), None)

    def _new_piece(self, name: str) -> RawTensor:
        """This rank's piece of the new view: a cast copy, or (streamed) its kept bits with the change written into
        a fresh copy (the kept bits themselves when unchanged)."""
        now = self._now
        piece = now.mine[name]
        if isinstance(piece, RawTensor):
            return piece
        assert now.kept is not None  # a streamed piece has a kept base (else it was cast in _encode)
        base = self._kept_piece(name, now.plan[name], now.kept)
        change = now.changes.get(name)
        if change is None:
            return base
        new = RawTensor(base.dtype, base.shape, base.bits.copy())
        change.write(new)
        return new

    def _kept_piece(self, name: str, t: TensorLayoutPlan, kept: Mapping[str, RawTensor]) -> RawTensor:
        """This rank's kept bits of its piece of tensor ``name`` (see :meth:`_base_block`).

        Raises:
            PublishError: a whole tensor now, a block of it kept (no rank holds its old bits whole).
        """
        block = self._block_of(t)
        if block is not None:
            return self._base_block(name, t, block, kept)
        if name in self._kept_blocks or name not in kept:
            raise PublishError(
                f"run {self.run}: tensor {name!r} is whole on rank {self.rank} now but was sharded in the last "
                "version: the layout changed; resume with resume='rebuild' or 'anchor'",
                name=name,
            )
        return kept[name]

    def _swap(self, payloads: Mapping[int, bytes], incoming: list[int]) -> list[bytes]:
        """Send each payload to its rank and take the ones sent here (``incoming[r]``: bytes from rank r), all at
        once (non-blocking sends and receives: no order between ranks to deadlock on)."""
        works = [
            dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), group=self._control, group_dst=dst)
            for dst, data in payloads.items()
        ]
        buffers = []
        for src, size in enumerate(incoming):
            if size and src != self.rank:
                buffer = torch.empty(size, dtype=torch.uint8)
                works.append(dist.irecv(buffer, group=self._control, group_src=src))
                buffers.append(buffer)
        _wait(works)
        return [b.numpy().tobytes() for b in buffers]

    def _writers(self, plan: Mapping[str, TensorLayoutPlan]) -> dict[str, int]:
        """Which rank writes each tensor's patch entry (from the ranks' encoded blocks) and, in an anchor, its
        snapshot: a whole tensor's owner; a sharded one goes to the least loaded rank, largest first (the same on
        every rank)."""
        load = [0] * self.world
        owners: dict[str, int] = {}
        for name, t in plan.items():
            if t.owner >= 0:
                owners[name] = t.owner
                load[t.owner] += math.prod(t.shape) * DTYPE_SIZES[t.dtype]
        for name in sorted((n for n, t in plan.items() if t.owner < 0), key=lambda n: (-math.prod(plan[n].shape), n)):
            rank = min(range(self.world), key=lambda r: (load[r], r))
            owners[name] = rank
            load[rank] += math.prod(plan[name].shape) * DTYPE_SIZES[plan[name].dtype]
        return owners

    # -- files: this rank's patch and snapshot shards ----------------------------------------

    def _write_and_upload(
        self,
        folder: Path,
        version: int,
        view: ViewPart | StreamedView,
        part: EncodedPart,
        weight_map: dict[str, str],
        index: tuple[FileRef, bytes] | None,
        snapshot: bool,
    ) -> tuple[float, RankPart]:
        plan = self._now.plan
        writers = self._writers(plan)
        t0 = time.perf_counter()
        items: list[tuple[FileRef, bytes | Path]] = []
        if part.patch is not None:
            items.append((bytes_ref(f"patch-v{version}-r{self.rank}.safetensors", part.patch, "patch"), part.patch))
        if weight_map:
            own = {n: s for n, s in weight_map.items() if writers[n] == self.rank}
            layout = {n: _layout(plan[n]) for n in own}
            sends = self._send_blocks(writers)
            shards = write_shards_streaming(folder, layout, own, self._whole_tensor)
            _wait(sends)
            items += [(file_ref(p, "snapshot"), p) for p in shards]
        write_s = time.perf_counter() - t0
        uploaded = upload_files(
            self.client, self.run, items + ([index] if index is not None and self.rank == 0 else [])
        )
        if snapshot and self.rank == 0:
            uploaded += upload_assets(self.client, self.run, self._assets, self._asset_data)
        specs = [self._spec(n, t) for n, t in plan.items() if writers[n] == self.rank]
        return write_s, RankPart(
            part.encoding, [ref for ref, _ in items], specs, part.changed_elements, len(part.changed_tensors), uploaded
        )

    def _spec(self, name: str, t: TensorLayoutPlan) -> TensorSpec:
        """The manifest entry of a tensor: a whole one's ``xxh3_128``; a sharded one's ``xxh3_128_parts`` and layout."""
        if t.owner >= 0:
            return TensorSpec(name=name, dtype=t.dtype, shape=list(t.shape), checksums={XXH3_128: self._now.sums[name]})
        return TensorSpec(
            name=name,
            dtype=t.dtype,
            shape=list(t.shape),
            checksums={parts.XXH3_128_PARTS: self._now.sums[name]},
            parts=[(b.dim, b.start, b.stop) for _, b in t.parts],
        )

    def _send_blocks(self, owners: Mapping[str, int]) -> list[Any]:
        """Post this rank's blocks of the sharded tensors other ranks write into the snapshot (non-blocking sends,
        tagged by the tensor's place in name order)."""
        works = []
        for tag, (name, t) in enumerate(self._now.plan.items()):
            if t.owner < 0 and owners[name] != self.rank and name in self._now.mine:
                bits = torch.from_numpy(np.ascontiguousarray(self._new_piece(name).bits).view(np.uint8))
                works.append(dist.isend(bits, group=self._control, group_dst=owners[name], tag=tag))
        return works

    def _whole_tensor(self, name: str) -> RawTensor:
        """Tensor ``name`` whole, for the snapshot this rank writes: its own, or its blocks received from the ranks."""
        plan = self._now.plan
        t = plan[name]
        if t.owner >= 0:
            return self._new_piece(name)
        tag = list(plan).index(name)
        rows, cols = parts.grid(t.shape)
        size = DTYPE_SIZES[t.dtype]
        full = np.empty(rows * cols * size, dtype=np.uint8)
        grid = full.reshape(rows, cols * size)
        for rank, block in t.parts:
            width = block.stop - block.start
            if rank == self.rank:
                piece = np.ascontiguousarray(self._new_piece(name).bits).view(np.uint8)
            else:
                piece = np.empty(width * (cols if block.dim == 0 else rows) * size, dtype=np.uint8)
                dist.recv(torch.from_numpy(piece), group=self._control, group_src=rank, tag=tag)
            if block.dim == 0:
                grid[block.start : block.stop] = piece.reshape(width, cols * size)
            else:
                grid[:, block.start * size : block.stop * size] = piece.reshape(rows, width * size)
        return RawTensor(t.dtype, t.shape, full.view(bits_type(t.dtype)))

    # -- after the commit: the kept blocks -----------------------------------------------------

    def _adopter(
        self, view: ViewPart | StreamedView, last: PublishedVersion | None, manifest: Any, snapshot: bool
    ) -> Callable[[], PublishedVersion]:
        now = self._now
        plan, mine, sums = now.plan, now.mine, now.sums
        tensors = {n: BaseTensor(t.dtype, t.shape, sums[n]) for n, t in plan.items()}
        since = 0 if snapshot or last is None else last.since_anchor + 1
        kept_blocks = {n: b for n, t in plan.items() for r, b in t.parts if r == self.rank and n in mine}

        def adopt() -> PublishedVersion:
            view: dict[str, RawTensor] = {}
            for name, piece in mine.items():
                if isinstance(piece, RawTensor):
                    view[name] = piece
                    continue
                assert now.kept is not None  # streamed: a delta from the kept view
                base = self._kept_piece(name, plan[name], now.kept)
                change = now.changes.get(name)
                if change is not None:
                    owned = last is not None and name in last.owned and base is now.kept.get(name)
                    if not (owned and base.bits.flags.writeable):
                        base = RawTensor(base.dtype, base.shape, base.bits.copy())
                    change.write(base)  # bits replaced in place, never float math
                view[name] = base
            self._kept_blocks = kept_blocks
            return PublishedVersion(manifest.version, view, tensors, since, frozenset(view))

        return adopt
