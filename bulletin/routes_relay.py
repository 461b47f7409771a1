"""The route a regional cache (``deploy/relay/``: nginx, or a CDN's edge check) asks before serving a cached object,
and the header by which the bulletin knows a request came through such a relay (bulletin process).

* ``GET /v1/runs/{run}/read-check``: 204 when the request's token may read ``run`` (scope ``read``, or
  ``publish``/``replica`` which imply it, and the token not limited to other runs), else the token rules' own 401 or
  403. It reads no body (cap 0, as every route without one), touches no store, and says ``no-store``: only a
  relay that keys its answer by the caller's token *and* the run keeps it (nginx's ``auth_request`` cache in
  ``deploy/relay/relay.conf.template``, a few seconds), so a cached blob is never served to a caller the bulletin
  would refuse.
* :data:`RELAY_HEADER`: a relay sets it on the requests it forwards; a blob GET carrying it is answered with the
  bytes, never a 307 to a presigned URL (:mod:`.routes_blobs`), since a relay must cache the object, not a
  redirect that expires. A client that fakes the header gains nothing: it passes the same token check and gets
  the same bytes it could read anyway, only from the bulletin instead of the object store.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from .deps import Read
from .ledger import run_key

router = APIRouter(prefix="/v1", tags=["relay"])

#: Set by a relay on every request it forwards (any value): blob GETs are then served, never redirected.
RELAY_HEADER = "x-stitch-relay"


@router.get("/runs/{run}/read-check", status_code=204, responses={401: {}, 403: {}, 422: {}})
def read_check(run: str, state: Read) -> Response:
    """Whether the caller's token may read ``run``: 204 (no body) if so.

    Raises:
        UnauthorizedError: no or unknown token (401).
        ForbiddenError: the token lacks ``read`` or is limited to other runs (403).
        InvalidRequestError: ``run`` is not a valid run id (422).
    """
    run_key(run)
    return Response(status_code=204)
