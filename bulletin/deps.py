"""What the routes share: the per-app :class:`BulletinState` and the bearer-token access checks.

:func:`stitchboard.bulletin.app.create_app` builds the state and stores it on the app; the
routes (:mod:`.routes_versions`, :mod:`.routes_blobs`) take it through the :data:`Read` and
:data:`Publish` dependencies, which check the token first. Nothing here imports the app or
the routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .auth import Authorizer, Scope
from .fleet_watch import FleetWatcher
from .ledger import Ledger
from .longpoll import Watcher
from .metrics import BulletinMetrics
from .settings import BulletinSettings
from .stores import Store

#: Declares the bearer scheme in the OpenAPI document; the check itself is :class:`Authorizer`'s.
bearer = HTTPBearer(auto_error=False, description="Token with scope read, publish or replica (STITCH_BULLETIN_TOKENS).")


@dataclass
class BulletinState:
    """What the routes share: settings, store, ledger, long-poll watcher, auth, metrics,
    the upload folder and the fleet's records."""

    settings: BulletinSettings
    store: Store
    ledger: Ledger
    watcher: Watcher
    auth: Authorizer
    metrics: BulletinMetrics
    upload_dir: Path
    fleet: FleetWatcher


def state_of(request: Request) -> BulletinState:
    """The :class:`BulletinState` of the app serving ``request``."""
    state: BulletinState = request.app.state.bulletin
    return state


def access(scope: Scope) -> Callable[..., Awaitable[BulletinState]]:
    """A route dependency: check the request's bearer token for ``scope`` on the path's run, then give the state.

    The dependency raises :class:`UnauthorizedError` (no or unknown token, 401) or
    :class:`ForbiddenError` (token lacks ``scope`` or is limited to other runs, 403).
    """

    async def dependency(
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
    ) -> BulletinState:
        state = state_of(request)
        state.auth.check(request.headers.get("authorization"), scope, request.path_params.get("run"))
        return state

    return dependency


#: Route parameter types: the state, after checking the token for ``read`` / ``publish`` on the path's run.
Read = Annotated[BulletinState, Depends(access("read"))]
Publish = Annotated[BulletinState, Depends(access("publish"))]
#: The state, after checking the token for ``replica`` (a sidecar reporting itself) on the path's run.
Replica = Annotated[BulletinState, Depends(access("replica"))]
