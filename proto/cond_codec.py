"""The ``cond`` encoding: positions and values coded conditioned on the base's bits.

An AdamW step moves every weight by about the learning rate; a bf16 element changes only when
that crosses a rounding boundary, whose spacing is proportional to its magnitude. So the base's
exponent, which the decoder holds, predicts both whether an element changed and by how many
grid steps. ``cond`` codes each tensor's changes with an adaptive binary range coder whose
contexts are the base element's exponent class (and sign, for values): over 30 real SmolLM2
AdamW steps it takes 0.22-0.64 bytes per changed element (median 0.53) against 1.21-1.84
(median 1.51) for ``xor``, whole patch files (``python -m tests.benchmarks.bench_codec``).
Like ``xor`` it is valid only on its exact base (the base checksum enforces that), and decoding
needs that whole base tensor (a tensor-parallel rank holding a slice cannot decode alone).

Byte format (patch format version 1, header ``"encoding": "cond"``). The container and index
are those of :mod:`stitchboard.proto.codec`; each index entry's ``gap_bytes`` is the length of
the tensor's coded stream, and ``__payload__`` holds the streams of the listed tensors
concatenated in name order, uncompressed (range-coded bytes do not compress).

Per tensor, elements are read as unsigned little-endian integers of w = 8 x element-size bits:

* class(x) = (x >> S) & (2^B - 1) with (S, B) from :data:`LAYOUTS` (the exponent field of a
  float; B = 0, one class, for integer and packed types); value context v(x) = 2 class(x) +
  (x >> (w - 1)).
* key(x), the monotone order of the bit patterns: for float dtypes (sign-magnitude) key(x) =
  x | 2^(w-1) if the sign bit of x is clear, else (NOT x) mod 2^w; for the others key(x) = x.
* The rank of element i is the number of elements j < i of its class. A change's step is
  d = key(new) - key(old) mod 2^w, negative iff d > 2^(w-1), of magnitude m in [1, 2^(w-1)] (a
  step of exactly 2^(w-1) is coded as positive).

The stream codes, in this order:

1. for each class c = 0 .. 2^B - 1: NUMBER(n_c) with the models (CU_h, CM_h), n_c its number of
   changes and h = 1 if class c - 1 has changes (h = 0 for c = 0); if n_c > 0, NUMBER(rank of
   its first change) with the class's models (GU_c, GM_c);
2. for each change, in position order, with c, r its class and rank: VALUE(v, d); then, if its
   class has changes left, NUMBER(r' - r - 1) with (GU_c, GM_c), r' the rank of the class's
   next change.

NUMBER(x), x >= 0, with models (U, M): the bucket u = bitlen(x + 1) - 1 in [0, 62] in unary:
bits (u > i) with U[i] for i = 0, 1 .. until a 0 or after i = 61; then, if u >= 1, bit u-1 of
x + 1 with M[u][0], if u >= 2 bit u-2 with M[u][1 + bit u-1], then bits u-3 .. 0 as flat bits.

VALUE(v, d): the sign with model S_v; then with s the sign, the bucket beta = bitlen(m) in
[1, w] in unary: bits (beta > i) with U_{v,s}[i] for i = 1, 2 .. until a 0 or after i = w - 1;
then the beta - 1 bits of m under its leading one, most significant first: the first
min(beta - 1, 8) through the bit tree V_{v,s,beta} (node 1; child 2 node + bit), the next up to
16 with models P_{v,s,beta}[j] (j = bit index after the tree bits), the rest as flat bits.

Range coder: LZMA's (32-bit range, 33-bit low with carry propagation, initial range 2^32 - 1,
normalised by shifting out a byte while range < 2^24, flushed with 5 byte shifts), except that
its first output byte, always 0, is not stored: the decoder starts by reading 4 bytes. A modelled
bit with P(0) = p / 65536: bound = (range >> 16) p; 0 sets range = bound; 1 adds bound to low
and subtracts it from range. A flat bit halves range and adds it to low for 1. Every model
starts, in each tensor's stream, at p = 32768 with count n = 0 and after each bit moves with rate r = floor(65536 / (n +
2)): p += ((65536 - p) r) >> 16 after a 0, p -= (p r) >> 16 after a 1, p clamped to [32, 65504],
n = min(n + 1, 126).

A decoder refuses (:class:`PatchFormatError`, before anything is written) class counts that
do not add up to the entry's count, a gap that runs past the end of its class, a magnitude
above 2^(w-1) or a negative one of 2^(w-1), and a stream whose last change does not end
exactly on its last byte. Decoding reads each base element and each stream byte at most once,
whatever the input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _condcoder
from .container import RawTensor
from .dtypes import DTYPE_SIZES
from .errors import PatchFormatError


@dataclass(frozen=True)
class CondLayout:
    """How ``cond`` reads one dtype's bits.

    Attributes:
        class_shift, class_bits: the class is ``(bits >> class_shift) & (2**class_bits - 1)``
            (``class_bits`` <= 8; 0 means one class).
        sign_magnitude: steps are taken in the monotone order of sign-magnitude floats (else of
            the unsigned bit patterns).
    """

    class_shift: int
    class_bits: int
    sign_magnitude: bool


#: Shortest stream of a tensor with changes: the coder's flush leaves at least 4 bytes.
MIN_STREAM_BYTES = 4

_PLAIN = CondLayout(0, 0, False)

#: dtype -> layout: the exponent field of each float format (IEEE 754, bfloat16, OCP FP8);
#: F64 uses the low 8 of its 11 exponent bits, F8_E8M0 (an exponent alone) its whole byte;
#: integer, bool and packed 4-bit (``U8``) tensors are one class, stepped as unsigned integers.
LAYOUTS: dict[str, CondLayout] = {
    "BF16": CondLayout(7, 8, True),
    "F16": CondLayout(10, 5, True),
    "F32": CondLayout(23, 8, True),
    "F64": CondLayout(52, 8, True),
    "F8_E4M3": CondLayout(3, 4, True),
    "F8_E5M2": CondLayout(2, 5, True),
    "F8_E8M0": CondLayout(0, 8, False),
    **{dtype: _PLAIN for dtype in ("BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64")},
}


def coder_args(dtype: str) -> tuple[int, int, int, bool]:
    """The arguments ``_condcoder.encode`` and ``decode`` take after the buffers for a dtype: (itemsize in bytes,
    class_shift, class_bits, sign_magnitude) from :data:`LAYOUTS` (raises KeyError for an unknown dtype)."""
    lay = LAYOUTS[dtype]
    return DTYPE_SIZES[dtype], lay.class_shift, lay.class_bits, lay.sign_magnitude


def encode(base: RawTensor, target: RawTensor) -> tuple[int, bytes]:
    """Code the changes from ``base`` to ``target`` (same dtype and shape; bits aligned).

    Returns:
        (number of changed elements, the tensor's coded stream; empty when nothing changed).
    """
    return _condcoder.encode(base.bits, target.bits, *coder_args(base.dtype))


def encode_keeping_change(base: RawTensor, target: RawTensor) -> tuple[int, bytes, bytes, bytes]:
    """:func:`encode`, and the change record its scan found on the way: (count, stream, the changed positions as
    varint gaps, their new bits), the last two as ``_bitdiff.diff(base, target, itemsize, False)`` gives them."""
    return _condcoder.encode(base.bits, target.bits, *coder_args(base.dtype), False, True)


def decode(stream: np.ndarray, base: RawTensor, count: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Decode and validate one tensor's stream against its base.

    Args:
        stream: uint8 [gap_bytes], the tensor's coded stream.
        base: the tensor's base bits (the caller has checked its checksum).
        count: changed elements the index lists (1 <= count <= numel).
        what: the tensor, for error messages.

    Returns:
        (positions, new bits): int64 [count], strictly increasing; ``bits_type(dtype)`` [count].

    Raises:
        PatchFormatError: the stream is malformed (see the module docstring).
    """
    positions = np.empty(count, dtype=np.int64)
    values = np.empty(count, dtype=base.bits.dtype)
    try:
        _condcoder.decode(base.bits, stream, positions, values, *coder_args(base.dtype))
    except ValueError as exc:
        raise PatchFormatError(f"{what}: {exc}") from None
    return positions, values
