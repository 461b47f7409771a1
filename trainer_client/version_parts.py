"""The records one version is built from, per rank, and the rules that combine them.

A publish runs in two steps on every rank of its group (one rank for
:class:`~stitchboard.trainer_client.publisher.Publisher`): encode its part of the view
(:class:`EncodeReport` is what it tells the others), then write and upload its files
(:class:`RankPart`). The committing rank turns the list of :class:`RankPart` into one manifest;
every rank turns it into the same :class:`PublishResult`. All of it is plain data, so it can
be sent between ranks (``torch.distributed`` object collectives pickle it).
"""

from __future__ import annotations

from dataclasses import dataclass

from stitchboard.proto.checkpoint import shard_name
from stitchboard.proto.container import RawTensor
from stitchboard.proto.schema import Encoding, FileRef, TensorSpec, VersionManifest

from .encode_version import BaseTensor
from .publish_result import PublishResult


@dataclass
class PublishedVersion:
    """The last committed version as a publisher keeps it.

    Attributes:
        version: its number.
        view: this rank's tensors of it (the base of the next delta), or None after
            ``resume="anchor"`` (then the next version is an anchor).
        tensors: dtype, shape and checksum of every tensor of the version (all ranks').
        since_anchor: versions since the last anchor (0: this one is an anchor).
        owned: names of the view's tensors that are the publisher's own copies, which a streamed publish
            writes in place after its commit; the others (a view given to ``publish_view``, shared with the
            caller) are copied before the first write (:mod:`.stream`).
    """

    version: int
    view: dict[str, RawTensor] | None
    tensors: dict[str, BaseTensor]
    since_anchor: int
    owned: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ViewPart:
    """One rank's part of a served view, as a publish takes it.

    Attributes:
        tensors: checkpoint name -> tensor, the tensors this rank publishes (all of them with
            one rank), sorted by name.
        names: every tensor name of the whole view (all ranks').
        error: a failure taking this rank's part; raised when the ranks compare their encodings,
            so that every rank fails together.
        owned: the tensors are the publisher's own fresh copies (taken from a model), not the caller's.
    """

    tensors: dict[str, RawTensor]
    names: frozenset[str]
    error: Exception | None = None
    owned: bool = False


@dataclass(frozen=True)
class EncodeReport:
    """What a rank tells the others once it has encoded its part.

    Attributes:
        tensor_set_changed: names, dtypes or shapes differ from the base version.
        shard_groups: its tensor names split into snapshot shards (see
            :func:`~stitchboard.proto.checkpoint.shard_groups`).
        view_bytes: bytes of its tensors.
    """

    tensor_set_changed: bool
    shard_groups: list[list[str]]
    view_bytes: int


@dataclass(frozen=True)
class RankPart:
    """What one rank put into a version: its files (uploaded) and its tensors.

    Attributes:
        encoding: the encoding of its patch (the same on every rank).
        files: its patch (none for version 0), then its snapshot shards (anchors only).
        tensors: the manifest entries of its tensors.
        changed_elements: elements of its tensors whose bits changed.
        changed_tensors: its tensors with at least one changed element.
        uploaded_bytes: bytes it sent to the bulletin (index and assets included on rank 0).
    """

    encoding: Encoding
    files: list[FileRef]
    tensors: list[TensorSpec]
    changed_elements: int
    changed_tensors: int
    uploaded_bytes: int


def needs_snapshot(last: PublishedVersion | None, anchor: bool, tensor_set_changed: bool, snapshot_every: int) -> bool:
    """Whether the next version carries a snapshot: the first of a run, when asked (``anchor``),
    after ``resume="anchor"``, when the tensor set or a dtype/shape changed, or when
    ``snapshot_every`` versions passed since the last one."""
    return last is None or anchor or last.view is None or tensor_set_changed or last.since_anchor + 1 >= snapshot_every


def shard_layout(groups_by_rank: list[list[list[str]]]) -> dict[str, str]:
    """Tensor name -> snapshot shard file name, the shards numbered across ranks in rank order.

    With one rank this is :func:`~stitchboard.proto.checkpoint.plan_shards`.
    """
    groups = [group for rank_groups in groups_by_rank for group in rank_groups]
    return {name: shard_name(i, len(groups)) for i, group in enumerate(groups) for name in group}


def version_result(
    manifest: VersionManifest,
    snapshot: bool,
    parts: list[RankPart],
    *,
    cast_s: float,
    diff_s: float,
    write_s: float,
    upload_s: float,
    commit_s: float,
) -> PublishResult:
    """The :class:`PublishResult` of a committed ``manifest`` built from ``parts`` (``snapshot``:
    the version was meant to carry one; the seconds are this rank's)."""
    return PublishResult(
        version=manifest.version,
        snapshot=snapshot,
        changed_elements=manifest.stats.changed_elements,
        total_elements=manifest.stats.total_elements,
        changed_tensors=sum(p.changed_tensors for p in parts),
        encoded_bytes=manifest.stats.encoded_bytes,
        snapshot_bytes=sum(f.size_bytes for f in manifest.files_of("snapshot")),
        uploaded_bytes=sum(p.uploaded_bytes for p in parts),
        view_bytes=sum(t.size_bytes for t in manifest.tensors),
        cast_s=cast_s,
        diff_s=diff_s,
        write_s=write_s,
        upload_s=upload_s,
        commit_s=commit_s,
    )
