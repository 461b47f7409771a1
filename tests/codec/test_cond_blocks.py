"""The ``cond`` coder's class counting in blocks of 64 elements (proto/_condblocks.h: with AVX2 where the host has
it, else SSE2) against the SSE2 blocks and one element at a time, and the change record its scan hands the publisher.

All three ways must code the same stream and decode the same positions and values, or the same refusal of a
corrupt stream: the block walk is only a faster way to find each change's rank. Inputs cover every
kernel, sizes around the block edge, class mixes the hot classes cover wholly, mostly or barely (one
dominant class with rare others, random bits), and densities up to every element.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stitchboard.proto import _bitdiff, _condcoder
from stitchboard.proto.codec import encode_tensor
from stitchboard.proto.cond_codec import coder_args
from stitchboard.proto.dtypes import DTYPE_SIZES, bits_type

from .helpers import raw
from .test_cond_codec import stepped, weight_like

KERNELS = ["BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "U8", "I16", "I32", "I64"]
#: The ``loops`` argument: the fastest blocks (AVX2 on a host that has it), one element at a time, the SSE2 blocks.
FASTEST, ONE_BY_ONE, SSE2 = 0, 1, 2
OTHER_LOOPS = (ONE_BY_ONE, SSE2)


def base_bits(dtype: str, n: int, mix: str, rng: np.random.Generator) -> np.ndarray:
    """``n`` elements: weight-like, random bits, or one repeated value with 2 % of random others."""
    if mix == "weights":
        return weight_like(dtype, n, rng)
    info = np.iinfo(bits_type(dtype))
    random = rng.integers(info.min, info.max, size=n, dtype=bits_type(dtype), endpoint=True)
    if mix == "random":
        return random
    out = np.full(n, random[0], dtype=bits_type(dtype))
    rare = rng.random(n) < 0.02
    out[rare] = random[rare]
    return out


def coded(dtype: str, base: np.ndarray, target: np.ndarray, loops: int) -> tuple[int, bytes]:
    return _condcoder.encode(base, target, *coder_args(dtype), loops)


def decoded(dtype: str, base: np.ndarray, stream: bytes, count: int, loops: int) -> tuple | str:
    """(positions, values) or the refusal's message."""
    positions, values = np.empty(count, np.int64), np.empty(count, bits_type(dtype))
    try:
        _condcoder.decode(base, stream, positions, values, *coder_args(dtype), loops)
    except ValueError as exc:
        return str(exc)
    return positions.tobytes(), values.tobytes()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the block walk is built for x86-64 only")
def test_this_host_counts_in_blocks():
    assert _condcoder.blocks == 1
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # the AVX2 blocks run where the CPU has AVX2
        flags = {f for line in cpuinfo.read_text().splitlines() if line.startswith("flags") for f in line.split()}
        assert _condcoder.avx2 == ("avx2" in flags)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(KERNELS),
    n=st.sampled_from([63, 64, 65, 128, 191, 1000, 4160]),
    mix=st.sampled_from(["weights", "random", "dominant"]),
    frac=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
)
def test_blocks_code_and_decode_as_one_by_one(seed: int, dtype: str, n: int, mix: str, frac: float):
    rng = np.random.default_rng(seed)
    base = base_bits(dtype, n, mix, rng)
    target = stepped(dtype, base, rng, frac, big=0.05)
    count, stream = coded(dtype, base, target, FASTEST)
    for loops in OTHER_LOOPS:
        assert (count, stream) == coded(dtype, base, target, loops)
    changed = np.flatnonzero(base != target)
    assert count == changed.size
    want = (changed.astype(np.int64).tobytes(), target[changed].tobytes())
    for loops in (FASTEST, *OTHER_LOOPS):
        assert decoded(dtype, base, stream, count, loops) == want


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(["BF16", "F32", "F8_E4M3", "U8"]),
    n=st.sampled_from([64, 200, 4160]),
    frac=st.sampled_from([0.01, 0.2]),
    flips=st.integers(1, 3),
    count_delta=st.sampled_from([0, 0, -1, 1]),
)
def test_corrupt_streams_are_refused_alike(seed: int, dtype: str, n: int, frac: float, flips: int, count_delta: int):
    """A stream with flipped bits, or a wrong count: every walk gives the same refusal (or, rarely, the same bits)."""
    rng = np.random.default_rng(seed)
    base = weight_like(dtype, n, rng)
    target = stepped(dtype, base, rng, frac, big=0.05)
    target[0] ^= bits_type(dtype)(1)
    count, stream = coded(dtype, base, target, FASTEST)
    bad = bytearray(stream)
    for _ in range(flips):
        bad[int(rng.integers(0, len(bad)))] ^= 1 << int(rng.integers(0, 8))
    count = max(0, count + count_delta)
    blocks = decoded(dtype, base, bytes(bad), count, FASTEST)
    for loops in OTHER_LOOPS:
        assert blocks == decoded(dtype, base, bytes(bad), count, loops)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(KERNELS),
    n=st.sampled_from([1, 63, 64, 65, 1000, 4160]),
    frac=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    loops=st.sampled_from([FASTEST, *OTHER_LOOPS]),
)
def test_the_change_record_is_the_one_a_compare_pass_finds(seed, dtype, n, frac, loops):
    """``with_change``: the scan's changed positions and new bits, as ``_bitdiff.diff`` finds them alone."""
    rng = np.random.default_rng(seed)
    base = weight_like(dtype, n, rng)
    target = stepped(dtype, base, rng, frac, big=0.05)
    args = (*coder_args(dtype), loops)
    count, stream, gaps, values = _condcoder.encode(base, target, *args, True)
    assert (count, stream) == _condcoder.encode(base, target, *args)
    assert (count, gaps, values) == _bitdiff.diff(base, target, DTYPE_SIZES[dtype], False)


@pytest.mark.parametrize(
    ("encoding", "part_bytes", "kept"),
    [("cond", None, True), ("overwrite", None, True), ("xor", None, False), ("cond", 256, False)],
)
def test_encode_tensor_keeps_the_change_where_its_encoder_finds_it(encoding, part_bytes, kept):
    rng = np.random.default_rng(5)
    base = weight_like("BF16", 64 * 64, rng)
    target = stepped("BF16", base, rng, 0.05, big=0.0)
    encoded = encode_tensor(
        "w",
        raw("BF16", (64, 64), base),
        raw("BF16", (64, 64), target),
        encoding,
        part_bytes=part_bytes,
        keep_change=True,
    )
    assert encoded is not None
    want = _bitdiff.diff(base, target, 2, False)
    assert encoded.change == ((want[1], want[2]) if kept else None)
