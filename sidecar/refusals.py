"""Which engine refusals retrying cannot fix (sidecar process).

An engine refuses a version before its first write for one of two kinds of reasons:

* **permanent**: the version names a tensor the engine has no place for, or gives one a dtype or
  shape the engine does not hold (``UnmappedTensor``, ``TensorSetMismatch``; e.g. a tied
  ``lm_head.weight`` published beside the embedding, or another model's run). The same tensor
  set is refused by every later attempt: the reconciler waits for a version with another tensor
  set, and never touches the engine for one it already saw refused (:class:`RefusedTensorSet`).
* **transient**: anything else (a busy engine, a base that moved, a staging that broke off):
  the same plan is tried again after ``refused_retry_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from stitchboard.proto.errors import StitchError, TensorSetMismatchError
from stitchboard.proto.schema import VersionManifest

from .errors import TpRankError, UnmappedTensorError

#: Wire types of the refusals no retry of the same tensor set can fix.
PERMANENT_CAUSES = frozenset({UnmappedTensorError.type, TensorSetMismatchError.type})


def is_permanent(exc: BaseException) -> bool:
    """Whether an engine's refusal names a tensor, dtype or shape the engine does not have
    (its ``cause``, or every failing TP rank's error under ``TpRankFailed``)."""
    if not isinstance(exc, StitchError):
        return False
    cause = exc.details.get("cause", exc.type)
    if cause in PERMANENT_CAUSES:
        return True
    failed = exc.details.get("failed")
    if cause == TpRankError.type and isinstance(failed, dict) and failed:
        return all(str(message).split(":", 1)[0].strip() in PERMANENT_CAUSES for message in failed.values())
    return False


def tensor_set(manifest: VersionManifest) -> frozenset[tuple[str, str, tuple[int, ...]]]:
    """A version's tensors as (name, dtype, shape): what a permanent refusal is about (a delta
    never changes it; only an anchor can)."""
    return frozenset((t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors)


@dataclass(frozen=True)
class RefusedTensorSet:
    """The tensor set of a version the engine refused permanently, and why.

    Attributes:
        version: the refused version.
        tensors: its tensor set (:func:`tensor_set`).
        cause: the refusal's wire type (``UnmappedTensor``...); message: its text.
    """

    version: int
    tensors: frozenset[tuple[str, str, tuple[int, ...]]]
    cause: str
    message: str
