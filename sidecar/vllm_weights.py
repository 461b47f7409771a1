"""In-place writes into a live vLLM model: patches and snapshots, verified, all or nothing.

Runs inside the engine's worker process (one call per TP rank, all ranks in step). The
sequence of :func:`apply_patch_files` keeps DESIGN.md invariants 1 and 5:

1. **validate** (nothing written): every patch file parses, every tensor name maps to a runtime
   placement (:mod:`.vllm_layout`) with the patch's dtype and shape, every position decodes,
   and every touched tensor, read back from the engine through the same mapping, matches the
   patch's base checksum (``overwrite``: base or target; a tensor already at the target is
   skipped);
2. **write**: the changed elements of each rank's block, by indexed assignment into the runtime
   parameter's raw bits (``param.data`` is never reassigned: CUDA graphs keep their pointers);
   the old bits of every written element are kept (patch-sized);
3. **re-pack**: on vLLM's CPU backend every linear layer multiplies with a packed copy of its
   weight (oneDNN / sgl ``cpu_linear``); the layers that read a written parameter, the tied
   ``lm_head`` included, are re-packed from the parameter;
4. **verify**: every touched tensor, read back, matches its target checksum.

Any failure after the first write restores the old bits (and re-packs) before the error is
raised, so the engine holds either the base or the target, never a mix.

Checksums with TP > 1: each rank holds slices, and the patch carries xxh3-128 of whole
tensors, which does not decompose. Every rank all-gathers the blocks of a tensor over the TP
group's CPU (gloo) group, reassembles the full tensor (replicated KV heads and vocab padding
dropped) and hashes it, so all ranks reach the same verdict. Cost per verified tensor: one
all-gather of the tensor's size (for a real RL step: the whole model, twice, base and target)
plus a host copy on GPU; with TP = 1 the block is hashed in place, no copy.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from stitchboard.proto.container import RawTensor, read_safetensors
from stitchboard.proto.decode import Patch, read_patch
from stitchboard.proto.errors import BaseMismatchError, PatchFormatError, TargetMismatchError, TensorSetMismatchError
from stitchboard.proto.schema import XXH3_128

from .vllm_layout import Placement, RuntimeLayout

log = logging.getLogger("stitchboard.sidecar.vllm_weights")

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


def _block_bytes(p: Placement) -> np.ndarray:
    """This rank's block as a uint8 numpy array (a view on CPU, a host copy on GPU)."""
    return p.block().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def _gathered_tensor_bytes(p: Placement, group: object) -> np.ndarray:
    """The full checkpoint tensor's raw bytes, reassembled from every TP rank's block."""
    split = p.split_dim
    longest = max(length for _, length in p.spans)
    mine = p.block().contiguous().view(torch.uint8)  # [rows, cols * itemsize] or [rows * itemsize]
    mine = mine.reshape(p.block_shape[0], -1).cpu()
    pad_shape = list(mine.shape)
    pad_shape[split] = longest * (1 if split == 0 else p.param.element_size())
    padded = torch.zeros(pad_shape, dtype=torch.uint8)
    padded.narrow(split, 0, mine.shape[split]).copy_(mine)
    parts = [torch.empty_like(padded) for _ in p.spans]
    torch.distributed.all_gather(parts, padded, group=group)
    unit = 1 if split == 0 else p.param.element_size()
    seen: dict[int, torch.Tensor] = {}
    for (start, length), part in zip(p.spans, parts):
        seen.setdefault(start, part.narrow(split, 0, length * unit))
    full = torch.cat([seen[s] for s in sorted(seen)], dim=split)
    return full.contiguous().reshape(-1).numpy()


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

    def checksum(self, p: Placement) -> str:
        """xxh3-128 hex digest of the full checkpoint tensor as the engine holds it (see module doc)."""
        raw = _gathered_tensor_bytes(p, self.tp_group) if self.tp_group is not None else _block_bytes(p)
        return xxhash.xxh3_128_hexdigest(raw)

    def checksums(self, names: Sequence[str]) -> dict[str, str]:
        """Checksums of the named checkpoint tensors (raises ``UnmappedTensorError``)."""
        return {name: self.checksum(self.layout.place(name)) for name in names}

    def repack_all(self, placements: Sequence[Placement]) -> int:
        """Re-pack the GEMM copies reading ``placements`` (no-op off the CPU backend)."""
        return _repack(placements) if self.repack else 0


