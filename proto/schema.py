"""The wire schema: version manifests, plans, version references and error bodies.

Pydantic v2 models with no server or engine imports. A manifest is the client's part of a
version and is byte-identical on a retried publish: it has no timestamps (the bulletin keeps
its commit time beside it, in :class:`VersionInfo`). :func:`canonical_json` gives the bytes
that are hashed and compared. The bulletin's listing and blob answers, which wrap these
records, are in :mod:`.answers`.

Lineage (DESIGN.md, invariant 3): versions of a run are consecutive integers from 0; version 0
is an anchor (``snapshot=True``, no base); version N > 0 has ``base_version == N - 1`` and
carries a delta from it (possibly empty); any version may also carry a full snapshot.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from .adapter_spec import AdapterSpec
from .dtypes import DTYPE_SIZES, MAX_NUMEL, numel_of
from .errors import SchemaError

#: Version of this schema; readers refuse manifests from a newer schema.
SCHEMA_VERSION = 1

#: The value encodings of a delta (see :mod:`stitchboard.proto.codec`).
Encoding = Literal["xor", "overwrite", "cond"]
#: The checksum algorithm every tensor carries; a device-computable fingerprint may sit beside it.
XXH3_128 = "xxh3_128"
#: The checksum of a tensor published in parts by several ranks, in place of ``xxh3_128`` (the name
#: :data:`stitchboard.proto.parts.XXH3_128_PARTS` defines; needs the tensor's ``parts`` layout).
XXH3_128_PARTS = "xxh3_128_parts"

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ALGORITHM = re.compile(r"[a-z0-9_]{1,32}")
_HEX = re.compile(r"[0-9a-f]+")
#: Where :meth:`VersionManifest.layout` keeps what it made (not a field: never validated, dumped or compared).
_LAYOUT_KEY = "_stitch_layout"
#: What :func:`check_name` refuses anywhere in a name: a drive prefix (``C:``), NUL and other control characters.
_BAD_IN_NAME = re.compile(r"^[A-Za-z]:|[\x00-\x1f\x7f]")
#: Hex digits of the digest of each known checksum algorithm; others take 8-128 hex digits.
DIGEST_HEX_DIGITS = {
    XXH3_128: 32,
    XXH3_128_PARTS: 32,
    "xxh3_64": 16,
    "xxh64": 16,
    "xxh32": 8,
    "crc32": 8,
    "crc32c": 8,
    "md5": 32,
    "sha1": 40,
    "sha256": 64,
    "sha512": 128,
    "blake2b": 128,
}
#: The checkpoint's own files in a version folder: an asset must not be named like one of them.
CHECKPOINT_INDEX_NAME = "model.safetensors.index.json"


def check_name(name: str, what: str = "name") -> str:
    """Reject names that could escape a folder or confuse a parser.

    Used for tensor names, file paths and store keys (a store prefix may end with one ``/``).
    Rejects empty names, ``.``, ``..``, empty or ``.`` path segments (``a//b``, ``./a``,
    ``a/.``), absolute paths (``/x``, ``\\x``, ``C:x``), backslashes, NUL and other control
    characters, and names over 1024 characters.

    Raises:
        SchemaError: with the offending name.
    """
    bad = (
        not name
        or ".." in name
        or name.startswith(("/", "\\"))
        or "\\" in name
        or _BAD_IN_NAME.search(name) is not None
        or len(name) > 1024
    )
    if bad or any(part in ("", ".") for part in name.removesuffix("/").split("/")):
        raise SchemaError(
            f"invalid {what} {name!r}: use a relative name without '..', '.' or empty segments, "
            "NUL or control characters"
        )
    return name


def check_path(name: str, what: str = "file path") -> str:
    """:func:`check_name` for a file or tensor name: also refuses a directory-like name (ending in ``/``).

    Raises:
        SchemaError: with the offending name.
    """
    if name.endswith("/"):
        raise SchemaError(f"invalid {what} {name!r}: a directory name; name a file")
    return check_name(name, what)


def check_digest(algorithm: str, digest: str) -> str:
    """Validate one checksum: lowercase hex of exactly the algorithm's length (:data:`DIGEST_HEX_DIGITS`).

    Raises:
        SchemaError: naming the algorithm and digest.
    """
    if not _ALGORITHM.fullmatch(algorithm):
        raise SchemaError(f"bad checksum algorithm {algorithm!r}: use 1-32 of [a-z0-9_]")
    want = DIGEST_HEX_DIGITS.get(algorithm)
    ok = _HEX.fullmatch(digest) is not None and (len(digest) == want if want else 8 <= len(digest) <= 128)
    if not ok:
        size = f"exactly {want}" if want else "8-128"
        raise SchemaError(f"bad checksum {algorithm!r}: {digest!r} (want {size} lowercase hex digits)")
    return digest


def duplicates(names: list[str]) -> list[str]:
    """The names listed more than once, sorted (linear in the list's length)."""
    seen: set[str] = set()
    dup: set[str] = set()
    for n in names:
        if n in seen:
            dup.add(n)
        seen.add(n)
    return sorted(dup)


def is_checkpoint_file(path: str) -> bool:
    """Whether ``path`` is named like a checkpoint file a pulled folder holds (``*.safetensors``, the index json)."""
    base = path.rsplit("/", 1)[-1]
    return base.endswith(".safetensors") or base == CHECKPOINT_INDEX_NAME


def check_run_id(run_id: str) -> str:
    """Validate a run id: 1-128 of ``[A-Za-z0-9._-]``, starting alphanumeric, no ``..``.

    Raises:
        SchemaError: with the offending run id.
    """
    if not _RUN_ID.fullmatch(run_id) or ".." in run_id:
        raise SchemaError(f"invalid run id {run_id!r}: use 1-128 characters of [A-Za-z0-9._-], starting alphanumeric")
    return run_id


def _schema_error(exc: Exception) -> ValueError:
    # pydantic wraps ValueErrors raised in validators into ValidationError; keep the message.
    return ValueError(str(exc))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Model):
    """One tensor of the served view.

    Attributes:
        name: checkpoint (HF) name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        dtype: safetensors dtype name (``BF16``, ``F32``, ``F8_E4M3``, ``U8`` for packed 4-bit...).
        shape: dimensions; ``[]`` is a scalar.
        checksums: algorithm -> lowercase hex digest of this version's raw little-endian
            element bits; has ``xxh3_128``, or ``xxh3_128_parts`` with ``parts`` (a tensor whose
            blocks live on several ranks: no process holds it whole; :mod:`stitchboard.proto.parts`).
        parts: ``[dim, start, stop]`` of each block ``xxh3_128_parts`` is computed over, tiling the
            tensor in order (DESIGN.md, "Parts"); None (left out of the JSON, so older manifests and
            their sha256 are unchanged) for a tensor checked whole.
    """

    name: str
    dtype: str
    shape: list[Annotated[int, Field(ge=0)]]
    checksums: dict[str, str]
    parts: list[tuple[int, int, int]] | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if self.parts is None:
            out.pop("parts", None)
        return out

    @property
    def algorithm(self) -> str:
        """The checksum algorithm this tensor is checked by: ``xxh3_128_parts`` (over :attr:`parts`) for a tensor
        published in parts, else ``xxh3_128``."""
        return XXH3_128 if self.parts is None else XXH3_128_PARTS

    def checksum(self) -> str:
        """The checksum this tensor is checked by (hex digest, in :attr:`algorithm`)."""
        return self.checksums[self.algorithm]

    @model_validator(mode="after")
    def _parts(self) -> TensorSpec:
        if XXH3_128 not in self.checksums and (XXH3_128_PARTS not in self.checksums or self.parts is None):
            raise ValueError(f"checksums must include {XXH3_128!r}, or {XXH3_128_PARTS!r} with the tensor's parts")
        if self.parts is None:
            return self
        rows = self.shape[0] if self.shape else 1
        cols = numel_of(self.shape[1:]) if self.shape else 1
        at = 0
        for dim, start, stop in self.parts:
            if dim != self.parts[0][0] or dim not in (0, 1) or start != at or stop <= start:
                raise ValueError(f"parts {self.parts} must be blocks of one dim (0 or 1) tiling the tensor in order")
            at = stop
        if at != (rows if self.parts[0][0] == 0 else cols):
            raise ValueError(f"parts {self.parts} do not cover the tensor {self.shape}")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        try:
            return check_path(v, "tensor name")
        except SchemaError as exc:
            raise _schema_error(exc) from None

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {v!r}; known: {', '.join(DTYPE_SIZES)}")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int]) -> list[int]:
        if len(v) > 16:
            raise ValueError(f"shape {v} has more than 16 dimensions")
        if numel_of(v) > MAX_NUMEL:
            raise ValueError(f"shape {v} overflows: more than 2**62 elements")
        return v

    @field_validator("checksums")
    @classmethod
    def _checksums(cls, v: dict[str, str]) -> dict[str, str]:
        if XXH3_128 not in v and XXH3_128_PARTS not in v:
            raise ValueError(f"checksums must include {XXH3_128!r} (or {XXH3_128_PARTS!r} with the tensor's parts)")
        for alg, digest in v.items():
            try:
                check_digest(alg, digest)
            except SchemaError as exc:
                raise _schema_error(exc) from None
        return v

    @property
    def numel(self) -> int:
        """Element count."""
        return numel_of(self.shape)

    @property
    def size_bytes(self) -> int:
        """Size of the raw tensor in bytes."""
        return self.numel * DTYPE_SIZES[self.dtype]


