"""Malformed patch files: each raises a typed error and leaves the base untouched."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard

from stitchboard.proto.apply import apply_patch
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from stitchboard.proto.errors import PatchError, PatchFormatError, TensorSetMismatchError

from .helpers import copy_view, patch_file, raw, rewrite_header, same_bits

BASE = {"model.w": raw("BF16", (4, 8), np.arange(32) * 7), "model.v": raw("F32", (5,), np.arange(5))}


def good_patch() -> bytes:
    target = copy_view(BASE)
    target["model.w"].bits[[1, 9, 30]] ^= np.uint16(5)
    target["model.v"].bits[2] = 0x7FC00001
    return diff_views(BASE, target).patch


def entry(count=1, gap_width=4, frame=b"", name="model.w", dtype="BF16", shape=(4, 8)) -> dict:
    z = "0" * 32
    return {"name": name, "dtype": dtype, "shape": list(shape), "count": count, "gap_width": gap_width,
            "frame_bytes": len(frame), "base": {"xxh3_128": z}, "target": {"xxh3_128": z}}


def frame_of(gaps: list[int], values: list[int], gap_dtype=np.uint32) -> bytes:
    g = np.array(gaps, dtype=gap_dtype)
    v = np.array(values, dtype=np.uint16)
    planes = np.concatenate([g.view(np.uint8).reshape(len(g), -1).T.ravel(), v.view(np.uint8).reshape(len(v), -1).T.ravel()])
    return zstandard.ZstdCompressor().compress(planes.tobytes())


def assert_refused(data: bytes, error=PatchFormatError, expected_size=None, match=None) -> None:
    """Reading and applying ``data`` raises ``error``; the base view is unchanged."""
    view = copy_view(BASE)
    with pytest.raises(error, match=match):
        apply_patch(view, read_patch(data, expected_size=expected_size))
    assert same_bits(view, BASE)


def test_good_patch_applies():
    view = copy_view(BASE)
    apply_patch(view, read_patch(good_patch()))
    assert not same_bits(view, BASE)


def test_truncated_file():
    data = good_patch()
    for cut in (0, 5, 8, 40, len(data) - 1):
        assert_refused(data[:cut])


def test_header_length_larger_than_file():
    data = good_patch()
    assert_refused((len(data)).to_bytes(8, "little") + data[8:], match="larger than the file")


def test_duplicate_tensor_names():
    data = good_patch()

    def dup(text: str) -> str:
        header = json.loads(text)
        key = "delta/model.w"
        item = json.dumps(header[key])
        return text.rstrip()[:-1] + f',"{key}":{item}' + "}"

    assert_refused(rewrite_header(data, dup), match="duplicate")


def test_payload_dtype_relabelled_same_size():
    data = good_patch()
    assert_refused(rewrite_header(data, lambda t: t.replace('"dtype":"U8"', '"dtype":"I8"', 1)), match="expected U8")


def test_tensor_dtype_relabelled_same_size():
    data = good_patch()
    relabelled = rewrite_header(data, lambda t: t.replace('\\"dtype\\":\\"BF16\\"', '\\"dtype\\":\\"F16\\"'))
    assert relabelled != data
    assert_refused(relabelled, error=TensorSetMismatchError, match="F16")


def test_index_out_of_range():
    f = frame_of([32], [1])  # position 32 in a 32-element tensor
    assert_refused(patch_file([entry(1, frame=f)], {"model.w": f}), match="out of range")


def test_positions_past_the_end_by_accumulation():
    f = frame_of([20, 20], [1, 1])  # positions 20, 41
    assert_refused(patch_file([entry(2, frame=f)], {"model.w": f}), match="past")


def test_unsorted_indices():
    # positions 5, then 3: the gap would have to be -3, which wraps to a huge unsigned value
    f = frame_of([5, 2**64 - 3], [1, 1], gap_dtype=np.uint64)
    assert_refused(patch_file([entry(2, gap_width=8, frame=f)], {"model.w": f}), match="unsorted")


def test_zstd_frame_declaring_huge_content_size():
    bomb = bytes.fromhex("28b52ffde06c06060663636363")
    assert len(bomb) == 13
    assert_refused(patch_file([entry(1, frame=bomb)], {"model.w": bomb}), match="refusing to decompress")


def test_frame_with_trailing_bytes():
    f = frame_of([3], [1]) + b"junk"
    assert_refused(patch_file([entry(1, frame=f)], {"model.w": f}), match="extra bytes")


def test_manifest_file_size_mismatch():
    data = good_patch()
    assert_refused(data, expected_size=len(data) + 1, match="manifest says")


def test_path_traversal_in_a_name():
    f = frame_of([3], [1])
    bad = entry(1, frame=f, name="../../etc/passwd")
    assert_refused(patch_file([bad], {"../../etc/passwd": f}), match="invalid tensor name")
    assert_refused(patch_file([bad], {"model.w": f}), match="invalid tensor name")


def test_count_larger_than_tensor():
    f = frame_of([0], [1])
    assert_refused(patch_file([entry(33, frame=f)], {"model.w": f}), match="changed elements")


def test_payload_without_entry_and_entry_without_payload():
    f = frame_of([0], [1])
    assert_refused(patch_file([], {"model.w": f}), match="no metadata entry")
    assert_refused(patch_file([entry(1, frame=f)], {}), match="no payload")


def test_not_a_patch_and_future_version():
    data = good_patch()
    assert_refused(rewrite_header(data, lambda t: t.replace('"stitchboard.patch":', '"format":', 1)), match="not a stitchboard patch")
    assert_refused(rewrite_header(data, lambda t: t.replace('\\"format_version\\":\\"1\\"', '\\"format_version\\":\\"9\\"')), match="upgrade")


def test_every_error_is_a_patch_error():
    assert issubclass(PatchFormatError, PatchError) and issubclass(TensorSetMismatchError, PatchError)
