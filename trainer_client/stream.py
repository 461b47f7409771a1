"""A delta publish taken tensor by tensor: the kept view plus one tensor in memory (trainer process, one rank).

A delta needs, of the new served view, only what differs from the kept view (the last published one).
:class:`ViewStreamer` takes the new view one tensor at a time, in its served form (cast, recipe), diffs it
against the kept tensor with the codec's per-tensor encoder (:func:`~stitchboard.proto.codec.encode_tensor`,
exactly what the whole-view diff runs, so the patch file is byte-identical), and keeps of it only its
checksum and its changed positions and bits (:class:`TensorChange`: the ``overwrite`` coder's varint gaps and
values, ~3 bytes per changed bf16 element; taken from the encoder's own scan where it has one, a tensor coded as
one stream, else by a second compare pass); the new tensor is then dropped. A tensor the kept view lacks (a
new name, dtype or shape) is kept whole: it joins the kept view. Memory: the kept view, one new tensor (or a few
small ones where :mod:`.stream_workers` takes them on worker threads), and the changes (~1.5 % of a bf16 view at
1 % changed elements). A tensor given as a torch tensor on a GPU is diffed
there (:mod:`.device_diff`: the same positions and bits, only the changes copied to the host); the rest on the host.

The kept view stays untouched until the version is committed (a failed or retried publish diffs against it
again); then :meth:`StreamedView.commit_into` writes the changes into it in place (bits replaced, never float
math). A kept tensor the publisher does not own (one given to ``publish_view``, or read-only memory) is copied
before it is written. An anchor's shards are written one tensor at a time from the kept view and the changes
(:meth:`StreamedView.tensor`, :func:`~stitchboard.proto.checkpoint.write_shards_streaming`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from stitchboard.proto import _bitdiff
from stitchboard.proto.codec import EncodedTensor, build_patch, checksum, encode_tensor
from stitchboard.proto.container import RawTensor
from stitchboard.proto.dtypes import DTYPE_SIZES, numel_of
from stitchboard.proto.schema import Encoding

from .device_diff import DeviceDiffer, flat_bits, on_device
from .encode_version import EncodedPart
from .errors import CheckpointNameError
from .link import PART_BYTES
from .served_view import TORCH_DTYPE_NAMES, to_raw
from .tied_head import TIED_HEADS, tied_head_error
from .version_parts import PublishedVersion


@dataclass(frozen=True)
class Layout:
    """Dtype name, shape and size in bytes of a tensor whose bits are not held."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class TensorChange:
    """The changed elements of one tensor: ``count`` positions as varint gaps, and their new bits (little-endian)."""

    count: int
    gaps: bytes
    values: bytes

    @staticmethod
    def between(old: RawTensor, new: RawTensor) -> TensorChange:
        """The change taking ``old`` to ``new`` (same dtype and shape; canonical: equal changes, equal bits)."""
        count, gaps, values = _bitdiff.diff(old.bits, new.bits, DTYPE_SIZES[old.dtype], False)
        return TensorChange(count, gaps, values)

    def write(self, t: RawTensor) -> None:
        """Replace the changed elements' bits of ``t`` (writable, of the dtype and shape the change was made on)."""
        positions = np.empty(self.count, dtype=np.int64)
        _bitdiff.positions(self.gaps, positions, t.numel)
        t.bits[positions] = np.frombuffer(self.values, dtype=t.bits.dtype)


