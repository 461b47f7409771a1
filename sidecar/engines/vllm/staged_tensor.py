"""One tensor's staged update in a vLLM worker: its write, its delta per step, and its staging on the live bits.

Runs inside the engine's worker process, called by :func:`.update.stage_patches` (see there for the order of
staging and commit). :func:`stage_live` stages a tensor that takes one step at TP = 1 without a host copy of its
parameter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stitchboard.proto.codec import PatchEntry
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import Patch, TensorDelta
from stitchboard.proto.dtypes import bits_type
from stitchboard.proto.errors import BaseMismatchError, PatchFormatError, TargetMismatchError
from stitchboard.proto.parts import XXH3_128_PARTS, Layout, digest_pair, matches
from stitchboard.proto.patched_digest import patched_checksum
from stitchboard.proto.schema import XXH3_128

from .layout import BITS_TORCH, Placement
from .weights import WeightIO

#: One step of a staged plan: ``(patch file paths, from_version, to_version)``.
Step = tuple[Sequence[str], int, int]
#: numpy dtype of each raw-bits torch dtype (:data:`.layout.BITS_TORCH`).
NUMPY_OF = {torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}


@dataclass
class StagedWrite:
    """One tensor's write of a staged update: flat positions of its block with their old and new bits."""

    placement: Placement
    index: torch.Tensor  # int64 [k], flat into block_bits(), on the parameter's device
    new: torch.Tensor  # bits [k]
    old: torch.Tensor  # bits [k]


@dataclass(frozen=True)
class StepDelta:
    """One tensor's delta in one step: decoded when read (``delta``; ``xor``, ``overwrite``) or,
    for ``cond``, by :meth:`on` against its base while staging."""

    patch: Patch
    entry: PatchEntry
    delta: TensorDelta | None

    def on(self, base: np.ndarray) -> TensorDelta:
        """The decoded delta; ``base``: the whole tensor's raw bytes, already matched to the entry's base checksum.

        Raises:
            PatchFormatError: a malformed ``cond`` stream.
            TargetMismatchError: a ``cond`` stream decoding to bits without the target checksum.
        """
        if self.delta is not None:
            return self.delta
        tensor = RawTensor(self.entry.dtype, self.entry.shape, base.view(bits_type(self.entry.dtype)))
        return self.patch.delta(self.entry.name, tensor, base_verified=True)


def stated_target(entry: PatchEntry) -> tuple[Layout | None, str]:
    """The target checksum a tensor is checked by: ``(None, xxh3_128)``, or ``(its parts' layout,
    xxh3_128_parts)`` when the patch carries only ``xxh3_128_parts`` (a sharded publish's patch)."""
    if XXH3_128 in entry.target:
        return None, entry.target[XXH3_128]
    return entry.layout, entry.target[XXH3_128_PARTS]


def at_base(step_delta: StepDelta, bits: np.ndarray, step: Step) -> bool:
    """Whether a tensor's flat ``bits`` are ``step``'s base (True) or, for an ``overwrite`` patch, already its
    target (False: nothing to write).

    Raises:
        BaseMismatchError: neither; naming the tensor, the step and both checksums.
    """
    entry = step_delta.entry
    have, want = digest_pair(bits, entry.shape, entry.base, entry.layout)
    if have == want:
        return True
    if step_delta.patch.encoding == "overwrite" and matches(bits, entry.shape, entry.target, entry.layout):
        return False
    raise BaseMismatchError(
        f"tensor {entry.name!r} is not the base of step {step[1]}->{step[2]} (xxh3 {have} != {want})",
        name=entry.name,
    )


def not_target(name: str) -> TargetMismatchError:
    """The refusal of tensor ``name`` whose steps applied to the engine's bits miss the target checksum."""
    return TargetMismatchError(
        f"tensor {name!r}: applying the steps to the engine's bits does not give the target checksum", name=name
    )


def stage_live(
    io: WeightIO, p: Placement, step_delta: StepDelta, step: Step, spent: dict[str, float]
) -> StagedWrite | None:
    """Stage one tensor's single step on the live parameter, read only (TP = 1): its delta (a ``cond`` one decoded
    on the live bits, which checks the target itself: :mod:`stitchboard.proto.decode`) and, for ``xor`` and
    ``overwrite``, the target checksum of the bits the delta makes
    (:func:`~stitchboard.proto.patched_digest.patched_checksum`: no copy of the tensor). Returns its write, or
    None for an ``overwrite`` tensor already at the target. Adds its seconds to ``spent``.

    The base checksum is taken only where it decides something: for an ``overwrite`` step (already at the
    target?) and when the decode or the target check fails (a step on another base is refused as a
    :class:`BaseMismatchError`, as before). Otherwise the target checksum of the live bits with the delta spliced
    in already proves the write makes the target; hashing the base too cost ~0.04 s of the staging threads per
    SmolLM2 step (269 MB) and decided nothing.

    Raises:
        BaseMismatchError, TargetMismatchError, PatchFormatError: as :func:`stage_patches`.
    """
    entry = step_delta.entry
    t = time.perf_counter()
    base = io.tensor_bytes(p)  # the live bits on the CPU (a view), a host copy of them on a GPU
    bits = base.view(bits_type(entry.dtype))
    overwrite = step_delta.patch.encoding == "overwrite"
    current = overwrite and not at_base(step_delta, bits, step)
    spent["check_s"] += time.perf_counter() - t
    if current:
        return None
    try:
        t = time.perf_counter()
        delta = step_delta.on(base)
        spent["decode_s"] += time.perf_counter() - t
        xor = delta.encoding == "xor"
        if delta.encoding != "cond":  # a cond decode checked its target itself (parted: every part's digest)
            t = time.perf_counter()
            layout, target = stated_target(entry)
            if patched_checksum(bits, entry.shape, delta.positions, delta.values, xor=xor, layout=layout) != target:
                raise not_target(entry.name)
            spent["check_s"] += time.perf_counter() - t
    except (PatchFormatError, TargetMismatchError):
        at_base(step_delta, bits, step)  # a step on another base is refused as such (BaseMismatchError)
        raise
    t = time.perf_counter()
    selected, index = p.select(delta.positions)  # the positions this rank's block holds, in its coordinates
    at = delta.positions[selected]
    old = bits[at]  # the live bits there (numpy: no torch kernel, no OpenMP team in the worker)
    values = delta.values.view(bits.dtype)[selected]
    new = old ^ values if xor else values
    device, numpy_bits = p.param.device, NUMPY_OF[BITS_TORCH[p.param.element_size()]]

    def there(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).view(numpy_bits)).to(device)

    write = StagedWrite(p, torch.from_numpy(index).to(device), there(new), there(old))
    spent["build_s"] += time.perf_counter() - t
    return write
