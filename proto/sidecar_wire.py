"""The sidecar's wire: request headers and body field, response stamps, states and the status body.

What a client of a sidecar sends and reads; the sidecar (:mod:`stitchboard.sidecar`) and its
clients (the demo, :class:`stitchboard.sidecar.client.SidecarClient`, tests) share these names.
No server or engine imports.

Requests may constrain the weight version (headers, or the body field :data:`BODY_FIELD`, which
the sidecar strips before forwarding)::

    X-Stitch-Min-Version: 12        body: {"weight_version": {"min_version": 12}}
    X-Stitch-Exact-Version: 12      body: {"weight_version": {"exact_version": 12}}
    X-Stitch-Wait-S: 5.0            body: {"weight_version": {"wait_s": 5.0}}

Every answer is stamped (DESIGN.md invariant 8): JSON fields :data:`START_FIELD` and
:data:`END_FIELD` plus headers :data:`START_HEADER` / :data:`END_HEADER`; a stream gets the
start header and one last event carrying both fields before ``data: [DONE]`` (a stream the
engine broke off ends with that event and an error event ``{"error": {...}}``, no ``[DONE]``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

MIN_HEADER = "X-Stitch-Min-Version"
EXACT_HEADER = "X-Stitch-Exact-Version"
WAIT_HEADER = "X-Stitch-Wait-S"
BODY_FIELD = "weight_version"
START_HEADER = "X-Stitch-Version-Start"
END_HEADER = "X-Stitch-Version-End"
START_FIELD = "weight_version_start"
END_FIELD = "weight_version_end"

#: What the sidecar is doing (``/v1/stitch/status`` ``state``): ``starting``; ``waiting_for_engine``
#: (booting, or the claim was dropped: the engine restarted, changed or does not answer);
#: ``booting``; ``idle``; ``staging`` (fetching files, or the engine staging while it serves);
#: ``committing`` / ``recovering`` / ``resuming`` (the engine is paused: :data:`COMMIT_STATES`);
#: ``retrying`` (the last attempt failed; backing off); ``unhealthy`` (a recovery failed).
SidecarState = Literal[
    "starting",
    "waiting_for_engine",
    "booting",
    "idle",
    "staging",
    "committing",
    "recovering",
    "resuming",
    "retrying",
    "unhealthy",
]
#: States while a commit holds the engine paused; in ``resuming`` the new version is already
#: marked applied and the engine is being resumed.
COMMIT_STATES: frozenset[SidecarState] = frozenset({"committing", "recovering", "resuming"})
#: How a commit reached its version (``SyncReport.route``, the ``route`` label of the pause
#: metric): ``delta`` (deltas staged while serving, written in the pause); ``staged_anchor`` (an
#: anchor route staged while serving: the target built in the sidecar, only the tensors that
#: differ written in the pause); ``anchor`` (snapshot and deltas applied in the pause: the engine
#: held no verified version); ``recovery`` (a failed or interrupted write recovered from the
#: anchor in the same pause); ``flip`` (empty deltas: no pause).
RouteKind = Literal["delta", "staged_anchor", "anchor", "recovery", "flip"]
ROUTE_KINDS: tuple[RouteKind, ...] = ("delta", "staged_anchor", "anchor", "recovery", "flip")
#: Header telling OpenAI-style clients whether retrying the same request can succeed.
SHOULD_RETRY_HEADER = "x-should-retry"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyncReport(_Model):
    """Figures of the last completed sync.

    Attributes:
        from_version: the version it started from (None: an anchor load into an engine of no
            known version).
        to_version: the version it applied.
        bytes_fetched: bytes downloaded and verified.
        stage_seconds: fetching and checking the files, seconds.
        engine_stage_seconds: the engine staging the update while serving, seconds.
        pause_seconds: the engine paused, seconds.
        apply_seconds: writing and verifying inside the pause, seconds.
        total_seconds: from seeing the version to having it applied, seconds.
        anchor: whether it went the anchor route (a snapshot, then deltas).
        finished_at: when it finished, Unix seconds.
        route: see :data:`RouteKind`.
    """

    from_version: int | None
    to_version: int
    bytes_fetched: int
    stage_seconds: float
    engine_stage_seconds: float
    pause_seconds: float
    apply_seconds: float
    total_seconds: float
    anchor: bool
    finished_at: float
    route: RouteKind = "delta"


class Refusal(_Model):
    """A plan the sidecar could not stage while the engine served (the engine refused it, or its
    target could not be built): nothing was written and the held version keeps serving.

    Attributes:
        from_version: the version the refused plan started from (None: an anchor route).
        to_version: the version it would have applied.
        route: ``delta`` or ``staged_anchor``.
        held_version: the version the engine still holds (and the sidecar serves).
        type, message: the error's wire type and message.
        attempts: refusals of this target in a row.
        at: when the last refusal happened, Unix seconds.
        retry_at: when the same plan is tried again (sooner once a newer version is published), Unix
            seconds; None for a permanent refusal, never tried again.
        permanent: the engine has no place for the version's tensor set (a name, dtype or shape it
            does not hold): only a version with another tensor set is tried, and a version with this
            one is refused without touching the engine.
    """

    from_version: int | None
    to_version: int
    route: RouteKind
    held_version: int | None
    type: str
    message: str
    attempts: int
    at: float
    retry_at: float | None
    permanent: bool = False


class SidecarStatus(_Model):
    """``GET /v1/stitch/status``.

    Attributes:
        run_id: the run followed.
        applied_version: the verified version the engine holds (None: none claimed).
        target_version: the newest version known at the bulletin.
        lag_versions: target minus applied (target + 1 while nothing is applied; None: no target).
        state: see :data:`SidecarState`.
        healthy: a version is applied and the last sync left the sidecar healthy.
        unhealthy_reason: why not, after a failed recovery.
        last_error: ``{"type", "message", "at"}`` of the last failure, if any.
        last_sync: the last completed sync.
        requests_in_flight: admitted requests not yet completed.
        requests_waiting: requests held for their version (or the end of a commit).
        committing: whether admission is closed for a commit.
        time: the sidecar's clock, Unix seconds.
        refused: the last refused plan, until a version at or past it is applied (None: none).
        pause_seconds_by_route: the last pause of each route kind taken so far, seconds.
    """

    run_id: str
    applied_version: int | None
    target_version: int | None
    lag_versions: int | None
    state: SidecarState
    healthy: bool
    unhealthy_reason: str | None
    last_error: dict[str, Any] | None
    last_sync: SyncReport | None
    requests_in_flight: int
    requests_waiting: int
    committing: bool
    time: float
    refused: Refusal | None = None
    pause_seconds_by_route: dict[str, float] = {}


#: ``GET /health``'s ``status``: ``ok`` (200) or why not (503).
HealthStatus = Literal[
    "ok", "standby", "unhealthy", "starting", "recovering", "engine_slow", "engine_changed", "engine_unhealthy"
]


class LeaseView(_Model):
    """The engine's lease as ``/health`` shows it.

    Attributes:
        owner: this sidecar's lease owner id.
        held: whether this sidecar holds the lease.
        holder: the owner the engine names (None while unknown).
        holder_expires_in_s: seconds until that lease lapses unless renewed (None while unknown).
    """

    owner: str
    held: bool
    holder: str | None
    holder_expires_in_s: float | None


class Health(_Model):
    """``GET /health`` (200 with ``status: ok``, else 503 with the ``reason``).

    Attributes:
        applied_version: the verified version applied (None: none, or the engine changed).
        state: see :data:`SidecarState`.
        lease: the engine's lease.
        refused: the last refused plan (absent: none).
        squash_quarantine: the quarantined squash ranges, oldest first (absent: none).
        relays: the regional blob relays in order (absent: none configured): ``url``, ``up`` (false while skipped
            after failing), ``fetched``, ``failed`` and ``last_error`` (``sidecar/relays.py``).
        adapters: an adapter run's resident versions (absent: a full-model run): ``run``, ``base_model``,
            ``resident`` and ``retired`` (``<run>@<N>`` names, oldest first), ``in_use`` (name -> admitted
            requests), ``ready``, ``waiting_load`` (why the next load waits, or null), ``resident_max`` and
            ``last_failed_load`` (``sidecar/adapter_follower.py``; docs/reference/sidecar-adapters.md).
        status: ``ok`` or why not.
        reason: why not (absent with ``ok``).
    """

    applied_version: int | None
    state: SidecarState
    lease: LeaseView
    refused: Refusal | None = None
    squash_quarantine: list[dict[str, Any]] | None = None
    relays: list[dict[str, Any]] | None = None
    adapters: dict[str, Any] | None = None
    status: HealthStatus
    reason: str | None = None

    def wire(self) -> dict[str, Any]:
        """The JSON body: the fields in order, the optional ones (``refused``, ``squash_quarantine``, ``relays``,
        ``adapters``, ``reason``) left out when None."""
        body = self.model_dump(mode="json")
        optional = ("refused", "squash_quarantine", "relays", "adapters", "reason")
        return {k: v for k, v in body.items() if v is not None or k not in optional}


#: Body field and header asking for per-token version spans; the answer's field holding them.
SPANS_WANT_FIELD = "return_weight_versions"
SPANS_WANT_HEADER = "x-stitch-return-weight-versions"
SPANS_FIELD = "weight_versions"
#: Body field and header asking for routing replay, the first position asked for, and the answer's fields.
ROUTING_WANT_FIELD = "return_routed_experts"
ROUTING_WANT_HEADER = "x-stitch-return-routed-experts"
ROUTING_START_LEN_FIELD = "routed_experts_start_len"
ROUTING_VERSIONS_FIELD = "routed_experts_weight_versions"
ROUTING_ERROR_FIELD = "routed_experts_error"


class VersionSpan(_Model):
    """One span of ``weight_versions`` (output tokens) or ``routed_experts_weight_versions`` (rows):
    ``[start, end)`` made by weight version ``version``."""

    version: int
    start: int
    end: int


class RoutingReplay(_Model):
    """The routing fields of an answer that asked for ``return_routed_experts`` (top-level; a
    stream: in its stamp event), next to ``sglext.routed_experts`` (base64 int32 rows).

    Attributes:
        routed_experts_start_len: the first position whose row is given.
        routed_experts_weight_versions: the rows' versions (None: unknown, see the error).
        routed_experts_error: why the rows or their versions are missing (absent: none missing).
    """

    routed_experts_start_len: int
    routed_experts_weight_versions: list[VersionSpan] | None
    routed_experts_error: str | None = None
