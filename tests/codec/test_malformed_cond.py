"""Malformed ``cond`` patches: each raises a typed error before anything is written.

Decoding happens while planning the writes, so every test also applies to a read-only copy of
the base: a refusal there (rather than the read-only ``ValueError``) shows the error came
before the first write. The container and index checks every encoding shares are in
test_malformed.py.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stitchboard.proto.apply import apply_patch
from stitchboard.proto.codec import PAYLOAD_KEY, checksum
from stitchboard.proto.container import RawTensor, parse_safetensors
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from stitchboard.proto.errors import BaseMismatchError, PatchError, PatchFormatError, TensorSetMismatchError

from .helpers import copy_view, patch_file, raw, same_bits

RNG = np.random.default_rng(7)
W = (RNG.normal(0, 0.02, 64 * 64).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
BASE = {"model.w": raw("BF16", (64, 64), W), "model.v": raw("F32", (5,), np.arange(5))}


TARGET = copy_view(BASE)
TARGET["model.w"].bits[RNG.random(W.size) < 0.05] += np.uint16(1)
TARGET["model.w"].bits[[3, 700]] = [0x7FC1, 0x8000]
TARGET["model.v"].bits[2] = 0x7FC00001
GOOD = diff_views(BASE, TARGET, "cond").patch


def parts(data: bytes) -> tuple[list[dict], bytes]:
    """The index entries (JSON) and the raw payload of a cond patch."""
    patch = read_patch(data)
    _, tensors = parse_safetensors(data)
    return [e.to_json() for e in patch.entries.values()], tensors[PAYLOAD_KEY].bits.tobytes()


def rebuilt(entries: list[dict], payload: bytes) -> bytes:
    return patch_file(entries, payload, encoding="cond")


def w_stream(entries: list[dict], payload: bytes) -> tuple[int, int]:
    """Offset and length of model.w's stream (entries in name order: model.v first)."""
    assert [e["name"] for e in entries] == ["model.v", "model.w"]
    return entries[0]["gap_bytes"], entries[1]["gap_bytes"]


def assert_refused(data: bytes, error: type[Exception] = PatchFormatError, match: str | None = None) -> None:
    """Applying ``data`` raises ``error`` on a writable and on a read-only base; both unchanged."""
    view = copy_view(BASE)
    with pytest.raises(error, match=match):
        apply_patch(view, read_patch(data))
    assert same_bits(view, BASE)
    frozen = copy_view(BASE)
    for t in frozen.values():
        t.bits.flags.writeable = False
    with pytest.raises(error, match=match):
        apply_patch(frozen, read_patch(data))


def test_good_patch_applies():
    view = copy_view(BASE)
    apply_patch(view, read_patch(GOOD))
    assert same_bits(view, TARGET)


def test_truncated_and_extended_streams():
    entries, payload = parts(GOOD)
    at, size = w_stream(entries, payload)
    short = [entries[0], {**entries[1], "gap_bytes": size - 1}]
    assert_refused(rebuilt(short, payload[: at + size - 1]), match="end exactly|past the end|add up")
    long = [entries[0], {**entries[1], "gap_bytes": size + 1}]
    assert_refused(rebuilt(long, payload[: at + size] + b"\x00"), match="end exactly")


def test_truncated_file():
    for cut in (0, 8, 40, len(GOOD) // 2, len(GOOD) - 1):
        with pytest.raises(PatchFormatError):
            read_patch(GOOD[:cut])


def test_index_entry_out_of_bounds():
    entries, payload = parts(GOOD)
    numel = 64 * 64
    assert_refused(rebuilt([entries[0], {**entries[1], "count": numel + 1}], payload), match="changed elements")
    assert_refused(
        rebuilt([entries[0], {**entries[1], "dtype": "F16"}], payload), error=TensorSetMismatchError, match="F16"
    )
    assert_refused(rebuilt([entries[0], {**entries[1], "shape": [32, 128]}], payload), error=TensorSetMismatchError)


def test_payload_size_disagrees_with_index():
    entries, payload = parts(GOOD)
    with pytest.raises(PatchFormatError, match="index implies"):
        read_patch(rebuilt(entries, payload + b"\x00"))
    with pytest.raises(PatchFormatError, match="index implies"):
        read_patch(rebuilt(entries, payload[:-1]))


def test_stream_shorter_than_any_coded_stream():
    entries, payload = parts(GOOD)
    with pytest.raises(PatchFormatError, match="at least 4"):
        read_patch(rebuilt([entries[0], {**entries[1], "gap_bytes": 3}], payload))


@pytest.mark.parametrize("delta", [-1, 1])
def test_count_disagrees_with_stream(delta: int):
    entries, payload = parts(GOOD)
    assert_refused(
        rebuilt([entries[0], {**entries[1], "count": entries[1]["count"] + delta}], payload), match="class counts"
    )


def test_wrong_base_is_refused_before_decoding():
    wrong = copy_view(BASE)
    wrong["model.w"].bits[1] ^= np.uint16(1)
    snapshot = copy_view(wrong)
    with pytest.raises(BaseMismatchError):
        apply_patch(wrong, read_patch(GOOD))
    assert same_bits(wrong, snapshot)


@settings(max_examples=150, deadline=None)
@given(offset=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_flipped_bits_never_reach_the_tensor(offset: int, bit: int):
    entries, payload = parts(GOOD)
    at = offset % len(payload)
    corrupt = payload[:at] + bytes([payload[at] ^ (1 << bit)]) + payload[at + 1 :]
    assert_refused(rebuilt(entries, corrupt), error=PatchError)


@settings(max_examples=150, deadline=None)
@given(stream=st.binary(min_size=4, max_size=64), count=st.integers(1, 64 * 64))
def test_garbage_streams_are_refused(stream: bytes, count: int):
    entries, payload = parts(GOOD)
    at, _ = w_stream(entries, payload)
    bad = [entries[0], {**entries[1], "count": count, "gap_bytes": len(stream)}]
    assert_refused(rebuilt(bad, payload[:at] + stream), error=PatchError)


@pytest.mark.parametrize("stream", [b"\x00" * 8, b"\xff" * 8, bytes(range(8)) * 4])
def test_garbage_on_a_large_tensor_is_refused_quickly(stream: bytes):
    """Decoding reads each base element at most once, whatever the stream claims."""
    n = 1 << 22
    base = RawTensor("BF16", (n,), np.zeros(n, dtype=np.uint16))
    z = "0" * 32
    entry = {
        "name": "big",
        "dtype": "BF16",
        "shape": [n],
        "count": n,
        "gap_bytes": len(stream),
        "base": {"xxh3_128": checksum(base)},
        "target": {"xxh3_128": z},
    }
    patch = read_patch(patch_file([entry], stream, encoding="cond"))
    t0 = time.perf_counter()
    with pytest.raises(PatchFormatError):
        patch.delta("big", base)
    assert time.perf_counter() - t0 < 10


def test_a_cond_header_over_an_xor_payload_is_refused():
    xor = diff_views(BASE, TARGET, "xor").patch
    entries, _ = parts(GOOD)
    _, tensors = parse_safetensors(xor)
    frame = tensors[PAYLOAD_KEY].bits.tobytes()
    with pytest.raises(PatchFormatError):
        apply_patch(copy_view(BASE), read_patch(rebuilt(entries, frame)))
    assert json.loads(parse_safetensors(GOOD)[0]["stitchboard.patch"])["encoding"] == "cond"
