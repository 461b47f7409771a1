"""The exception tree of the bulletin, shared by the service and its HTTP client.

Each class carries the HTTP status the service answers with and the wire ``type`` of the JSON
error body (``{"type": ..., "message": ..., <details>}`` from :meth:`StitchError.body`, see
:class:`stitchboard.proto.schema.ErrorBody`). The client maps an error body back to the same
class with :func:`error_from_body`, so callers catch one tree whether they talk to the
service or use the store directly::

    BulletinError
    ├── NotFoundError            404  run, version or blob does not exist
    ├── ConflictError            409  store state forbids the request
    │   ├── VersionConflictError      same version published before with different bytes
    │   ├── VersionRewindError        version is not after the run's latest
    │   ├── BaseMissingError          base version (version - 1) is not committed
    │   └── AdapterMismatchError      the adapter differs from the base version's (adapter runs)
    ├── InvalidRequestError      400/422  bad input; nothing was written
    │   ├── BlobMissingError          manifest references a blob that was never uploaded
    │   ├── BlobMismatchError         blob bytes/size disagree with the stated sha256/size
    │   ├── TooManyReplicasError      a new replica's report past the run's live-replica cap
    │   └── PayloadTooLargeError 413  body over the configured limit
    ├── AuthError                401/403
    │   ├── UnauthorizedError    401  no or unknown bearer token
    │   └── ForbiddenError       403  token lacks the scope for this run
    ├── UnavailableError         503  store or service unreachable (after the client's retries)
    ├── RequestTimeoutError      408  a request body arrived too slowly; nothing was stored
    └── MisdirectedAnswerError   502  (client side) an answer is for another run or version than asked
"""

from __future__ import annotations

from typing import Any

from stitchboard.proto.errors import SchemaError, StitchError, wire_types


class BulletinError(StitchError):
    """Root of bulletin errors (service side and client side)."""

    type = "BulletinError"
    status = 500

    def __init__(self, message: str, *, status: int | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        if status is not None:
            self.status = status


class NotFoundError(BulletinError):
    """The run, version or blob does not exist (or was removed by retention)."""

    type = "NotFound"
    status = 404


class ConflictError(BulletinError):
    """The request conflicts with what the store already holds; retrying it unchanged will not help."""

    type = "Conflict"
    status = 409


class VersionConflictError(ConflictError):
    """The version was already published with different bytes. Versions are immutable: publish the next one."""

    type = "VersionConflict"


class VersionRewindError(ConflictError):
    """The version is not after the run's latest one. Versions only move forward; a new run starts from an anchor."""

    type = "VersionRewind"


class BaseMissingError(ConflictError):
    """The manifest's base version (``version - 1``) is not committed yet: publish it first."""

    type = "BaseMissing"


class AdapterMismatchError(ConflictError):
    """The version's adapter (``VersionManifest.adapter``) differs from its base version's in a field every version
    of an adapter run keeps (``stitchboard.proto.adapter.spec_mismatch``; ``adapter`` when one is a full run's).
    Details: ``field``, ``base_value``, ``value``. Publish that adapter to a new run."""

    type = "AdapterMismatch"


class InvalidRequestError(BulletinError):
    """Bad input (schema, names, sizes, JSON). Nothing was written; fix the request."""

    type = "InvalidRequest"
    status = 422


class BlobMissingError(InvalidRequestError):
    """A manifest references a blob that is not in the store: upload it (PUT .../blobs/{sha256}) first."""

    type = "BlobMissing"


class BlobMismatchError(InvalidRequestError):
    """Received bytes (or a stored blob) disagree with the stated sha256 or size."""

    type = "BlobMismatch"


class TooManyReplicasError(InvalidRequestError):
    """A new replica reported while its run already has ``max_live_replicas`` live ones (live replicas
    renewing are never refused; expired ones do not count). Details: ``run_id``, ``replica_id``,
    ``setting`` (the setting's environment variable) and ``limit``. Wait for replicas to expire,
    or raise the setting."""

    type = "TooManyReplicas"


class PayloadTooLargeError(InvalidRequestError):
    """The body is over its route's cap (``docs/reference/limits.md``: blobs ``max_blob_bytes``, manifests
    and squash records ``max_manifest_bytes``, replica reports ``max_report_bytes``, the login form
    ``max_login_bytes``; a route that takes no body refuses any), or a blob's stated ``size_bytes`` is.
    Refused before the body is read further and before the token is checked; the connection is
    closed. Details: ``limit_bytes``, ``setting`` (the setting's environment variable), ``run_id``."""

    type = "PayloadTooLarge"
    status = 413


class AuthError(BulletinError):
    """Authentication or authorization failed."""

    type = "AuthError"
    status = 401


class UnauthorizedError(AuthError):
    """No bearer token, or one the bulletin does not know."""

    type = "Unauthorized"
    status = 401


class ForbiddenError(AuthError):
    """The token is valid but lacks the scope (``read``/``publish``) for this run."""

    type = "Forbidden"
    status = 403


class UnavailableError(BulletinError):
    """The object store or the bulletin could not be reached (the client gives up after its retries)."""

    type = "Unavailable"
    status = 503


class RequestTimeoutError(BulletinError):
    """A request body arrived too slowly (idle longer than ``upload_idle_timeout_s``,
    or under ``upload_min_bytes_per_s``); nothing was stored. Send it again."""

    type = "RequestTimeout"
    status = 408


class MisdirectedAnswerError(BulletinError):
    """Raised by the client, never answered by a bulletin: an answer names another run or version
    than the one asked for (a manifest, plan, squash record, latest or long-poll answer, version
    list or fleet answer), as a blob whose bytes hash to another sha256 is refused. The bulletin
    URL, or a proxy or ingress in front of it, routes to another run or store; nothing of the
    answer was used. Details: ``run_id`` and ``version`` (asked), ``answer_run_id`` and
    ``answer_version`` (received)."""

    type = "MisdirectedAnswer"
    status = 502


#: Wire type -> class, derived from the tree (a schema error in a body reads as bad input).
_BY_TYPE: dict[str, type[BulletinError]] = {**wire_types(BulletinError), SchemaError.type: InvalidRequestError}

_BY_STATUS: dict[int, type[BulletinError]] = {
    401: UnauthorizedError,
    403: ForbiddenError,
    404: NotFoundError,
    408: RequestTimeoutError,
    409: ConflictError,
    413: PayloadTooLargeError,
    503: UnavailableError,
}


def error_from_body(status: int, body: Any) -> BulletinError:
    """Rebuild the exception for an error answer.

    Args:
        status: HTTP status code of the answer.
        body: the decoded JSON body (or anything else, e.g. text from a proxy).

    Returns:
        An instance of the class named by ``body["type"]``; when the type is unknown, the
        class for the status (any other 4xx -> :class:`InvalidRequestError`, 5xx ->
        :class:`UnavailableError`). The wire type and status are kept on the instance.
    """
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        wire_type = str(body.get("type", ""))
        message = body["message"]
        details = {k: v for k, v in body.items() if k not in ("type", "message", "status")}
    else:
        wire_type, message, details = "", f"HTTP {status}: {str(body)[:500]}", {}
    cls = (
        _BY_TYPE.get(wire_type) or _BY_STATUS.get(status) or (InvalidRequestError if status < 500 else UnavailableError)
    )
    exc = cls(message, status=status, **details)
    if wire_type:
        exc.type = wire_type
    return exc
