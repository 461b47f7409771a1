"""Reading, hashing and loading checkpoint tensors of a live vLLM model, on one TP rank.

Runs inside the engine's worker process (one call per TP rank, all ranks in step).
:class:`WeightIO` hashes tensors as the engine holds them; :func:`load_snapshot_files` loads a
full snapshot in place (validate every file tensor's checksum, write, re-pack the CPU GEMM
copies, verify); patches are staged and committed by :mod:`.update`.

Checksums with TP > 1: each rank holds slices, and the patch carries xxh3-128 of whole
tensors, which does not decompose. Every rank all-gathers the blocks of a tensor over a gloo
group of the TP ranks (the worker extension creates one for stitchboard, so that staging in a
background thread never shares a group with vLLM's own collectives), reassembles the full
tensor (replicated KV heads and vocab padding dropped) and hashes it, so all ranks reach the
same verdict. Cost per verified tensor: one all-gather of the tensor's size (for a real RL step:
the whole model, three times: base and target while staging, target after the commit) plus a
host copy on GPU; with TP = 1 the block is hashed in place, no copy. A ``cond`` delta decodes
only against its whole base tensor, so staging one decodes it, on every rank, against the same
gathered bytes that were hashed (:meth:`WeightIO.tensor_bytes`): a run is published once for
every replica, whatever its TP size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import torch

from stitchboard.proto.container import RawTensor, read_safetensors
from stitchboard.proto.decode import Patch, read_patch
from stitchboard.proto.dtypes import bits_type
from stitchboard.proto.errors import (
    PatchFormatError,
    TargetMismatchError,
    TensorSetMismatchError,
)
from stitchboard.proto.parts import Layout, layout_checksum, tensor_checksum

from ..write_core import PhaseHook, agreed, write_verified
from .layout import Placement, RuntimeLayout

T = TypeVar("T")


def _repack(placements: Sequence[Placement]) -> int:
    """Re-pack the GEMM copies of every module reading a written parameter; returns the count."""
    modules = {id(m): m for p in placements for m in p.packed_by}
    if not modules:
        return 0
    from vllm.model_executor.layers import utils

    for mod in modules.values():
        utils.dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
    return len(modules)


class WeightIO:
    """Reads and writes checkpoint tensors of one rank's live model.

    Args:
        layout: this rank's :class:`RuntimeLayout`.
        tp_group: the TP group's CPU process group (gloo) when TP > 1, else None.
        repack: whether written parameters' GEMM copies must be re-packed (vLLM CPU backend).
    """

    def __init__(self, layout: RuntimeLayout, tp_group: object | None, repack: bool) -> None:
        self.layout = layout
        self.tp_group = tp_group
        self.repack = repack

    def checksum(self, p: Placement, block: torch.Tensor | None = None, layout: Layout | None = None) -> str:
        """xxh3-128 hex digest of the full checkpoint tensor as the engine holds it (see module doc), or with a
        ``layout`` its ``xxh3_128_parts`` over that layout (a tensor published in parts; the tensor's bytes are
        gathered as :meth:`tensor_bytes` does).

        Args:
            p: the tensor's placement.
            block: this rank's block of a copy (``p.block(copy)``) to hash instead of the
                engine's; with TP > 1 every rank must pass its block of the same copy.
            layout: the part layout the manifest's ``xxh3_128_parts`` is computed over; None: ``xxh3_128``.
        """
        if layout is None:
            return p.checksum(p.block() if block is None else block, self.tp_group)
        return layout_checksum(self.tensor_bytes(p, block).view(bits_type(p.dtype)), p.shape, layout)

    def tensor_bytes(self, p: Placement, block: torch.Tensor | None = None) -> np.ndarray:
        """The full checkpoint tensor's raw little-endian bytes (uint8, flat) as the engine holds it.

        With TP > 1 every rank all-gathers the blocks (collective: every rank must call it for
        the same tensor, passing its block of the same copy); at TP = 1 this rank's block (a view
        on CPU, a host copy on GPU). A ``cond`` delta decodes against these bytes.

        Args:
            p, block: as :meth:`checksum`.
        """
        return p.gather_whole(p.block() if block is None else block, self.tp_group)

    def agreed(self, step: Callable[[], T], what: str) -> T:
        """:func:`.write_core.agreed` over this rank's stitchboard TP group."""
        return agreed(self.tp_group, step, what)

    def checksums(self, names: Sequence[str], layouts: Mapping[str, Layout] | None = None) -> dict[str, str]:
        """Checksums of the named checkpoint tensors: ``xxh3_128``, or ``xxh3_128_parts`` over ``layouts[name]``
        for a name ``layouts`` lists (raises ``UnmappedTensorError``)."""
        parted = layouts or {}
        return {name: self.checksum(self.layout.place(name), None, parted.get(name)) for name in names}

    def repack_all(self, placements: Sequence[Placement]) -> int:
        """Re-pack the GEMM copies reading ``placements`` (no-op off the CPU backend)."""
        return _repack(placements) if self.repack else 0


def placements_for(io: WeightIO, specs: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Placement]:
    """Map every name; check dtype and shape. Raises UnmappedTensorError, TensorSetMismatchError."""
    out = {}
    for name, (dtype, shape) in specs.items():
        p = io.layout.place(name)
        if (p.dtype, p.shape) != (dtype, tuple(shape)):
            raise TensorSetMismatchError(
                f"tensor {name!r} is {dtype}{list(shape)} in the input but the engine holds {p.dtype}{list(p.shape)}",
                name=name,
            )
        out[name] = p
    return out