@dataclass(frozen=True)
class StreamedView:
    """A new served view held as its difference from the kept view of version ``base_version``.

    Attributes:
        base_version: the version whose kept view the changes apply to (None: no kept view; every tensor is
            in ``whole``).
        layout: name -> dtype, shape, size of every tensor of the new view, names sorted.
        checksums: name -> xxh3-128 of every tensor of the new view, names sorted.
        encoded: the codec's delta of each changed tensor the kept view also holds (same dtype and shape).
        changes: name -> its changed elements, for the same tensors.
        whole: the tensors the kept view lacks (by name, dtype or shape), held whole.
        encoding: the encoding of ``encoded``.
        tensor_set_changed: names, dtypes or shapes differ from the base version.
        owns_whole: the tensors of ``whole`` are fresh copies made for this view (a cast), not the caller's.
    """

    base_version: int | None
    layout: dict[str, Layout]
    checksums: dict[str, str]
    encoded: tuple[EncodedTensor, ...]
    changes: dict[str, TensorChange]
    whole: dict[str, RawTensor]
    encoding: Encoding
    tensor_set_changed: bool
    owns_whole: bool

    def part(self, metadata: Mapping[str, str]) -> EncodedPart:
        """The version's delta: the same patch bytes and counts as :func:`.encode_version.encode_part` of the whole
        new view against the kept one (``metadata``: the patch's ``__metadata__`` strings)."""
        return EncodedPart(
            build_patch(list(self.encoded), self.encoding, metadata),
            self.encoding,
            self.checksums,
            sum(e.entry.count for e in self.encoded),
            sum(numel_of(t.shape) for t in self.layout.values()),
            sorted(e.entry.name for e in self.encoded),
            self.tensor_set_changed,
        )

    def tensor(self, name: str, kept: Mapping[str, RawTensor]) -> RawTensor:
        """Tensor ``name`` of the new view: a changed one is a fresh copy of the kept tensor with its change written
        (one tensor of memory, dropped by the caller), an unchanged one the kept tensor itself."""
        if name in self.whole:
            return self.whole[name]
        old = kept[name]
        change = self.changes.get(name)
        if change is None:
            return old
        new = RawTensor(old.dtype, old.shape, old.bits.copy())
        change.write(new)
        return new

    def commit_into(
        self, kept: dict[str, RawTensor], owned: frozenset[str]
    ) -> tuple[dict[str, RawTensor], frozenset[str]]:
        """After the commit: ``kept`` made the new view in place (returned, names sorted), and the names the
        publisher now owns.

        A changed tensor in ``owned`` whose memory is writable gets its change written in place; another changed
        tensor is replaced by a copy first (never writing memory a caller shares; the old one is let go at once,
        so a caller's view costs one tensor more at a time). Tensors the new view lacks are dropped.

        Args:
            kept: the publisher's dict of the kept view of ``base_version`` (entries replaced, added, removed).
            owned: names of ``kept``'s tensors that are the publisher's own copies.
        """
        mine = set(owned) & set(self.layout)
        for name in [n for n in kept if n not in self.layout or n in self.whole]:
            del kept[name]
        for name, change in self.changes.items():
            t = kept[name]
            if name not in owned or not t.bits.flags.writeable:
                t = kept[name] = RawTensor(t.dtype, t.shape, t.bits.copy())
            change.write(t)
            mine.add(name)
        kept.update(self.whole)
        if self.owns_whole:
            mine.update(self.whole)
        view = dict(sorted(kept.items()))
        kept.clear()
        return view, frozenset(mine)


