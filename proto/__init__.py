"""stitchboard.proto: the wire contracts and the bit-exact patch codec (no server or engine imports).

The names below are the ones most callers need. Every module, with what it holds and the process it
runs in, is listed in DESIGN.md's map ("Packages and modules"), the one list of them.
"""

from .answers import BlobStored, RunList, UploadUrl, VersionPage
from .errors import (
    BaseMismatchError,
    PatchError,
    PatchFormatError,
    SchemaError,
    StitchError,
    TargetMismatchError,
    TensorSetMismatchError,
    wire_types,
)
from .schema import (
    SCHEMA_VERSION,
    ErrorBody,
    FileRef,
    Plan,
    PlanStep,
    RunInfo,
    TensorSpec,
    VersionInfo,
    VersionManifest,
    VersionStats,
    canonical_json,
    check_name,
    check_run_id,
    parse_manifest,
)

__all__ = [
    "SCHEMA_VERSION",
    "BaseMismatchError",
    "BlobStored",
    "ErrorBody",
    "FileRef",
    "PatchError",
    "PatchFormatError",
    "Plan",
    "PlanStep",
    "RunInfo",
    "RunList",
    "SchemaError",
    "StitchError",
    "TargetMismatchError",
    "TensorSetMismatchError",
    "TensorSpec",
    "UploadUrl",
    "VersionInfo",
    "VersionManifest",
    "VersionPage",
    "VersionStats",
    "canonical_json",
    "check_name",
    "check_run_id",
    "parse_manifest",
    "wire_types",
]
