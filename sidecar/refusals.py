"""Which engine refusals retrying cannot fix, and the book of refused plans (sidecar process).

An engine refuses a version before its first write for one of two kinds of reasons:

* **permanent**: the version names a tensor the engine has no place for, or gives one a dtype or
  shape the engine does not hold (``UnmappedTensor``, ``TensorSetMismatch``; e.g. a tied
  ``lm_head.weight`` published beside the embedding, or another model's run). The same tensor
  set is refused by every later attempt: the reconciler waits for a version with another tensor
  set, and never touches the engine for one it already saw refused (:class:`RefusedTensorSet`).
* **transient**: anything else (a busy engine, a base that moved, a staging that broke off):
  the same plan is tried again after ``refused_retry_s``.

The reconciler keeps its refused plans in a :class:`RefusalBook` (``refused`` in status and
``/health``, ``stitch_sidecar_refusals_total``), cleared when a version is applied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from stitchboard.proto.errors import StitchError, TensorSetMismatchError
from stitchboard.proto.schema import VersionManifest
from stitchboard.proto.sidecar_wire import Refusal, RouteKind

from .errors import PlanRefusedError, TpRankError, UnmappedTensorError
from .metrics import SidecarMetrics

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


@dataclass(frozen=True)
class RefusedTensorSet:
    """The tensor set of a version the engine refused permanently, and why.

    Attributes:
        version: the refused version.
        tensors: its tensor set (:meth:`~stitchboard.proto.schema.VersionManifest.layout`: (name, dtype,
            shape) triples, what a permanent refusal is about; a delta never changes it, only an anchor can).
        cause: the refusal's wire type (``UnmappedTensor``...); message: its text.
    """

    version: int
    tensors: frozenset[tuple[str, str, tuple[int, ...]]]
    cause: str
    message: str


class RefusalBook:
    """The plans the engine refused (nothing written), and when each may be tried again.

    Args:
        metrics: where refusals are counted (``stitch_sidecar_refusals_total``, ``stitch_sidecar_refused_version``).
        retry_s: how long a transiently refused plan waits before it is tried again, seconds.
    """

    def __init__(self, metrics: SidecarMetrics, retry_s: float) -> None:
        self.metrics = metrics
        self.retry_s = retry_s
        self.refused: Refusal | None = None  # the last plan that could not be staged, until one is applied
        self.tensor_set: RefusedTensorSet | None = None  # the tensor set the engine last refused permanently
        self._retry_at: dict[tuple[int | None, int], float] = {}  # (from, to) -> when to try it again, Unix s

    def wait_s(self, start: int | None, end: int) -> float:
        """Seconds until the plan ``start``->``end`` may be tried again (0 or less: now; inf: never)."""
        retry_at = self._retry_at.get((start, end))
        return 0.0 if retry_at is None else retry_at - time.time()

    def record(
        self,
        start: int | None,
        end: int,
        route: RouteKind,
        exc: Exception,
        target: VersionManifest | None,
        held: int | None,
    ) -> PlanRefusedError:
        """Record a plan that could not be staged (nothing written; ``held`` keeps serving) and
        when to try it again: after ``retry_s`` (transient), or never (permanent: a version with
        another tensor set, :func:`is_permanent`). Returns the error to raise."""
        kind = exc.type if isinstance(exc, StitchError) else type(exc).__name__
        permanent = is_permanent(exc)
        if permanent and target is not None and isinstance(exc, StitchError):
            self.tensor_set = RefusedTensorSet(end, target.layout(), str(exc.details.get("cause", kind)), str(exc))
        now = time.time()
        last = self.refused
        attempts = last.attempts + 1 if last is not None and last.to_version == end else 1
        retry_at = None if permanent else now + self.retry_s
        self.refused = Refusal(
            from_version=start, to_version=end, route=route, held_version=held, type=kind, message=str(exc),
            attempts=attempts, at=now, retry_at=retry_at, permanent=permanent,
        )  # fmt: skip
        self._retry_at[(start, end)] = float("inf") if retry_at is None else retry_at
        self.metrics.refusals.labels(route).inc()
        self.metrics.refused_version.set(end)
        retry = (
            "it is not tried again: the engine has no place for this tensor set; a version with another tensor "
            "set is awaited (was the run published for this model?)"
            if permanent
            else f"this plan is tried again in {self.retry_s:g} s (sooner if a newer version is published)"
        )
        return PlanRefusedError(
            f"versions {start}->{end} ({route} route) could not be staged, nothing written: {kind}: {exc}; "
            f"version {held} keeps serving; {retry}",
            from_version=start, to_version=end, route=route, held=held, cause=kind, permanent=permanent,
        )  # fmt: skip

    def failed_recovery(self, version: int, target: VersionManifest | None, exc: BaseException) -> None:
        """A recovery to ``version`` failed: if the engine refused its tensor set permanently,
        later versions of that set are refused without an engine call."""
        if is_permanent(exc) and target is not None and isinstance(exc, StitchError):
            cause = str(exc.details.get("cause", exc.type))
            self.tensor_set = RefusedTensorSet(version, target.layout(), cause, str(exc))

    def clear(self) -> None:
        """A version was applied: no plan is refused any more (a permanently refused tensor set stays known)."""
        self.refused = None
        self._retry_at.clear()
        self.metrics.refused_version.set(-1)
