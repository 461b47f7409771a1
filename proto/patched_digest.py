"""The checksum a tensor would have with a delta applied, computed without a fresh copy of the tensor.

Runs wherever a delta's target is checked without writing its base: engine workers staging a patch on the live
bits, the patch reader checking a decoded ``cond`` delta, the trainer's device differ. A patch states each
tensor's target checksum; the usual way to check it is to copy the base, apply the delta to the copy and hash
the copy, which costs a whole tensor of fresh memory per tensor staged (at ~1 % density every tensor of a real
RL step changes: for SmolLM2-135M that is 269 MB of first-touch pages per version). Here nothing is allocated
per tensor:

* a range of at most :data:`WHOLE_BYTES` (every tensor of a dense model but its embeddings, and every row part
  of a parted one) is copied into one buffer per thread, kept and reused, given its new bits and hashed: three
  calls that release the GIL;
* a larger range is read where it lives, chunk by chunk (:data:`CHUNK_BYTES`): a chunk the delta does not touch
  is hashed in place, a touched one copied into the start of the same thread buffer (it stays in the core's
  cache), given its new bits and hashed, xxh3-128's streaming state carrying over the chunks.

Both give the one-shot digest of the applied range bit for bit (xxh3's streaming and one-shot forms are the same
function). The chunk loop holds the GIL for a few numpy calls per 256 KiB: two engine staging threads running it
side by side took longer than one (0.08-0.10 s against 0.06 s for 150 SmolLM2-sized tensors at 0.9 % density on
the CI's 2-core host), the whole-range copy 0.033-0.040 s on two threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from .parts import Layout, block, digest, grid, parts_checksum

__all__ = ["CHUNK_BYTES", "WHOLE_BYTES", "patched_checksum"]

#: Bytes hashed per step of a range larger than :data:`WHOLE_BYTES`: a touched chunk's copy (256 KiB) stays in a
#: core's L2 cache between its copy, its writes and its hash.
CHUNK_BYTES = 1 << 18
#: Largest range copied whole into its thread's buffer (4 MiB: twice the default row part,
#: :data:`stitchboard.trainer_client.link.PART_BYTES`); so each thread that checks keeps at most 4 MiB.
WHOLE_BYTES = 1 << 22

_scratch = threading.local()


def _buffer(nbytes: int) -> np.ndarray:
    """This thread's reused buffer, uint8 [>= nbytes] (grown to the largest range it has copied)."""
    buf: np.ndarray | None = getattr(_scratch, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _scratch.buf = np.empty(nbytes, dtype=np.uint8)
    return buf


def _apply(buf: np.ndarray, at: np.ndarray, values: np.ndarray, xor: bool) -> None:
    """Write ``values`` (or XOR them, ``xor``) at ``at`` of ``buf`` in place."""
    if xor:
        buf[at] ^= values
    else:
        buf[at] = values


def _digest_range(bits: np.ndarray, offset: int, positions: np.ndarray, values: np.ndarray, xor: bool) -> str:
    """xxh3-128 hex of ``bits`` (a flat contiguous range of a tensor starting at flat element ``offset``) with
    the changes ``positions`` (whole-tensor flat indices inside the range, increasing) applied."""
    if bits.nbytes <= WHOLE_BYTES:
        if not positions.size:
            return xxhash.xxh3_128_hexdigest(bits.view(np.uint8).data)
        buf = _buffer(bits.nbytes)[: bits.nbytes].view(bits.dtype)
        np.copyto(buf, bits)
        _apply(buf, positions - offset if offset else positions, values, xor)
        return xxhash.xxh3_128_hexdigest(buf.view(np.uint8).data)
    h = xxhash.xxh3_128()
    n = int(bits.size)
    step = max(1, CHUNK_BYTES // bits.itemsize)
    cuts = np.searchsorted(positions, offset + np.arange(0, n + step, step, dtype=np.int64))
    scratch = _buffer(step * bits.itemsize)[: step * bits.itemsize].view(bits.dtype)  # the same thread buffer
    for i, a in enumerate(range(0, n, step)):
        b = min(a + step, n)
        lo, hi = int(cuts[i]), int(cuts[i + 1])
        if lo == hi:
            h.update(bits[a:b].view(np.uint8).data)
            continue
        buf = scratch[: b - a]
        np.copyto(buf, bits[a:b])
        _apply(buf, positions[lo:hi] - (offset + a), values[lo:hi], xor)
        h.update(buf.view(np.uint8).data)
    return h.hexdigest()


def patched_checksum(
    bits: np.ndarray,
    shape: Sequence[int],
    positions: np.ndarray,
    values: np.ndarray,
    *,
    xor: bool = False,
    layout: Layout | None = None,
) -> str:
    """The checksum :func:`~stitchboard.proto.parts.tensor_checksum` gives the tensor ``bits`` would be after the
    delta, without writing ``bits`` or allocating per call: a range of at most :data:`WHOLE_BYTES` is copied into
    the calling thread's reused buffer, a larger one :data:`CHUNK_BYTES` at a time (a column block of a ``dim`` 1
    layout is copied whole, as :func:`~stitchboard.proto.parts.block` does).

    Args:
        bits: the base tensor's flat bits (``bits_type(dtype)`` [numel], C-contiguous; read only).
        shape: its shape.
        positions: int64 [k], strictly increasing flat indices < numel (a decoded delta's positions).
        values: ``bits``' dtype [k]: the new bits, or with ``xor`` the bits to XOR in.
        xor: whether ``values`` are XOR bits (the ``xor`` encoding) rather than new bits.
        layout: the part layout of an :data:`~stitchboard.proto.parts.XXH3_128_PARTS` checksum; None:
            ``xxh3_128`` of the whole tensor.

    Returns:
        The hex digest (``xxh3_128``, or ``xxh3_128_parts`` over ``layout``).

    Raises:
        ValueError: ``positions`` and ``values`` differ in length, or ``bits`` is not flat and contiguous.
    """
    if (
        positions.shape != values.shape
        or values.itemsize != bits.itemsize
        or bits.ndim != 1
        or not bits.flags.c_contiguous
    ):
        raise ValueError(
            f"patched_checksum: {positions.size} positions for {values.size} values of {values.itemsize} bytes over "
            f"bits of shape {bits.shape} and {bits.itemsize} bytes (want equal counts and element sizes over flat, "
            "contiguous bits)"
        )
    values = values.view(bits.dtype)
    if layout is None:
        return _digest_range(bits, 0, positions, values, xor)
    cols = grid(shape)[1]
    digests = []
    for dim, start, stop in layout:
        if dim == 0:
            lo, hi = np.searchsorted(positions, [start * cols, stop * cols])
            d = _digest_range(bits[start * cols : stop * cols], start * cols, positions[lo:hi], values[lo:hi], xor)
        else:
            copy = block(bits, shape, dim, start, stop)  # a copy of the columns, never a view of ``bits``
            col = positions % cols
            inside = np.flatnonzero((col >= start) & (col < stop))
            width = stop - start
            _apply(copy, (positions[inside] // cols) * width + col[inside] - start, values[inside], xor)
            d = digest(copy)
        digests.append((dim, start, stop, d))
    return parts_checksum(digests)
