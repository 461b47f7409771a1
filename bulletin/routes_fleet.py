"""REST routes of the fleet: replicas report themselves; trainers and people ask where the fleet is.

* ``PUT /v1/runs/{run}/replicas/{replica_id}`` (scope ``replica``): a sidecar's report
  (:class:`~stitchboard.proto.fleet.ReplicaReport`); stored at once, answered with its lease. A
  new replica past the run's ``max_live_replicas`` live ones is refused (422 ``TooManyReplicas``).
* ``GET /v1/runs/{run}/replicas`` (``read``): every replica with its state and liveness.
* ``GET /v1/runs/{run}/fleet?version=v`` (``read``): how many live replicas are at >= v; with
  ``min_replicas`` and/or ``fraction`` and ``wait_s`` it long-polls until that many are.

Replica ids never become metric labels (their number is unbounded).
"""

from __future__ import annotations

from typing import Annotated

from anyio import to_thread
from fastapi import APIRouter, Query, Request
from pydantic import ValidationError

from stitchboard.proto.fleet import FleetCount, FleetView, ReplicaReport, ReportAccepted

from .deps import Read, Replica
from .errors import InvalidRequestError
from .fleet import replica_key
from .hangup import Hangup
from .ledger import run_key

router = APIRouter(prefix="/v1", tags=["fleet"])


@router.put("/runs/{run}/replicas/{replica_id}", response_model=ReportAccepted, responses={413: {}, 422: {}})
async def report(run: str, replica_id: str, request: Request, state: Replica) -> ReportAccepted:
    """Store a replica's report (JSON :class:`ReplicaReport`, its ``replica_id`` the path's) and renew its lease.

    Renew before ``renew_s`` has passed; a replica that stops reporting is shown as expired
    once ``lease_s`` has passed since its last report. A report with a non-finite or absurd
    time (outside 2000-2100 as Unix seconds) is refused (422 ``InvalidRequest`` naming the
    field); so is a new replica while the run has ``max_live_replicas`` live ones (422
    ``TooManyReplicas``; a live replica's renewal is never refused).
    """
    replica_key(run, replica_id)
    body = await request.body()  # at most max_report_bytes (the body rule, body_caps.py)
    try:
        parsed = ReplicaReport.model_validate_json(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise InvalidRequestError(
            f"invalid report of replica {replica_id!r}: {problems}", run_id=run, replica_id=replica_id
        ) from None
    if parsed.replica_id != replica_id:
        raise InvalidRequestError(
            f"report names replica {parsed.replica_id!r} but was sent for {replica_id!r}",
            run_id=run,
            replica_id=replica_id,
        )
    async with state.fleet.admission(run, replica_id, state.settings.max_live_replicas):
        record = await to_thread.run_sync(state.fleet.fleet.write, run, parsed)
        state.fleet.reported(run, record)
    return ReportAccepted(lease_s=record.lease_s, renew_s=record.lease_s / 3)


@router.get("/runs/{run}/replicas", response_model=FleetView)
async def replicas(run: str, state: Read) -> FleetView:
    """Every replica of the run (live, or expired less than ``replica_forget_s`` ago) with its last report,
    sorted by id."""
    run_key(run)
    return await state.fleet.view(run)


@router.get("/runs/{run}/fleet", response_model=FleetCount)
async def fleet(
    run: str,
    request: Request,
    state: Read,
    version: Annotated[int, Query(ge=0, description="count live replicas whose applied version is >= this")],
    min_replicas: Annotated[int | None, Query(ge=1, description="requirement: at least this many")] = None,
    fraction: Annotated[
        float | None,
        Query(gt=0, le=1, description="requirement: at least this fraction of the live replicas (and at least one)"),
    ] = None,
    wait_s: Annotated[
        float, Query(ge=0, description="long-poll up to this many seconds for the requirement (capped by max_wait_s)")
    ] = 0.0,
) -> FleetCount:
    """How many live replicas are at >= ``version``; with a requirement and ``wait_s``,
    answers once it is met (``met``) or after ``wait_s``.

    The answer names the live replicas below ``version`` (``laggards``: state and last error)
    and those whose lease expired.
    """
    run_key(run)
    with Hangup(request.scope, request.receive) as hangup:  # the wait ends when the client hangs up
        return await state.fleet.wait(
            run,
            version,
            min_replicas,
            fraction,
            min(wait_s, state.settings.max_wait_s) if (min_replicas or fraction) else 0.0,
            hangup,
        )
