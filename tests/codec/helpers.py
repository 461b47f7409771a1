"""Builders for codec tests: random views and hand-made (malformed) patch files."""

from __future__ import annotations

import json
import struct

import numpy as np

from stitchboard.proto.codec import FORMAT, FORMAT_VERSION, PAYLOAD_PREFIX
from stitchboard.proto.container import RawTensor, serialize_safetensors
from stitchboard.proto.dtypes import bits_type


def raw(dtype: str, shape: tuple[int, ...], bits: np.ndarray) -> RawTensor:
    """A RawTensor owning a writable copy of ``bits``."""
    return RawTensor(dtype, shape, np.ascontiguousarray(bits, dtype=bits_type(dtype)).reshape(-1).copy())


def copy_view(view: dict[str, RawTensor]) -> dict[str, RawTensor]:
    """Deep copy of a view (writable)."""
    return {k: RawTensor(t.dtype, t.shape, t.bits.copy()) for k, t in view.items()}


def same_bits(a: dict[str, RawTensor], b: dict[str, RawTensor]) -> bool:
    """Bitwise equality of two views (names, dtypes, shapes, bits)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and tuple(a[k].shape) == tuple(b[k].shape) and np.array_equal(a[k].bits, b[k].bits) for k in a
    )


def patch_file(entries: list[dict], frames: dict[str, bytes], encoding: str = "xor", payload_dtype: str = "U8") -> bytes:
    """A patch file with the given metadata entries and raw frames (no validation)."""
    meta = {FORMAT: json.dumps({"format_version": FORMAT_VERSION, "encoding": encoding, "tensors": entries, "metadata": {}})}
    payloads = {PAYLOAD_PREFIX + n: RawTensor(payload_dtype, (len(f),), np.frombuffer(f, dtype=np.uint8)) for n, f in frames.items()}
    return serialize_safetensors(payloads, meta)


def rewrite_header(data: bytes, edit) -> bytes:
    """Apply ``edit(header_text) -> header_text`` to a safetensors file's JSON header."""
    (n,) = struct.unpack("<Q", data[:8])
    text = edit(data[8 : 8 + n].decode())
    body = text.encode()
    pad = (-len(body)) % 8
    body += b" " * pad
    return struct.pack("<Q", len(body)) + body + data[8 + n :]
