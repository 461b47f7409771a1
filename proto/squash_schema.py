"""The wire schema of squashes: one patch taking a replica from an older version straight to a newer one.

A squash is a derived object beside a run's versions, never part of one (DESIGN.md invariant 3:
versions stay immutable). The trainer encodes it with the same encoder as its deltas, from its
own view of ``base_version`` to its view of ``target_version``: every tensor entry of the patch
carries the base tensor's checksum (from version ``base_version``) and the target's (version
``target_version``), so it applies only on its exact base and ends verified, like a delta. The
record pins both versions by the sha256 of their manifests (``VersionInfo.manifest_sha256``),
and with them every tensor checksum of the base and of the target view. It can be dropped and
rebuilt at any time; the planner only uses it while both versions are stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from .codec import PatchEntry
from .errors import SchemaError
from .schema import SCHEMA_VERSION, Encoding, FileRef, VersionManifest, _Model, check_run_id

_SHA256 = re.compile(r"[0-9a-f]{64}")

#: Fewest versions a squash spans: one version apart is the version's own delta.
MIN_SQUASH_SPAN = 2


class SquashManifest(_Model):
    """The record of one squash (``PUT /v1/runs/{run}/squashes/{base}/{target}``).

    Attributes:
        schema_version: :data:`~stitchboard.proto.schema.SCHEMA_VERSION` of the writer.
        run_id: the run.
        base_version: the version it applies to.
        target_version: the version it yields (at least ``base_version + 2``).
        encoding: the value encoding of its patch files (``cond``, ``xor`` or ``overwrite``).
        base_manifest_sha256, target_manifest_sha256: sha256 of the two versions' manifests
            (canonical JSON): the bulletin refuses a squash whose versions differ from these.
        files: its patch files (role ``patch``; one per publishing rank), each listed once.
        size_bytes: sum of the files' sizes, bytes.
        changed_elements: elements whose bits differ between the two versions.
    """

    schema_version: int = SCHEMA_VERSION
    run_id: str
    base_version: Annotated[int, Field(ge=0, lt=10**12)]
    target_version: Annotated[int, Field(ge=0, lt=10**12)]
    encoding: Encoding
    base_manifest_sha256: str
    target_manifest_sha256: str
    files: list[FileRef]
    size_bytes: Annotated[int, Field(ge=0)]
    changed_elements: Annotated[int, Field(ge=0)]

    @field_validator("run_id")
    @classmethod
    def _run(cls, v: str) -> str:
        try:
            return check_run_id(v)
        except SchemaError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("base_manifest_sha256", "target_manifest_sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        if not _SHA256.fullmatch(v):
            raise ValueError(f"manifest sha256 {v!r} is not 64 lowercase hex digits")
        return v

    @model_validator(mode="after")
    def _check(self) -> SquashManifest:
        if not 1 <= self.schema_version <= SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {self.schema_version} is not supported (this reader knows 1..{SCHEMA_VERSION}); "
                "upgrade stitchboard"
            )
        if self.target_version - self.base_version < MIN_SQUASH_SPAN:
            raise ValueError(
                f"a squash spans at least {MIN_SQUASH_SPAN} versions: {self.base_version} -> {self.target_version} "
                "is not one (use the version's delta)"
            )
        if not self.files:
            raise ValueError("a squash has at least one patch file")
        if any(f.role != "patch" for f in self.files):
            raise ValueError("a squash's files are patches (role 'patch')")
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("a squash lists a file path more than once; list each file once")
        total = sum(f.size_bytes for f in self.files)
        if total != self.size_bytes:
            raise ValueError(f"size_bytes {self.size_bytes} != {total} (sum of the files' sizes)")
        return self


class SquashList(_Model):
    """The squashes stored for a run (``GET /v1/runs/{run}/squashes``), by target then base version."""

    run_id: str
    squashes: list[SquashManifest]


def check_patch_lineage(
    files: Iterable[tuple[str, Mapping[str, PatchEntry]]], base: VersionManifest, target: VersionManifest
) -> None:
    """Check that patch files take the view of ``base`` to the view of ``target``, by their indexes alone.

    Every listed tensor must be in both versions with the entry's dtype and shape, carry the base
    version's checksum as its base and the target version's as its target (``xxh3_128``, or
    ``xxh3_128_parts`` for a tensor a shard-local publish wrote in parts), and appear in one file
    only; every tensor whose checksum differs between the versions must be listed. Values are not
    decoded (a ``cond`` stream decodes only on its base); the engine checks them on its bits.

    Args:
        files: (file name, its entries by tensor name) per patch file.
        base, target: the two versions' manifests (same tensor set).

    Raises:
        SchemaError: naming the file, tensor and versions that disagree.
    """
    what = f"the squash {base.version} -> {target.version} of run {target.run_id!r}"
    if base.layout() != target.layout():
        raise SchemaError(
            f"{what}: versions {base.version} and {target.version} have different tensor sets: "
            "only an anchor leads across that"
        )
    before, after = base.checksums(), target.checksums()
    specs, base_specs = target.tensor_map(), base.tensor_map()
    touched: set[str] = set()
    for path, entries in files:
        for name, entry in entries.items():
            spec = specs.get(name)
            if spec is None or entry.dtype != spec.dtype or list(entry.shape) != spec.shape:
                raise SchemaError(
                    f"{what}: {path}: tensor {name!r} is not in version {target.version} with that dtype and shape"
                )
            if name in touched:
                raise SchemaError(f"{what}: tensor {name!r} appears in two patch files")
            if entry.base.get(base_specs[name].algorithm) != before[name]:
                raise SchemaError(f"{what}: {path}: tensor {name!r}'s base checksum is not version {base.version}'s")
            if entry.target.get(spec.algorithm) != after[name]:
                raise SchemaError(
                    f"{what}: {path}: tensor {name!r}'s target checksum is not version {target.version}'s"
                )
            touched.add(name)
    moved = sorted(n for n in after if n not in touched and after[n] != before[n])
    if moved:
        raise SchemaError(f"{what}: tensors {moved[:3]} differ between the versions but no patch file lists them")
