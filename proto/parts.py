"""A tensor's patch in parts: independent per-block streams, their layout and checksums.

Runs wherever patches are made or read (trainer ranks encode their own blocks; sidecars and engine
workers read them). A tensor is viewed as 2-D ``(shape[0], prod(shape[1:]))`` (1-D ``(n, 1)``, a
scalar ``(1, 1)``); a part is a block of it:

* ``dim`` 0: rows ``[start, stop)`` with all columns, a contiguous range of flat elements (what
  FSDP2 ``Shard(0)`` and the publisher's chunking give);
* ``dim`` 1: columns ``[start, stop)`` with all rows (tensor-parallel ``Shard(1)``).

The parts of a tensor all have the same ``dim`` and tile it in order (the first starts at 0, each
starts where the previous stops, the last stops at the extent). Each part's stream codes the
block's changes on its own (its own ``cond`` models, or its own varint gaps for ``xor`` and
``overwrite``) against the base block alone, with positions in the block's own row-major order, so
parts encode where the block lives and decode in parallel. A part without changes is listed (its
digests make up the tensor's checksum) with ``count`` 0 and no stream.

Checksum of a parted tensor, :data:`XXH3_128_PARTS`: the xxh3-128 hex digest of the UTF-8 bytes of
``"".join(f"{dim},{start},{stop}:{digest}\\n" for each part)``, ``digest`` the xxh3-128 hex of the
block's bits in its row-major order; it needs no whole tensor in one place, only each block's digest.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from . import _bitdiff, cond_codec
from .container import RawTensor
from .dtypes import DTYPE_SIZES
from .errors import PatchFormatError
from .schema import XXH3_128, XXH3_128_PARTS, Encoding
from .threads import SharedPool

__all__ = [
    "PART_KEYS",
    "XXH3_128_PARTS",
    "EncodedBlock",
    "Layout",
    "Part",
    "block",
    "check_parts",
    "checksums_of",
    "digest",
    "digest_pair",
    "encode_part",
    "grid",
    "layout_checksum",
    "layout_of",
    "layouts_from_json",
    "matches",
    "parts_checksum",
    "pool",
    "row_layout",
    "same_checksum",
    "tensor_checksum",
    "to_whole",
]  # XXH3_128_PARTS is the schema's, re-exported

#: The part layout of a tensor: ``(dim, start, stop)`` per part, in order.
Layout = tuple[tuple[int, int, int], ...]
#: Keys of a part in a patch index entry's ``parts`` list.
PART_KEYS = frozenset({"dim", "start", "stop", "count", "base", "target", "bytes"})


_PART_THREADS = SharedPool("stitch-parts")


def pool() -> ThreadPoolExecutor:
    """The process's threads for part encoding and decoding (:class:`~.threads.SharedPool`: one per usable CPU, at
    most 8; the C coders release the GIL while they run). Never submit to it from one of its own tasks."""
    return _PART_THREADS()


def grid(shape: Sequence[int]) -> tuple[int, int]:
    """The ``(rows, columns)`` a tensor of ``shape`` is viewed as: ``(shape[0], prod(shape[1:]))``,
    ``(n, 1)`` for 1-D, ``(1, 1)`` for a scalar."""
    if not shape:
        return 1, 1
    cols = 1
    for d in shape[1:]:
        cols *= int(d)
    return int(shape[0]), cols


def block(bits: np.ndarray, shape: Sequence[int], dim: int, start: int, stop: int) -> np.ndarray:
    """The bits of one block of a whole tensor, flat in the block's row-major order.

    Args:
        bits: the whole tensor's flat bits (``bits_type(dtype)`` [numel]).
        shape: its shape.
        dim, start, stop: the block (see the module docstring).

    Returns:
        ``dim`` 0: a view of ``bits`` (no copy); ``dim`` 1: a C-contiguous copy of the columns.
    """
    rows, cols = grid(shape)
    if dim == 0:
        return bits[start * cols : stop * cols]
    # A copy even when the columns are contiguous (one row, or every column): callers may write it.
    return np.array(bits.reshape(rows, cols)[:, start:stop], order="C", copy=True).reshape(-1)


def digest(bits: np.ndarray) -> str:
    """xxh3-128 hex digest of flat bits (a block's or a whole tensor's)."""
    return xxhash.xxh3_128_hexdigest(bits.data.cast("B") if bits.size else b"")


def parts_checksum(blocks: Sequence[tuple[int, int, int, str]]) -> str:
    """:data:`XXH3_128_PARTS` of a tensor from its blocks' ``(dim, start, stop, xxh3-128 hex)`` in order."""
    text = "".join(f"{dim},{start},{stop}:{d}\n" for dim, start, stop, d in blocks)
    return xxhash.xxh3_128_hexdigest(text.encode())


