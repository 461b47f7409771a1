"""The bit-exact patch codec.

A patch takes every tensor of a base view to the target view by replacing element bits; it
never adds floating-point deltas. For each changed tensor it stores:

* the flat positions of the elements whose bits changed, gap-coded (``gap_i = pos_i -
  pos_{i-1} - 1``, ``pos_{-1} = -1``) as little-endian unsigned integers of 4 bytes (8 when the
  tensor has more than 2**32 elements);
* one value per changed element: ``old XOR new`` bits (``xor`` encoding: smallest, valid only
  on its exact base) or the new bits (``overwrite``: applying it again to its own result is
  harmless, so it suits at-least-once delivery);
* xxh3-128 checksums of the tensor's base and target bits.

Gaps and values are split into byte planes (all first bytes, then all second bytes, ...), so
the near-constant high bytes compress to almost nothing, and the planes of one tensor form one
zstd frame with its content size declared. Small RL steps change ~1-5 % of bf16 elements with
XORs of a few low mantissa bits, which this turns into ~1.1-1.3 bytes per changed element
(figures: ``python tests/benchmarks/bench_codec.py``).

Container: a safetensors file whose tensors are the frames (dtype ``U8``, key ``delta/<name>``)
and whose ``__metadata__`` has one key, ``stitchboard.patch``, holding JSON with
``format_version``, ``encoding``, ``tensors`` (the per-tensor entries, see :class:`PatchEntry`)
and ``metadata`` (free strings: run id, versions). Tensors not listed are unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from . import _bitdiff
from .container import RawTensor, serialize_safetensors
from .dtypes import DTYPE_SIZES, bits_type, numel_of
from .errors import TensorSetMismatchError
from .schema import XXH3_128, Encoding

FORMAT = "stitchboard.patch"
FORMAT_VERSION = "1"
PAYLOAD_PREFIX = "delta/"
#: zstd level of the frames; level 1 measured as small as 3 on RL steps and faster.
DEFAULT_LEVEL = 1
ENCODINGS: tuple[str, ...] = ("xor", "overwrite")


def checksum(t: RawTensor) -> str:
    """xxh3-128 hex digest of a tensor's raw little-endian bits (32 lowercase hex digits)."""
    return xxhash.xxh3_128_hexdigest(memoryview(t.bits).cast("B")) if t.bits.size else xxhash.xxh3_128_hexdigest(b"")


@dataclass(frozen=True)
class PatchEntry:
    """Metadata of one changed tensor in a patch (one element of the ``tensors`` JSON list).

    Attributes:
        name: checkpoint name of the tensor.
        dtype, shape: of the tensor (unchanged by the patch).
        count: number of changed elements (>= 1).
        gap_width: bytes per gap, 4 or 8.
        frame_bytes: size of the zstd frame in bytes.
        base, target: algorithm -> hex digest of the tensor's bits before and after.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    count: int
    gap_width: int
    frame_bytes: int
    base: dict[str, str]
    target: dict[str, str]

    @property
    def numel(self) -> int:
        """Element count of the tensor."""
        return numel_of(self.shape)

    @property
    def payload_bytes(self) -> int:
        """Decompressed size of the frame: ``count * (gap_width + element size)``."""
        return self.count * (self.gap_width + DTYPE_SIZES[self.dtype])

    def to_json(self) -> dict:
        """The entry as stored in the patch metadata."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "count": self.count,
            "gap_width": self.gap_width,
            "frame_bytes": self.frame_bytes,
            "base": self.base,
            "target": self.target,
        }


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's encoded delta, ready to be put in a patch file."""

    entry: PatchEntry
    frame: bytes


def _planes(arr: np.ndarray, width: int, out: np.ndarray) -> None:
    """Write the byte planes of ``arr`` (uint, ``width`` bytes each) into ``out`` (uint8)."""
    out.reshape(width, arr.shape[0])[:] = arr.view(np.uint8).reshape(arr.shape[0], width).T


def check_compatible(name: str, base: RawTensor, target: RawTensor) -> None:
    """Check that ``base`` and ``target`` have the same dtype and shape.

    Raises:
        TensorSetMismatchError: naming the tensor; publish an anchor instead.
    """
    if base.dtype != target.dtype or tuple(base.shape) != tuple(target.shape):
        raise TensorSetMismatchError(
            f"tensor {name!r} changed from {base.dtype}{list(base.shape)} to {target.dtype}{list(target.shape)}: "
            "a delta cannot express that; publish an anchor (full snapshot)"
        )


def encode_tensor(
    name: str,
    base: RawTensor,
    target: RawTensor,
    encoding: Encoding = "xor",
    *,
    base_checksum: str | None = None,
    target_checksum: str | None = None,
    level: int = DEFAULT_LEVEL,
) -> EncodedTensor | None:
    """Diff one tensor bitwise and encode the changed positions and values.

    Args:
        name: checkpoint name.
        base, target: same dtype and shape; ``bits`` aligned to the element size.
        encoding: ``xor`` or ``overwrite``.
        base_checksum, target_checksum: xxh3-128 hex digests if already known (else computed).
        level: zstd level.

    Returns:
        The encoded delta, or ``None`` when no element's bits changed.

    Raises:
        TensorSetMismatchError: dtype or shape differ.
        ValueError: unknown encoding.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; use one of {ENCODINGS}")
    check_compatible(name, base, target)
    itemsize = DTYPE_SIZES[base.dtype]
    numel = base.numel
    gap_width = 4 if numel <= 2**32 else 8
    count, gaps, vals, _ = _bitdiff.diff(base.bits, target.bits, itemsize, gap_width, encoding == "xor", 0, numel, -1)
    if count == 0:
        return None
    payload = np.empty(count * (gap_width + itemsize), dtype=np.uint8)
    _planes(np.frombuffer(gaps, dtype=np.uint32 if gap_width == 4 else np.uint64), gap_width, payload[: count * gap_width])
    _planes(np.frombuffer(vals, dtype=bits_type(base.dtype)), itemsize, payload[count * gap_width :])
    frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload)
    entry = PatchEntry(
        name=name,
        dtype=base.dtype,
        shape=tuple(base.shape),
        count=count,
        gap_width=gap_width,
        frame_bytes=len(frame),
        base={XXH3_128: base_checksum or checksum(base)},
        target={XXH3_128: target_checksum or checksum(target)},
    )
    return EncodedTensor(entry, frame)


def build_patch(encoded: list[EncodedTensor], encoding: Encoding = "xor", metadata: Mapping[str, str] | None = None) -> bytes:
    """Assemble encoded tensors into patch-file bytes (deterministic for equal input).

    ``metadata`` adds free string entries (e.g. run id, base and target version).
    """
    encoded = sorted(encoded, key=lambda e: e.entry.name)
    header = {
        "format_version": FORMAT_VERSION,
        "encoding": encoding,
        "tensors": [e.entry.to_json() for e in encoded],
        "metadata": dict(metadata or {}),
    }
    # One metadata key: safetensors writes __metadata__ from a hash map in arbitrary order,
    # and a retried publish must produce the same bytes.
    meta = {FORMAT: json.dumps(header, separators=(",", ":"), sort_keys=True)}
    payloads = {
        PAYLOAD_PREFIX + e.entry.name: RawTensor("U8", (len(e.frame),), np.frombuffer(e.frame, dtype=np.uint8)) for e in encoded
    }
    return serialize_safetensors(payloads, meta)
