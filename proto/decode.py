"""Reading patch files: parse, validate and decode deltas before anything is written.

:func:`read_patch` checks the container and every entry's metadata; :meth:`Patch.delta`
decompresses one tensor's frame only after checking that the frame declares exactly the size
its metadata implies (so a frame that claims a huge content size is refused before any
allocation), then checks the positions (in range, strictly increasing). Every failure raises
:class:`PatchFormatError` naming the tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import zstandard

from .codec import ENCODINGS, FORMAT, FORMAT_VERSION, PAYLOAD_PREFIX, PatchEntry
from .container import parse_safetensors
from .dtypes import DTYPE_SIZES, MAX_NUMEL, bits_type, numel_of
from .errors import PatchFormatError
from .schema import XXH3_128, check_name


@dataclass(frozen=True)
class TensorDelta:
    """A decoded, validated delta of one tensor.

    Attributes:
        entry: its :class:`~stitchboard.proto.codec.PatchEntry`.
        encoding: ``xor`` or ``overwrite``.
        positions: int64 [count], strictly increasing flat element indices < numel.
        values: ``bits_type(dtype)`` [count]: XOR bits or new bits per position.
    """

    entry: PatchEntry
    encoding: str
    positions: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class Patch:
    """A parsed patch file (entries validated, frames not yet decompressed).

    Attributes:
        encoding: ``xor`` or ``overwrite``.
        entries: tensor name -> :class:`PatchEntry`, in name order.
        metadata: the extra ``__metadata__`` strings (run id, versions...).
        size_bytes: size of the patch file in bytes.
    """

    encoding: str
    entries: dict[str, PatchEntry]
    metadata: dict[str, str]
    size_bytes: int
    _frames: dict[str, memoryview]

    @property
    def changed_elements(self) -> int:
        """Changed elements over all tensors."""
        return sum(e.count for e in self.entries.values())

    def delta(self, name: str) -> TensorDelta:
        """Decompress and validate one tensor's delta.

        Raises:
            KeyError: the patch does not touch ``name``.
            PatchFormatError: the frame's declared size, real size or positions are invalid.
        """
        entry = self.entries[name]
        frame = self._frames[name]
        want = entry.payload_bytes
        declared = zstandard.frame_content_size(frame)
        if declared != want:
            raise PatchFormatError(f"tensor {name!r}: zstd frame declares {declared} bytes, metadata implies {want}; refusing to decompress")
        dobj = zstandard.ZstdDecompressor().decompressobj()
        try:
            raw = dobj.decompress(frame)
        except zstandard.ZstdError as exc:
            raise PatchFormatError(f"tensor {name!r}: corrupt zstd frame ({exc})") from None
        if len(raw) != want or not dobj.eof or dobj.unused_data:
            raise PatchFormatError(f"tensor {name!r}: zstd frame is truncated, longer than declared or followed by extra bytes")
        buf = np.frombuffer(raw, dtype=np.uint8)
        gw, isz, n = entry.gap_width, DTYPE_SIZES[entry.dtype], entry.count
        gaps = np.ascontiguousarray(buf[: n * gw].reshape(gw, n).T).view(np.uint32 if gw == 4 else np.uint64).reshape(n)
        values = np.ascontiguousarray(buf[n * gw :].reshape(isz, n).T).view(bits_type(entry.dtype)).reshape(n)
        numel = entry.numel
        if int(gaps.max()) >= numel:
            raise PatchFormatError(f"tensor {name!r}: a position gap exceeds the tensor's {numel} elements (index out of range or unsorted)")
        positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
        if int(positions[-1]) >= numel or (n > 1 and not bool(np.all(positions[1:] > positions[:-1]))):
            raise PatchFormatError(f"tensor {name!r}: positions run past the tensor's {numel} elements or are not increasing")
        return TensorDelta(entry, self.encoding, positions, values)

    def deltas(self) -> dict[str, TensorDelta]:
        """Decode and validate every tensor's delta (all of them, before any use)."""
        return {name: self.delta(name) for name in self.entries}


