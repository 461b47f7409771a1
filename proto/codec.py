"""The bit-exact patch codec: format and encoder.

A patch takes every tensor of a base view to the target view by replacing element bits; it
never adds floating-point deltas. For each changed tensor it stores:

* the flat positions of the elements whose bits changed, gap-coded (``gap_i = pos_i -
  pos_{i-1} - 1``, ``pos_{-1} = -1``) as LEB128 varints (one byte for gaps < 128);
* one value per changed element: ``old XOR new`` bits (``xor`` encoding: the fastest, valid
  only on its exact base) or the new bits (``overwrite``: applying it again to its own result is
  harmless, so it suits at-least-once delivery);
* xxh3-128 checksums of the tensor's base and target bits.

The whole patch is one zstd frame (content size declared) over a payload laid out as: every
tensor's gap varints, then byte plane 0 of every tensor's values, then plane 1 of the tensors
whose elements have 2+ bytes, and so on (tensors in name order). Splitting values into byte
planes puts the near-constant high bytes (sign and exponent; an XOR's high byte is almost always
0) together, where they compress to almost nothing, and one frame over all tensors shares the
entropy tables. Real RL steps change ~0.5-1.5 % of bf16 elements, mostly by one ulp; this gives
~1.35-1.6 bytes per changed element against ~2.5 for whole-tensor XOR + zstd and 6 for int32
index + bf16 value (``python -m tests.benchmarks.bench_codec``). The coding does not depend on
the base's values, so a tensor-parallel rank can pick out the positions of its own slice.

Container: a safetensors file (readable with plain ``safetensors.safe_open``) with two ``U8``
tensors, ``__index__`` (a zstd frame of the JSON list of :class:`PatchEntry`) and
``__payload__`` (the frame above); its ``__metadata__`` has one key, ``stitchboard.patch``,
with JSON ``format_version``, ``encoding`` and ``metadata`` (free strings: run id, versions).
Tensors not listed are unchanged.

The ``cond`` encoding (:mod:`stitchboard.proto.cond_codec`) keeps this container and index but
codes each tensor's positions and values in one range-coded stream conditioned on the base's
bits (~2.8x smaller than ``xor`` on real steps; it decodes only against the whole base tensor);
``__payload__`` is then the uncompressed concatenation of those streams.

Parts (format version 2, :mod:`stitchboard.proto.parts`): an entry may carry ``parts``, blocks
of the tensor each coded on its own (own varint gaps or own ``cond`` stream, positions in the
block's own order) so that they encode and decode in parallel and a rank can encode only its own
block. The entry's ``count`` and ``gap_bytes`` are then the sums over its parts, its region of the
payload (gap streams; each value plane) holds the parts' pieces in part order, so the payload
layout is that of version 1; its ``base`` and ``target`` carry ``xxh3_128_parts`` (and
``xxh3_128`` where the whole tensor was at hand). A patch without parted entries is written as
version 1, byte for byte as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import xxhash
import zstandard

from . import _bitdiff, cond_codec
from .container import RawTensor, serialize_safetensors
from .dtypes import DTYPE_SIZES, numel_of
from .errors import TensorSetMismatchError
from .parts import EncodedBlock, Layout, Part, block, checksums_of, encode_part, layout_of, pool, row_layout
from .schema import XXH3_128

FORMAT = "stitchboard.patch"
FORMAT_VERSION = "1"
#: The format version of a patch with at least one parted entry (:mod:`stitchboard.proto.parts`).
PARTS_FORMAT_VERSION = "2"
#: Format versions this reader decodes.
FORMAT_VERSIONS = (FORMAT_VERSION, PARTS_FORMAT_VERSION)
INDEX_KEY = "__index__"
PAYLOAD_KEY = "__payload__"
#: zstd level of the payload; on RL steps levels 2-6 are within 1 % of level 1 and slower.
DEFAULT_LEVEL = 1
#: zstd level of the index (small; names and shapes compress well).
INDEX_LEVEL = 9
#: The value encodings a patch can use: ``xor`` and ``overwrite`` (this module's format) and
#: ``cond`` (:mod:`stitchboard.proto.cond_codec`).
PatchEncoding = Literal["xor", "overwrite", "cond"]
ENCODINGS: tuple[PatchEncoding, ...] = ("xor", "overwrite", "cond")


def checksum(t: RawTensor) -> str:
    """xxh3-128 hex digest (32 lowercase hex digits) of a tensor's raw little-endian bits."""
    return xxhash.xxh3_128_hexdigest(t.bits.data.cast("B") if t.bits.size else b"")


