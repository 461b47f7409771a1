"""REST routes for versions: publish, latest (long-poll), one manifest, a page of versions or the version at a step,
runs, plans."""

from __future__ import annotations

import asyncio
from typing import Annotated

from anyio import to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from stitchboard.proto.answers import RunList, VersionPage
from stitchboard.proto.errors import SchemaError
from stitchboard.proto.schema import Plan, VersionInfo, VersionManifest, check_publishable, parse_manifest

from .cache_headers import immutable
from .deps import BulletinState, Publish, Read
from .errors import BulletinError, InvalidRequestError, NotFoundError
from .gc_hold import COLLECTOR
from .hangup import Hangup
from .ledger import run_key
from .metrics import OTHER
from .planner import make_plan
from .squash_store import list_squashes

router = APIRouter(prefix="/v1", tags=["versions"])


def _parse(body: bytes, run: str, max_files: int) -> VersionManifest:
    try:
        manifest = check_publishable(parse_manifest(body))
    except SchemaError as exc:
        raise InvalidRequestError(exc.message, run_id=run) from None
    if len(manifest.files) > max_files:
        raise InvalidRequestError(
            f"manifest for run {run!r} lists {len(manifest.files)} files, over the {max_files}-file limit "
            "(max_files_per_version): use larger shards",
            run_id=run,
        )
    return manifest


def _run_label(state: BulletinState, run: str) -> str:
    """``run`` if it has a committed version, else :data:`OTHER`: labels never come from unchecked input."""
    try:
        return run if state.ledger.latest(run) is not None else OTHER
    except BulletinError:
        return OTHER


@router.post(
    "/runs/{run}/versions",
    response_model=VersionInfo,
    status_code=201,
    responses={200: {"description": "identical manifest already committed (no-op)"}, 409: {}, 413: {}, 422: {}},
)
async def publish(run: str, request: Request, state: Publish) -> JSONResponse:
    """Publish a version manifest (JSON body). 201 when committed, 200 when the identical manifest already was.

    Every referenced blob must be stored with the stated size, the base version must be
    committed, versions only move forward, and a manifest lists at most ``max_files_per_version``
    files. Nothing is written on a 4xx.
    """
    run_key(run)
    body = await request.body()  # at most max_manifest_bytes (the body rule, body_caps.py)
    loop = asyncio.get_running_loop()

    def on_commit(committed: VersionInfo) -> None:  # wakes this process's long-polls before the latest pointer moves
        loop.call_soon_threadsafe(state.watcher.note, committed)

    try:
        with COLLECTOR.held():  # no full collection between the publish and its long-polls' answers (gc_hold.py)
            manifest = await to_thread.run_sync(_parse, body, run, state.settings.max_files_per_version)
            info, created = await to_thread.run_sync(state.ledger.publish, run, manifest, on_commit)
    except BulletinError:
        state.metrics.publishes.labels(await to_thread.run_sync(_run_label, state, run), "rejected").inc()
        raise
    state.metrics.publishes.labels(run, "created" if created else "noop").inc()
    state.watcher.note(info)
    return JSONResponse(info.model_dump(mode="json"), status_code=201 if created else 200)


@router.get(
    "/runs/{run}/versions/latest",
    response_model=VersionInfo,
    responses={204: {"description": "nothing newer than `after` within wait_s"}},
)
async def latest(
    run: str,
    request: Request,
    state: Read,
    after: Annotated[int, Query(ge=-1, description="answer only with a version greater than this")] = -1,
    wait_s: Annotated[float, Query(ge=0, description="long-poll up to this many seconds (capped by max_wait_s)")] = 0.0,
) -> Response:
    """The latest committed version of the run, as soon as it is greater than ``after``; 204 if none within ``wait_s``.

    A run with no version yet is not an error (204). The wait ends when the client hangs up.
    """
    run_key(run)
    with Hangup(request.scope, request.receive) as hangup:
        info = await state.watcher.wait(run, after, min(wait_s, state.settings.max_wait_s), hangup)
    if info is None:
        return Response(status_code=204)
    return state.watcher.answer(run)


