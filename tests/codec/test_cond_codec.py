"""The ``cond`` encoding: every dtype's kernel, steps in bit order, base handling, determinism.

The round-trip properties shared with the other encodings are in test_codec_roundtrip.py; here
the base values look like weights (so exponent classes matter) and changes are small steps in
the monotone order of the bit patterns, as real optimizer steps are.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stitchboard.proto import cond_codec
from stitchboard.proto.apply import apply_to_copy
from stitchboard.proto.codec import encode_tensor
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from stitchboard.proto.dtypes import DTYPE_SIZES, bits_type
from stitchboard.proto.errors import BaseMismatchError, TensorSetMismatchError

from .helpers import copy_view, raw, same_bits


def key(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The monotone order of the bit patterns (module docstring of cond_codec), as uint64."""
    w = 8 * DTYPE_SIZES[dtype]
    x = bits.astype(np.uint64)
    if not cond_codec.LAYOUTS[dtype].sign_magnitude:
        return x
    sign, mask = np.uint64(1 << (w - 1)), np.uint64((1 << w) - 1)
    return np.where(x & sign, ~x & mask, x | sign)


def unkey(k: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of :func:`key`."""
    w = 8 * DTYPE_SIZES[dtype]
    k = k & np.uint64((1 << w) - 1) if w < 64 else k
    if cond_codec.LAYOUTS[dtype].sign_magnitude:
        sign, mask = np.uint64(1 << (w - 1)), np.uint64((1 << w) - 1)
        k = np.where(k & sign, k ^ sign, ~k & mask)
    return k.astype(bits_type(dtype))


def weight_like(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Bits of values spread like weights (normal, std 0.02, some exact zeros), else random bits."""
    if dtype in ("BF16", "F16", "F32", "F64"):
        vals = rng.normal(0, 0.02, n)
        vals[rng.random(n) < 0.05] = 0.0
        f32 = vals.astype(np.float32)
        if dtype == "BF16":
            return (f32.view(np.uint32) >> 16).astype(np.uint16)
        return vals.astype({"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]).view(bits_type(dtype))
    return rng.integers(0, np.iinfo(bits_type(dtype)).max, size=n, dtype=bits_type(dtype), endpoint=True)


def stepped(dtype: str, base: np.ndarray, rng: np.random.Generator, frac: float, big: float) -> np.ndarray:
    """``base`` with a fraction ``frac`` of elements moved by +-1..3 steps in bit order, a
    fraction ``big`` of those by a large random step (sign and exponent changes, NaN payloads)."""
    n = base.size
    where = np.flatnonzero(rng.random(n) < frac)
    steps = rng.choice(np.array([-3, -2, -1, 1, 2, 3], dtype=np.int64), size=where.size)
    far = rng.random(where.size) < big
    steps[far] = rng.integers(-(2**62), 2**62, size=int(far.sum()))
    steps[steps == 0] = 1
    out = base.copy()
    out[where] = unkey(key(base[where], dtype) + steps.astype(np.uint64), dtype)
    return out


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
@pytest.mark.parametrize("n", [1, 7, 4099])
def test_every_dtype_round_trips(dtype: str, n: int):
    rng = np.random.default_rng(n)
    b = weight_like(dtype, n, rng)
    t = stepped(dtype, b, rng, frac=0.2 if n > 1 else 1.0, big=0.1)
    if np.array_equal(b, t):
        t[0] ^= bits_type(dtype)(1)  # at least one change
    base, target = {"w": raw(dtype, (n,), b)}, {"w": raw(dtype, (n,), t)}
    patch = read_patch(diff_views(base, target, "cond").patch)
    assert patch.changed_elements == int(np.count_nonzero(b != t))
    assert same_bits(apply_to_copy(base, patch), target)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(["BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "F8_E8M0", "U8", "F64"]),
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    frac=st.sampled_from([0.001, 0.02, 0.3, 1.0]),
    big=st.sampled_from([0.0, 0.05, 1.0]),
)
def test_small_steps_round_trip(seed: int, dtype: str, shape: list[int], frac: float, big: float):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    b = weight_like(dtype, n, rng)
    t = stepped(dtype, b, rng, frac, big)
    base, target = {"w": raw(dtype, tuple(shape), b)}, {"w": raw(dtype, tuple(shape), t)}
    patch = read_patch(diff_views(base, target, "cond").patch)
    assert same_bits(apply_to_copy(base, patch), target)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "F8_E4M3", "U8", "I32"])
def test_extreme_steps_zero_crossings_and_special_values(dtype: str):
    """Steps of exactly half the range (both directions), -0.0 <-> +0.0, tiny values changing
    sign, NaN payloads and infinities, to and from every one of them."""
    w = 8 * DTYPE_SIZES[dtype]
    half, top = 1 << (w - 1), (1 << w) - 1
    specials = [0, half, 1, half | 1, top, top ^ 1, half - 1, (half - 1) ^ 1, 2, half | 2]
    pairs = [(a, b) for a in specials for b in specials if a != b]
    k0 = key(np.array([5], dtype=bits_type(dtype)), dtype)
    pairs += [(5, int(unkey(k0 + np.uint64(half), dtype)[0])), (int(unkey(k0 + np.uint64(half), dtype)[0]), 5)]
    b = np.array([p[0] for p in pairs], dtype=bits_type(dtype))
    t = np.array([p[1] for p in pairs], dtype=bits_type(dtype))
    base, target = {"w": raw(dtype, (len(pairs),), b)}, {"w": raw(dtype, (len(pairs),), t)}
    assert same_bits(apply_to_copy(base, read_patch(diff_views(base, target, "cond").patch)), target)


def test_layouts_cover_every_dtype_with_a_kernel():
    assert set(cond_codec.LAYOUTS) == set(DTYPE_SIZES)
    for dtype in DTYPE_SIZES:
        one = raw(dtype, (3,), np.array([0, 1, 2]))
        count, stream = cond_codec.encode(one, raw(dtype, (3,), np.array([0, 2, 2])))
        assert count == 1 and len(stream) >= cond_codec.MIN_STREAM_BYTES


def test_a_cond_delta_needs_its_exact_base():
    rng = np.random.default_rng(3)
    b = weight_like("BF16", 256, rng)
    base, target = {"w": raw("BF16", (16, 16), b)}, {"w": raw("BF16", (16, 16), stepped("BF16", b, rng, 0.1, 0.0))}
    patch = read_patch(diff_views(base, target, "cond").patch)
    with pytest.raises(ValueError, match="against its base"):
        patch.delta("w")
    with pytest.raises(ValueError, match="against its base"):
        patch.deltas()
    wrong = copy_view(base)
    wrong["w"].bits[0] ^= np.uint16(1)
    with pytest.raises(BaseMismatchError, match="exact base"):
        patch.delta("w", wrong["w"])
    with pytest.raises(TensorSetMismatchError):
        patch.delta("w", raw("BF16", (256,), b))
    delta = patch.delta("w", base["w"])
    assert delta.encoding == "cond" and np.array_equal(delta.values, target["w"].bits[delta.positions])


def test_bytes_do_not_depend_on_threads_or_on_what_was_coded_before():
    rng = np.random.default_rng(4)
    base, target = {}, {}
    for i, (dtype, n) in enumerate([("BF16", 5000), ("F32", 3000), ("BF16", 70), ("F8_E4M3", 900), ("F16", 2000)]):
        b = weight_like(dtype, n, rng)
        base[f"t{i}"], target[f"t{i}"] = raw(dtype, (n,), b), raw(dtype, (n,), stepped(dtype, b, rng, 0.05, 0.02))
    one = diff_views(base, target, "cond", threads=1).patch
    assert diff_views(base, target, "cond", threads=4).patch == one
    alone = encode_tensor("t2", base["t2"], target["t2"], "cond")
    encode_tensor("t0", base["t0"], target["t0"], "cond")  # this thread's model now holds other statistics
    again = encode_tensor("t2", base["t2"], target["t2"], "cond")
    assert alone is not None and again is not None and alone.gaps == again.gaps


def test_cond_is_much_smaller_than_xor_on_adam_like_steps():
    """fp32 masters on the bf16 grid, moved by a constant ~lr each step: which elements cross a
    rounding boundary depends on their exponent, which the decoder knows."""
    rng = np.random.default_rng(5)
    master = rng.normal(0, 0.02, 200_000).astype(np.float32)
    master = ((master.view(np.uint32) >> 16) << 16).view(np.float32)  # start on the bf16 grid
    views = []
    for _ in range(8):
        bf = (master.view(np.uint32) + 0x7FFF + ((master.view(np.uint32) >> 16) & 1)) >> 16  # round to nearest even
        views.append({"w": RawTensor("BF16", (400, 500), bf.astype(np.uint16))})
        master = master - np.float32(3e-5) * np.sign(rng.normal(0.3, 1, master.size)).astype(np.float32)
    cond = sum(len(diff_views(a, b, "cond").patch) for a, b in itertools.pairwise(views))
    xor = sum(len(diff_views(a, b, "xor").patch) for a, b in itertools.pairwise(views))
    assert cond < 0.6 * xor