def layout_checksum(bits: np.ndarray, shape: Sequence[int], layout: Layout) -> str:
    """:data:`XXH3_128_PARTS` of a whole tensor (flat ``bits`` of ``shape``) cut by ``layout``."""
    return parts_checksum([(d, a, b, digest(block(bits, shape, d, a, b))) for d, a, b in layout])


def tensor_checksum(bits: np.ndarray, shape: Sequence[int], layout: Layout | None) -> str:
    """The checksum a whole tensor's flat ``bits`` (of ``shape``) are checked by: ``xxh3_128`` (``layout`` None),
    or :data:`XXH3_128_PARTS` over ``layout`` (a tensor published in parts: ``VersionManifest.layouts()``)."""
    return digest(bits) if layout is None else layout_checksum(bits, shape, layout)


def layouts_from_json(obj: object, what: str) -> dict[str, Layout]:
    """The part layouts an engine call names (``{tensor name: [[dim, start, stop], ...]}``, as
    :meth:`~stitchboard.proto.schema.VersionManifest.layouts` gives them; None or absent: no tensor in parts).

    Raises:
        ValueError: naming ``what``: not a map of names to non-empty lists of three integers ``dim`` (0 or 1),
            ``start``, ``stop`` with ``0 <= start < stop``.
    """
    if obj is None:
        return {}
    given: dict[Any, Any] = obj if isinstance(obj, dict) else {"(not a map)": None}
    bad = [n for n, parts in given.items() if not _is_layout(parts)]
    if bad:
        raise ValueError(
            f"{what}: layouts must map tensor names to non-empty lists of [dim (0 or 1), start, stop] with "
            f"0 <= start < stop; {bad[0]!r} does not"
        )
    return {str(n): tuple((int(d), int(a), int(b)) for d, a, b in parts) for n, parts in given.items()}


def _is_layout(parts: object) -> bool:
    """Whether ``parts`` (JSON) is a non-empty list of ``[dim, start, stop]``: integers, dim 0 or 1, start < stop."""
    return (
        isinstance(parts, (list, tuple))
        and bool(parts)
        and all(
            isinstance(p, (list, tuple))
            and len(p) == 3
            and all(type(x) is int for x in p)
            and p[0] in (0, 1)
            and 0 <= p[1] < p[2]
            for p in parts
        )
    )