@dataclass(frozen=True)
class PatchEntry:
    """Metadata of one changed tensor in a patch (one element of the ``__index__`` list).

    Attributes:
        name: checkpoint name of the tensor.
        dtype, shape: of the tensor (unchanged by the patch).
        count: number of changed elements (>= 1).
        gap_bytes: length in the payload of the tensor's varint gap stream (``xor``,
            ``overwrite``) or of its whole coded stream (``cond``).
        base, target: algorithm -> hex digest of the tensor's bits before and after
            (``xxh3_128``; a parted entry ``xxh3_128_parts``, with ``xxh3_128`` too when known).
        parts: the tensor's blocks (format version 2), each coded on its own; None: one stream.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    count: int
    gap_bytes: int
    base: dict[str, str]
    target: dict[str, str]
    parts: tuple[Part, ...] | None = None

    @property
    def layout(self) -> Layout | None:
        """``(dim, start, stop)`` of each part; None for an unparted entry."""
        return None if self.parts is None else layout_of(self.parts)

    @property
    def numel(self) -> int:
        """Element count of the tensor."""
        return numel_of(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """The entry as stored in the index."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "count": self.count,
            "gap_bytes": self.gap_bytes,
            "base": self.base,
            "target": self.target,
            **({} if self.parts is None else {"parts": [p.to_json() for p in self.parts]}),
        }


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor's delta before compression: its entry, varint gaps and raw values (``cond``:
    ``gaps`` is the tensor's coded stream and ``values`` is empty).

    ``change``: when :func:`encode_tensor` was asked to keep it (``keep_change``) and the encoder found it on the
    way (a one-stream ``cond`` or ``overwrite`` delta), the changed positions as varint gaps and their new bits,
    exactly what ``_bitdiff.diff(base, target, itemsize, False)`` returns; else None.
    """

    entry: PatchEntry
    gaps: bytes
    values: bytes
    change: tuple[bytes, bytes] | None = None


def payload_size(entries: list[PatchEntry], encoding: str) -> int:
    """Bytes of the (decompressed) payload the entries imply."""
    if encoding == "cond":
        return sum(e.gap_bytes for e in entries)
    return sum(e.gap_bytes + e.count * e.itemsize for e in entries)


def payload_layout(entries: list[PatchEntry]) -> list[tuple[int, list[int]]]:
    """Where each entry's gaps and value planes sit in the payload (entries in payload order).

    Returns:
        Per entry: (offset of its gap stream, [offset of its value plane k for each byte k]).
        The payload's total size is ``sum(gap_bytes) + sum(count * itemsize)``.
    """
    offset = 0
    layout: list[tuple[int, list[int]]] = []
    for e in entries:
        layout.append((offset, []))
        offset += e.gap_bytes
    for k in range(max((e.itemsize for e in entries), default=0)):
        for e, (_, planes) in zip(entries, layout, strict=True):
            if e.itemsize > k:
                planes.append(offset)
                offset += e.count
    return layout


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
    encoding: PatchEncoding = "xor",
    *,
    base_checksum: str | None = None,
    target_checksum: str | None = None,
    part_bytes: int | None = None,
    keep_change: bool = False,
) -> EncodedTensor | None:
    """Diff one tensor bitwise: the changed positions (varint gaps) and values.

    Args:
        name: checkpoint name.
        base, target: same dtype and shape; ``bits`` aligned to the element size.
        encoding: ``xor``, ``overwrite`` or ``cond``.
        base_checksum, target_checksum: xxh3-128 hex digests if already known (else computed).
        part_bytes: a tensor larger than this is cut into row chunks of about this size
            (:func:`~stitchboard.proto.parts.row_layout`), coded as independent parts on every
            core (format version 2); None or a tensor that fits: one stream (version 1).
        keep_change: also return the change record (:attr:`EncodedTensor.change`) where the encoder finds it
            on the way: the ``cond`` scan of one stream (~0.04 s less per SmolLM2 publish than a second compare
            pass), ``overwrite``.

    Returns:
        The tensor's delta, or ``None`` when no element's bits changed.

    Raises:
        TensorSetMismatchError: dtype or shape differ.
        ValueError: unknown encoding.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; use one of {ENCODINGS}")
    check_compatible(name, base, target)
    layout = row_layout(base.shape, DTYPE_SIZES[base.dtype], part_bytes) if part_bytes else ((0, 0, 0),)
    if len(layout) > 1:
        return _encode_parted(name, base, target, encoding, layout, base_checksum, target_checksum)
    change: tuple[bytes, bytes] | None = None
    if encoding == "cond" and keep_change:
        count, gaps, changed_gaps, changed_values = cond_codec.encode_keeping_change(base, target)
        values, change = b"", (changed_gaps, changed_values)
    elif encoding == "cond":
        count, gaps = cond_codec.encode(base, target)
        values = b""
    else:
        count, gaps, values = _bitdiff.diff(base.bits, target.bits, DTYPE_SIZES[base.dtype], encoding == "xor")
        change = (gaps, values) if encoding == "overwrite" and keep_change else None
    if count == 0:
        return None
    entry = PatchEntry(
        name=name,
        dtype=base.dtype,
        shape=tuple(base.shape),
        count=count,
        gap_bytes=len(gaps),
        base={XXH3_128: base_checksum or checksum(base)},
        target={XXH3_128: target_checksum or checksum(target)},
    )
    return EncodedTensor(entry, gaps, values, change)


