"""Squashes of a shard-local publish: each rank squashes its own pieces; a sharded tensor's parts meet at its writer.

Runs in every trainer rank of a :class:`~.shard_local.ShardLocalPublisher` with ``squash_depths``. As with
:class:`~.squash.Squasher` (whose records, size rule, upload and bulletin record it keeps), each rank keeps the
last versions of *its own pieces* as reverse records: its blocks of the sharded tensors and the whole tensors it
publishes. For a squash ``B -> L`` every rank rebuilds its pieces at ``B`` (only those of tensors whose checksum
moved since ``B``, the same set on every rank: it is read from the manifests) and:

* encodes each whole tensor it owns against its rebuilt base, as a delta is encoded;
* encodes each block it holds of a moved sharded tensor as a part against its rebuilt base block
  (:func:`stitchboard.proto.parts.encode_part`), unchanged blocks included (their digests tile the tensor);
* checks its own encodings before anything leaves it: they are decoded on the rebuilt bases, as an engine
  decodes them, and must reach the latest pieces' bits (a block as a one-part tensor of the block's shape:
  a block's stream is in the block's own row-major order);
* sends its changed blocks to each tensor's writer rank (the delta's writer, :meth:`ShardLocalPublisher._writers`)
  and every block's digests to every rank (metadata only);

and the writer checks that the base digests of the parts combine to version ``B``'s checksum of the tensor and
the target digests to ``L``'s (``xxh3_128_parts``: the rebuilt blocks are ``B``'s), then assembles the tensor's
entry (:func:`~stitchboard.proto.codec.encoded_from_parts`) into its own file ``squash-vB-vL-r{rank}``. A failed
check or encode on any rank skips the squash on every rank (logged; the chain serves). The tensor traffic is the
encoded change, as for a delta.

A squash needs each rank's pieces of the new view kept as they were published, so a shard-local publish with
squashes casts its pieces when it takes the view (like :class:`~.publisher.Publisher` with squashes) instead of
streaming them: each rank then holds its kept pieces and its new pieces during a publish (2x its shard).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto import parts
from stitchboard.proto.apply import apply_patch
from stitchboard.proto.codec import EncodedTensor, build_patch, encode_tensor, encoded_from_parts
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.errors import BaseMismatchError, PatchError, TargetMismatchError
from stitchboard.proto.schema import Encoding, VersionManifest

from .local_shards import PartDigests, TensorLayoutPlan, digests_checksum, entry_of_blocks, ordered_digests
from .squash import Exchange, OnCommitter, Squasher

log = logging.getLogger("stitchboard.trainer_client")

#: The layout of the version just published: its plan and each tensor's writer rank.
Layout = tuple[Mapping[str, TensorLayoutPlan], Mapping[str, int]]


class ShardSquasher(Squasher):
    """A :class:`~.squash.Squasher` over this rank's pieces of a shard-local publish (module docstring).

    Args:
        client, run, rank, depths, encoding: as :class:`~.squash.Squasher`.
        gather: the publisher's all-gather of a small object over its control group (every rank's, in rank order).
        swap: the publisher's point-to-point exchange: ``swap(payloads by destination rank, bytes from each rank)``
            -> the payloads sent to this rank.
        layout: the plan and the writer ranks of the version just committed.
    """

    def __init__(
        self,
        client: BulletinClient,
        run: str,
        rank: int,
        depths: Iterable[int],
        encoding: Encoding,
        *,
        gather: Callable[[Any], list[Any]],
        swap: Callable[[Mapping[int, bytes], list[int]], list[bytes]],
        layout: Callable[[], Layout],
    ) -> None:
        super().__init__(client, run, rank, depths, encoding)
        self._gather, self._swap, self._layout = gather, swap, layout

    def after_commit(
        self,
        manifest: VersionManifest,
        old: Mapping[str, RawTensor] | None,
        new: Mapping[str, RawTensor],
        old_checksums: Mapping[str, str],
        exchange: Exchange,
        on_committer: OnCommitter,
    ) -> list[Any]:
        """As :meth:`.Squasher.after_commit`; when any rank's pieces differ from its last ones in names or shapes
        (a resumed or re-laid-out job) every rank restarts its records, as a changed tensor set does: the ranks
        decide it together (a rank with other records than the others would leave them in another collective)."""
        if not self.depths:
            return []
        same = (
            old is not None
            and set(old) == set(new)
            and all(tuple(old[n].shape) == tuple(t.shape) for n, t in new.items())
        )
        if not all(self._gather(same)):
            old = None
        return super().after_commit(manifest, old, new, old_checksums, exchange, on_committer)

    def _encode(
        self,
        what: str,
        base: int,
        manifest: VersionManifest,
        new: Mapping[str, RawTensor],
        metadata: Mapping[str, str],
        exchange: Exchange,
    ) -> tuple[bytes | None, list[tuple[int, int] | None]]:
        plan, writers = self._layout()
        base_sums, _ = self.views.base_of(base)
        target_sums = manifest.checksums()
        moved = sorted(n for n in plan if base_sums.get(n) != target_sums[n])  # the same on every rank
        error: str | None = None
        whole: list[EncodedTensor] = []
        blocks: dict[str, parts.EncodedBlock] = {}
        try:
            whole, blocks = self._encode_own(base, moved, plan, new, base_sums, target_sums)
        except PatchError as exc:  # wrong bits: never uploaded, every rank skips it
            error = f"failed its check against rank {self.rank}'s views ({exc})"
        except Exception as exc:  # a derived object: every rank must reach the gather, then skip
            log.exception("%s: encoding failed on rank %d", what, self.rank)
            error = f"encoding failed on rank {self.rank} ({exc!r})"
        digests = {n: (e.part.dim, e.part.start, e.part.stop, e.part.base, e.part.target) for n, e in blocks.items()}
        outgoing: dict[int, dict[tuple[str, int], parts.EncodedBlock]] = {}
        for name, enc in blocks.items():
            if enc.part.count and writers[name] != self.rank:
                outgoing.setdefault(writers[name], {})[(name, enc.part.start)] = enc
        payloads = {dst: pickle.dumps(b) for dst, b in sorted(outgoing.items())}
        every = self._gather((error, digests, {dst: len(data) for dst, data in payloads.items()}))
        failed = [(r, e) for r, (e, _, _) in enumerate(every) if e is not None]
        if failed:
            log.error("%s %s: not uploaded; the chain serves", what, failed[0][1])
            return None, [None] * len(every)
        received = {(n, e.part.start): e for n, e in blocks.items() if e.part.count}
        swapped: Exception | None = None
        try:
            for data in self._swap(payloads, [sizes.get(self.rank, 0) for _, _, sizes in every]):
                received.update(pickle.loads(data))  # this job's own ranks, over its own gloo group
        except Exception as exc:  # noqa: BLE001 - logged in assemble; every rank must still reach the exchange
            swapped = exc

        def assemble() -> tuple[bytes | None, tuple[int, int] | None]:
            if swapped is not None:
                log.error("%s: receiving the ranks' blocks failed on rank %d (%r)", what, self.rank, swapped)
                return None, None
            try:
                for name in moved:
                    if plan[name].owner < 0 and writers[name] == self.rank:
                        ordered = ordered_digests(name, (ds for _, ds, _ in every))
                        whole.append(self._assemble(name, plan[name], ordered, received, base_sums, target_sums))
                data = build_patch(whole, self.encoding, metadata)
            except PatchError as exc:
                log.error("%s failed its check on its writer rank %d (%s): not uploaded", what, self.rank, exc)
                return None, None
            return data, (len(data), sum(e.entry.count for e in whole))

        return exchange(f"assembling {what}", assemble)

    def _encode_own(
        self,
        base: int,
        moved: list[str],
        plan: Mapping[str, TensorLayoutPlan],
        new: Mapping[str, RawTensor],
        base_sums: Mapping[str, str],
        target_sums: Mapping[str, str],
    ) -> tuple[list[EncodedTensor], dict[str, parts.EncodedBlock]]:
        """This rank's share: the whole tensors it owns (encoded), every block it holds of a moved sharded tensor
        (encoded as a part, unchanged ones with count 0), both checked by decoding them on the rebuilt bases.

        Raises:
            BaseMismatchError, TargetMismatchError: the rebuilt pieces are not version ``base``'s, or an encoding
                does not reach the latest bits (PatchError: it does not decode).
            KeyError: a moved piece this rank holds has no record since ``base``.
        """
        old = self.views.view_at(base, new)  # copies of this rank's pieces that moved since the base
        mine = [n for n in moved if n in new]
        missing = [n for n in mine if n not in old]
        if missing:
            raise KeyError(f"rank {self.rank} holds tensors {missing[:3]} but has no record of their changes")
        whole: list[EncodedTensor] = []
        blocks: dict[str, parts.EncodedBlock] = {}
        checked: list[EncodedTensor] = []  # each block as a one-part tensor of the block's shape
        for name in mine:
            t = plan[name]
            if t.owner >= 0:
                enc = encode_tensor(
                    name, old[name], new[name], self.encoding,
                    base_checksum=base_sums[name], target_checksum=target_sums[name],
                )  # fmt: skip
                if enc is None:
                    raise BaseMismatchError(f"tensor {name!r}: the rebuilt base has the latest bits, not the base's")
                whole.append(enc)
                checked.append(enc)
                continue
            block = next(b for r, b in t.parts if r == self.rank)
            enc_block = parts.encode_part(old[name], new[name], block.dim, block.start, block.stop, self.encoding)
            blocks[name] = enc_block
            if enc_block.part.count:
                alone = replace(enc_block.part, dim=0, start=0, stop=int(new[name].shape[0]))
                shape = tuple(int(d) for d in new[name].shape)
                checked.append(
                    encoded_from_parts(
                        name, new[name].dtype, shape, [parts.EncodedBlock(alone, enc_block.stream, enc_block.values)]
                    )
                )
        if checked:  # decoded on the rebuilt bases (their copies), as an engine decodes it
            apply_patch(old, read_patch(build_patch(checked, self.encoding, {}), what="squash check"))
        return whole, blocks

    def _assemble(
        self,
        name: str,
        t: TensorLayoutPlan,
        ordered: list[PartDigests],
        received: Mapping[tuple[str, int], parts.EncodedBlock],
        base_sums: Mapping[str, str],
        target_sums: Mapping[str, str],
    ) -> EncodedTensor:
        """Tensor ``name``'s entry from every rank's blocks, on its writer.

        Raises:
            BaseMismatchError, TargetMismatchError: the blocks' digests do not combine to the base version's or the
                latest version's checksum of the tensor.
        """
        if digests_checksum(ordered, target=False) != base_sums[name]:
            raise BaseMismatchError(f"tensor {name!r}: the ranks' rebuilt blocks are not the base version's")
        if digests_checksum(ordered, target=True) != target_sums[name]:
            raise TargetMismatchError(f"tensor {name!r}: the ranks' blocks are not the latest version's")
        return entry_of_blocks(name, t, ordered, received)
