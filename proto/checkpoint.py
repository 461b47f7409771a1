"""HF-style safetensors checkpoints (one file, or shards + ``model.safetensors.index.json``).

Anchors are written here: plain checkpoints of the served view that vLLM and transformers load
unchanged (DESIGN.md invariant 6), split into shards of at most ``max_shard_bytes`` like
``save_pretrained`` does, with the ``{"format": "pt"}`` metadata transformers expects.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import numpy as np

from .container import RawTensor, load_json, read_safetensors, serialize_safetensors, write_safetensors
from .dtypes import DTYPE_SIZES, bits_type
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


class TensorLayout(Protocol):
    """What a shard plan needs of a tensor: its dtype name, shape and size (a :class:`RawTensor` has them)."""

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...


def shard_groups(tensors: Mapping[str, TensorLayout], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[list[str]]:
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


@functools.cache
def _dtype_rank() -> dict[str, int]:
    """dtype name -> its place in a safetensors file's data (the ``safetensors`` library's own order, read once
    from a file of one element per dtype: largest alignment first)."""
    one = {d: RawTensor(d, (1,), np.zeros(1, dtype=bits_type(d))) for d in DTYPE_SIZES}
    data = serialize_safetensors(one)
    (size,) = struct.unpack("<Q", data[:8])
    return {name: i for i, name in enumerate(json.loads(data[8 : 8 + size]))}


def safetensors_header(tensors: Mapping[str, TensorLayout], metadata: Mapping[str, str] | None = None) -> bytes:
    """The head of the safetensors file of ``tensors`` (length, JSON header, padding), from dtypes and shapes only:
    byte-identical to what :func:`~.container.write_safetensors` writes before the data (tested against it).

    Returns:
        The bytes before the first tensor's data; the data then follows in :func:`safetensors_order`.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in safetensors_order(tensors):
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def safetensors_order(tensors: Mapping[str, TensorLayout]) -> list[str]:
    """The order of the tensors' data in their safetensors file: by dtype (the library's order), then by name."""
    rank = _dtype_rank()
    return sorted(tensors, key=lambda n: (rank[tensors[n].dtype], n))


def write_shards_streaming(
    folder: str | os.PathLike[str],
    layout: Mapping[str, TensorLayout],
    weight_map: Mapping[str, str],
    tensor_of: Callable[[str], RawTensor],
) -> list[Path]:
    """:func:`write_shards` taking one tensor at a time: byte-identical files, memory one tensor.

    Each shard's header is written from ``layout`` (dtype, shape), then each tensor's bits as ``tensor_of(name)``
    returns them, dropped before the next is asked for; the file is written to a temporary name, fsynced and
    renamed, as :func:`~.container.write_safetensors` does. (The ``safetensors`` library writes whole dicts only:
    its ``serialize_file`` needs every tensor's memory at once.)

    Args:
        folder: created if needed.
        layout: tensor name -> dtype, shape and size of every tensor ``weight_map`` names.
        weight_map: tensor name -> shard file name.
        tensor_of: the bits of a tensor (C-contiguous, of the layout's dtype and shape).

    Returns:
        The shard files written, sorted by name.

    Raises:
        KeyError: ``weight_map`` names a tensor ``layout`` lacks.
        ValueError: ``tensor_of`` returned a tensor of another dtype or shape than ``layout`` says.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for shard in sorted(set(weight_map.values())):
        part = {n: layout[n] for n in sorted(weight_map) if weight_map[n] == shard}
        path = folder / shard
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(safetensors_header(part, {"format": "pt"}))
            for name in safetensors_order(part):
                t = tensor_of(name)
                if (t.dtype, tuple(t.shape)) != (part[name].dtype, tuple(part[name].shape)):
                    raise ValueError(
                        f"tensor {name!r} is {t.dtype}{list(t.shape)}, its layout says "
                        f"{part[name].dtype}{list(part[name].shape)}"
                    )
                f.write(t.bits.data.cast("B") if t.bits.size else b"")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        written.append(path)
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