class FileRef(_Model):
    """A file a version references, stored by the bulletin under its sha256.

    Attributes:
        path: relative file name (e.g. ``model-00001-of-00002.safetensors``, ``patch-r0.safetensors``).
        sha256: lowercase hex sha256 of the file's bytes.
        size_bytes: file size in bytes.
        role: ``patch`` (a delta from the base version, or a squash's patch: see
            :mod:`.squash_schema`), ``snapshot`` (a shard of a full safetensors checkpoint of
            the served view) or ``asset`` (config, tokenizer...).
    """

    path: str
    sha256: str
    size_bytes: Annotated[int, Field(ge=0)]
    role: Literal["patch", "snapshot", "asset"]

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        try:
            return check_path(v, "file path")
        except SchemaError as exc:
            raise _schema_error(exc) from None

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        if not _SHA256.fullmatch(v):
            raise ValueError(f"sha256 {v!r} is not 64 lowercase hex digits")
        return v


class VersionStats(_Model):
    """Size figures of one version.

    Attributes:
        changed_elements: elements whose bits differ from the base version (0 for version 0).
        total_elements: elements in the served view.
        encoded_bytes: bytes of the patch files (the delta), excluding snapshot and assets.
    """

    changed_elements: Annotated[int, Field(ge=0)]
    total_elements: Annotated[int, Field(ge=0)]
    encoded_bytes: Annotated[int, Field(ge=0)]


