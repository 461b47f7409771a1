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
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch
import xxhash

from stitchboard.proto.container import RawTensor, read_safetensors
from stitchboard.proto.decode import Patch, read_patch
from stitchboard.proto.errors import (
    PatchFormatError,
    TargetMismatchError,
    TensorSetMismatchError,
)

from ...errors import ApplyFailedError, TpRankError
from .layout import Placement, RuntimeLayout

T = TypeVar("T")

#: Called at named points of an apply (fault injection); gets the phase name.
PhaseHook = Callable[[str], None]


def _repack(placements: Sequence[Placement]) -> int:
    """Re-pack the GEMM copies of every module reading a written parameter; returns the count."""
    modules = {id(m): m for p in placements for m in p.packed_by}
    if not modules:
        return 0
    from vllm.model_executor.layers import utils

    for mod in modules.values():
        utils.dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
    return len(modules)


def _block_bytes(block: torch.Tensor) -> np.ndarray:
    """A block as a uint8 numpy array (a view on CPU, a host copy on GPU)."""
    return block.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def _gathered_tensor_bytes(p: Placement, block: torch.Tensor, group: object) -> np.ndarray:
    """The full checkpoint tensor's raw bytes, reassembled from every TP rank's ``block``."""
    split = p.split_dim
    longest = max(length for _, length in p.spans)
    mine = block.contiguous().view(torch.uint8)  # [rows, cols * itemsize] or [rows * itemsize]
    mine = mine.reshape(p.block_shape[0], -1).cpu()
    pad_shape = list(mine.shape)
    pad_shape[split] = longest * (1 if split == 0 else p.param.element_size())
    padded = torch.zeros(pad_shape, dtype=torch.uint8)
    padded.narrow(split, 0, mine.shape[split]).copy_(mine)
    parts = [torch.empty_like(padded) for _ in p.spans]
    torch.distributed.all_gather(parts, padded, group=group)
    unit = 1 if split == 0 else p.param.element_size()
    seen: dict[int, torch.Tensor] = {}
    for (start, length), part in zip(p.spans, parts, strict=False):
        seen.setdefault(start, part.narrow(split, 0, length * unit))
    full = torch.cat([seen[s] for s in sorted(seen)], dim=split)
    return full.contiguous().reshape(-1).numpy()


def agreed(group: object | None, step: Callable[[], T], what: str) -> T:
    """Run ``step`` (rank-local work: reading files, mapping names, writing, a lease check) and
    tell every TP rank of ``group`` whether any rank failed it, before anyone's next collective;
    returns its result.

    Without this the other ranks would wait in a gather for a rank that gave up, until the
    group's timeout (10 min); with it every rank refuses, or restores, at once. With no group
    (TP = 1) it just runs ``step``.

    Raises:
        what ``step`` raised, on its rank; :class:`TpRankError` on every other rank when any failed.
    """
    error: Exception | None = None
    result = None
    try:
        result = step()
    except Exception as exc:  # noqa: BLE001 - every rank's failure is shared with the others
        error = exc
    failed: dict[int, str] = {}
    if group is not None:
        mine = None if error is None else f"{type(error).__name__}: {error}"
        everyone: list[str | None] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(everyone, mine, group=group)
        failed = {rank: message for rank, message in enumerate(everyone) if message is not None}
    if error is not None:
        raise error
    if failed:
        rank, message = next(iter(failed.items()))
        raise TpRankError(f"{what}: TP rank {rank} failed ({message}); this rank did not", failed=failed)
    return result  # type: ignore[return-value]


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

    def checksum(self, p: Placement, block: torch.Tensor | None = None) -> str:
        """xxh3-128 hex digest of the full checkpoint tensor as the engine holds it (see module doc).

        Args:
            p: the tensor's placement.
            block: this rank's block of a copy (``p.block(copy)``) to hash instead of the
                engine's; with TP > 1 every rank must pass its block of the same copy.
        """
        return xxhash.xxh3_128_hexdigest(self.tensor_bytes(p, block))

    def tensor_bytes(self, p: Placement, block: torch.Tensor | None = None) -> np.ndarray:
        """The full checkpoint tensor's raw little-endian bytes (uint8, flat) as the engine holds it.

        With TP > 1 every rank all-gathers the blocks (collective: every rank must call it for
        the same tensor, passing its block of the same copy); at TP = 1 this rank's block (a view
        on CPU, a host copy on GPU). A ``cond`` delta decodes against these bytes.

        Args:
            p, block: as :meth:`checksum`.
        """
        block = p.block() if block is None else block
        return _gathered_tensor_bytes(p, block, self.tp_group) if self.tp_group is not None else _block_bytes(block)

    def agreed(self, step: Callable[[], T], what: str) -> T:
        """:func:`agreed` over this rank's stitchboard TP group."""
        return agreed(self.tp_group, step, what)

    def checksums(self, names: Sequence[str]) -> dict[str, str]:
        """Checksums of the named checkpoint tensors (raises ``UnmappedTensorError``)."""
        return {name: self.checksum(self.layout.place(name)) for name in names}

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
                f"{path}: touches tensors another file of the same version touches: {sorted(names & set(patch.entries))[:3]}"
            )
        names |= set(patch.entries)
        patches.append(patch)
        size += len(data)
    return patches, size