def _entry_from_json(obj: object, what: str) -> PatchEntry:
    if not isinstance(obj, dict):
        raise PatchFormatError(f"{what}: tensor entry is not an object")
    want = {"name", "dtype", "shape", "count", "gap_width", "frame_bytes", "base", "target"}
    if set(obj) != want:
        raise PatchFormatError(f"{what}: tensor entry keys {sorted(obj)} != {sorted(want)}")
    name = obj["name"]
    try:
        check_name(name if isinstance(name, str) else "", "tensor name")
    except Exception as exc:
        raise PatchFormatError(f"{what}: {exc}") from None
    dtype, shape = obj["dtype"], obj["shape"]
    if dtype not in DTYPE_SIZES:
        raise PatchFormatError(f"{what}: tensor {name!r} has unknown dtype {dtype!r}")
    ints = [obj["count"], obj["gap_width"], obj["frame_bytes"]]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape + ints):
        raise PatchFormatError(f"{what}: tensor {name!r} has a bad shape, count, gap_width or frame_bytes")
    numel = numel_of(shape)
    if numel > MAX_NUMEL:
        raise PatchFormatError(f"{what}: tensor {name!r} shape {shape} overflows")
    if not 1 <= obj["count"] <= numel:
        raise PatchFormatError(f"{what}: tensor {name!r} claims {obj['count']} changed elements of {numel}")
    if obj["gap_width"] not in (4, 8) or (obj["gap_width"] == 4 and numel > 2**32):
        raise PatchFormatError(f"{what}: tensor {name!r} has gap_width {obj['gap_width']} for {numel} elements")
    for key in ("base", "target"):
        sums = obj[key]
        if not isinstance(sums, dict) or not isinstance(sums.get(XXH3_128), str) or len(sums[XXH3_128]) != 32:
            raise PatchFormatError(f"{what}: tensor {name!r} lacks a {key} {XXH3_128} checksum")
    return PatchEntry(name, dtype, tuple(shape), obj["count"], obj["gap_width"], obj["frame_bytes"], dict(obj["base"]), dict(obj["target"]))


def read_patch(data: bytes | bytearray | memoryview, expected_size: int | None = None, what: str = "patch") -> Patch:
    """Parse and validate a patch file's container and metadata.

    Args:
        data: the whole file.
        expected_size: size in bytes the manifest states, if known.
        what: name used in error messages (e.g. the file path or sha256).

    Raises:
        PatchFormatError: size differs from ``expected_size``, not safetensors, not a
            stitchboard patch (format/version/encoding), an entry is invalid, a payload is
            missing, extra, not ``U8`` or of another size than ``frame_bytes``.
    """
    if expected_size is not None and len(data) != expected_size:
        raise PatchFormatError(f"{what}: {len(data)} bytes, the manifest says {expected_size}")
    meta, payloads = parse_safetensors(data, what)
    if set(meta) != {FORMAT}:
        raise PatchFormatError(f"{what}: not a stitchboard patch (no {FORMAT!r} metadata); an anchor is a plain checkpoint, load it instead")
    try:
        header = json.loads(meta[FORMAT])
    except json.JSONDecodeError as exc:
        raise PatchFormatError(f"{what}: {FORMAT!r} metadata is not JSON ({exc})") from None
    if not isinstance(header, dict) or set(header) != {"format_version", "encoding", "tensors", "metadata"}:
        raise PatchFormatError(f"{what}: {FORMAT!r} metadata must have format_version, encoding, tensors, metadata")
    if header["format_version"] != FORMAT_VERSION:
        raise PatchFormatError(f"{what}: patch format version {header['format_version']!r} is not supported (this reader knows {FORMAT_VERSION}); upgrade stitchboard")
    encoding, items, extra = header["encoding"], header["tensors"], header["metadata"]
    if encoding not in ENCODINGS:
        raise PatchFormatError(f"{what}: unknown encoding {encoding!r}")
    if not isinstance(items, list):
        raise PatchFormatError(f"{what}: 'tensors' is not a list")
    if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise PatchFormatError(f"{what}: 'metadata' must map strings to strings")
    entries: dict[str, PatchEntry] = {}
    for obj in items:
        entry = _entry_from_json(obj, what)
        if entry.name in entries:
            raise PatchFormatError(f"{what}: tensor {entry.name!r} listed twice")
        entries[entry.name] = entry
    frames: dict[str, memoryview] = {}
    for key, raw in payloads.items():
        name = key[len(PAYLOAD_PREFIX) :] if key.startswith(PAYLOAD_PREFIX) else None
        if name not in entries:
            raise PatchFormatError(f"{what}: payload {key!r} has no metadata entry")
        entry = entries[name]
        if raw.dtype != "U8" or raw.shape != (entry.frame_bytes,):
            raise PatchFormatError(f"{what}: payload {key!r} is {raw.dtype}{list(raw.shape)}, expected U8[{entry.frame_bytes}]")
        frames[name] = memoryview(raw.bits)
    missing = sorted(set(entries) - set(frames))
    if missing:
        raise PatchFormatError(f"{what}: no payload for tensors {missing[:5]}")
    return Patch(encoding, dict(sorted(entries.items())), dict(extra), len(data), frames)
