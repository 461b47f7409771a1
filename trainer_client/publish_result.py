"""What one publish did (:class:`PublishResult`), as :class:`~.publisher.Publisher` and
:class:`~.sharded.ShardedPublisher` return and log it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("stitchboard.trainer_client")


@dataclass(frozen=True)
class PublishResult:
    """What one publish did.

    Attributes:
        version: the committed version number.
        snapshot: whether it carries a full snapshot (an anchor).
        changed_elements, total_elements: elements whose bits changed / elements of the view.
        changed_tensors: tensors with at least one changed element.
        encoded_bytes: bytes of the patch file(s), the delta.
        snapshot_bytes: bytes of the snapshot shards (0 for a plain delta).
        uploaded_bytes: bytes sent to the bulletin (files it already had are skipped).
        view_bytes: bytes of the whole served view (what a full copy would cost).
        cast_s: seconds taking the served-view snapshot (on the caller's thread).
        diff_s: seconds diffing and encoding (xxh3 checksums, change detection, zstd).
        write_s: seconds writing snapshot shards to the work folder.
        upload_s: seconds uploading files.
        commit_s: seconds committing the manifest.
    """

    version: int
    snapshot: bool
    changed_elements: int
    total_elements: int
    changed_tensors: int
    encoded_bytes: int
    snapshot_bytes: int
    uploaded_bytes: int
    view_bytes: int
    cast_s: float
    diff_s: float
    write_s: float
    upload_s: float
    commit_s: float

    @property
    def changed_fraction(self) -> float:
        """changed_elements / total_elements (0.0 for an empty view)."""
        return self.changed_elements / self.total_elements if self.total_elements else 0.0


def log_result(run: str, r: PublishResult) -> None:
    """Log one publish at INFO: changed %, bytes, seconds per stage."""
    log.info(
        "run %s: published version %d%s: %.3f %% changed (%d of %d elements, %d tensors), "
        "patch %d bytes (%.3f %% of the %d-byte view)%s, "
        "uploaded %d bytes; cast %.2f s, diff+encode %.2f s, write %.2f s, upload %.2f s, commit %.2f s",
        run,
        r.version,
        " (anchor)" if r.snapshot else "",
        100 * r.changed_fraction,
        r.changed_elements,
        r.total_elements,
        r.changed_tensors,
        r.encoded_bytes,
        100 * r.encoded_bytes / max(r.view_bytes, 1),
        r.view_bytes,
        f", snapshot {r.snapshot_bytes} bytes" if r.snapshot else "",
        r.uploaded_bytes,
        r.cast_s,
        r.diff_s,
        r.write_s,
        r.upload_s,
        r.commit_s,
    )
