"""Bit-exact in-place updates of one SGLang TP rank's live weights (runs in the scheduler process).

Called by :mod:`.loader` inside SGLang's ``update_weights_from_tensor`` (engine paused, all ranks
in step); at TP = 1 :func:`stage` also runs in the loader's stager thread while the engine serves
(reads only; :func:`commit` then reads each chunk of written elements back as it writes it,
``verify="written"``). Patches are read and decoded with :mod:`stitchboard.proto.decode` (``xor``,
``overwrite``, ``cond``: a ``cond`` delta decodes against the whole base tensor). Checksums are
of whole checkpoint tensors: at TP > 1 every rank all-gathers a split tensor's blocks over the TP
group's gloo group and reassembles it (padding never included), so every rank reaches the same
verdict. Order (DESIGN.md invariants 2 and 5): read and map every file, check every touched
tensor's base checksum, build the new bits and check every target checksum, all before the
first write; then write the changed elements in place, verify every target on the live weights,
and on any failure write the old bits back. A step one rank can fail alone ends with an
agreement between the ranks (:meth:`Ranks.agreed`), so they all refuse or restore together.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from stitchboard.proto.container import RawTensor, parse_safetensors
from stitchboard.proto.decode import Patch, read_patch
from stitchboard.proto.dtypes import bits_type
from stitchboard.proto.errors import BaseMismatchError, PatchFormatError, TargetMismatchError, TensorSetMismatchError
from stitchboard.proto.parts import Layout, digest_pair, layout_checksum, matches, tensor_checksum

from ..write_core import PhaseHook, agreed, write_read_back, write_verified
from .layout import SglangLayout
from .slot import Slot

T = TypeVar("T")
XXH3 = "xxh3_128"


class Ranks:
    """This rank's layout and the TP group's CPU (gloo) group (None at TP = 1)."""

    def __init__(self, layout: SglangLayout, group: object | None) -> None:
        self.layout = layout
        self.group = group

    def agreed(self, step: Callable[[], T], what: str) -> T:
        """:func:`.write_core.agreed` over this rank's TP group."""
        return agreed(self.group, step, what)

    def whole(self, slot: Slot, block: torch.Tensor) -> np.ndarray:
        """The whole checkpoint tensor's raw bits (numpy, flat, the slot's integer type) from every
        rank's ``block`` ([rows, cols] bits of the same copy; collective at TP > 1 unless whole)."""
        group = None if slot.whole else self.group
        return slot.gather_whole(block, group).view(f"<i{block.element_size()}")

    def checksum(self, slot: Slot, layout: Layout | None = None) -> str:
        """xxh3-128 of the whole checkpoint tensor as the engine holds it now; with a part ``layout`` (a patch
        carrying only xxh3_128_parts) its xxh3_128_parts over that layout."""
        if layout is not None:
            return layout_checksum(self.whole(slot, slot.bits()).view(bits_type(slot.dtype)), slot.shape, layout)
        return slot.checksum(slot.bits(), None if slot.whole else self.group)