@router.get(
    "/runs/{run}/versions/{version}", responses={200: {"description": "the manifest (canonical JSON)"}, 404: {}}
)
def manifest(run: str, version: int, state: Read) -> Response:
    """One version's manifest, byte-identical to what was published (canonical JSON).

    Headers: ``ETag`` (sha256 of the manifest), ``X-Stitch-Committed-At``, ``Cache-Control`` immutable (a
    committed version never changes; ``public`` on an open bulletin; :mod:`.cache_headers`).
    """
    found = state.ledger.committed(run, version)
    headers = {
        "etag": f'"{found.info.manifest_sha256}"',
        "x-stitch-committed-at": found.info.committed_at or "",
        "cache-control": immutable(state.auth.open),
    }
    return Response(found.manifest_json, media_type="application/json", headers=headers)


@router.get(
    "/runs/{run}/versions",
    response_model=VersionPage | VersionInfo,
    responses={404: {"description": "with `step`: no version at that step or later"}},
)
def versions(
    run: str,
    state: Read,
    after: Annotated[int, Query(ge=-1, description="list versions greater than this")] = -1,
    limit: Annotated[int, Query(ge=1, description="page size (capped by versions_page_max)")] = 100,
    step: Annotated[
        int | None,
        Query(ge=0, lt=2**63, description="answer the first version whose step is this or later (a VersionInfo)"),
    ] = None,
) -> VersionPage | VersionInfo:
    """A page of the run's committed versions (ascending) as VersionInfo; ``next_after`` continues the listing.

    With ``step``: the first committed version whose manifest records that step or later (its
    VersionInfo; ``after`` and ``limit`` do not apply), 404 naming the run and step when none does.
    """
    if step is not None:
        found = state.ledger.version_for_step(run, step)
        if found is None:
            raise NotFoundError(f"run {run!r} has no version at step {step} or later", run_id=run, step=step)
        return found
    numbers = state.ledger.version_numbers(run, after)
    page = numbers[: min(limit, state.settings.versions_page_max)]
    items = []
    for v in page:
        try:
            items.append(state.ledger.committed(run, v).info)
        except NotFoundError:
            continue  # removed by retention between listing and reading
    return VersionPage(run_id=run, versions=items, next_after=page[-1] if len(numbers) > len(page) else None)


@router.get("/runs", response_model=RunList)
def runs(request: Request, state: Read) -> RunList:
    """Every run (that the token may read) with its latest version."""
    authorization = request.headers.get("authorization")
    return RunList(runs=[r for r in state.ledger.runs() if state.auth.visible(authorization, r.run_id)])


@router.get("/runs/{run}/plan", response_model=Plan)
def plan(
    run: str,
    state: Read,
    from_version: Annotated[
        int | None, Query(alias="from", ge=0, description="version the caller holds; absent: nothing")
    ] = None,
    to_version: Annotated[int | None, Query(alias="to", ge=0, description="target version; absent: latest")] = None,
    squash: Annotated[
        bool, Query(description="the caller applies squash steps: routes may use the run's squashes")
    ] = False,
) -> Plan:
    """The ordered files to fetch to go from ``from`` to ``to``: the cheapest of deltas, anchor-then-deltas
    and (with ``squash=true``) routes through the run's squashes."""
    if to_version is None:
        info = state.ledger.latest(run)
        if info is None:
            raise NotFoundError(f"run {run!r} has no version yet: nothing to plan", run_id=run)
        to_version = info.version

    def lookup(version: int) -> VersionManifest | None:
        try:
            return state.ledger.committed(run, version).manifest
        except NotFoundError:
            return None

    return make_plan(run, from_version, to_version, lookup, list_squashes(state.ledger, run) if squash else ())