def read_patches(paths: Sequence[str]) -> tuple[list[Patch], int]:
    """Read and parse hand-off patch files; returns the patches and their total size in bytes.

    Raises:
        PatchFormatError: a file is malformed, or two files touch the same tensor.
        OSError: a file cannot be read.
    """
    patches, size, names = [], 0, set()
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        patch = read_patch(data, what=os.path.basename(path))
        if names & set(patch.entries):
            raise PatchFormatError(
                f"{path}: touches tensors another file of the same version touches: "
                f"{sorted(names & set(patch.entries))[:3]}"
            )
        names |= set(patch.entries)
        patches.append(patch)
        size += len(data)
    return patches, size


def _read_snapshot(
    io: WeightIO, paths: Sequence[str], checksums: dict[str, str], layouts: Mapping[str, Layout]
) -> tuple[dict[str, RawTensor], dict[str, Placement], int]:
    """Read and check a snapshot's shards (see :func:`load_snapshot_files`); returns tensors, placements, bytes."""
    tensors: dict[str, RawTensor] = {}
    size = 0
    for path in paths:
        _, part = read_safetensors(path)
        if set(part) & set(tensors):
            raise PatchFormatError(f"{path}: tensors appear in two shards: {sorted(set(part) & set(tensors))[:3]}")
        tensors.update(part)
        size += os.path.getsize(path)
    if set(tensors) != set(checksums):
        raise TensorSetMismatchError(
            f"snapshot tensors differ from the manifest: missing {sorted(set(checksums) - set(tensors))[:3]}, extra "
            f"{sorted(set(tensors) - set(checksums))[:3]}"
        )
    places = placements_for(io, {n: (t.dtype, t.shape) for n, t in tensors.items()})
    uncovered = set(io.layout.runtime_params()) - {p.runtime_name for p in places.values()}
    if uncovered:
        raise TensorSetMismatchError(f"snapshot leaves runtime parameters without data: {sorted(uncovered)[:3]}")
    for name, t in tensors.items():
        if tensor_checksum(t.bits, t.shape, layouts.get(name)) != checksums[name]:
            raise TargetMismatchError(f"snapshot tensor {name!r} does not match the manifest checksum", name=name)
    return tensors, places, size


def _write_snapshot(io: WeightIO, tensors: dict[str, RawTensor], places: dict[str, Placement]) -> None:
    """Copy this rank's slice of every snapshot tensor into the live parameters."""
    for name, p in places.items():
        start, length = p.local_span
        full = torch.from_numpy(tensors[name].bits.view(f"i{tensors[name].bits.itemsize}")).reshape(p.shape)
        p.write_block(full.narrow(p.split_dim, start, length).contiguous())


def load_snapshot_files(
    io: WeightIO,
    paths: Sequence[str],
    checksums: dict[str, str],
    hook: PhaseHook,
    layouts: Mapping[str, Layout] | None = None,
) -> dict:
    """Load a full snapshot (anchor shards) in place, verified against the manifest's checksums.

    Args:
        io: the rank's weight reader/writer.
        paths: safetensors shard files holding every tensor of the served view once.
        checksums: checkpoint name -> its checksum (hex): ``xxh3_128``, or ``xxh3_128_parts`` over
            ``layouts[name]`` for a tensor published in parts (``VersionManifest.checksums()``).
        hook: called with ``staged`` and ``written-unverified``.
        layouts: name -> part layout of the tensors published in parts (``VersionManifest.layouts()``).

    Returns:
        Report: ``bytes``, ``tensors``, ``repacked_modules``, seconds ``read_s`` (mapping and
        hashing the files), ``write_s`` (writing and re-packing), ``repack_s`` (of it), ``verify_s``.

    Raises:
        PatchFormatError, TensorSetMismatchError (names differ from ``checksums``, a runtime
        parameter gets no data, dtype/shape), UnmappedTensorError, TargetMismatchError (a file
        tensor's checksum differs), TpRankError (another TP rank failed one of those): refused,
        nothing written.
        ApplyFailedError: any error after the first write (``cause``; ``restored`` False: the
            engine holds no verified version).
    """
    t0 = time.perf_counter()
    parted = layouts or {}
    tensors, places, size = io.agreed(lambda: _read_snapshot(io, paths, checksums, parted), "reading the snapshot")
    t_read = time.perf_counter()
    repacked: dict[str, float] = {}

    def write(_: PhaseHook) -> None:  # no half-written point: the old bits are not kept
        _write_snapshot(io, tensors, places)
        t = time.perf_counter()
        repacked["modules"] = io.repack_all(list(places.values()))
        repacked["repack_s"] = time.perf_counter() - t

    targets = ((n, lambda n=n, p=p: io.checksum(p, None, parted.get(n)), checksums[n]) for n, p in places.items())
    timing = write_verified("loading the snapshot", write, targets, hook, io.agreed, undo=None)
    return {
        "bytes": size,
        "tensors": len(places),
        "repacked_modules": int(repacked["modules"]),
        "read_s": t_read - t0,
        "repack_s": repacked["repack_s"],
        **timing,
    }