def _block_index(slot: Slot, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoint flat ``positions`` (int64, increasing) this rank holds: themselves, and their
    flat indices into :meth:`Slot.flat_bits` (int64; padding is never among them)."""
    selected, index = slot.select(positions)
    rows, cols = np.divmod(index, slot.block_shape[1])
    return positions[selected], slot.flat_index(rows, cols)


def read_files(paths: Sequence[str], digests: Sequence[str]) -> tuple[list[bytes], int]:
    """The hand-off files' bytes, each checked against its sha256 ``digests`` entry.

    Raises:
        PatchFormatError: a file's bytes are not the ones the sidecar handed over.
        OSError: a file cannot be read.
    """
    out = []
    for path, digest in zip(paths, digests, strict=True):
        with open(path, "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise PatchFormatError(
                f"{os.path.basename(path)}: its sha256 is not the one the sidecar handed over (changed after the "
                "hand-off?)"
            )
        out.append(data)
    return out, sum(len(d) for d in out)


@dataclass
class _Write:
    slot: Slot
    index: np.ndarray  # int64 [k] into slot.flat_bits()
    new: np.ndarray  # bits [k]
    old: np.ndarray  # bits [k]
    target: str  # xxh3-128 of the whole tensor after the writes, or its xxh3_128_parts over ``layout``
    layout: Layout | None = None  # the part layout of a patch carrying only xxh3_128_parts


def stage(ranks: Ranks, steps: Sequence[tuple[Sequence[str], Sequence[str]]]) -> tuple[list[_Write], dict]:
    """Read, map and check consecutive patch steps ``(paths, sha256 digests)``; nothing written.

    Returns:
        The writes and the report: ``bytes``, ``tensors``, ``elements`` (changed elements of
        whole tensors, over the steps), ``rank_elements``, seconds ``read_s``, ``check_s``,
        ``decode_s``.

    Raises:
        PatchFormatError, UnmappedTensorError, TensorSetMismatchError, BaseMismatchError,
        TargetMismatchError, TpRankError: refused, the engine untouched.
    """
    t0 = time.perf_counter()

    def read() -> tuple[list[dict[str, tuple[Patch, object]]], dict[str, Slot], int]:
        chain, size = [], 0
        for paths, digests in steps:
            blobs, n = read_files(paths, digests)
            size += n
            step: dict[str, tuple[Patch, object]] = {}
            for path, data in zip(paths, blobs, strict=True):
                patch = read_patch(data, what=os.path.basename(path))
                if set(step) & set(patch.entries):
                    raise PatchFormatError(f"{path}: touches tensors another file of the same version touches")
                step.update({name: (patch, entry) for name, entry in patch.entries.items()})
            chain.append(step)
        slots = {}
        for name in sorted({n for step in chain for n in step}):
            slot = ranks.layout.place(name)
            for step in chain:
                if name in step:
                    entry = step[name][1]
                    if (entry.dtype, tuple(entry.shape)) != (slot.dtype, slot.shape):  # type: ignore[attr-defined]
                        raise TensorSetMismatchError(
                            f"tensor {name!r} is {entry.dtype}{list(entry.shape)} in the patch"  # type: ignore[attr-defined]
                            f" but the engine holds {slot.dtype}{list(slot.shape)}",
                            name=name,
                        )
            slots[name] = slot
        return chain, slots, size

    chain, slots, size = ranks.agreed(read, "reading the patch files")
    report = {"bytes": size, "read_s": time.perf_counter() - t0, "check_s": 0.0, "decode_s": 0.0, "index_s": 0.0}
    writes: list[_Write] = []
    elements = 0
    for name, slot in slots.items():
        t = time.perf_counter()
        full = ranks.whole(slot, slot.bits()).copy()  # the whole tensor's bits, updated step by step below
        report["check_s"] += time.perf_counter() - t
        target, touched, parted = None, [], None
        bits = full.view(bits_type(slot.dtype))
        for i, step in enumerate(chain):
            if name not in step:
                continue
            patch, entry = step[name]
            parted = None if XXH3 in entry.target else entry.layout  # type: ignore[attr-defined]
            t = time.perf_counter()
            have, want = digest_pair(bits, slot.shape, entry.base, entry.layout)  # type: ignore[attr-defined]
            report["check_s"] += time.perf_counter() - t
            if patch.encoding == "overwrite" and matches(bits, slot.shape, entry.target, entry.layout):  # type: ignore[attr-defined]
                target = digest_pair(bits, slot.shape, entry.target, parted)[0]  # type: ignore[attr-defined]
                continue
            if have != want:
                raise BaseMismatchError(
                    f"tensor {name!r} is not the base of step {i + 1} of this update (xxh3 {have} != {want})",
                    name=name,
                )
            t = time.perf_counter()
            delta = patch.delta(
                name, RawTensor(slot.dtype, slot.shape, full.view(bits_type(slot.dtype))), base_verified=True
            )
            values = delta.values.view(full.dtype)
            full[delta.positions] = (full[delta.positions] ^ values) if delta.encoding == "xor" else values
            touched.append(delta.positions)
            elements += int(delta.positions.size)
            report["decode_s"] += time.perf_counter() - t
            t = time.perf_counter()
            got, target = digest_pair(bits, slot.shape, entry.target, parted)  # type: ignore[attr-defined]
            if got != target:
                raise TargetMismatchError(
                    f"tensor {name!r}: applying step {i + 1} to the engine's bits does not give the target checksum",
                    name=name,
                )
            report["check_s"] += time.perf_counter() - t
        if not touched:
            continue
        t = time.perf_counter()
        positions = touched[0] if len(touched) == 1 else np.unique(np.concatenate(touched))
        selected, index = _block_index(slot, positions)
        if index.size:
            writes.append(_Write(slot, index, full[selected], slot.gather(index), str(target), parted))
        report["index_s"] += time.perf_counter() - t
    report.update(tensors=len(writes), elements=elements, rank_elements=int(sum(w.index.size for w in writes)))
    return writes, report


#: The second thread of :func:`_on_two_threads` (numpy gathers and scatters run without the GIL).
_HELPER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stitchboard-inplace")


def _on_two_threads(writes: list[_Write], fn: Callable[[_Write], None]) -> None:
    """``fn`` on every write, split by element count between this thread and a helper (the engine
    is paused: its cores are free); returns once both halves ended, raising the first error."""
    if not writes:
        return
    sizes = np.cumsum([w.index.size for w in writes])
    split = int(np.searchsorted(sizes, sizes[-1] / 2)) + 1 if len(writes) > 1 else 1

    def others() -> None:
        for w in writes[split:]:
            fn(w)

    rest = _HELPER.submit(others)
    try:
        for w in writes[:split]:
            fn(w)
    finally:
        error = rest.exception()  # waits: nothing may run on after this returns
    if error is not None:
        raise error


def _scatter(w: _Write) -> None:
    w.slot.scatter(w.index, w.new)


def _scatter_read_back(w: _Write) -> None:
    write_read_back(w.slot.name, w.slot.accessors(), w.index, w.new)


def commit(ranks: Ranks, writes: list[_Write], hook: PhaseHook, what: str, verify: str = "full") -> dict:
    """Write staged changes in place and verify them; or restore.

    Args:
        verify: ``full``: every written tensor's target checksum on the live weights (the whole
            tensor read) after all writes; ``written``: the written elements read back hold the
            new bits, each chunk read back right after its write (the rest is what :func:`stage`
            checked against the base checksum, untouched since: the caller's guarantee, see
            :mod:`.loader`).

    Returns:
        Seconds ``write_s`` (with ``written``: writing and reading back) and ``verify_s``.

    Raises:
        ApplyFailedError: a target did not match or writing failed (``restored``: whether the old
            bits are back).
    """
    scatter = _scatter_read_back if verify == "written" else _scatter

    def write(hook: PhaseHook) -> None:
        half = len(writes) // 2 + 1
        _on_two_threads(writes[:half], scatter)
        hook("half-written")
        _on_two_threads(writes[half:], scatter)

    def undo() -> None:
        for w in reversed(writes):
            w.slot.scatter(w.index, w.old)

    targets = [
        (w.slot.name, lambda w=w: ranks.checksum(w.slot, w.layout), w.target) for w in writes if verify == "full"
    ]
    return write_verified(what, write, targets, hook, ranks.agreed, undo)


def load_snapshot(
    ranks: Ranks,
    paths: Sequence[str],
    digests: Sequence[str],
    checksums: dict[str, str],
    hook: PhaseHook,
    layouts: Mapping[str, Layout] | None = None,
) -> dict:
    """Load a full snapshot (anchor shards) in place, verified against the manifest's ``checksums``
    (xxh3-128, or xxh3_128_parts over ``layouts[name]`` for a tensor published in parts).

    Refused before any write (PatchFormatError, TensorSetMismatchError, UnmappedTensorError,
    TargetMismatchError, TpRankError) when the files are not the handed-over ones, their names
    differ from ``checksums``, a runtime parameter gets no data, or a file tensor's checksum
    differs. After the first write any failure raises ApplyFailedError (``restored`` False).

    Returns:
        ``bytes``, ``tensors``, seconds ``read_s``, ``write_s``, ``verify_s``.
    """
    t0 = time.perf_counter()
    parted = layouts or {}

    def read() -> tuple[dict[str, RawTensor], dict[str, Slot], int]:
        blobs, size = read_files(paths, digests)
        tensors: dict[str, RawTensor] = {}
        for path, data in zip(paths, blobs, strict=True):
            part = parse_safetensors(data, what=os.path.basename(path))[1]
            if set(part) & set(tensors):
                raise PatchFormatError(f"{path}: tensors appear in two shards")
            tensors.update(part)
        if set(tensors) != set(checksums):
            raise TensorSetMismatchError(
                f"snapshot tensors differ from the manifest: missing {sorted(set(checksums) - set(tensors))[:3]}, "
                f"extra {sorted(set(tensors) - set(checksums))[:3]}"
            )
        slots = {n: ranks.layout.place(n) for n in sorted(tensors)}
        for n, t in tensors.items():
            if (t.dtype, tuple(t.shape)) != (slots[n].dtype, slots[n].shape):
                raise TensorSetMismatchError(
                    f"snapshot tensor {n!r} is {t.dtype}{list(t.shape)}, the engine holds "
                    f"{slots[n].dtype}{list(slots[n].shape)}",
                    name=n,
                )
            if tensor_checksum(t.bits, t.shape, parted.get(n)) != checksums[n]:
                raise TargetMismatchError(f"snapshot tensor {n!r} does not match the manifest checksum", name=n)
        uncovered = set(ranks.layout.runtime_params()) - {s.runtime_name for s in slots.values()}
        if uncovered:
            raise TensorSetMismatchError(f"snapshot leaves runtime parameters without data: {sorted(uncovered)[:3]}")
        return tensors, slots, size

    tensors, slots, size = ranks.agreed(read, "reading the snapshot")
    t_read = time.perf_counter()

    def write(_: PhaseHook) -> None:  # no half-written point: the old bits are not kept
        for n, slot in slots.items():
            full = torch.from_numpy(tensors[n].bits.view(bits_type(slot.dtype)).copy())  # the file's bits are read-only
            slot.bits().copy_(slot.local_block(full).view(slot.bits().dtype))

    targets = [
        (n, lambda n=n, slot=slot: ranks.checksum(slot, parted.get(n)), checksums[n]) for n, slot in slots.items()
    ]
    timing = write_verified("loading the snapshot", write, targets, hook, ranks.agreed, undo=None)
    return {"bytes": size, "tensors": len(slots), "read_s": t_read - t0, **timing}