def _encode_parted(
    name: str,
    base: RawTensor,
    target: RawTensor,
    encoding: PatchEncoding,
    layout: Layout,
    base_checksum: str | None,
    target_checksum: str | None,
) -> EncodedTensor | None:
    """:func:`encode_tensor` of a tensor cut into the blocks of ``layout``, encoded in parallel."""

    def one(cut: tuple[int, int, int]) -> EncodedBlock:
        dim, start, stop = cut
        return encode_part(
            RawTensor(base.dtype, (), block(base.bits, base.shape, dim, start, stop)),
            RawTensor(target.dtype, (), block(target.bits, target.shape, dim, start, stop)),
            dim,
            start,
            stop,
            encoding,
        )

    blocks = list(pool().map(one, layout))
    if not any(b.part.count for b in blocks):
        return None
    return encoded_from_parts(
        name, base.dtype, base.shape, blocks, base_checksum or checksum(base), target_checksum or checksum(target)
    )


def encoded_from_parts(
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    blocks: list[EncodedBlock],
    base_checksum: str | None = None,
    target_checksum: str | None = None,
) -> EncodedTensor:
    """One tensor's delta from its encoded blocks (:func:`~stitchboard.proto.parts.encode_part`), for
    :func:`build_patch`: what a sharded publish assembles from its ranks' blocks.

    Args:
        name, dtype, shape: the whole tensor's.
        blocks: every block of the tensor, in order (they must tile it: the reader refuses otherwise),
            unchanged ones included (``count`` 0), so its ``xxh3_128_parts`` can be checked.
        base_checksum, target_checksum: the whole tensor's xxh3-128 where known (a single process);
            None: the entry carries only ``xxh3_128_parts``.

    Raises:
        ValueError: no block has a change (a tensor without changes has no entry).
    """
    done = [b.part for b in blocks]
    count = sum(p.count for p in done)
    if count == 0:
        raise ValueError(f"tensor {name!r}: no block has a change; leave the tensor out of the patch")
    whole_base = {} if base_checksum is None else {XXH3_128: base_checksum}
    whole_target = {} if target_checksum is None else {XXH3_128: target_checksum}
    entry = PatchEntry(
        name=name,
        dtype=dtype,
        shape=tuple(shape),
        count=count,
        gap_bytes=sum(p.bytes for p in done),
        base={**whole_base, **checksums_of(done, "base")},
        target={**whole_target, **checksums_of(done, "target")},
        parts=tuple(done),
    )
    return EncodedTensor(entry, b"".join(b.stream for b in blocks), b"".join(b.values for b in blocks))


def build_patch(
    encoded: list[EncodedTensor],
    encoding: PatchEncoding = "xor",
    metadata: Mapping[str, str] | None = None,
    level: int = DEFAULT_LEVEL,
) -> bytes:
    """Assemble tensor deltas into patch-file bytes (deterministic for equal input).

    Args:
        encoded: deltas from :func:`encode_tensor` (any order; stored in name order).
        encoding: the encoding they were made with.
        metadata: free string entries (e.g. run id, base and target version).
        level: zstd level of the payload (not used by ``cond``).
    """
    encoded = sorted(encoded, key=lambda e: e.entry.name)
    entries = [e.entry for e in encoded]
    if encoding == "cond":
        frame = b"".join(e.gaps for e in encoded)
    else:
        payload = np.empty(payload_size(entries, encoding), dtype=np.uint8)
        for enc, (gap_at, plane_at) in zip(encoded, payload_layout(entries), strict=True):
            e = enc.entry
            payload[gap_at : gap_at + e.gap_bytes] = np.frombuffer(enc.gaps, dtype=np.uint8)
            values = np.frombuffer(enc.values, dtype=np.uint8).reshape(e.count, e.itemsize)
            for k, at in enumerate(plane_at):
                payload[at : at + e.count] = values[:, k]
        frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload.data)
    listing = json.dumps([e.to_json() for e in entries], separators=(",", ":"), sort_keys=True).encode()
    index = zstandard.ZstdCompressor(level=INDEX_LEVEL, write_content_size=True).compress(listing)
    # One metadata key: safetensors writes __metadata__ from a hash map in arbitrary order,
    # and a retried publish must produce the same bytes.
    version = PARTS_FORMAT_VERSION if any(e.parts is not None for e in entries) else FORMAT_VERSION
    header = {"format_version": version, "encoding": encoding, "metadata": dict(metadata or {})}
    return serialize_safetensors(
        {
            INDEX_KEY: RawTensor("U8", (len(index),), np.frombuffer(index, dtype=np.uint8)),
            PAYLOAD_KEY: RawTensor("U8", (len(frame),), np.frombuffer(frame, dtype=np.uint8)),
        },
        {FORMAT: json.dumps(header, separators=(",", ":"), sort_keys=True)},
    )
