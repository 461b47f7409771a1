"""Training steps of a run's versions: the publish rule for steps and the lookup by step.

Runs in the bulletin (the rule at every publish, the lookup of ``GET /v1/runs/{run}/versions?step=N``)
and in its clients (the client checks a no-op answer with :func:`same_step_and_bits`).

A version's step is the trainer's step the SDK records in the manifest's metadata (``"step"``,
an integer >= 0). Steps keep to the run's versions the way versions keep to the run
(DESIGN.md invariant 3), so that "the first version at step N or later" has one answer found
in a binary search (about log2(versions) manifest reads, each a hit of the ledger's cache
revalidated by one metadata read):

* once a version records a step, every later version records one (a run may start without steps);
* a step is never lower than the latest version's;
* the latest version's step again with the same bits (every tensor's checksums and the served
  recipe equal) is a no-op: the publish answers that version (200) and writes nothing;
* the latest version's step again with other bits is refused (409 ``VersionConflict``, naming
  the step and both versions).

Runs published before this rule may hold steps out of order; a lookup on them answers some
version at step N or later whose predecessor is below N.
"""

from __future__ import annotations

from collections.abc import Callable

from stitchboard.proto.schema import VersionManifest

from .errors import InvalidRequestError, VersionConflictError


def recorded_step(manifest: VersionManifest) -> int | None:
    """The training step a manifest records (its metadata ``step``); None when it records none, or
    one that is not an integer >= 0 (a version committed before the rule)."""
    step = manifest.metadata.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def step_of(manifest: VersionManifest) -> int | None:
    """The training step a new manifest records (its metadata ``step``), or None when it records none.

    Raises:
        InvalidRequestError: ``step`` is there but not an integer >= 0 (a bool, a float, a string...).
    """
    step = recorded_step(manifest)
    if step is None and manifest.metadata.get("step") is not None:
        raise InvalidRequestError(
            f"version {manifest.version} of run {manifest.run_id!r} records step {manifest.metadata['step']!r}: a "
            "step is an integer >= 0",
            run_id=manifest.run_id,
            version=manifest.version,
        )
    return step


def same_step_and_bits(a: VersionManifest, b: VersionManifest) -> bool:
    """Whether two manifests record the same step (both record one) and the same served bits: the same
    tensors (names, dtypes, shapes, each tensor's own checksum: ``xxh3_128``, or ``xxh3_128_parts`` for one
    published in parts) in the same recipe. Files, encoding and other
    metadata may differ.
    """
    step = recorded_step(a)
    return (
        step is not None
        and step == recorded_step(b)
        and a.served == b.served
        and a.layout() == b.layout()
        and a.checksums() == b.checksums()
    )


def check_step(manifest: VersionManifest, latest: VersionManifest) -> bool:
    """Apply the step rule (module docstring) to ``manifest``, the next version after ``latest``.

    Returns:
        True when ``manifest`` is a no-op (``latest``'s step with the same bits): answer ``latest``.

    Raises:
        InvalidRequestError: the step is not an integer >= 0, or missing after a version that records one.
        VersionConflictError: the step is below ``latest``'s, or equal to it with other bits.
    """
    run, version, before = manifest.run_id, manifest.version, latest.version
    step, last = step_of(manifest), recorded_step(latest)
    if last is None:
        return False
    if step is None:
        raise InvalidRequestError(
            f"version {version} of run {run!r} records no step, but version {before} records step {last}: once a "
            f"run records steps every version does; publish it with a step >= {last}",
            run_id=run,
            version=version,
            latest_step=last,
        )
    if step > last:
        return False
    if step < last:
        raise VersionConflictError(
            f"version {version} of run {run!r} records step {step}, below step {last} of version {before}: steps "
            f"only move forward within a run; publish steps after {last}, or start a new run",
            run_id=run,
            version=version,
            step=step,
            latest_version=before,
        )
    if same_step_and_bits(manifest, latest):
        return True
    raise VersionConflictError(
        f"step {step} of run {run!r} is version {before}; version {version} records step {step} with other bits: a "
        f"step's weights are published once; publish them under a later step",
        run_id=run,
        version=version,
        step=step,
        latest_version=before,
    )


def first_at_step(step: int, latest: int, read: Callable[[int], VersionManifest | None]) -> int | None:
    """The first version in ``0 .. latest`` whose step is ``step`` or later, by binary search.

    Args:
        step: the step asked for (>= 0).
        latest: the run's latest version.
        read: a version's manifest, or None when it is not stored (removed by retention: the
            oldest versions go first, so these count as before every step).

    Returns:
        The version, or None when no version's step is ``step`` or later. Reads at most
        ``ceil(log2(latest + 2))`` manifests.
    """
    lo, hi = 0, latest + 1
    while lo < hi:
        mid = (lo + hi) // 2
        manifest = read(mid)
        at = None if manifest is None else recorded_step(manifest)
        if at is not None and at >= step:
            hi = mid
        else:
            lo = mid + 1
    return lo if lo <= latest else None
