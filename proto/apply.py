"""Applying a patch to a view: validate everything, write, verify, or undo.

The sequence keeps DESIGN.md invariants 1 and 5 at the codec level:

1. every touched tensor exists with the patch's dtype and shape, every frame decodes and every
   position is valid (:meth:`Patch.deltas`);
2. every touched tensor's current bits match the patch's base checksum (``xor``, ``cond``), or
   the base or the target checksum (``overwrite``: a tensor already at the target is left
   alone); ``cond`` checks this first, since it decodes against the base, and then checks its
   decoded bits against the target checksum too;
3. only then are bits written (``xor``: ``old ^ value``; ``overwrite``, ``cond``: ``value``);
4. every touched tensor is checked against its target checksum (``cond``: already done in 2,
   on the very bits written); on any mismatch all written elements are restored and
   :class:`TargetMismatchError` is raised.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np

from .codec import PatchEntry
from .container import RawTensor
from .decode import Patch, TensorDelta
from .errors import BaseMismatchError, TargetMismatchError, TensorSetMismatchError
from .parts import matches


@dataclass(frozen=True)
class ApplyResult:
    """What an apply did.

    Attributes:
        tensors_written: tensors whose bits were changed.
        elements_written: elements written.
        tensors_already_current: ``overwrite`` tensors already at the target (not written).
    """

    tensors_written: int
    elements_written: int
    tensors_already_current: int


def _is_base(name: str, entry: PatchEntry, view: Mapping[str, RawTensor], encoding: str) -> bool:
    """Whether ``view[name]`` is the entry's base (write it); False for an ``overwrite`` tensor
    already at its target (leave it).

    Raises:
        BaseMismatchError: it is neither.
    """
    t = view[name]
    if matches(t.bits, t.shape, entry.base, entry.layout):
        return True
    at_target = matches(t.bits, t.shape, entry.target, entry.layout)
    if encoding == "overwrite" and at_target:
        return False
    hint = f" ({encoding} patches are valid only on their exact base, not on their own result)" if at_target else ""
    raise BaseMismatchError(
        f"tensor {name!r} is not the patch's base (its checksum is not {entry.base}){hint}: "
        "fetch the base version or an anchor and apply again"
    )


def _plan_writes(view: Mapping[str, RawTensor], patch: Patch) -> list[TensorDelta]:
    for name, entry in patch.entries.items():
        have = view.get(name)
        if have is None:
            raise TensorSetMismatchError(
                f"patch touches tensor {name!r}, which the view does not have: apply it to its base version"
            )
        if have.dtype != entry.dtype or tuple(have.shape) != entry.shape:
            raise TensorSetMismatchError(
                f"tensor {name!r} is {have.dtype}{list(have.shape)} but the patch is for "
                f"{entry.dtype}{list(entry.shape)}"
            )
    if patch.encoding == "cond":
        for name, entry in patch.entries.items():
            _is_base(name, entry, view, patch.encoding)
        return list(patch.deltas(view, bases_verified=True).values())
    deltas = patch.deltas()
    return [delta for name, delta in deltas.items() if _is_base(name, delta.entry, view, patch.encoding)]


def apply_patch(view: Mapping[str, RawTensor], patch: Patch) -> ApplyResult:
    """Apply ``patch`` in place to ``view`` (name -> tensor with writable bits).

    Tensors the patch does not list are not touched. Nothing is written unless the whole patch
    decodes and every touched tensor is the base; a failed target check undoes all writes.

    Raises:
        TensorSetMismatchError: a touched tensor is missing or has another dtype/shape.
        PatchFormatError: a frame, its positions or a ``cond`` stream are invalid.
        BaseMismatchError: a touched tensor is not the patch's base.
        TargetMismatchError: a tensor's new bits differ from the target (``cond``: found before
            writing; else after, and undone).
        ValueError: a touched tensor's bits are read-only.
    """
    writes = _plan_writes(view, patch)
    for delta in writes:
        if not view[delta.entry.name].bits.flags.writeable:
            raise ValueError(f"tensor {delta.entry.name!r} is read-only; copy the view (apply_to_copy) first")
    undo: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    try:
        for delta in writes:
            bits = view[delta.entry.name].bits
            old = bits[delta.positions]
            undo.append((bits, delta.positions, old))
            bits[delta.positions] = (old ^ delta.values) if patch.encoding == "xor" else delta.values
        checked = (
            [] if patch.encoding == "cond" else writes
        )  # cond deltas were checked against their targets before writing
        for delta in checked:
            t = view[delta.entry.name]
            if not matches(t.bits, t.shape, delta.entry.target, delta.entry.layout):
                raise TargetMismatchError(
                    f"tensor {delta.entry.name!r} does not match its target checksum after apply; the write was undone"
                )
    except BaseException:
        for bits, positions, old in reversed(undo):
            bits[positions] = old
        raise
    return ApplyResult(
        tensors_written=len(writes),
        elements_written=sum(d.entry.count for d in writes),
        tensors_already_current=len(patch.entries) - len(writes),
    )


def apply_to_copy(view: Mapping[str, RawTensor], patch: Patch) -> dict[str, RawTensor]:
    """Apply ``patch`` to a copy of ``view``: touched tensors are copied, others shared.

    Raises:
        the errors of :func:`apply_patch`; ``view`` is never modified.
    """
    out: MutableMapping[str, RawTensor] = dict(view)
    for name in patch.entries:
        if name in view:
            t = view[name]
            out[name] = RawTensor(t.dtype, tuple(t.shape), t.bits.copy())
    apply_patch(out, patch)
    return dict(out)
