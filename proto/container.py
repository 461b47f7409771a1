"""Raw tensors and the safetensors container, read strictly.

The codec works on :class:`RawTensor`: a dtype name, a shape and the flat raw element bits as
a numpy unsigned array (``BF16`` -> uint16, ``F8_E4M3`` -> uint8, ...), so it never interprets
values and NaN payloads, -0.0, Inf and denormals pass through unchanged.

Files follow the safetensors format (https://github.com/huggingface/safetensors, "Format"): an
8-byte little-endian header length N, N bytes of JSON header, then the data. Reading checks
everything the format allows to go wrong before any tensor is used (truncation, header length
past the end, duplicate names, unknown dtypes, sizes that disagree with shapes, overlapping or
out-of-range offsets) and raises :class:`PatchFormatError`. Writing goes through the
``safetensors`` library, so every file is readable with plain ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize, serialize_file

from .dtypes import DTYPE_SIZES, MAX_NUMEL, SPEC_NAMES, bits_type, numel_of
from .errors import PatchFormatError
from .schema import check_path, duplicates

#: Largest JSON header accepted (the safetensors library uses the same 100 MB bound).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class RawTensor:
    """A tensor as raw bits.

    Attributes:
        dtype: safetensors dtype name (``BF16``, ``F32``, ``F8_E4M3``, ``U8``...).
        shape: dimensions.
        bits: 1-D C-contiguous numpy array of ``bits_type(dtype)`` (uint8/16/32/64) with
            ``numel`` elements, little-endian; may be a read-only view of a mapped file.
    """

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray

    @property
    def numel(self) -> int:
        """Element count."""
        return int(self.bits.shape[0])

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return int(self.bits.nbytes)

    @staticmethod
    def from_bytes(dtype: str, shape: tuple[int, ...] | list[int], data: bytes | bytearray | memoryview) -> RawTensor:
        """Wrap raw little-endian bytes (no copy) as a tensor of ``dtype`` and ``shape``.

        Raises:
            PatchFormatError: unknown dtype, or the byte count is not ``numel * element size``.
        """
        if dtype not in DTYPE_SIZES:
            raise PatchFormatError(f"unknown dtype {dtype!r}")
        shape = tuple(int(d) for d in shape)
        n = numel_of(shape)
        if len(data) != n * DTYPE_SIZES[dtype]:
            raise PatchFormatError(f"{len(data)} bytes do not hold shape {list(shape)} of {dtype}")
        return RawTensor(dtype, shape, np.frombuffer(data, dtype=bits_type(dtype), count=n))


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise PatchFormatError(f"duplicate tensor names in safetensors header: {duplicates([k for k, _ in pairs])[:5]}")
    return out


def load_json(text: str | bytes, what: str, **kwargs: object) -> object:
    """``json.loads`` that refuses input nested deeper than Python's recursion limit (about 1,000).

    Raises:
        PatchFormatError: naming ``what``: invalid UTF-8, invalid JSON or nested too deep; and
            whatever an ``object_pairs_hook`` in ``kwargs`` raises.
    """
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text, **kwargs)  # type: ignore[arg-type]
    except RecursionError:
        raise PatchFormatError(f"{what}: JSON nested too deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PatchFormatError(f"{what}: not valid JSON ({exc})") from None


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bits lie in a safetensors file, from its header.

    Attributes:
        dtype: safetensors dtype name.
        shape: dimensions.
        begin, end: byte offsets of its bits in the data section (after the header), ``end`` exclusive.
    """

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def parse_safetensors_header(
    header: bytes | memoryview, data_len: int, what: str = "file"
) -> tuple[dict[str, str], dict[str, TensorSlot]]:
    """Parse a safetensors JSON header strictly into (``__metadata__``, name -> :class:`TensorSlot`).

    Reads no tensor bits: ``data_len`` is the size of the data section that follows the header
    (file size - 8 - header length, bytes), which the slots must tile exactly.

    Raises:
        PatchFormatError: invalid or duplicate-keyed JSON, bad ``__metadata__``, a bad tensor
            name, unknown dtype, bad shape, offsets out of range, overlapping or leaving gaps, or
            a byte size that disagrees with the shape.
    """
    parsed = load_json(bytes(header), f"{what}: header", object_pairs_hook=_no_duplicates)
    if not isinstance(parsed, dict):
        raise PatchFormatError(f"{what}: header is not a JSON object")
    meta = parsed.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise PatchFormatError(f"{what}: __metadata__ must map strings to strings")
    slots: dict[str, TensorSlot] = {}
    for name, entry in parsed.items():
        try:
            check_path(name, "tensor name")
        except Exception as exc:  # noqa: BLE001 - any refusal of the name is this file's format error
            raise PatchFormatError(f"{what}: {exc}") from None
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise PatchFormatError(f"{what}: tensor {name!r} entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise PatchFormatError(f"{what}: tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise PatchFormatError(f"{what}: tensor {name!r} has invalid shape {shape!r}")
        if numel_of(shape) > MAX_NUMEL:
            raise PatchFormatError(f"{what}: tensor {name!r} shape {shape} overflows")
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise PatchFormatError(f"{what}: tensor {name!r} has invalid data_offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end <= data_len:
            raise PatchFormatError(
                f"{what}: tensor {name!r} data_offsets {offs} outside the {data_len}-byte data section "
                "(truncated file?)"
            )
        if end - begin != numel_of(shape) * DTYPE_SIZES[dtype]:
            raise PatchFormatError(
                f"{what}: tensor {name!r} holds {end - begin} bytes but shape {shape} of {dtype} needs "
                f"{numel_of(shape) * DTYPE_SIZES[dtype]}"
            )
        slots[name] = TensorSlot(dtype, tuple(shape), begin, end)
    cursor = 0
    for begin, end, name in sorted((s.begin, s.end, n) for n, s in slots.items()):
        if begin != cursor:
            raise PatchFormatError(
                f"{what}: tensor {name!r} data starts at {begin}, expected {cursor} (overlap or gap)"
            )
        cursor = end
    if cursor != data_len:
        raise PatchFormatError(f"{what}: {data_len - cursor} trailing bytes after the last tensor")
    return meta, slots


def parse_safetensors(
    buf: bytes | bytearray | memoryview | mmap.mmap, what: str = "file"
) -> tuple[dict[str, str], dict[str, RawTensor]]:
    """Parse a safetensors buffer strictly into (``__metadata__``, name -> :class:`RawTensor`).

    Tensor bits are zero-copy views of ``buf`` (aligned copies only where the data is not
    aligned to its element size). ``what`` names the file in error messages.

    Raises:
        PatchFormatError: truncated buffer, header length past the end or over 100 MB, or a
            header :func:`parse_safetensors_header` refuses.
    """
    view = memoryview(buf).cast("B")
    total = len(view)
    if total < 8:
        raise PatchFormatError(
            f"{what}: truncated ({total} bytes; a safetensors file starts with an 8-byte header length)"
        )
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > total - 8:
        raise PatchFormatError(
            f"{what}: header length {hlen} is larger than the file ({total} bytes): truncated or not safetensors"
        )
    if hlen > MAX_HEADER_BYTES:
        raise PatchFormatError(f"{what}: header of {hlen} bytes exceeds {MAX_HEADER_BYTES}")
    data_start = 8 + hlen
    meta, slots = parse_safetensors_header(view[8:data_start], total - data_start, what)
    tensors: dict[str, RawTensor] = {}
    for name, slot in slots.items():
        size = DTYPE_SIZES[slot.dtype]
        raw: memoryview | bytearray = view[data_start + slot.begin : data_start + slot.end]
        if (data_start + slot.begin) % size:
            raw = bytearray(raw)  # align for the kernels; only files not written by safetensors
        tensors[name] = RawTensor(slot.dtype, slot.shape, np.frombuffer(raw, dtype=bits_type(slot.dtype)))
    return meta, tensors


def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, str], dict[str, RawTensor]]:
    """Memory-map and parse a safetensors file (see :func:`parse_safetensors`); read-only views.

    Raises:
        PatchFormatError: as :func:`parse_safetensors`.
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise PatchFormatError(f"{path}: empty file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return parse_safetensors(mm, what=str(path))


def _specs(tensors: Mapping[str, RawTensor]) -> dict[str, TensorSpec]:
    specs = {}
    for name, t in tensors.items():
        if not t.bits.flags.c_contiguous:
            raise ValueError(f"tensor {name!r}: bits must be C-contiguous")
        specs[name] = TensorSpec(
            dtype=SPEC_NAMES[t.dtype], shape=list(t.shape), data_ptr=t.bits.ctypes.data, data_len=t.bits.nbytes
        )
    return specs


def serialize_safetensors(tensors: Mapping[str, RawTensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize raw tensors into safetensors bytes (deterministic for equal input)."""
    return bytes(serialize(_specs(tensors), metadata=dict(metadata) if metadata else None))


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, RawTensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write raw tensors as a safetensors file, atomically (temp file + fsync + rename).

    Returns:
        The file size in bytes.

    Raises:
        FileNotFoundError: the folder ``path`` names does not exist.
        OSError: the file cannot be written.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: folder {path.parent} does not exist; create it first")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    serialize_file(_specs(tensors), str(tmp), metadata=dict(metadata) if metadata else None)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size
