"""Round-trip properties of the patch codec over random shapes, dtypes and change masks, for
every encoding (``xor``, ``overwrite``, ``cond``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from stitchboard.proto.apply import apply_patch, apply_to_copy
from stitchboard.proto.codec import ENCODINGS
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from stitchboard.proto.dtypes import bits_type
from stitchboard.proto.errors import BaseMismatchError, TensorSetMismatchError

from .helpers import copy_view, raw, same_bits

DTYPES = ["BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "U8", "F64"]
# Special bit patterns: NaN payloads (quiet and signalling, with payload bits), -0.0, +-Inf, denormals.
SPECIAL = {
    "BF16": [0x7FC1, 0xFF81, 0x7F81, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x8001],
    "F16": [0x7E01, 0xFC01, 0x8000, 0x7C00, 0x0001, 0x83FF],
    "F32": [0x7FC00001, 0xFF800001, 0x80000000, 0x7F800000, 0x00000001, 0x807FFFFF],
    "F64": [0x7FF8000000000001, 0x8000000000000000, 0x0000000000000001],
    "F8_E4M3": [0x7F, 0xFF, 0x80, 0x01],
    "F8_E5M2": [0x7D, 0xFE, 0x80, 0x7C, 0x01],
    "U8": [0x00, 0xFF, 0x0F],
}


@st.composite
def view_pair(draw):
    """Two views with the same tensors, differing by a drawn change mask per tensor."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base, target = {}, {}
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        info = np.iinfo(bits_type(dtype))
        b = rng.integers(0, int(info.max) + 1, size=n, dtype=bits_type(dtype), endpoint=False)
        specials = np.array(SPECIAL[dtype], dtype=bits_type(dtype))
        if n:
            b[rng.integers(0, n, size=min(n, 3))] = rng.choice(specials, size=min(n, 3))
        mask_kind = draw(st.sampled_from(["none", "all", "one", "clustered", "random"]))
        mask = np.zeros(n, dtype=bool)
        if n and mask_kind == "all":
            mask[:] = True
        elif n and mask_kind == "one":
            mask[rng.integers(0, n)] = True
        elif n and mask_kind == "clustered":
            start = int(rng.integers(0, n))
            mask[start : start + int(rng.integers(1, 6))] = True
        elif n and mask_kind == "random":
            mask = rng.random(n) < 0.3
        t = b.copy()
        flips = rng.integers(1, int(info.max) + 1, size=int(mask.sum()), dtype=bits_type(dtype), endpoint=False)
        t[mask] ^= flips  # nonzero XOR: every masked element really changes
        if mask.any():  # changed elements may become special values too
            t[np.flatnonzero(mask)[0]] = specials[0] if b[np.flatnonzero(mask)[0]] != specials[0] else specials[1]
        base[f"layers.{i}.w"] = raw(dtype, shape, b)
        target[f"layers.{i}.w"] = raw(dtype, shape, t)
    return base, target


@settings(max_examples=200, deadline=None)
@given(pair=view_pair(), encoding=st.sampled_from(ENCODINGS))
def test_apply_of_diff_is_target_bitwise(pair, encoding):
    base, target = pair
    result = diff_views(base, target, encoding)
    patch = read_patch(result.patch)
    expected_changed = sum(int(np.count_nonzero(base[k].bits != target[k].bits)) for k in base)
    assert result.changed_elements == patch.changed_elements == expected_changed
    out = apply_to_copy(base, patch)
    assert same_bits(out, target)


@settings(max_examples=60, deadline=None)
@given(pair=view_pair(), encoding=st.sampled_from(["xor", "cond"]))
def test_base_only_encodings_are_refused_on_wrong_base_and_on_their_own_result(pair, encoding):
    base, target = pair
    patch = read_patch(diff_views(base, target, encoding).patch)
    if not patch.entries:
        return
    applied = copy_view(base)
    apply_patch(applied, patch)
    before = copy_view(applied)
    with pytest.raises(BaseMismatchError):
        apply_patch(applied, patch)  # twice
    assert same_bits(applied, before)
    wrong = copy_view(base)
    name = next(iter(patch.entries))
    wrong[name].bits[0] ^= wrong[name].bits.dtype.type(1)
    snapshot = copy_view(wrong)
    with pytest.raises(BaseMismatchError):
        apply_patch(wrong, patch)
    assert same_bits(wrong, snapshot)


@settings(max_examples=60, deadline=None)
@given(pair=view_pair())
def test_overwrite_applied_again_to_its_result_still_yields_target(pair):
    base, target = pair
    patch = read_patch(diff_views(base, target, "overwrite").patch)
    view = copy_view(base)
    apply_patch(view, patch)
    second = apply_patch(view, patch)
    assert second.tensors_written == 0
    assert same_bits(view, target)


def test_empty_delta_round_trips():
    base = {"a": raw("BF16", (4, 4), np.arange(16)), "b": raw("F32", (3,), np.arange(3))}
    result = diff_views(base, copy_view(base))
    patch = read_patch(result.patch)
    assert result.changed_elements == 0 and patch.entries == {} and result.changed_tensors == []
    assert set(result.target_checksums) == {"a", "b"}
    assert same_bits(apply_to_copy(base, patch), base)


def test_patch_file_is_plain_safetensors(tmp_path):
    base = {"w": raw("BF16", (8,), np.arange(8))}
    target = copy_view(base)
    target["w"].bits[3] = 0x7FC1
    path = tmp_path / "p.safetensors"
    path.write_bytes(diff_views(base, target).patch)
    with safe_open(str(path), "np") as f:
        assert sorted(f.keys()) == ["__index__", "__payload__"]
        assert json.loads(f.metadata()["stitchboard.patch"])["encoding"] == "xor"


def test_tensor_set_change_needs_an_anchor():
    base = {"w": raw("BF16", (8,), np.arange(8))}
    with pytest.raises(TensorSetMismatchError, match="anchor"):
        diff_views(base, {"w": raw("BF16", (2, 4), np.arange(8))})
    with pytest.raises(TensorSetMismatchError, match="added"):
        diff_views(base, {**base, "v": raw("U8", (1,), np.zeros(1))})