class VersionManifest(_Model):
    """The immutable description of one version of a run (the client's part; no timestamps).

    Attributes:
        schema_version: :data:`SCHEMA_VERSION` of the writer.
        run_id: the run, see :func:`check_run_id`.
        version: consecutive integer from 0.
        base_version: ``version - 1``; ``None`` for version 0.
        snapshot: whether ``files`` hold a full snapshot (anchor) of the served view.
        encoding: value encoding of the patch files (``xor``, ``overwrite`` or ``cond``).
        tensors: the whole served view of this version, with target checksums.
        files: patch, snapshot and asset files.
        stats: changed/total elements and encoded bytes.
        metadata: free-form trainer metadata (step, loss, ...), JSON values.
        served: the served-view recipe the tensors are in (``bf16``, ``fp8``, ``fp8-block``,
            ``nvfp4``: see ``stitchboard.trainer_client.recipes``); 1-32 of ``[a-z0-9.-]``.
        adapter: for a version of an adapter run, the LoRA adapter it is (:mod:`.adapter`; its
            tensors are the adapter's under PEFT's saved names); ``None`` (and left out of the
            JSON, so a full run's manifest and its sha256 are as before) for a full run.
    """

    schema_version: int = SCHEMA_VERSION
    run_id: str
    version: Annotated[int, Field(ge=0, lt=2**53)]
    base_version: int | None
    snapshot: bool
    encoding: Encoding = "xor"
    tensors: list[TensorSpec]
    files: list[FileRef]
    stats: VersionStats
    metadata: dict[str, Any] = Field(default_factory=dict)
    served: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,31}$")] = "bf16"
    adapter: AdapterSpec | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if self.adapter is None:
            out.pop("adapter", None)
        return out

    @field_validator("run_id")
    @classmethod
    def _run(cls, v: str) -> str:
        try:
            return check_run_id(v)
        except SchemaError as exc:
            raise _schema_error(exc) from None

    @field_validator("schema_version")
    @classmethod
    def _schema(cls, v: int) -> int:
        if not 1 <= v <= SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {v} is not supported (this reader knows 1..{SCHEMA_VERSION}); upgrade stitchboard"
            )
        return v

    @model_validator(mode="after")
    def _lineage(self) -> VersionManifest:
        if self.version == 0:
            if self.base_version is not None or not self.snapshot:
                raise ValueError("version 0 must be an anchor: base_version null and snapshot true")
        elif self.base_version != self.version - 1:
            raise ValueError(
                f"version {self.version} must have base_version {self.version - 1}, got {self.base_version}"
            )
        dup = duplicates([t.name for t in self.tensors])
        if dup:
            raise ValueError(f"duplicate tensor names: {dup[:5]}")
        dup = duplicates([f.path for f in self.files])
        if dup:
            raise ValueError(f"file paths listed more than once: {dup[:5]}; list each file once")
        roles = {f.role for f in self.files}
        if self.snapshot and "snapshot" not in roles:
            raise ValueError(f"version {self.version} says snapshot=true but has no snapshot file")
        if not self.snapshot and "snapshot" in roles:
            raise ValueError(f"version {self.version} has snapshot files but snapshot=false")
        if self.version == 0 and "patch" in roles:
            raise ValueError("version 0 has no base: it cannot carry patch files")
        total = sum(t.numel for t in self.tensors)
        if self.stats.total_elements != total:
            raise ValueError(f"stats.total_elements {self.stats.total_elements} != {total} (sum over tensors)")
        if self.stats.changed_elements > total:
            raise ValueError("stats.changed_elements exceeds total_elements")
        enc = sum(f.size_bytes for f in self.files if f.role == "patch")
        if self.stats.encoded_bytes != enc:
            raise ValueError(f"stats.encoded_bytes {self.stats.encoded_bytes} != {enc} (sum of patch file sizes)")
        json.dumps(self.metadata)  # must be plain JSON
        return self

    def files_of(self, role: str) -> list[FileRef]:
        """The files of one role, in manifest order."""
        return [f for f in self.files if f.role == role]

    def tensor_map(self) -> dict[str, TensorSpec]:
        """Tensor name -> spec."""
        return {t.name: t for t in self.tensors}

    def checksums(self, algorithm: str | None = None) -> dict[str, str]:
        """Tensor name -> its target checksum (hex digest).

        Args:
            algorithm: None: each tensor's own, the one an engine checks it by (:meth:`TensorSpec.checksum`:
                ``xxh3_128_parts`` over :meth:`layouts` for a tensor published in parts, else ``xxh3_128``); a
                name: that algorithm's, KeyError if a tensor lacks it.
        """
        if algorithm is not None:
            return {t.name: t.checksums[algorithm] for t in self.tensors}
        return {t.name: t.checksum() for t in self.tensors}

    def layouts(self) -> dict[str, tuple[tuple[int, int, int], ...]]:
        """Tensor name -> its part layout ``((dim, start, stop), ...)``, for the tensors published in parts only:
        the layout :meth:`checksums` (``algorithm`` None) of those tensors is computed over."""
        return {t.name: tuple(t.parts) for t in self.tensors if t.parts is not None}

    def layout(self) -> frozenset[tuple[str, str, tuple[int, ...]]]:
        """The tensor set as (name, dtype, shape) triples: a delta can only connect equal layouts.

        Made once per manifest (the bulletin's planner compares it for every version back to the anchor, per plan)
        and kept in the instance's ``__dict__`` beside the tensor list it was made of: pydantic compares models by
        their fields there, and a ``model_copy`` that replaces the tensors gets a new list, so it is made again."""
        made = self.__dict__.get(_LAYOUT_KEY)
        if made is None or made[0] is not self.tensors:
            made = (self.tensors, frozenset((t.name, t.dtype, tuple(t.shape)) for t in self.tensors))
            self.__dict__[_LAYOUT_KEY] = made
        return made[1]