def _read_snapshot(
    io: WeightIO, paths: Sequence[str], checksums: dict[str, str]
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
            f"snapshot tensors differ from the manifest: missing {sorted(set(checksums) - set(tensors))[:3]}, extra {sorted(set(tensors) - set(checksums))[:3]}"
        )
    places = placements_for(io, {n: (t.dtype, t.shape) for n, t in tensors.items()})
    uncovered = set(io.layout.runtime_params()) - {p.runtime_name for p in places.values()}
    if uncovered:
        raise TensorSetMismatchError(f"snapshot leaves runtime parameters without data: {sorted(uncovered)[:3]}")
    for name, t in tensors.items():
        if xxhash.xxh3_128_hexdigest(memoryview(t.bits).cast("B")) != checksums[name]:
            raise TargetMismatchError(f"snapshot tensor {name!r} does not match the manifest checksum", name=name)
    return tensors, places, size


def _write_snapshot(io: WeightIO, tensors: dict[str, RawTensor], places: dict[str, Placement]) -> None:
    """Copy this rank's slice of every snapshot tensor into the live parameters."""
    for name, p in places.items():
        start, length = p.local_span
        full = torch.from_numpy(tensors[name].bits.view(f"i{tensors[name].bits.itemsize}")).reshape(p.shape)
        p.write_block(full.narrow(p.split_dim, start, length).contiguous())


def load_snapshot_files(io: WeightIO, paths: Sequence[str], checksums: dict[str, str], hook: PhaseHook) -> dict:
    """Load a full snapshot (anchor shards) in place, verified against the manifest's checksums.

    Args:
        io: the rank's weight reader/writer.
        paths: safetensors shard files holding every tensor of the served view once.
        checksums: checkpoint name -> xxh3-128 hex digest (the manifest's tensor list).
        hook: called with ``staged`` and ``written-unverified``.

    Returns:
        Report: ``bytes``, ``tensors``, ``repacked_modules``, seconds ``read_s`` (mapping and
        hashing the files), ``write_s``, ``repack_s``, ``verify_s``.

    Raises:
        PatchFormatError, TensorSetMismatchError (names differ from ``checksums``, a runtime
        parameter gets no data, dtype/shape), UnmappedTensorError, TargetMismatchError (a file
        tensor's checksum differs), TpRankError (another TP rank failed one of those): refused,
        nothing written.
        ApplyFailedError: any error after the first write (``cause``; ``restored`` False: the
            engine holds no verified version).
    """
    t0 = time.perf_counter()
    tensors, places, size = io.agreed(lambda: _read_snapshot(io, paths, checksums), "reading the snapshot")
    t_read = time.perf_counter()
    hook("staged")
    timing: dict[str, float] = {}
    try:
        io.agreed(lambda: _write_snapshot(io, tensors, places), "writing the snapshot")
        timing["write_s"] = time.perf_counter() - t_read
        t = time.perf_counter()
        repacked = io.agreed(lambda: io.repack_all(list(places.values())), "re-packing GEMM copies")
        timing["repack_s"] = time.perf_counter() - t
        hook("written-unverified")
        t = time.perf_counter()
        for name, p in places.items():
            if io.checksum(p) != checksums[name]:
                raise TargetMismatchError(
                    f"tensor {name!r} does not match the manifest checksum after loading", name=name
                )
        timing["verify_s"] = time.perf_counter() - t
    except Exception as exc:
        raise ApplyFailedError.after_write("loading the snapshot", exc, restored=False) from exc
    return {"bytes": size, "tensors": len(places), "repacked_modules": repacked, "read_s": t_read - t0, **timing}
