"""A version of an adapter run written as a PEFT adapter folder (issue #31): what ``stitchboard pull`` writes for it.

The folder holds ``adapter_model.safetensors`` (the version's tensors under PEFT's saved names, in the served
dtype, with PEFT's ``{"format": "pt"}`` header metadata) and ``adapter_config.json`` (the run's
:class:`~stitchboard.proto.adapter.AdapterSpec` ``config``, as PEFT's ``save_pretrained`` writes it), plus the
run's asset files if it has any: ``PeftModel.from_pretrained(base, folder)`` and vLLM's ``--lora-modules
name=folder`` (or ``/v1/load_lora_adapter``) load it unchanged. What is written is read back and verified against
the manifest (every tensor's xxh3-128, the config's JSON) before the call returns. Runs in the trainer or CLI process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.adapter import spec_json
from stitchboard.proto.checkpoint import load_checkpoint, save_checkpoint
from stitchboard.proto.container import write_safetensors
from stitchboard.proto.schema import is_checkpoint_file

from .errors import AdapterRefusedError, ResumeError
from .resume import RebuiltVersion, download_assets, empty_folder, rebuild_version, verify_pulled, verify_view

#: The PEFT folder's files (PEFT's ``SAFETENSORS_WEIGHTS_NAME`` and ``CONFIG_NAME``).
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"


def write_adapter_folder(rebuilt: RebuiltVersion, out: str | os.PathLike[str]) -> None:
    """Write a rebuilt (verified) version of an adapter run into the folder ``out`` (created; assets are the
    caller's), then read it back and verify it.

    Raises:
        AdapterRefusedError: the version is a full run's (``details["field"]`` is ``adapter``); nothing is written.
        ResumeError: what was written differs from the manifest (tensors, or the config's JSON).
    """
    manifest, spec = rebuilt.manifest, rebuilt.manifest.adapter
    if spec is None:
        raise AdapterRefusedError(
            f"version {manifest.version} of run {manifest.run_id!r} is a full run's, not an adapter: "
            "pull it as a checkpoint (stitchboard pull writes one for a full run)",
            field="adapter",
            value="full",
        )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / ADAPTER_WEIGHTS_NAME, rebuilt.view, metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG_NAME).write_bytes(spec_json(spec))
    verify_view(manifest, load_checkpoint(folder / ADAPTER_WEIGHTS_NAME))
    if json.loads((folder / ADAPTER_CONFIG_NAME).read_bytes()) != spec.config:
        raise ResumeError(
            f"{folder / ADAPTER_CONFIG_NAME} does not hold the adapter config of version {manifest.version} "
            f"of run {manifest.run_id!r}",
            files=[ADAPTER_CONFIG_NAME],
        )


def _reserved(path: str) -> bool:
    """Whether an asset path is named like a file an adapter folder holds itself (or a checkpoint file)."""
    return is_checkpoint_file(path) or path.rsplit("/", 1)[-1] in (ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME)


def pull_folder(
    client: BulletinClient,
    run: str,
    out: str | os.PathLike[str],
    version: int | None = None,
    *,
    require_adapter: bool = False,
) -> RebuiltVersion:
    """Pull ``version`` (None: the latest) of ``run`` into the folder ``out`` (must not exist or be empty), verified:
    a PEFT adapter folder for an adapter run's version (:func:`write_adapter_folder`), else a plain checkpoint
    folder (:func:`~stitchboard.trainer_client.resume.pull_version`). What ``stitchboard pull`` does.

    Args:
        require_adapter: refuse a full run's version (``stitchboard pull --adapter``).

    Raises:
        AdapterRefusedError: ``require_adapter`` and the version is a full run's; nothing is written.
        FileExistsError, ResumeError, BulletinError, PatchError: as :func:`~.resume.pull_version`.
    """
    folder = empty_folder(out)
    rebuilt = rebuild_version(client, run, version, workdir=folder.parent if folder.parent.exists() else None)
    if rebuilt.manifest.adapter is None and not require_adapter:
        download_assets(client, rebuilt, folder, is_checkpoint_file)
        save_checkpoint(folder, rebuilt.view)
        verify_pulled(rebuilt, folder)
        return rebuilt
    if rebuilt.manifest.adapter is not None:
        download_assets(client, rebuilt, folder, _reserved)
    write_adapter_folder(rebuilt, folder)
    return rebuilt


def pull_adapter(
    client: BulletinClient, run: str, out: str | os.PathLike[str], version: int | None = None
) -> RebuiltVersion:
    """Pull ``version`` (None: the latest) of an adapter run as a PEFT adapter folder ``out`` (must not exist or be
    empty), verified; a full run's version is refused (:class:`AdapterRefusedError`, nothing written).

    Raises:
        the errors of :func:`pull_folder`.
    """
    return pull_folder(client, run, out, version, require_adapter=True)
