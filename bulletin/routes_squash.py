"""REST routes for squashes (derived patches from an older version straight to a newer one): put, list, drop.

See :mod:`.squash_store` for what is checked and how squashes live beside the versions; plans
use them only when asked (``GET /v1/runs/{run}/plan?squash=true``, :mod:`.routes_versions`).
"""

from __future__ import annotations

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from stitchboard.proto.squash_schema import SquashList, SquashManifest

from .deps import Publish, Read
from .errors import InvalidRequestError, NotFoundError
from .ledger import run_key
from .squash_store import drop_squash, list_squashes, put_squash

router = APIRouter(prefix="/v1", tags=["squashes"])


@router.put(
    "/runs/{run}/squashes/{base}/{target}",
    status_code=201,
    response_model=SquashManifest,
    responses={200: {"description": "identical squash already stored"}, 404: {}, 409: {}, 422: {}},
)
async def put(run: str, base: int, target: int, request: Request, state: Publish) -> JSONResponse:
    """Store a squash record (JSON :class:`SquashManifest`) after its files were uploaded as blobs.

    Both versions must be committed with the manifests the record names, and every patch file's
    index must take the base version's checksums to the target's. 201 when stored, 200 when the
    identical record already was; nothing is written on a 4xx.
    """
    run_key(run)
    body = await request.body()  # at most max_manifest_bytes (the body rule, body_caps.py)
    try:
        squash = SquashManifest.model_validate_json(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'squash'}: {e['msg']}" for e in exc.errors()[:10])
        raise InvalidRequestError(f"invalid squash record: {problems}", run_id=run) from None
    if (squash.base_version, squash.target_version) != (base, target):
        raise InvalidRequestError(
            f"the record is the squash {squash.base_version} -> {squash.target_version}, "
            f"the URL says {base} -> {target}",
            run_id=run,
        )
    created = await to_thread.run_sync(put_squash, state.ledger, run, squash)
    return JSONResponse(squash.model_dump(mode="json"), status_code=201 if created else 200)


@router.get("/runs/{run}/squashes", response_model=SquashList)
def squashes(run: str, state: Read) -> SquashList:
    """Every squash record of the run (a squash whose version was removed is dropped by the next gc)."""
    run_key(run)
    return SquashList(run_id=run, squashes=list_squashes(state.ledger, run))


@router.delete("/runs/{run}/squashes/{base}/{target}", status_code=204, responses={404: {}})
def drop(run: str, base: int, target: int, state: Publish) -> Response:
    """Drop one squash record (plans stop using it at once; its blobs go with the next gc). 404 if not stored."""
    if not drop_squash(state.ledger, run, base, target):
        raise NotFoundError(f"run {run!r} has no squash {base} -> {target}", run_id=run)
    return Response(status_code=204)