@dataclass
class _Write:
    placement: Placement
    index: torch.Tensor  # int64 [k_local], flat into block_bits()
    values: torch.Tensor  # bits [k_local]
    old: torch.Tensor | None = None


def _placements_for(io: WeightIO, specs: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Placement]:
    """Map every name; check dtype and shape. Raises UnmappedTensorError, TensorSetMismatchError."""
    out = {}
    for name, (dtype, shape) in specs.items():
        p = io.layout.place(name)
        if (p.dtype, p.shape) != (dtype, tuple(shape)):
            raise TensorSetMismatchError(f"tensor {name!r} is {dtype}{list(shape)} in the input but the engine holds {p.dtype}{list(p.shape)}", name=name)
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
        data = open(path, "rb").read()
        patch = read_patch(data, what=os.path.basename(path))
        if names & set(patch.entries):
            raise PatchFormatError(f"{path}: touches tensors another file of the same version touches: {sorted(names & set(patch.entries))[:3]}")
        names |= set(patch.entries)
        patches.append(patch)
        size += len(data)
    return patches, size


def apply_patch_files(io: WeightIO, paths: Sequence[str], hook: PhaseHook) -> dict:
    """Apply hand-off patch files in place: validate all, write, re-pack, verify, or restore.

    Args:
        io: the rank's weight reader/writer.
        paths: patch files of one version (disjoint tensors).
        hook: called with ``staged`` (validated, nothing written), ``half-written`` and
            ``written-unverified``.

    Returns:
        Report: ``bytes``, ``tensors``, ``tensors_already_current``, ``elements`` (changed
        elements written, whole tensors), ``rank_elements`` (those this rank holds),
        ``repacked_modules`` and seconds ``read_s`` (hand-off read + decode), ``base_check_s``,
        ``write_s``, ``repack_s``, ``verify_s``.

    Raises:
        PatchFormatError, UnmappedTensorError, TensorSetMismatchError, BaseMismatchError:
            refused, nothing written (``written`` attribute False).
        TargetMismatchError or any error while writing: old bits restored, then re-raised
            with attribute ``written`` True (and ``restore_failed`` True if the restore failed
            too: the engine then holds no verified version).
    """
    t0 = time.perf_counter()
    patches, size = read_patches(paths)
    entries = {n: e for patch in patches for n, e in patch.entries.items()}
    places = _placements_for(io, {n: (e.dtype, e.shape) for n, e in entries.items()})
    deltas = {n: d for patch in patches for n, d in patch.deltas().items()}
    t_read = time.perf_counter()
    writes: list[_Write] = []
    current = 0
    for name, delta in deltas.items():
        have = io.checksum(places[name])
        if have == delta.entry.base[XXH3_128]:
            selected, index = places[name].local_indices(delta.positions)
            bits = delta.values[selected].view(f"i{delta.values.itemsize}")
            writes.append(_Write(places[name], torch.from_numpy(index), torch.from_numpy(np.ascontiguousarray(bits))))
        elif delta.encoding == "overwrite" and have == delta.entry.target[XXH3_128]:
            current += 1
        else:
            raise BaseMismatchError(f"tensor {name!r} in the engine is not the patch's base (xxh3 {have} != {delta.entry.base[XXH3_128]})", name=name)
    t_base = time.perf_counter()
    hook("staged")
    touched = [w.placement for w in writes]
    timing: dict[str, float] = {}
    try:
        for i, w in enumerate(writes):
            flat = w.placement.block_bits()
            index, values = w.index.to(flat.device), w.values.to(flat.device)
            w.old = flat[index]
            flat[index] = (w.old ^ values) if deltas[w.placement.name].encoding == "xor" else values
            if i == len(writes) // 2:
                hook("half-written")
        timing["write_s"] = time.perf_counter() - t_base
        t = time.perf_counter()
        repacked = io.repack_all(touched)
        timing["repack_s"] = time.perf_counter() - t
        hook("written-unverified")
        t = time.perf_counter()
        for w in writes:
            got = io.checksum(w.placement)
            if got != entries[w.placement.name].target[XXH3_128]:
                raise TargetMismatchError(f"tensor {w.placement.name!r} does not match its target checksum after the write", name=w.placement.name)
        timing["verify_s"] = time.perf_counter() - t
    except BaseException as exc:
        exc.written = True  # type: ignore[attr-defined]
        try:
            for w in reversed(writes):
                if w.old is not None:
                    w.placement.block_bits()[w.index.to(w.old.device)] = w.old
            io.repack_all(touched)
        except BaseException:
            exc.restore_failed = True  # type: ignore[attr-defined]
            log.exception("restoring the old bits failed: the engine holds no verified version")
        raise
    return {
        "bytes": size,
        "tensors": len(writes),
        "tensors_already_current": current,
        "elements": int(sum(deltas[w.placement.name].entry.count for w in writes)),
        "rank_elements": int(sum(int(w.index.numel()) for w in writes)),
        "repacked_modules": repacked,
        "read_s": t_read - t0,
        "base_check_s": t_base - t_read,
        **timing,
    }


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
        tensor's checksum differs): refused, nothing written. After the first write, any error
        is re-raised with attribute ``written`` True and the engine holds no verified version.
    """
    t0 = time.perf_counter()
    tensors: dict[str, RawTensor] = {}
    size = 0
    for path in paths:
        _, part = read_safetensors(path)
        if set(part) & set(tensors):
            raise PatchFormatError(f"{path}: tensors appear in two shards: {sorted(set(part) & set(tensors))[:3]}")
        tensors.update(part)
        size += os.path.getsize(path)
    if set(tensors) != set(checksums):
        raise TensorSetMismatchError(f"snapshot tensors differ from the manifest: missing {sorted(set(checksums) - set(tensors))[:3]}, extra {sorted(set(tensors) - set(checksums))[:3]}")
    places = _placements_for(io, {n: (t.dtype, t.shape) for n, t in tensors.items()})
    uncovered = set(io.layout.runtime_params()) - {p.runtime_name for p in places.values()}
    if uncovered:
        raise TensorSetMismatchError(f"snapshot leaves runtime parameters without data: {sorted(uncovered)[:3]}")
    for name, t in tensors.items():
        if xxhash.xxh3_128_hexdigest(memoryview(t.bits).cast("B")) != checksums[name]:
            raise TargetMismatchError(f"snapshot tensor {name!r} does not match the manifest checksum", name=name)
    t_read = time.perf_counter()
    hook("staged")
    timing: dict[str, float] = {}
    try:
        for name, p in places.items():
            start, length = p.local_span
            full = torch.from_numpy(tensors[name].bits.view(f"i{tensors[name].bits.itemsize}")).reshape(p.shape)
            p.block().view(full.dtype).copy_(full.narrow(p.split_dim, start, length))
        timing["write_s"] = time.perf_counter() - t_read
        t = time.perf_counter()
        repacked = io.repack_all(list(places.values()))
        timing["repack_s"] = time.perf_counter() - t
        hook("written-unverified")
        t = time.perf_counter()
        for name, p in places.items():
            if io.checksum(p) != checksums[name]:
                raise TargetMismatchError(f"tensor {name!r} does not match the manifest checksum after loading", name=name)
        timing["verify_s"] = time.perf_counter() - t
    except BaseException as exc:
        exc.written = True  # type: ignore[attr-defined]
        raise
    return {"bytes": size, "tensors": len(places), "repacked_modules": repacked, "read_s": t_read - t0, **timing}
