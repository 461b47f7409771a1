"""The fleet's wire: what a sidecar reports to the bulletin and what fleet queries answer.

A sidecar (:mod:`stitchboard.sidecar.report`) sends a :class:`ReplicaReport` to
``PUT /v1/runs/{run}/replicas/{replica_id}`` whenever what it reports changes and before its
lease runs out; the bulletin (:mod:`stitchboard.bulletin.fleet`) stores it as the replica's
record and answers :class:`ReportAccepted`. ``GET /v1/runs/{run}/replicas`` answers
:class:`FleetView`; ``GET /v1/runs/{run}/fleet`` answers :class:`FleetCount` (optionally
long-polling until a requirement is met; counted by :mod:`stitchboard.bulletin.fleet_counts`). No server or
engine imports.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import Field, field_validator

from .adapter import parse_adapter_name
from .errors import SchemaError
from .schema import _Model

_REPLICA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: How many (version, applied_at) pairs a report carries for the convergence plots.
HISTORY_LEN = 32
#: Most resident adapters one report lists (an engine's LoRA slots are a handful).
MAX_ADAPTERS = 64
#: The Unix times a report may carry, seconds: 2000-01-01 to 2100-01-01 (others are a broken clock or a bad value).
UNIX_S_MIN, UNIX_S_MAX = 946_684_800.0, 4_102_444_800.0
#: The longest duration a report may carry (a sync's seconds), seconds: 30 days.
DURATION_S_MAX = 30 * 86_400.0

#: A time in a report: finite Unix seconds within [UNIX_S_MIN, UNIX_S_MAX].
UnixSeconds = Annotated[float, Field(ge=UNIX_S_MIN, le=UNIX_S_MAX, allow_inf_nan=False)]
#: A duration in a report: finite seconds within [0, DURATION_S_MAX].
Seconds = Annotated[float, Field(ge=0, le=DURATION_S_MAX, allow_inf_nan=False)]


def check_replica_id(replica_id: str) -> str:
    """Validate a replica id: 1-128 of ``[A-Za-z0-9._-]``, starting alphanumeric, no ``..``.

    Raises:
        SchemaError: with the offending id.
    """
    if not _REPLICA_ID.fullmatch(replica_id) or ".." in replica_id:
        raise SchemaError(
            f"invalid replica id {replica_id!r}: use 1-128 characters of [A-Za-z0-9._-], starting alphanumeric"
        )
    return replica_id


class SyncFigures(_Model):
    """The last completed sync of a replica: the version it reached, bytes fetched, seconds, pause seconds,
    when (Unix s).

    Times and durations are finite and within :data:`UnixSeconds` / :data:`Seconds` (else the report is refused).
    """

    to_version: int
    bytes_fetched: Annotated[int, Field(ge=0)]
    total_seconds: Seconds
    pause_seconds: Seconds
    route: str
    finished_at: UnixSeconds


class ErrorNote(_Model):
    """The last failure of a replica: wire ``type``, ``message`` (at most 1,000 characters) and when (Unix s)."""

    type: str
    message: Annotated[str, Field(max_length=1000)]
    at: UnixSeconds


class ReplicaReport(_Model):
    """What one sidecar says about itself (the body of ``PUT .../replicas/{replica_id}``).

    Nothing in it changes while the replica's situation does not, so renewing a lease sends
    the same bytes (and the store keeps the same etag: readers need not read it again). Every
    time in it is finite Unix seconds from 2000 to 2100 (:data:`UnixSeconds`), every duration
    finite seconds up to 30 days: a report with another value is refused (422 naming the field).

    Attributes:
        replica_id: stable id of the replica (``STITCH_SIDECAR_REPLICA_ID``; default host and port).
        engine: engine kind behind the sidecar (``vllm``, ...).
        applied_version: the verified version the engine holds (None: none).
        target_version: the newest version the sidecar knows of.
        state: the sidecar's state (:data:`stitchboard.proto.sidecar_wire.SidecarState`).
        lag_versions: target minus applied, as the sidecar sees it.
        healthy: a version is applied and the last sync left the sidecar healthy.
        last_sync: the last completed sync.
        last_error: the last failure (a refused plan, a failed apply, ...), until a sync succeeds after it.
        history: the last :data:`HISTORY_LEN` versions applied, ``[version, applied_at]`` (Unix s), oldest first.
        started_at: when this sidecar process started (Unix s): a restart shows as a new value.
        adapters: for an adapter run, the versions the engine holds resident, as served names ``<run>@<N>``
            (:func:`stitchboard.proto.adapter.adapter_name`), oldest first; at most :data:`MAX_ADAPTERS`.
    """

    replica_id: str
    engine: str
    applied_version: Annotated[int, Field(ge=0)] | None
    target_version: Annotated[int, Field(ge=0)] | None
    state: str
    lag_versions: int | None
    healthy: bool
    last_sync: SyncFigures | None = None
    last_error: ErrorNote | None = None
    history: Annotated[
        list[tuple[Annotated[int, Field(ge=0)], UnixSeconds]], Field(default_factory=list, max_length=HISTORY_LEN)
    ]
    started_at: UnixSeconds
    adapters: Annotated[list[str], Field(default_factory=list, max_length=MAX_ADAPTERS)]

    @field_validator("replica_id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        try:
            return check_replica_id(value)
        except SchemaError as exc:
            raise ValueError(exc.message) from None

    @field_validator("adapters")
    @classmethod
    def _check_adapters(cls, value: list[str]) -> list[str]:
        for name in value:
            try:
                _, version = parse_adapter_name(name)
            except SchemaError as exc:
                raise ValueError(exc.message) from None
            if version is None:
                raise ValueError(f"resident adapter {name!r} names no version: report '<run>@<N>'")
        return value


class ReportAccepted(_Model):
    """The bulletin's answer to a report: the lease it granted and when to renew it, seconds."""

    lease_s: float
    renew_s: float


