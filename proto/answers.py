"""Bodies of the bulletin's listing and blob answers: version pages, run lists, blob receipts, upload URLs.

The bulletin's routes declare them as their response models and
:class:`stitchboard.bulletin.client.BulletinClient` parses them, so both sides share one
contract. The version records they carry (:class:`VersionInfo`, :class:`RunInfo`) and the
manifest and plan bodies live in :mod:`stitchboard.proto.schema`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .schema import RunInfo, VersionInfo, _Model


class VersionPage(_Model):
    """A page of committed versions, ascending (``GET /v1/runs/{run}/versions``).

    Attributes:
        run_id: the run.
        versions: the page's versions, ascending.
        next_after: the ``after`` of the next page; ``None`` on the last page.
    """

    run_id: str
    versions: list[VersionInfo]
    next_after: int | None


class RunList(_Model):
    """Runs with their latest version (``GET /v1/runs``), only those the caller's token may read."""

    runs: list[RunInfo]


class BlobStored(_Model):
    """Answer of a blob upload (``PUT /v1/runs/{run}/blobs/{sha256}``).

    Attributes:
        run_id: the run.
        sha256: the blob's lowercase hex sha256 (verified while receiving).
        size_bytes: bytes received.
        created: False when an identical blob was already stored (201 vs 200).
    """

    run_id: str
    sha256: str
    size_bytes: Annotated[int, Field(ge=0)]
    created: bool


class UploadUrl(_Model):
    """Where to upload a blob (``POST /v1/runs/{run}/blobs/{sha256}/upload-url``).

    Attributes:
        url: a presigned URL straight to the object store; ``None``: PUT the blob to the bulletin.
        method: the HTTP method to use with ``url``.
        expires_s: lifetime of ``url``, seconds.
    """

    url: str | None
    method: Literal["PUT"]
    expires_s: int