def row_layout(shape: Sequence[int], itemsize: int, part_bytes: int) -> Layout:
    """Row chunks (``dim`` 0) of about ``part_bytes`` each covering a tensor of ``shape``.

    Rows are kept whole, so a part holds at least one row; the chunks are as even as whole rows
    allow (``ceil(size / part_bytes)`` of them). One part when the tensor is no larger than
    ``part_bytes``.
    """
    rows, cols = grid(shape)
    size = rows * cols * itemsize
    n = max(1, min(rows, -(-size // max(1, part_bytes))))
    cuts = [rows * i // n for i in range(n + 1)]
    return tuple((0, a, b) for a, b in itertools.pairwise(cuts) if b > a)


@dataclass(frozen=True)
class Part:
    """One block of a parted tensor in a patch index entry.

    Attributes:
        dim, start, stop: the block (module docstring).
        count: changed elements in the block (0: no stream).
        base, target: xxh3-128 hex digests of the block's bits before and after.
        bytes: length of the block's stream in the payload (``cond``: its coded stream; ``xor``,
            ``overwrite``: its varint gaps, its values sitting in the payload's byte planes).
    """

    dim: int
    start: int
    stop: int
    count: int
    base: str
    target: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        """The part as stored in the index."""
        return {
            "dim": self.dim,
            "start": self.start,
            "stop": self.stop,
            "count": self.count,
            "base": self.base,
            "target": self.target,
            "bytes": self.bytes,
        }

    def numel(self, shape: Sequence[int]) -> int:
        """Elements of the block in a tensor of ``shape``."""
        rows, cols = grid(shape)
        return (self.stop - self.start) * (cols if self.dim == 0 else rows)


@dataclass(frozen=True)
class EncodedBlock:
    """One part's delta: its index entry, its stream (``cond``) or varint gaps, and its raw values
    (``xor``, ``overwrite``: ``count * itemsize`` bytes, little-endian; ``cond``: empty)."""

    part: Part
    stream: bytes
    values: bytes


def encode_part(
    base_block: RawTensor, target_block: RawTensor, dim: int, start: int, stop: int, encoding: Encoding
) -> EncodedBlock:
    """Encode one block's changes, against the base block alone (a rank encodes only its own block).

    Args:
        base_block, target_block: the block's bits before and after, flat in the block's row-major
            order (:func:`block`), same dtype and element count; ``shape`` is not read.
        dim, start, stop: where the block lies in the whole tensor (module docstring).
        encoding: ``cond``, ``xor`` or ``overwrite``.

    Returns:
        The part (``count`` 0 and an empty stream when nothing changed).

    Raises:
        ValueError: dtypes or element counts differ, an unknown encoding, or ``dim``/``start``/``stop`` invalid.
    """
    if base_block.dtype != target_block.dtype or base_block.numel != target_block.numel:
        raise ValueError(
            f"part {dim},{start},{stop}: base is {base_block.dtype}[{base_block.numel}], "
            f"target {target_block.dtype}[{target_block.numel}]"
        )
    if dim not in (0, 1) or not 0 <= start < stop:
        raise ValueError(f"part {dim},{start},{stop}: want dim 0 or 1 and 0 <= start < stop")
    if encoding == "cond":
        count, stream = cond_codec.encode(base_block, target_block)
        values = b""
    elif encoding in ("xor", "overwrite"):
        count, stream, values = _bitdiff.diff(
            base_block.bits, target_block.bits, DTYPE_SIZES[base_block.dtype], encoding == "xor"
        )
    else:
        raise ValueError(f"unknown encoding {encoding!r}")
    base = digest(base_block.bits)
    target = base if count == 0 else digest(target_block.bits)
    return EncodedBlock(Part(dim, start, stop, count, base, target, len(stream)), stream, values)


def layout_of(parts: Sequence[Part]) -> Layout:
    """The ``(dim, start, stop)`` of each part."""
    return tuple((p.dim, p.start, p.stop) for p in parts)


def checksums_of(parts: Sequence[Part], which: str) -> dict[str, str]:
    """``{xxh3_128_parts: ...}`` of the parts' ``base`` or ``target`` digests (``which``)."""
    return {XXH3_128_PARTS: parts_checksum([(p.dim, p.start, p.stop, getattr(p, which)) for p in parts])}


def digest_pair(bits: np.ndarray, shape: Sequence[int], want: dict[str, str], layout: Layout | None) -> tuple[str, str]:
    """(the checksum a whole tensor's flat ``bits`` have, the one ``want`` states) in the first algorithm ``want``
    carries of ``xxh3_128`` (one pass over the bits) and :data:`XXH3_128_PARTS` over ``layout``.

    Raises:
        PatchFormatError: ``want`` has neither (or ``xxh3_128_parts`` without a layout).
    """
    if XXH3_128 in want:
        return digest(bits), want[XXH3_128]
    if XXH3_128_PARTS in want and layout:
        return layout_checksum(bits, shape, layout), want[XXH3_128_PARTS]
    raise PatchFormatError(f"no checksum to verify against: {sorted(want)} (want {XXH3_128} or {XXH3_128_PARTS})")


def same_checksum(a: dict[str, str], b: dict[str, str]) -> bool:
    """Whether two checksum maps (a patch entry's ``base``/``target``, a manifest tensor's ``checksums``) name the
    same bits: equal ``xxh3_128`` where both carry it, else equal :data:`XXH3_128_PARTS` (whose text includes the
    layout); False when they share neither."""
    for alg in (XXH3_128, XXH3_128_PARTS):
        if alg in a and alg in b:
            return a[alg] == b[alg]
    return False


def matches(bits: np.ndarray, shape: Sequence[int], want: dict[str, str], layout: Layout | None) -> bool:
    """Whether a whole tensor's flat ``bits`` carry the checksum ``want`` states (:func:`digest_pair`).

    Raises:
        PatchFormatError: as :func:`digest_pair`.
    """
    have, wanted = digest_pair(bits, shape, want, layout)
    return have == wanted


def check_parts(obj: object, shape: Sequence[int], encoding: str, what: str) -> tuple[Part, ...]:
    """Validate an index entry's ``parts`` list (JSON) for a tensor of ``shape``.

    Raises:
        PatchFormatError: naming ``what``: not a non-empty list of objects with exactly :data:`PART_KEYS`;
            a non-integer field, mixed dims, a gap or overlap (they must tile the tensor in order),
            a count over the block's elements, a stream length impossible for the count
            (``cond``: 0 without changes, else at least 4 bytes; ``xor``/``overwrite``: 1-10 bytes
            per change), or a bad digest.
    """
    if not isinstance(obj, list) or not obj:
        raise PatchFormatError(f"{what}: parts must be a non-empty list")
    rows, cols = grid(shape)
    parts: list[Part] = []
    cursor = 0
    for item in obj:
        if not isinstance(item, dict) or set(item) != PART_KEYS:
            raise PatchFormatError(f"{what}: a part must have exactly the keys {sorted(PART_KEYS)}")
        ints = [item[k] for k in ("dim", "start", "stop", "count", "bytes")]
        if not all(type(v) is int and v >= 0 for v in ints):
            raise PatchFormatError(
                f"{what}: part {item.get('dim')},{item.get('start')},{item.get('stop')}: dim, start, stop, count "
                "and bytes must be integers >= 0"
            )
        part = Part(
            item["dim"], item["start"], item["stop"], item["count"], item["base"], item["target"], item["bytes"]
        )
        name = f"{what}: part {part.dim},{part.start},{part.stop}"
        if part.dim not in (0, 1) or part.dim != (parts[0].dim if parts else part.dim):
            raise PatchFormatError(f"{name}: dim must be 0 or 1, the same for every part of a tensor")
        if part.start != cursor or part.stop <= part.start:
            raise PatchFormatError(f"{name}: parts must tile the tensor in order (this one should start at {cursor})")
        cursor = part.stop
        if part.count > part.numel(shape):
            raise PatchFormatError(f"{name}: {part.count} changes in a block of {part.numel(shape)} elements")
        if encoding == "cond":
            ok = part.bytes == 0 if part.count == 0 else part.bytes >= cond_codec.MIN_STREAM_BYTES
        else:
            ok = part.count <= part.bytes <= 10 * part.count
        if not ok:
            raise PatchFormatError(f"{name}: a {part.bytes}-byte stream cannot hold {part.count} {encoding} changes")
        for key in ("base", "target"):
            value = item[key]
            if not (isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)):
                raise PatchFormatError(f"{name}: {key} must be a 32-digit lowercase hex xxh3-128")
        if part.count == 0 and part.base != part.target:
            raise PatchFormatError(f"{name}: no changes but different base and target digests")
        parts.append(part)
    extent = rows if parts[0].dim == 0 else cols
    if cursor != extent:
        raise PatchFormatError(
            f"{what}: parts stop at {cursor}, the tensor's extent along dim {parts[0].dim} is {extent}"
        )
    return tuple(parts)


def to_whole(part: Part, shape: Sequence[int], local: np.ndarray) -> np.ndarray:
    """Flat positions in the whole tensor of a block's own row-major positions (int64 [k] -> int64 [k])."""
    cols = grid(shape)[1]
    if part.dim == 0:
        return local + part.start * cols
    width = part.stop - part.start
    whole: np.ndarray = (local // width) * cols + part.start + local % width
    return whole