class ViewStreamer:
    """Builds a :class:`StreamedView` from the new view's tensors, given one at a time in their served form.

    Args:
        base: the last published version, with its kept view (None, or no view: every tensor is kept whole).
        encoding: the patch encoding (``cond``, ``xor``, ``overwrite``).
        owns: the tensors given are fresh copies made for this stream (a cast), which the publisher may keep
            and later write in place; False: the caller's, never written.
        tied: whether the model's config ties its embeddings: an output head (``lm_head.weight``) is then held
            until the stream ends and dropped when it equals its input embedding bit for bit (refused otherwise),
            as :func:`~.tied_head.fold_tied_head` does for a whole view.
        device: diffs the tensors given as torch tensors on a device other than the CPU where they live
            (:mod:`.device_diff`; None: a differ that copies each kept tensor there); CPU tensors and
            :class:`RawTensor` s are diffed on the host by the codec's C kernel.
        part_bytes: tensors larger than this are coded in row parts of about this size, on every core
            (:mod:`.link`; default :data:`.link.PART_BYTES`); None: one stream per tensor.
    """

    def __init__(
        self,
        base: PublishedVersion | None,
        encoding: Encoding,
        tied: bool | None,
        *,
        owns: bool = True,
        device: DeviceDiffer | None = None,
        part_bytes: int | None = PART_BYTES,
    ) -> None:
        self.base = base if base is not None and base.view is not None else None
        self.encoding: Encoding = encoding
        self.tied = tied
        self.owns = owns
        self.device = device or DeviceDiffer()
        self.part_bytes = part_bytes
        self._layout: dict[str, Layout] = {}
        self._checksums: dict[str, str] = {}
        self._encoded: list[EncodedTensor] = []
        self._changes: dict[str, TensorChange] = {}
        self._whole: dict[str, RawTensor] = {}
        self._heads: dict[str, RawTensor] = {}
        self._names: set[str] = set()
        self._names_lock = threading.Lock()

    def _kept(self, name: str, t: RawTensor) -> RawTensor | None:
        return self._kept_as(name, t.dtype, tuple(t.shape))

    def _kept_as(self, name: str, dtype: str | None, shape: tuple[int, ...]) -> RawTensor | None:
        if self.base is None or self.base.view is None or name not in self.base.tensors:
            return None
        kept = self.base.view.get(name)
        if kept is None or (kept.dtype, tuple(kept.shape)) != (dtype, shape):
            return None
        return kept

    def add(self, name: str, t: RawTensor | torch.Tensor) -> None:
        """Take tensor ``name`` of the new view (the caller may drop ``t`` afterwards unless it is new to the view).

        A torch tensor on a device other than the CPU (a fresh one the stream may keep: a cast) is diffed there when
        the kept view holds its name, dtype and shape (only its changes come to the host); any other torch tensor
        is copied to the host first.

        Safe to call from several threads at once for host tensors (:mod:`.stream_workers`); a tensor on a GPU is
        given from one thread only.

        Raises:
            CheckpointNameError: ``name`` was already given.
            ServedViewError: a torch tensor's dtype has no safetensors name.
        """
        with self._names_lock:
            if name in self._names:
                raise CheckpointNameError(f"tensor {name!r} appears twice in the streamed view", name=name)
            self._names.add(name)
        if isinstance(t, torch.Tensor):
            kept = self._kept_as(name, TORCH_DTYPE_NAMES.get(t.dtype), tuple(t.shape))
            if on_device(t) and kept is not None and not (self.tied and name in TIED_HEADS):
                self._take_on_device(name, kept, t)
                return
            host = to_raw(t.detach().to("cpu", copy=True).contiguous())
            if on_device(t) and not (self.tied and name in TIED_HEADS):
                self._take(name, host)
                self.device.remember(name, self._checksums[name], flat_bits(t))
                return
            t = host
        if self.tied and name in TIED_HEADS:
            self._heads[name] = t
        else:
            self._take(name, t)

    def _take(self, name: str, t: RawTensor) -> None:
        self._layout[name] = Layout(t.dtype, tuple(t.shape), t.nbytes)
        self._checksums[name] = checksum(t)
        kept = self._kept(name, t)
        if kept is None:
            self._whole[name] = t
            return
        assert self.base is not None  # _kept found a base tensor
        encoded = encode_tensor(
            name,
            kept,
            t,
            self.encoding,
            base_checksum=self.base.tensors[name].checksum,
            target_checksum=self._checksums[name],
            part_bytes=self.part_bytes,
            keep_change=True,
        )
        if encoded is not None:
            self._encoded.append(encoded)
            change = encoded.change  # found by the encoder's scan (one stream), else a second compare pass
            self._changes[name] = (
                TensorChange(encoded.entry.count, *change) if change else TensorChange.between(kept, t)
            )

    def _take_on_device(self, name: str, kept: RawTensor, t: torch.Tensor) -> None:
        assert self.base is not None  # _kept_as found a base tensor
        self._layout[name] = Layout(kept.dtype, tuple(kept.shape), kept.nbytes)
        found = self.device.diff(name, kept, self.base.tensors[name].checksum, t, self.encoding, self.part_bytes)
        self._checksums[name] = found.target_checksum
        if found.encoded is not None:
            self._encoded.append(found.encoded)
            self._changes[name] = TensorChange(found.count, found.gaps, found.new_bits)

    def _equals(self, name: str, t: RawTensor) -> bool:
        """Whether tensor ``name`` of the new view has ``t``'s dtype, shape and bits (compared without a copy)."""
        layout = self._layout[name]
        if (layout.dtype, layout.shape) != (t.dtype, tuple(t.shape)):
            return False
        if name in self._whole:
            return bool(np.array_equal(self._whole[name].bits, t.bits))
        kept = self._kept(name, t)
        assert kept is not None  # not whole: kept with this dtype and shape
        return TensorChange.between(kept, t) == self._changes.get(name, TensorChange(0, b"", b""))

    def finish(self) -> StreamedView:
        """The streamed view (a tied head folded into its embedding).

        Raises:
            TiedWeightsError: a tied head differs from its embedding.
        """
        for head, t in sorted(self._heads.items()):
            embedding = next((e for e in TIED_HEADS[head] if e in self._layout), None)
            if embedding is None:
                self._take(head, t)
            elif not self._equals(embedding, t):
                raise tied_head_error(head, embedding)
        names = set(self._layout)
        self.device.retain(names)
        base = self.base
        return StreamedView(
            base_version=None if base is None else base.version,
            layout=dict(sorted(self._layout.items())),
            checksums=dict(sorted(self._checksums.items())),
            encoded=tuple(self._encoded),
            changes=self._changes,
            whole=self._whole,
            encoding=self.encoding,
            tensor_set_changed=base is not None and (bool(self._whole) or names != set(base.tensors)),
            owns_whole=self.owns,
        )
