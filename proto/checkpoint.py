"""HF-style safetensors checkpoints (one file, or shards + ``model.safetensors.index.json``).

Anchors are written here: plain checkpoints of the served view that vLLM and transformers load
unchanged (DESIGN.md invariant 6), split into shards of at most ``max_shard_bytes`` like
``save_pretrained`` does, with the ``{"format": "pt"}`` metadata transformers expects.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from .container import RawTensor, load_json, read_safetensors, write_safetensors
from .errors import PatchFormatError, SchemaError
from .schema import CHECKPOINT_INDEX_NAME, check_path

INDEX_NAME = CHECKPOINT_INDEX_NAME
SINGLE_NAME = "model.safetensors"
#: Default shard size bound: 2 GiB, as the bulletin's snapshot shards.
DEFAULT_SHARD_BYTES = 2 * 1024**3


def _is_file_name(name: str) -> bool:
    try:
        check_path(name, "shard file name")
    except SchemaError:
        return False
    return True


def checkpoint_files(path: str | os.PathLike[str]) -> tuple[dict[str, str], Path]:
    """Resolve a checkpoint path to (tensor name -> shard file name, folder).

    ``path`` is a ``.safetensors`` file, an index json, or a folder holding either.

    Raises:
        FileNotFoundError: no safetensors checkpoint there.
        PatchFormatError: the index is malformed (not JSON, nested too deep, no ``weight_map``,
            or a shard name that is not a plain file name).
    """
    p = Path(path)
    if p.is_dir():
        if (p / INDEX_NAME).exists():
            p = p / INDEX_NAME
        elif (p / SINGLE_NAME).exists():
            p = p / SINGLE_NAME
        else:
            files = sorted(p.glob("*.safetensors"))
            if len(files) != 1:
                raise FileNotFoundError(
                    f"{path}: expected {INDEX_NAME}, {SINGLE_NAME} or exactly one .safetensors file"
                )
            p = files[0]
    if p.name.endswith(".json"):
        index = load_json(p.read_bytes(), f"{p}: safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and "/" not in v and _is_file_name(v) for v in weight_map.values()
        ):
            raise PatchFormatError(f"{p}: weight_map must map tensor names to shard file names in the same folder")
        return dict(weight_map), p.parent
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    return {}, p


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, RawTensor]:
    """Memory-map a checkpoint as name -> :class:`RawTensor` (read-only views).

    Raises:
        FileNotFoundError, PatchFormatError: see :func:`checkpoint_files`; a shard is malformed,
            a tensor appears in two shards, or the index names a tensor its shard lacks.
    """
    weight_map, where = checkpoint_files(path)
    if not weight_map:
        return read_safetensors(where)[1]
    out: dict[str, RawTensor] = {}
    for shard in sorted(set(weight_map.values())):
        _, tensors = read_safetensors(where / shard)
        for name, t in tensors.items():
            if name in out:
                raise PatchFormatError(f"{where}: tensor {name!r} appears in more than one shard")
            if weight_map.get(name) != shard:
                raise PatchFormatError(
                    f"{where}: tensor {name!r} is in {shard} but the index says {weight_map.get(name)}"
                )
            out[name] = t
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise PatchFormatError(f"{where}: index lists tensors no shard holds: {missing[:5]}")
    return out


def shard_name(index: int, total: int) -> str:
    """File name of shard ``index`` (from 0) of ``total``: ``model.safetensors`` alone, else
    ``model-0000i-of-0000n.safetensors`` (numbered from 1), as ``save_pretrained`` names them."""
    return SINGLE_NAME if total == 1 else f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def shard_groups(tensors: Mapping[str, RawTensor], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[list[str]]:
    """Split tensor names (in name order) into shards of at most ``max_shard_bytes`` each.

    A tensor larger than the bound gets a shard of its own; no tensors give no shard.
    """
    groups: list[list[str]] = []
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if not groups or size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def plan_shards(tensors: Mapping[str, RawTensor], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, str]:
    """Tensor name -> shard file name: :func:`shard_groups` named by :func:`shard_name`."""
    groups = shard_groups(tensors, max_shard_bytes)
    return {name: shard_name(i, len(groups)) for i, group in enumerate(groups) for name in group}


def write_shards(
    folder: str | os.PathLike[str], tensors: Mapping[str, RawTensor], weight_map: Mapping[str, str]
) -> list[Path]:
    """Write the shards ``weight_map`` names (tensor name -> shard file name), in name order,
    into ``folder`` (created if needed), each with the ``{"format": "pt"}`` metadata
    transformers expects. A sharded publisher writes its own shards of one checkpoint with it.

    Returns:
        The shard files written, sorted by name.

    Raises:
        KeyError: ``weight_map`` names a tensor ``tensors`` lacks.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for shard in sorted(set(weight_map.values())):
        write_safetensors(
            folder / shard, {n: tensors[n] for n in sorted(weight_map) if weight_map[n] == shard}, {"format": "pt"}
        )
        written.append(folder / shard)
    return written


def index_json(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """The bytes of ``model.safetensors.index.json`` for a sharded checkpoint.

    Args:
        weight_map: tensor name -> shard file name, every tensor of the checkpoint.
        total_size: bytes of all its tensors.
    """
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2) + "\n").encode()


def save_checkpoint(
    folder: str | os.PathLike[str],
    tensors: Mapping[str, RawTensor],
    weight_map: Mapping[str, str] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write ``tensors`` as an HF checkpoint into ``folder`` (created if needed).

    Args:
        weight_map: tensor name -> shard file name to reuse a layout; default
            :func:`plan_shards`.

    Returns:
        The files written (shards, then the index when there are several shards).

    Raises:
        ValueError: ``weight_map`` does not name exactly the tensors.
    """
    folder = Path(folder)
    weight_map = dict(weight_map) if weight_map else plan_shards(tensors, max_shard_bytes)
    if set(weight_map) != set(tensors):
        raise ValueError("weight_map must name exactly the tensors to save")
    written = write_shards(folder, tensors, weight_map)
    if len(written) > 1:
        (folder / INDEX_NAME).write_bytes(index_json(weight_map, sum(t.nbytes for t in tensors.values())))
        written.append(folder / INDEX_NAME)
    return written
