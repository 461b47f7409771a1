"""The answers of stitchboard's in-engine methods, typed (parsed in the sidecar process).

Every in-engine method (vLLM's worker extension over ``collective_rpc``; the same shape for any
engine whose ranks report per call) answers, per TP rank, a JSON object::

    {"ok": true,  "state": {"version", "phase", "instance"}, "lease": {"holder", "expires_in_s"},
     "report" | "staging" | "checksums": ...}
    {"ok": false, "state": {...}, "lease": {...}, "error": {"type", "message", ...details}}

The error is the wire body of the exception raised in the engine: type ``ApplyFailed``
(details ``cause``, ``restored``) once writing began; ``LeaseNotHeld`` when the caller holds no
live lease (nothing done); any other type means refused, nothing written. ``lease`` is the
rank's lease after the call (:mod:`.lease`). :func:`combine` turns the ranks' answers into one
:class:`EngineState`, :func:`raise_if_failed` raises the sidecar's typed error for a failed call
and :func:`lease_grant` reads what the ranks say of the caller's lease.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import (
    AdapterLoadError,
    ApplyFailedError,
    ApplyRefusedError,
    EngineRequestError,
    EngineStateError,
    LeaseNotHeldError,
)
from .base import EngineState, LeaseGrant, Phase


class RankState(BaseModel):
    """What one rank records: its version, phase and instance id."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int | None
    phase: Phase
    instance: str = ""


class RankLease(BaseModel):
    """One rank's lease after a call: the owner whose lease is live (None: none) and the seconds
    it has left (0.0 when none is live)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    holder: str | None
    expires_in_s: float


class RankError(BaseModel):
    """The wire body of the error one rank raised (details as extra fields)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str
    message: str = ""

    def details(self) -> dict[str, Any]:
        """The error's details (everything but ``type`` and ``message``)."""
        return dict(self.model_extra or {})


class RankAnswer(BaseModel):
    """One rank's answer to one call.

    Attributes:
        ok: whether the call succeeded on this rank.
        state: the rank's record after the call.
        error: the rank's error when not ``ok``.
        report: figures of an apply, commit or snapshot load (seconds, bytes, counts).
        staging: ``{"state": "running" | "ready", "from_version", "to_version", "report"?}``.
        checksums: checkpoint name -> xxh3-128 hex, as the engine holds them.
        lease: the rank's lease after the call (None: engine code that answers none).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool
    state: RankState
    lease: RankLease | None = None
    error: RankError | None = None
    report: dict[str, Any] | None = None
    staging: dict[str, Any] | None = None
    checksums: dict[str, str] | None = None


def parse_answers(method: str, results: Any) -> list[RankAnswer]:
    """The per-rank answers of ``method`` (rank order).

    Raises:
        EngineRequestError: not a non-empty list of answers of this shape (is the stitchboard
            engine code loaded?).
    """
    if not isinstance(results, list) or not results:
        raise EngineRequestError(
            f"{method}: unexpected answer {str(results)[:300]} (is the stitchboard worker extension loaded?)",
            path="/collective_rpc",
        )
    try:
        return [RankAnswer.model_validate(r) for r in results]
    except ValidationError as exc:
        raise EngineRequestError(
            f"{method}: a rank's answer has the wrong shape ({exc.error_count()} errors: {str(exc)[:300]})",
            path="/collective_rpc",
        ) from None


def combine(answers: Sequence[RankAnswer]) -> EngineState:
    """The engine's state: the ranks' common version and phase; the instance joins the ranks' ids,
    so that a restart of any rank changes it.

    Raises:
        EngineStateError: the ranks record different versions or phases.
    """
    states = [(a.state.version, a.state.phase) for a in answers]
    if any(s != states[0] for s in states):
        raise EngineStateError(f"TP ranks record different states: {states}", held=None, phase="inconsistent")
    version, phase = states[0]
    return EngineState(version, phase, "/".join(a.state.instance for a in answers))


def lease_grant(answers: Sequence[RankAnswer], owner: str, sent_at: float) -> LeaseGrant | None:
    """``owner``'s lease as the ranks answered a call sent at ``sent_at`` (``time.monotonic()``):
    live on every rank until at least ``sent_at`` plus the least time any rank has left; None
    unless every rank names ``owner`` as its holder."""
    leases = [a.lease for a in answers]
    if not leases or any(lease is None or lease.holder != owner for lease in leases):
        return None
    return LeaseGrant(owner, sent_at + min(lease.expires_in_s for lease in leases if lease is not None))


def granted_lease(answers: Sequence[RankAnswer], owner: str, sent_at: float, method: str, path: str) -> LeaseGrant:
    """:func:`lease_grant` of a take every rank answered without an error.

    Raises:
        EngineRequestError: some rank names another holder (or none) although no rank refused:
            the engine's lease code disagrees with itself; ``path`` is the transport the answers came by.
    """
    grant = lease_grant(answers, owner, sent_at)
    if grant is None:
        raise EngineRequestError(
            f"{method}: the ranks granted the lease but name other holders: {[a.lease for a in answers]}", path=path
        )
    return grant


def snapshot_checksums(paths: Sequence[str]) -> dict[str, str]:
    """Tensor name -> xxh3-128 checksum (:func:`stitchboard.proto.codec.checksum`) of every tensor in the
    snapshot shards ``paths`` (safetensors files), for a load whose manifest checksums were not given."""
    from stitchboard.proto.codec import checksum
    from stitchboard.proto.container import read_safetensors

    return {name: checksum(t) for path in paths for name, t in read_safetensors(path)[1].items()}


def lease_refusal(answers: Sequence[RankAnswer]) -> LeaseNotHeldError | None:
    """The first rank's ``LeaseNotHeld`` refusal among ``answers`` (None: no rank refused so)."""
    for answer in answers:
        err = answer.error
        if not answer.ok and err is not None and err.type == LeaseNotHeldError.type:
            details = err.details()
            return LeaseNotHeldError(
                err.message,
                holder=details.get("holder"),
                expires_in_s=details.get("expires_in_s"),
                owner=details.get("owner"),
            )
    return None


def raise_if_failed(method: str, answers: Sequence[RankAnswer]) -> None:
    """Raise the typed error of the first rank that failed ``method`` (details gain ``held`` and
    ``phase``: the engine's record after the call).

    Raises:
        LeaseNotHeldError: the caller holds no live lease on some rank (nothing done there).
        ApplyFailedError: writing began (``restored``: whether the old bits are back).
        EngineStateError: the engine's record forbade the call (nothing written).
        AdapterLoadError: a LoRA adapter call was refused (details as the rank gave them).
        ApplyRefusedError: refused before any write (``cause``: the rank's error type).
        EngineStateError: the ranks record different states.
    """
    failed = [a for a in answers if not a.ok]
    state = combine(answers)
    if not failed:
        return
    refusal = lease_refusal(answers)
    if refusal is not None and all(a.error is None or a.error.type != ApplyFailedError.type for a in failed):
        raise refusal
    err = failed[0].error or RankError(type="Error", message="the rank reported no error")
    details = {**err.details(), "held": state.version, "phase": state.phase}
    if err.type == ApplyFailedError.type:
        raise ApplyFailedError(f"{method}: {err.message}", **{**details, "restored": bool(details.get("restored"))})
    if err.type == EngineStateError.type:
        raise EngineStateError(f"{method}: {err.message}", **details)
    if err.type == AdapterLoadError.type:
        raise AdapterLoadError(f"{method}: {err.message}", **details)
    raise ApplyRefusedError(
        f"{method} refused, nothing written: {err.type}: {err.message}", **{**details, "cause": err.type}
    )