class VersionInfo(_Model):
    """What the bulletin knows of a committed version, beside its manifest.

    Attributes:
        run_id, version, snapshot: as in the manifest.
        manifest_sha256: sha256 of the manifest's canonical JSON.
        committed_at: RFC 3339 time the bulletin committed it (outside the hashed content).
        size_bytes: bytes of the delta files (``encoded_bytes``).
        snapshot_bytes: bytes of the snapshot files (0 for a plain delta).
    """

    run_id: str
    version: int
    snapshot: bool
    manifest_sha256: str
    committed_at: str | None = None
    size_bytes: int = 0
    snapshot_bytes: int = 0


class RunInfo(_Model):
    """A run and its latest committed version (``None`` while nothing is published)."""

    run_id: str
    latest_version: int | None


class PlanStep(_Model):
    """One step of a plan: load a snapshot, apply one version's delta, or apply a squash.

    Attributes:
        version: the version this step brings the holder to.
        kind: ``snapshot`` (load the full view from ``files``), ``delta`` (apply ``files``, from
            ``version - 1``) or ``squash`` (apply ``files``, one patch from ``base_version``
            straight to ``version``; only in plans asked for with ``squash=true``, so a client
            that does not know the kind never receives it).
        files: files to fetch for this step (may be empty for an empty delta).
        size_bytes: sum of the files' sizes.
        base_version: the version a ``squash`` applies to; ``None`` (and left out of the JSON,
            which older readers refuse as an unknown field) for the other kinds.
    """

    version: int
    kind: Literal["snapshot", "delta", "squash"]
    files: list[FileRef]
    size_bytes: int
    base_version: int | None = None

    @model_validator(mode="after")
    def _base(self) -> PlanStep:
        if (self.kind == "squash") != (self.base_version is not None):
            raise ValueError("a squash step names its base_version; other steps do not")
        if self.base_version is not None and not 0 <= self.base_version < self.version - 1:
            raise ValueError(
                f"squash to version {self.version} from base {self.base_version}: "
                "the base must be at least two versions older"
            )
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if self.base_version is None:
            out.pop("base_version", None)
        return out

    @property
    def from_version(self) -> int | None:
        """The version this step applies to (``None`` for a snapshot)."""
        if self.kind == "snapshot":
            return None
        return self.base_version if self.base_version is not None else self.version - 1


