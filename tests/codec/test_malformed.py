"""Malformed patch files: each raises a typed error and leaves the base untouched."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard

from stitchboard.proto.apply import apply_patch
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from stitchboard.proto.errors import PatchError, PatchFormatError, TensorSetMismatchError

from .helpers import bf16_payload, copy_view, patch_file, raw, rewrite_header, same_bits, varints

BASE = {"model.w": raw("BF16", (4, 8), np.arange(32) * 7), "model.v": raw("F32", (5,), np.arange(5))}
BOMB = bytes.fromhex("28b52ffde06c06060663636363")  # 13-byte zstd frame declaring a huge content size


def good_patch() -> bytes:
    target = copy_view(BASE)
    target["model.w"].bits[[1, 9, 30]] ^= np.uint16(5)
    target["model.v"].bits[2] = 0x7FC00001
    return diff_views(BASE, target).patch


def entry(count=1, gap_bytes=None, name="model.w", dtype="BF16", shape=(4, 8)) -> dict:
    z = "0" * 32
    return {
        "name": name,
        "dtype": dtype,
        "shape": list(shape),
        "count": count,
        "gap_bytes": count if gap_bytes is None else gap_bytes,
        "base": {"xxh3_128": z},
        "target": {"xxh3_128": z},
    }


def one(gaps: list[int], values: list[int], gap_stream: bytes | None = None, **kw) -> bytes:
    """A patch touching one bf16 tensor with the given gaps and values."""
    g = varints(gaps) if gap_stream is None else gap_stream
    frame = zstandard.ZstdCompressor().compress(bf16_payload(g, values))
    return patch_file([entry(len(values), gap_bytes=len(g), **kw)], frame)


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
    assert_refused(len(data).to_bytes(8, "little") + data[8:], match="larger than the file")


def test_duplicate_tensor_names():
    data = good_patch()

    def dup(text: str) -> str:
        header = json.loads(text)
        return text.rstrip()[:-1] + f',"__payload__":{json.dumps(header["__payload__"])}' + "}"

    assert_refused(rewrite_header(data, dup), match="duplicate")
    assert_refused(_index_twice(), match="unique")


def _index_twice() -> bytes:
    g = varints([0])
    frame = zstandard.ZstdCompressor().compress(bf16_payload(g, [1]) * 2)
    return patch_file([entry(1), entry(1)], frame)


def test_payload_dtype_relabelled_same_size():
    data = good_patch()
    relabelled = rewrite_header(data, lambda t: t.replace('"__payload__":{"dtype":"U8"', '"__payload__":{"dtype":"I8"'))
    assert relabelled != data
    assert_refused(relabelled, match="expected U8")


def test_tensor_dtype_relabelled_same_size():
    assert_refused(one([3], [1], dtype="F16"), error=TensorSetMismatchError, match="F16")


def test_index_out_of_range():
    assert_refused(one([32], [1]), match="out of range")  # position 32 in a 32-element tensor


def test_positions_past_the_end_by_accumulation():
    assert_refused(one([20, 20], [1, 1]), match="out of range")  # positions 20, 41


def test_unsorted_indices():
    # positions 5, then 3: the gap would be -3, which as an unsigned varint is huge
    assert_refused(one([5, 2**64 - 3], [1, 1]), match="unsorted")


def test_overlong_truncated_and_leftover_varints():
    assert_refused(one([0], [1], gap_stream=b"\x80" * 10), match="overflows 64 bits")
    assert_refused(one([0], [1], gap_stream=b"\x80" * 11), match="gap bytes")
    assert_refused(one([0, 0], [1, 1], gap_stream=b"\x80\x80"), match="truncated")
    assert_refused(one([0], [1], gap_stream=b"\x00\x00"), match="left after")


def test_zstd_frame_declaring_huge_content_size():
    assert len(BOMB) == 13
    assert_refused(patch_file([entry(1)], BOMB), match="refusing to decompress")
    assert_refused(patch_file([], b"", index=BOMB), match="refusing to decompress")


def test_payload_with_trailing_bytes():
    frame = zstandard.ZstdCompressor().compress(bf16_payload(varints([3]), [1]))
    assert_refused(patch_file([entry(1)], frame + b"junk"), match="extra bytes")


def test_manifest_file_size_mismatch():
    data = good_patch()
    assert_refused(data, expected_size=len(data) + 1, match="manifest says")


def test_path_traversal_in_a_name():
    assert_refused(one([3], [1], name="../../etc/passwd"), match="invalid tensor name")
    assert_refused(one([3], [1], name="/etc/passwd"), match="invalid tensor name")


def test_count_larger_than_tensor():
    assert_refused(one([0] * 33, [1] * 33), match="changed elements")


def test_index_and_payload_disagree():
    frame = zstandard.ZstdCompressor().compress(bf16_payload(varints([3]), [1]))
    assert_refused(patch_file([entry(2, gap_bytes=2)], frame), match="index implies")
    assert_refused(
        patch_file([entry(1)], frame, extra={"stray": RawTensor("U8", (1,), np.zeros(1, np.uint8))}), match="found"
    )


def test_not_a_patch_and_future_version():
    data = good_patch()
    assert_refused(
        rewrite_header(data, lambda t: t.replace('"stitchboard.patch":', '"format":', 1)),
        match="not a stitchboard patch",
    )
    assert_refused(
        rewrite_header(data, lambda t: t.replace('\\"format_version\\":\\"1\\"', '\\"format_version\\":\\"9\\"')),
        match="upgrade",
    )


def test_every_error_is_a_patch_error():
    assert issubclass(PatchFormatError, PatchError) and issubclass(TensorSetMismatchError, PatchError)
