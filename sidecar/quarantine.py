"""Squashes this sidecar set aside after they failed a check (sidecar process).

A squash (one patch from an older version B straight to T, :mod:`stitchboard.proto.squash_schema`)
is derived: the chain of deltas B+1 .. T (or an anchor) always leads to T too. So a squash that
fails a check must never block a catch-up. It can fail at three places:

* **fetch** (:mod:`.fetch`): its stored bytes are not its sha256 (a copy corrupted in the store),
  its blob is gone, or its index disagrees with the two versions;
* **stage**: the engine (or the sidecar, building an anchor route, :mod:`.rebase`) decodes it on
  the base and gets bits without the target checksum, or a stream that does not decode: a squash
  whose index is right but whose bits are wrong passes every check short of that;
* **apply**: the same found while writing, inside the pause.

The sidecar then *quarantines* that squash's range (B, T) for as long as it runs, plans again,
and reports it (``squash_quarantine`` in ``/health``, ``stitch_sidecar_squash_quarantines_total``).
Every plan the reconciler asks for goes through :meth:`SquashQuarantine.plan`, the anchor route
included (the recovery inside a pause asks for no squash at all). It asks the bulletin for a
plan with squash steps; when that plan routes through a quarantined range it asks again without
squashes. That keeps the wire as it is (any bulletin answers it, and nothing is trusted to a
bulletin that might not know a parameter to exclude ranges) at the cost of only those plans'
extra bytes: a quarantine is rare, and the chain is always complete.

An engine error at stage or apply cannot name the step it came from; a refusal about the patch
content (``TargetMismatch``, ``PatchFormatError``; per TP rank under ``TpRankFailed``) of a
plan that holds squash steps sets all of them aside (a wrong delta is a published version's
fault, and the chain's own refusal follows). Other refusals (a base that moved, a busy engine, a
tensor the engine lacks) are not the squash's doing and set nothing aside.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Literal

from prometheus_client import Counter

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.errors import PatchFormatError, StitchError, TargetMismatchError
from stitchboard.proto.schema import Plan

from .errors import StagingError, TpRankError
from .fetch import FetchedPlan

log = logging.getLogger("stitchboard.sidecar")

#: Where a squash failed: downloading and checking it, staging it, or writing it in the pause.
During = Literal["fetch", "stage", "apply"]

#: Error types (or causes) that say a patch's content is wrong, not the engine's state.
CONTENT_CAUSES = frozenset({TargetMismatchError.type, PatchFormatError.type})

#: Ranges kept at most (the oldest goes first): a squash's range matters only while a plan can reach it.
MAX_QUARANTINED = 256


@dataclass(frozen=True)
class QuarantinedSquash:
    """One squash range set aside.

    Attributes:
        base_version, target_version: its range.
        during: where it failed (:data:`During`).
        reason: the failure, as logged.
        at: when, seconds since the epoch.
    """

    base_version: int
    target_version: int
    during: str
    reason: str
    at: float


def _about_content(exc: BaseException) -> bool:
    # Whether an engine's (or the codec's) refusal is about the patch's content.
    if not isinstance(exc, StitchError):
        return False
    cause = exc.details.get("cause", exc.type)
    if cause in CONTENT_CAUSES or exc.type in CONTENT_CAUSES:
        return True
    failed = exc.details.get("failed")
    if cause == TpRankError.type and isinstance(failed, dict):
        return any(str(message).split(":", 1)[0].strip() in CONTENT_CAUSES for message in failed.values())
    return False


class SquashQuarantine:
    """The squash ranges one sidecar no longer plans through (see the module docstring).

    Args:
        counter: ``stitch_sidecar_squash_quarantines_total`` (label ``during``).
    """

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._ranges: OrderedDict[tuple[int, int], QuarantinedSquash] = OrderedDict()

    def holds(self, base: int | None, target: int) -> bool:
        """Whether the squash ``base -> target`` is set aside."""
        return base is not None and (base, target) in self._ranges

    def plan(self, client: BulletinClient, run: str, start: int | None, target: int) -> Plan:
        """The plan from ``start`` to ``target``: with squash steps, unless it would route through a
        quarantined one, then without squashes (blocking: call from a worker thread).

        Raises:
            BulletinError: as :meth:`BulletinClient.plan`.
        """
        plan = client.plan(run, start, target, squash=True)
        avoided = [(s.base_version, s.version) for s in plan.steps if self.holds(s.base_version, s.version)]
        if not avoided:
            return plan
        log.info(
            "the plan %s -> %d routes through quarantined squashes %s: planning without squashes",
            start,
            target,
            avoided,
        )
        return client.plan(run, start, target)

    def blame_fetch(self, plan: Plan, exc: BaseException) -> bool:
        """Quarantine the squash step of ``plan`` a fetch failure names (:func:`.fetch.squash_failed`).
        True when one was set aside (plan again), False when the failure is not a squash's."""
        if not isinstance(exc, StagingError) or "squash_target" not in exc.details:
            return False
        base, target = exc.details["squash_base"], exc.details["squash_target"]
        if not any(s.kind == "squash" and (s.base_version, s.version) == (base, target) for s in plan.steps):
            return False
        self._add(base, target, "fetch", exc)
        return True

    def blame_engine(self, staged: FetchedPlan, exc: BaseException, during: During) -> bool:
        """Quarantine the squash steps of ``staged`` when its staging or apply failed on the patch
        content (see the module docstring). True when any was set aside."""
        spans = [(s.base_version, s.version) for s in staged.steps if s.kind == "squash" and s.base_version is not None]
        if not spans or not _about_content(exc):
            return False
        for base, target in spans:
            self._add(base, target, during, exc)
        return True

    def _add(self, base: int, target: int, during: During, exc: BaseException) -> None:
        if (base, target) in self._ranges:
            return
        reason = f"{type(exc).__name__}: {exc}"
        self._ranges[(base, target)] = QuarantinedSquash(base, target, during, reason, time.time())
        while len(self._ranges) > MAX_QUARANTINED:
            self._ranges.popitem(last=False)
        self._counter.labels(during).inc()
        log.warning(
            "squash %d -> %d failed at %s (%s): quarantined; plans take the chain or another squash instead",
            base,
            target,
            during,
            reason,
        )

    def body(self) -> list[dict[str, Any]]:
        """The quarantined ranges, oldest first (``/health``'s ``squash_quarantine``)."""
        return [asdict(q) for q in self._ranges.values()]