class Plan(_Model):
    """Ordered steps taking a holder of ``from_version`` (``None``: nothing) to ``to_version``."""

    run_id: str
    from_version: int | None
    to_version: int
    steps: list[PlanStep]
    total_bytes: int


class ErrorBody(BaseModel):
    """The JSON body of every error answer: ``{"type": ..., "message": ..., <details>}``."""

    model_config = ConfigDict(extra="allow")

    type: str
    message: str


def check_publishable(manifest: VersionManifest) -> VersionManifest:
    """The checks a new version must pass beyond the schema, which versions committed before them
    need not (they stay readable; readers such as ``stitchboard pull`` check what concerns them).

    Refuses an asset named like a checkpoint file (``*.safetensors``, the index json): in a pulled
    folder it would stand in for the weights.

    Raises:
        SchemaError: naming the offending paths.
    """
    shadows = [f.path for f in manifest.files if f.role == "asset" and is_checkpoint_file(f.path)]
    if shadows:
        raise SchemaError(
            f"version {manifest.version} of run {manifest.run_id!r}: asset paths {shadows[:5]} are named like "
            f"checkpoint files (*.safetensors, {CHECKPOINT_INDEX_NAME}); rename the assets"
        )
    return manifest


def canonical_json(model: BaseModel) -> bytes:
    """Canonical bytes of a model: sorted keys, no spaces, UTF-8. Equal content -> equal bytes."""
    return json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def parse_manifest(data: bytes | str | dict[str, Any]) -> VersionManifest:
    """Parse and validate a manifest from JSON bytes/text or a dict.

    Raises:
        SchemaError: the input is not valid JSON or breaks the schema; the message lists each
            offending field.
    """
    try:
        if isinstance(data, dict):
            return VersionManifest.model_validate(data)
        return VersionManifest.model_validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'manifest'}: {e['msg']}" for e in exc.errors()[:10])
        raise SchemaError(f"invalid manifest: {problems}") from None
