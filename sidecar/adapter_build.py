"""Adapter versions rebuilt in the sidecar (sidecar process, a worker thread of the follower's pool).

An adapter is megabytes, so its versions are decoded here, not in the engine (DESIGN.md, the
decode policy for adapters): a fetched, sha256-checked plan (:class:`~.fetch.FetchedPlan`) is
replayed on raw bits with the codec's own :func:`~stitchboard.proto.decode.read_patch` and
:func:`~stitchboard.proto.apply.apply_to_copy` (each patch checks its base and target checksums
as it applies), starting from the version the sidecar holds in memory (or the plan's snapshot);
then every tensor is checked against the target manifest's xxh3-128 checksums. The result is
written as a PEFT folder (``adapter_model.safetensors`` + ``adapter_config.json`` from
:attr:`~stitchboard.proto.adapter.AdapterSpec.config`) into the memory-backed hand-off folder for
the engine's own LoRA loader; the follower removes the folder once the engine has loaded it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from stitchboard.proto.apply import apply_to_copy
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor, write_safetensors
from stitchboard.proto.decode import read_patch
from stitchboard.proto.schema import XXH3_128, VersionManifest

from .errors import StagingError
from .fetch import FetchedPlan

#: The PEFT folder's file names (what ``PeftModel.from_pretrained`` and vLLM's LoRA loader read).
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"

#: An adapter version's tensors: PEFT name -> raw bits (served dtype, bf16), owned by the sidecar.
AdapterTensors = dict[str, RawTensor]


def _owned(t: RawTensor) -> RawTensor:
    # A copy in the sidecar's memory (a snapshot's tensors map a hand-off file that is removed).
    return RawTensor(t.dtype, tuple(t.shape), np.array(t.bits, copy=True))


def rebuild(plan: FetchedPlan, held: Mapping[int, AdapterTensors]) -> AdapterTensors:
    """The tensors of ``plan.to_version``, rebuilt from ``held[plan.from_version]`` (or the plan's
    snapshot) by applying each step's patches on raw bits, then checked against the target manifest.

    Args:
        plan: a fetched plan (its files sha256-checked and indexed by :class:`~.fetch.Fetcher`).
        held: the versions the sidecar holds in memory (never modified).

    Returns:
        PEFT name -> tensor (copies owned by the caller).

    Raises:
        StagingError: the plan starts from a version not held; a tensor differs from the target
            manifest (its name, dtype, shape or checksum).
        PatchError: a patch does not decode, or its base or target checksums do not match
            (nothing of ``held`` changed).
    """
    view: AdapterTensors
    if plan.from_version is None:
        view = {}
    elif plan.from_version in held:
        view = dict(held[plan.from_version])
    else:
        raise StagingError(f"the plan starts at adapter version {plan.from_version}, which the sidecar does not hold")
    for step in plan.steps:
        if step.kind == "snapshot":
            tensors = load_checkpoint(step.folder)  # the step's folder holds its shards (and index) only
            view = {name: _owned(t) for name, t in tensors.items()}
        else:
            for path in step.paths:
                view = apply_to_copy(view, read_patch(Path(path).read_bytes(), what=str(path)))
    if not plan.steps:
        raise StagingError(f"the plan to adapter version {plan.to_version} has no step")
    check_against(view, plan.steps[-1].manifest)
    return view


def check_against(view: Mapping[str, RawTensor], manifest: VersionManifest) -> None:
    """Check that ``view`` is exactly ``manifest``'s tensors: names, dtypes, shapes, xxh3-128 checksums.

    Raises:
        StagingError: naming the first tensor that differs.
    """
    want = manifest.tensor_map()
    if set(view) != set(want):
        raise StagingError(
            f"adapter version {manifest.version}: tensors differ from the manifest (missing "
            f"{sorted(set(want) - set(view))[:3]}, extra {sorted(set(view) - set(want))[:3]})"
        )
    for name in sorted(want):
        spec, t = want[name], view[name]
        if t.dtype != spec.dtype or list(t.shape) != spec.shape or checksum(t) != spec.checksums[XXH3_128]:
            raise StagingError(
                f"adapter version {manifest.version}: tensor {name!r} differs from the manifest (dtype, shape or "
                "xxh3_128 checksum)"
            )


def checksums_of(manifest: VersionManifest) -> dict[str, str]:
    """PEFT name -> xxh3-128 of ``manifest``'s tensors (what the engine verifies a load against)."""
    return {spec.name: spec.checksums[XXH3_128] for spec in manifest.tensors}


def write_peft_folder(folder: Path, tensors: Mapping[str, RawTensor], config: Mapping[str, object]) -> Path:
    """Write a PEFT adapter folder: ``adapter_model.safetensors`` (``tensors``) and
    ``adapter_config.json`` (``config``, the run's :attr:`AdapterSpec.config`). Replaces ``folder``.

    Raises:
        OSError: the hand-off folder cannot be written (full ``/dev/shm``...).
    """
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    write_safetensors(folder / WEIGHTS_FILE, tensors)
    (folder / CONFIG_FILE).write_text(json.dumps(dict(config), sort_keys=True))
    return folder