class ReplicaView(_Model):
    """One replica as fleet queries show it: its last report, whether its lease is live,
    and its lag behind the run's latest version.

    Attributes:
        report: the replica's last report.
        live: its lease has not expired.
        reported_at: when the store last received its report (Unix s).
        lease_expires_at: ``reported_at`` plus the lease (Unix s).
        behind_latest: the run's latest version minus ``applied_version`` (None: nothing applied or nothing published).
    """

    report: ReplicaReport
    live: bool
    reported_at: float
    lease_expires_at: float
    behind_latest: int | None


class FleetView(_Model):
    """``GET /v1/runs/{run}/replicas``: every replica of the run (live or recently expired), sorted by id."""

    run_id: str
    latest_version: int | None
    replicas: list[ReplicaView]
    time: float


class Laggard(_Model):
    """A live replica below the asked version: its id, applied version, state and last error message (None: none)."""

    replica_id: str
    applied_version: int | None
    state: str
    error: str | None


class FleetCount(_Model):
    """``GET /v1/runs/{run}/fleet``: how many live replicas are at or past ``version``.

    Attributes:
        run_id, version: what was asked.
        live: replicas whose lease is live.
        at_or_above: live replicas whose applied version is >= ``version``.
        needed: replicas the requirement asks for (None: no requirement given).
        met: ``at_or_above >= needed`` (True when no requirement was given).
        laggards: the live replicas below ``version``, most behind first (none applied, then by version; ties by id).
        expired: replicas whose lease ran out (not counted as live).
    """

    run_id: str
    version: int
    live: int
    at_or_above: int
    needed: int | None
    met: bool
    laggards: list[Laggard]
    expired: list[str]


def needed_replicas(live: int, min_replicas: int | None, fraction: float | None) -> int | None:
    """Replicas a requirement asks for among ``live`` ones: the larger of ``min_replicas`` and
    ``ceil(fraction * live)`` (a fraction asks for at least one); None when neither is given."""
    wants = []
    if min_replicas is not None:
        wants.append(min_replicas)
    if fraction is not None:
        wants.append(max(1, math.ceil(fraction * live - 1e-9)))
    return max(wants) if wants else None


def describe_laggards(count: FleetCount) -> str:
    """One line naming the replicas below the version and why (their state and last error)."""
    parts: list[str] = []
    for lag in count.laggards:
        why = f"state {lag.state}" + (f", last error: {lag.error}" if lag.error else "")
        parts.append(f"{lag.replica_id} at version {lag.applied_version} ({why})")
    if count.expired:
        parts.append(f"lease expired: {', '.join(count.expired)}")
    if not parts:
        return (
            "no live replica reports to the bulletin"
            if not count.live
            else f"none: every live replica is there, but only {count.live} report to the bulletin"
        )
    return "; ".join(parts)
