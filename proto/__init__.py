"""stitchboard.proto: the wire contracts and the bit-exact patch codec (no server or engine imports).

Module tree (module -> what it holds -> which process uses it)::

    proto/
    ├── schema.py       VersionManifest (TensorSpec, FileRef, VersionStats), VersionInfo,     every process
    │                   RunInfo, Plan/PlanStep, ErrorBody; name checks, canonical_json
    ├── answers.py      bulletin answer bodies: VersionPage, RunList, BlobStored, UploadUrl   bulletin and its client
    ├── sidecar_wire.py the sidecar's headers, stamps, states and SidecarStatus              sidecar and its clients
    ├── errors.py       StitchError (root of every tree; body()), wire_types, codec errors     every process
    ├── dtypes.py       safetensors dtype names and element sizes                            trainer, codec
    ├── container.py    RawTensor; strict safetensors read/write                             trainer, sidecar/vLLM worker
    ├── codec.py        the patch format and encoder (positions + replacement/XOR bits)      trainer, sidecar/vLLM worker
    ├── _bitdiff.c      the change-detection and position kernels (C extension)              codec
    ├── decode.py       reading and validating patch files before any write                  sidecar/vLLM worker, trainer
    ├── apply.py        apply a patch: validate, write, verify or undo                       trainer (checks), `patch apply`
    ├── diff.py         diff whole views in a thread pool                                    trainer
    ├── checkpoint.py   HF-style (sharded) safetensors checkpoints: anchors                  trainer, sidecar
    ├── cli.py          the `stitchboard` command (subcommands from entry points)            every CLI
    ├── env.py          renamed env variables: RENAMED_ENV, env_setting                      every process
    └── patch_cli.py    `stitchboard patch diff|apply|inspect`                               people debugging weights

Inside the package imports point one way: the codec modules import schema, dtypes and
errors; schema imports dtypes and errors; answers imports schema; sidecar_wire and env import
nothing of the package.
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
