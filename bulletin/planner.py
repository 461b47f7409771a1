"""Plans: the ordered files that take a holder of version A to version B (pure functions).

Two routes are compared and the cheaper one (fewer bytes; deltas on a tie) is returned:

* **deltas**: apply the ``patch`` files of A+1, A+2, ..., B in order (needs A <= B, every
  version in between still stored, and no version in between changing the tensor set: such a
  version is an anchor, and only its snapshot leads past it);
* **anchor**: load the snapshot of the nearest anchor S <= B (its ``snapshot`` and ``asset``
  files), then apply the deltas of S+1 .. B.

A holder with nothing (``from_version=None``) always takes the anchor route.
"""

from __future__ import annotations

from collections.abc import Callable

from stitchboard.proto.schema import Plan, PlanStep, VersionManifest

from .errors import NotFoundError

#: Returns the manifest of a version, or ``None`` if it is not (or no longer) stored.
ManifestLookup = Callable[[int], "VersionManifest | None"]


def _delta(m: VersionManifest) -> PlanStep:
    files = m.files_of("patch")
    return PlanStep(version=m.version, kind="delta", files=files, size_bytes=sum(f.size_bytes for f in files))


def _snapshot(m: VersionManifest) -> PlanStep:
    files = m.files_of("snapshot") + m.files_of("asset")
    return PlanStep(version=m.version, kind="snapshot", files=files, size_bytes=sum(f.size_bytes for f in files))


def _deltas(lookup: ManifestLookup, start: int, stop: int) -> list[PlanStep] | None:
    steps = []
    prev = lookup(start)
    for v in range(start + 1, stop + 1):
        m = lookup(v)
        if m is None or prev is None or m.layout() != prev.layout():
            return None
        steps.append(_delta(m))
        prev = m
    return steps


def _anchor_route(lookup: ManifestLookup, to_version: int, budget: float) -> list[PlanStep] | None:
    # Walks back from the target; gives up once the deltas alone cost more than ``budget``.
    deltas: list[PlanStep] = []
    spent = 0
    for v in range(to_version, -1, -1):
        m = lookup(v)
        if m is None:
            return None
        if m.snapshot:
            return [_snapshot(m), *reversed(deltas)]
        deltas.append(_delta(m))
        spent += deltas[-1].size_bytes
        if spent > budget:
            return None
    return None


def make_plan(run_id: str, from_version: int | None, to_version: int, lookup: ManifestLookup) -> Plan:
    """The cheaper plan from ``from_version`` to ``to_version`` of ``run_id``.

    Args:
        run_id: the run.
        from_version: what the holder has (``None``: nothing; it needs an anchor).
        to_version: the target version (must be committed).
        lookup: manifest of a version, ``None`` when it is not stored.

    Returns:
        A :class:`Plan`; empty steps when ``from_version == to_version``.

    Raises:
        NotFoundError: the target is not stored, or neither route is complete (versions removed
            by retention and no anchor left before the target).
    """
    if lookup(to_version) is None:
        raise NotFoundError(f"run {run_id!r} has no version {to_version}", run_id=run_id, version=to_version)
    if from_version == to_version:
        return Plan(run_id=run_id, from_version=from_version, to_version=to_version, steps=[], total_bytes=0)
    routes = []
    budget = float("inf")
    if from_version is not None and from_version < to_version:
        deltas = _deltas(lookup, from_version, to_version)
        if deltas is not None:
            routes.append(deltas)
            budget = sum(s.size_bytes for s in deltas)
    anchored = _anchor_route(lookup, to_version, budget)
    if anchored is not None:
        routes.append(anchored)
    if not routes:
        raise NotFoundError(
            f"no way from version {from_version} to {to_version} of run {run_id!r}: intermediate versions were removed by retention and no anchor <= {to_version} is stored",
            run_id=run_id,
            version=to_version,
        )
    best = min(routes, key=lambda steps: sum(s.size_bytes for s in steps))
    return Plan(run_id=run_id, from_version=from_version, to_version=to_version, steps=best, total_bytes=sum(s.size_bytes for s in best))
