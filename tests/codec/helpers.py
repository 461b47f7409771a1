"""Builders for codec tests: random views and hand-made (malformed) patch files."""

from __future__ import annotations

import json
import struct

import numpy as np
import zstandard

from stitchboard.proto.codec import FORMAT, FORMAT_VERSION, INDEX_KEY, PAYLOAD_KEY
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
        a[k].dtype == b[k].dtype and tuple(a[k].shape) == tuple(b[k].shape) and np.array_equal(a[k].bits, b[k].bits)
        for k in a
    )


def varints(values: list[int]) -> bytes:
    """LEB128 encoding of unsigned integers."""
    out = bytearray()
    for v in values:
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def bf16_payload(gap_stream: bytes, values: list[int]) -> bytes:
    """Uncompressed payload of a one-tensor bf16 patch: varint gaps, then the two value planes."""
    v = np.array(values, dtype=np.uint16)
    return gap_stream + v.view(np.uint8).reshape(len(v), 2).T.tobytes()


def patch_file(
    entries: list[dict], frame: bytes, encoding: str = "xor", index: bytes | None = None, extra: dict | None = None
) -> bytes:
    """A patch file with the given index entries and payload frame (no validation)."""
    meta = {FORMAT: json.dumps({"format_version": FORMAT_VERSION, "encoding": encoding, "metadata": {}})}
    if index is None:
        index = zstandard.ZstdCompressor().compress(json.dumps(entries).encode())
    payloads = {
        INDEX_KEY: RawTensor("U8", (len(index),), np.frombuffer(index, dtype=np.uint8)),
        PAYLOAD_KEY: RawTensor("U8", (len(frame),), np.frombuffer(frame, dtype=np.uint8)),
        **(extra or {}),
    }
    return serialize_safetensors(payloads, meta)


def rewrite_header(data: bytes, edit) -> bytes:
    """Apply ``edit(header_text) -> header_text`` to a safetensors file's JSON header."""
    (n,) = struct.unpack("<Q", data[:8])
    text = edit(data[8 : 8 + n].decode())
    body = text.encode()
    pad = (-len(body)) % 8
    body += b" " * pad
    return struct.pack("<Q", len(body)) + body + data[8 + n :]
