"""Building one version's content: the patch of a set of tensors, snapshot shards, the manifest.

Pure functions over :class:`RawTensor` views, shared by the single-process
:class:`~stitchboard.trainer_client.publisher.Publisher` and the per-rank
:class:`~stitchboard.trainer_client.sharded.ShardedPublisher` (each rank encodes its own part).
Everything here is deterministic: equal inputs give byte-identical files and manifests, so a
retried publish is the same version with the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from stitchboard.proto.checkpoint import TensorLayout
from stitchboard.proto.codec import EncodedTensor, build_patch, checksum, encode_tensor
from stitchboard.proto.container import RawTensor
from stitchboard.proto.diff import diff_views
from stitchboard.proto.schema import XXH3_128, Encoding, FileRef, TensorSpec, VersionManifest, VersionStats
from stitchboard.proto.threads import thread_map

from .link import PART_BYTES

#: The role of a file in a manifest (see :class:`~stitchboard.proto.schema.FileRef`).
FileRole = Literal["patch", "snapshot", "asset"]


@dataclass(frozen=True)
class BaseTensor:
    """What is known of a base tensor without its bits: dtype, shape and xxh3-128 checksum."""

    dtype: str
    shape: tuple[int, ...]
    checksum: str


@dataclass(frozen=True)
class EncodedPart:
    """The delta of a set of tensors from their base.

    Attributes:
        patch: the patch file's bytes (possibly with no tensor in it), or ``None`` for version 0.
        encoding: the patch's encoding.
        checksums: name -> xxh3-128 of every target tensor of the part.
        changed_elements: elements whose bits differ from the base.
        total_elements: elements of the part.
        changed_tensors: names of tensors with at least one changed element.
        tensor_set_changed: names, dtypes or shapes differ from the base; the patch covers only
            the tensors present in both with the same dtype and shape.
    """

    patch: bytes | None
    encoding: Encoding
    checksums: dict[str, str]
    changed_elements: int
    total_elements: int
    changed_tensors: list[str]
    tensor_set_changed: bool


def checksums_of(view: Mapping[str, RawTensor]) -> dict[str, str]:
    """name -> xxh3-128 hex digest of every tensor (hashed in a thread pool)."""
    names = sorted(view)
    return dict(zip(names, thread_map(lambda n: checksum(view[n]), names), strict=True))


def encode_part(
    view: Mapping[str, RawTensor],
    base: Mapping[str, BaseTensor] | None,
    base_view: Mapping[str, RawTensor] | None,
    encoding: Encoding,
    metadata: Mapping[str, str],
    part_bytes: int | None = PART_BYTES,
) -> EncodedPart:
    """Encode the delta taking ``base`` to ``view``.

    Args:
        view: the target tensors.
        base: what is known of the base tensors (``None``: no base, version 0).
        base_view: the base tensors' bits, if kept. Without them (a publisher resumed with
            ``resume="anchor"``) every tensor whose checksum differs from the base is sent whole
            as an ``overwrite`` delta that applies on the base named by its checksum.
        encoding: ``cond``, ``xor`` or ``overwrite`` (when ``base_view`` is given).
        metadata: patch ``__metadata__`` strings (run, versions).
        part_bytes: tensors larger than this are coded in row parts of about this size (:mod:`.link`);
            None: one stream per tensor.
    """
    total = sum(t.numel for t in view.values())
    if base is None:
        return EncodedPart(None, encoding, checksums_of(view), 0, total, [], False)
    common = sorted(
        n for n in view if n in base and (base[n].dtype, tuple(base[n].shape)) == (view[n].dtype, tuple(view[n].shape))
    )
    changed_set = len(common) != len(view) or len(common) != len(base)
    rest = {n: view[n] for n in view if n not in set(common)}
    sums = checksums_of(rest)
    if base_view is not None:
        diff = diff_views(
            {n: base_view[n] for n in common},
            {n: view[n] for n in common},
            encoding,
            base_checksums={n: base[n].checksum for n in common},
            metadata=metadata,
            part_bytes=part_bytes,
        )
        sums.update(diff.target_checksums)
        return EncodedPart(
            diff.patch,
            encoding,
            dict(sorted(sums.items())),
            diff.changed_elements,
            total,
            diff.changed_tensors,
            changed_set,
        )
    sums.update(checksums_of({n: view[n] for n in common}))

    def whole(name: str) -> EncodedTensor | None:
        t = view[name]
        if sums[name] == base[name].checksum:
            return None
        flipped = RawTensor(t.dtype, t.shape, np.invert(t.bits))  # differs from t everywhere
        return encode_tensor(
            name, flipped, t, "overwrite", base_checksum=base[name].checksum, target_checksum=sums[name]
        )

    encoded = [e for e in thread_map(whole, common) if e is not None]
    return EncodedPart(
        build_patch(encoded, "overwrite", metadata),
        "overwrite",
        dict(sorted(sums.items())),
        sum(e.entry.count for e in encoded),
        total,
        sorted(e.entry.name for e in encoded),
        changed_set,
    )


def sha256_file(path: Path) -> str:
    """Lowercase hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_ref(path: Path, role: FileRole, name: str | None = None) -> FileRef:
    """The manifest entry of a file on disk (sha256 and size measured)."""
    return FileRef(path=name or path.name, sha256=sha256_file(path), size_bytes=path.stat().st_size, role=role)


def bytes_ref(name: str, data: bytes, role: FileRole) -> FileRef:
    """The manifest entry of in-memory file bytes."""
    return FileRef(path=name, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), role=role)


def tensor_specs(view: Mapping[str, TensorLayout], checksums: Mapping[str, str]) -> list[TensorSpec]:
    """The manifest's tensor list, sorted by name."""
    return [
        TensorSpec(name=n, dtype=view[n].dtype, shape=list(view[n].shape), checksums={XXH3_128: checksums[n]})
        for n in sorted(view)
    ]


def build_manifest(
    run: str,
    version: int,
    *,
    tensors: list[TensorSpec],
    patches: list[FileRef],
    snapshots: list[FileRef],
    assets: list[FileRef],
    encoding: Encoding,
    changed_elements: int,
    metadata: Mapping[str, object],
) -> VersionManifest:
    """Assemble and validate a version manifest (see DESIGN.md and proto/schema.py).

    Raises:
        pydantic.ValidationError: the pieces break the schema (a bug in the caller).
    """
    snapshot = bool(snapshots)
    return VersionManifest(
        run_id=run,
        version=version,
        base_version=None if version == 0 else version - 1,
        snapshot=snapshot,
        encoding=encoding,
        tensors=sorted(tensors, key=lambda t: t.name),
        files=patches + snapshots + (assets if snapshot else []),
        stats=VersionStats(
            changed_elements=changed_elements,
            total_elements=sum(t.numel for t in tensors),
            encoded_bytes=sum(f.size_bytes for f in patches),
        ),
        metadata=dict(metadata),
    )


def version_metadata(step: int | None, tensor_set_changed: bool, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The manifest's free-form trainer metadata: ``extra``, the trainer ``step``, and
    ``tensor_set_changed`` when the tensor set or a dtype/shape changed since the base."""
    meta: dict[str, Any] = dict(extra or {})
    if step is not None:
        meta["step"] = int(step)
    if tensor_set_changed:
        meta["tensor_set_changed"] = True
    return meta
