"""Uploads of a version's files to the bulletin, by sha256 (files it already has are skipped)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.schema import FileRef

from .errors import PublishError


def upload_files(client: BulletinClient, run: str, items: list[tuple[FileRef, bytes | Path]]) -> int:
    """Upload files (bytes or paths) by sha256, skipping those the bulletin has; returns bytes sent."""
    return sum(ref.size_bytes * client.put_blob(run, ref.sha256, source, ref.size_bytes) for ref, source in items)


def upload_assets(client: BulletinClient, run: str, refs: list[FileRef], data: Mapping[str, bytes]) -> int:
    """Make sure every run asset is stored: upload those given in ``data``, check the others.

    Returns:
        Bytes sent.

    Raises:
        PublishError: an asset not in ``data`` is missing from the bulletin.
    """
    sent = upload_files(client, run, [(ref, data[ref.path]) for ref in refs if ref.path in data])
    for ref in refs:
        if ref.path not in data and client.has_blob(run, ref.sha256) != ref.size_bytes:
            raise PublishError(
                f"run asset {ref.path} ({ref.sha256}) is gone from the bulletin; pass assets= to upload it again"
            )
    return sent
