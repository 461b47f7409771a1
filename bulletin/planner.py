"""Plans: the ordered files that take a holder of version A to version B (pure functions).

The plan is the cheapest route by bytes over three kinds of edges between versions:

* **delta** ``v-1 -> v``: the ``patch`` files of version v (only between versions with the
  same tensor set: a version that changes it is an anchor, and only its snapshot leads past it);
* **squash** ``b -> t``: one stored squash (:mod:`stitchboard.proto.squash_schema`), used only
  when the caller applies squash steps, while both its versions are stored with the manifests it
  names and have the same tensor set;
* **anchor** ``nothing -> s``: the ``snapshot`` and ``asset`` files of an anchor s, open to any
  holder (and the only start for one that holds nothing, ``from_version=None``).

Versions only move forward, so every edge goes from a lower version to a higher one and one
pass in version order finds the shortest path (between the nearest anchor at or below the
target, or the holder's version if lower, and the target). On equal bytes a delta wins over a
squash and a squash over an anchor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from stitchboard.proto.schema import Plan, PlanStep, VersionManifest, canonical_json
from stitchboard.proto.squash_schema import SquashManifest

from .errors import NotFoundError

#: Returns the manifest of a version, or ``None`` if it is not (or no longer) stored.
ManifestLookup = Callable[[int], "VersionManifest | None"]

# Preference on equal bytes (lower wins).
_RANK = {"delta": 0, "squash": 1, "snapshot": 2}


def _delta(m: VersionManifest) -> PlanStep:
    files = m.files_of("patch")
    return PlanStep(version=m.version, kind="delta", files=files, size_bytes=sum(f.size_bytes for f in files))


def _snapshot(m: VersionManifest) -> PlanStep:
    files = m.files_of("snapshot") + m.files_of("asset")
    return PlanStep(version=m.version, kind="snapshot", files=files, size_bytes=sum(f.size_bytes for f in files))


def _squash(s: SquashManifest) -> PlanStep:
    return PlanStep(
        version=s.target_version,
        kind="squash",
        files=list(s.files),
        size_bytes=s.size_bytes,
        base_version=s.base_version,
    )


def _digest(m: VersionManifest) -> str:
    return hashlib.sha256(canonical_json(m)).hexdigest()


def _usable(
    squashes: Sequence[SquashManifest], manifests: dict[int, VersionManifest | None], to_version: int
) -> dict[int, list[SquashManifest]]:
    """Squashes inside the window whose versions are stored as named and share a tensor set, by target."""
    by_target: dict[int, list[SquashManifest]] = {}
    for s in squashes:
        base, target = manifests.get(s.base_version), manifests.get(s.target_version)
        if base is None or target is None or s.target_version > to_version or base.layout() != target.layout():
            continue
        if _digest(base) != s.base_manifest_sha256 or _digest(target) != s.target_manifest_sha256:
            continue
        by_target.setdefault(s.target_version, []).append(s)
    return by_target


def _window(lookup: ManifestLookup, from_version: int | None, to_version: int) -> dict[int, VersionManifest | None]:
    """Manifests from the lower of the nearest anchor <= target and the holder's version, up to the target."""
    manifests: dict[int, VersionManifest | None] = {}
    v = to_version
    while v >= 0:
        manifests[v] = lookup(v)
        if manifests[v] is None or manifests[v].snapshot:  # type: ignore[union-attr]
            break
        v -= 1
    if from_version is not None and from_version < to_version:
        for w in range(from_version, min(manifests)):
            manifests[w] = lookup(w)
    return manifests


def make_plan(
    run_id: str,
    from_version: int | None,
    to_version: int,
    lookup: ManifestLookup,
    squashes: Sequence[SquashManifest] = (),
) -> Plan:
    """The cheapest plan from ``from_version`` to ``to_version`` of ``run_id``.

    Args:
        run_id: the run.
        from_version: what the holder has (``None``: nothing; it needs an anchor).
        to_version: the target version (must be committed).
        lookup: manifest of a version, ``None`` when it is not stored.
        squashes: the run's squash records the route may use (empty: deltas and anchors only,
            the plan for a caller that does not apply squash steps).

    Returns:
        A :class:`Plan`; empty steps when ``from_version == to_version``.

    Raises:
        NotFoundError: the target is not stored, or no route is complete (versions removed by
            retention and no anchor left before the target).
    """
    if lookup(to_version) is None:
        raise NotFoundError(f"run {run_id!r} has no version {to_version}", run_id=run_id, version=to_version)
    if from_version == to_version:
        return Plan(run_id=run_id, from_version=from_version, to_version=to_version, steps=[], total_bytes=0)
    manifests = _window(lookup, from_version, to_version)
    by_target = _usable(squashes, manifests, to_version)
    # best[v] = (bytes, rank of the last step, previous node, last step); previous node None: the start.
    best: dict[int, tuple[int, int, int | None, PlanStep | None]] = {}
    if from_version is not None and from_version in manifests and from_version < to_version:
        best[from_version] = (0, -1, None, None)
    for v in sorted(manifests):
        m = manifests[v]
        if m is None:
            continue
        candidates: list[tuple[int, int, int | None, PlanStep]] = []
        prev = manifests.get(v - 1)
        if v - 1 in best and prev is not None and prev.layout() == m.layout():
            step = _delta(m)
            candidates.append((best[v - 1][0] + step.size_bytes, _RANK["delta"], v - 1, step))
        for s in by_target.get(v, []):
            if s.base_version in best:
                candidates.append((best[s.base_version][0] + s.size_bytes, _RANK["squash"], s.base_version, _squash(s)))
        if m.snapshot:
            step = _snapshot(m)
            candidates.append((step.size_bytes, _RANK["snapshot"], None, step))
        for bytes_, rank, back, step in candidates:
            if v not in best or (bytes_, rank) < best[v][:2]:
                best[v] = (bytes_, rank, back, step)
    if to_version not in best:
        raise NotFoundError(
            f"no way from version {from_version} to {to_version} of run {run_id!r}: "
            f"intermediate versions were removed by retention and no anchor <= {to_version} is stored",
            run_id=run_id,
            version=to_version,
        )
    steps: list[PlanStep] = []
    node: int | None = to_version
    while node is not None:
        _, _, node, last = best[node]
        if last is None:
            break
        steps.append(last)
    steps.reverse()
    return Plan(
        run_id=run_id, from_version=from_version, to_version=to_version, steps=steps, total_bytes=best[to_version][0]
    )
