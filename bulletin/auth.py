"""Bearer-token authorization: scopes ``read``, ``publish``, ``replica`` and ``metrics``,
optionally limited to some runs.

Tokens come from :attr:`BulletinSettings.tokens`. ``publish`` implies ``read`` (a trainer checks
for existing blobs before uploading); ``replica`` (a sidecar: follow the run and report itself,
``PUT .../replicas/{id}``) implies ``read`` but not ``publish``; ``metrics`` (``GET /metrics``,
which names every run) is implied by no other scope. With no tokens configured every request is allowed and the service
warns at start-up.
"""

from __future__ import annotations

import hmac
from typing import Literal

from .errors import ForbiddenError, UnauthorizedError
from .settings import TokenGrant

Scope = Literal["read", "publish", "metrics", "replica"]


class Authorizer:
    """Checks ``Authorization: Bearer <token>`` headers against the configured grants."""

    def __init__(self, tokens: dict[str, TokenGrant]) -> None:
        self._tokens = dict(tokens)

    @property
    def open(self) -> bool:
        """True when no tokens are configured (everything is allowed)."""
        return not self._tokens

    def _grant(self, authorization: str | None) -> TokenGrant:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UnauthorizedError(
                "this bulletin needs 'Authorization: Bearer <token>' (set --token or STITCH_CLIENT_TOKEN)"
            )
        token = token.strip()
        for known, grant in self._tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                return grant
        raise UnauthorizedError("unknown bearer token: check the token configured for this client")

    def check(self, authorization: str | None, scope: Scope, run: str | None = None) -> None:
        """Allow the request or raise.

        Args:
            authorization: the ``Authorization`` header (None if absent).
            scope: what the request needs.
            run: the run it touches (None for cross-run requests such as listing runs).

        Raises:
            UnauthorizedError: no or unknown token (401).
            ForbiddenError: the token lacks ``scope`` or is limited to other runs (403).
        """
        if self.open:
            return
        grant = self._grant(authorization)
        scopes = set(grant.scopes) | ({"read"} if {"publish", "replica"} & set(grant.scopes) else set())
        if scope not in scopes:
            raise ForbiddenError(f"this token has scopes {sorted(scopes)}, the request needs {scope!r}", scope=scope)
        if run is not None and grant.runs is not None and run not in grant.runs:
            raise ForbiddenError(f"this token is not valid for run {run!r}", scope=scope, run_id=run)

    def visible(self, authorization: str | None, run: str) -> bool:
        """Whether the caller may read ``run`` (used to filter run listings)."""
        try:
            self.check(authorization, "read", run)
        except (UnauthorizedError, ForbiddenError):
            return False
        return True
