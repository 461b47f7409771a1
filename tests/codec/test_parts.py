"""Patches in parts (format version 2): round trips, parallel decode equal to one stream bit for bit,
old patches unchanged, and malformed parts refused before any write."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import numpy as np
import pytest
import zstandard

from stitchboard.proto import parts
from stitchboard.proto.apply import apply_patch, apply_to_copy
from stitchboard.proto.codec import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_KEY,
    PARTS_FORMAT_VERSION,
    PAYLOAD_KEY,
    build_patch,
    encode_tensor,
    encoded_from_parts,
)
from stitchboard.proto.container import RawTensor, parse_safetensors, serialize_safetensors
from stitchboard.proto.decode import read_patch, read_patch_index
from stitchboard.proto.dtypes import bits_type
from stitchboard.proto.errors import BaseMismatchError, PatchError, PatchFormatError, TargetMismatchError

from .helpers import copy_view, raw, same_bits

ENCODINGS = ("cond", "xor", "overwrite")


def _pair(dtype: str, shape: tuple[int, ...], density: float = 0.02, seed: int = 0) -> tuple[RawTensor, RawTensor]:
    """A random base and a target with about ``density`` of its elements moved by one step of the bit pattern."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape)) if shape else 1
    width = np.dtype(bits_type(dtype)).itemsize * 8
    base = raw(dtype, shape, rng.integers(0, 2 ** min(width, 62), size=n, dtype=np.uint64))
    target = RawTensor(dtype, shape, base.bits.copy())
    hit = rng.random(n) < density
    target.bits[hit] = target.bits[hit] ^ np.array(1, dtype=target.bits.dtype)
    return base, target


def _columns(base: RawTensor, target: RawTensor, cuts: list[int], encoding: str) -> bytes:
    """A one-tensor patch cut into column blocks (``dim`` 1) at ``cuts``, as tensor-parallel ranks encode them."""
    blocks = [
        parts.encode_part(
            RawTensor(base.dtype, (), parts.block(base.bits, base.shape, 1, a, b)),
            RawTensor(target.dtype, (), parts.block(target.bits, target.shape, 1, a, b)),
            1,
            a,
            b,
            encoding,  # type: ignore[arg-type]
        )
        for a, b in itertools.pairwise(cuts)
    ]
    return build_patch([encoded_from_parts("w", base.dtype, base.shape, blocks)], encoding)  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize(
    ("dtype", "shape"), [("BF16", (300, 70)), ("F32", (97, 13)), ("F8_E4M3", (64, 9)), ("U8", (5000,))]
)
def test_row_parts_round_trip_and_equal_one_stream(encoding: str, dtype: str, shape: tuple[int, ...]) -> None:
    base, target = _pair(dtype, shape)
    whole = encode_tensor("w", base, target, encoding)  # type: ignore[arg-type]
    cut = encode_tensor("w", base, target, encoding, part_bytes=max(64, base.nbytes // 5))  # type: ignore[arg-type]
    assert whole is not None and cut is not None and cut.entry.parts is not None and len(cut.entry.parts) >= 4
    one, parted = read_patch(build_patch([whole], encoding)), read_patch(build_patch([cut], encoding))  # type: ignore[arg-type]
    a, b = one.delta("w", base), parted.delta("w", base)  # parts decode on the pool's threads
    assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
    assert same_bits(apply_to_copy({"w": base}, parted), {"w": target})
    assert parted.entries["w"].base[parts.XXH3_128_PARTS] == parts.layout_checksum(
        base.bits, shape, parted.entries["w"].layout or ()
    )


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_column_parts_from_ranks_carry_only_the_parts_checksum(encoding: str) -> None:
    base, target = _pair("BF16", (120, 50))
    data = _columns(base, target, [0, 17, 18, 50], encoding)
    patch = read_patch(data)
    entry = patch.entries["w"]
    assert set(entry.base) == {parts.XXH3_128_PARTS} and entry.layout == ((1, 0, 17), (1, 17, 18), (1, 18, 50))
    view = copy_view({"w": base})
    apply_patch(view, patch)
    assert same_bits(view, {"w": target})
    assert read_patch_index(lambda at, n: data[at : at + n], len(data)).entries["w"].parts == entry.parts


def test_unparted_patches_stay_version_1_and_parted_ones_are_version_2() -> None:
    base, target = _pair("BF16", (64, 64))
    small = encode_tensor("w", base, target, "cond", part_bytes=base.nbytes)  # fits one part: one stream
    assert small is not None and small.entry.parts is None
    assert build_patch([small], "cond") == build_patch([encode_tensor("w", base, target, "cond")], "cond")  # type: ignore[list-item]
    for data, version in (
        (build_patch([small], "cond"), FORMAT_VERSION),
        (_columns(base, target, [0, 8, 64], "cond"), PARTS_FORMAT_VERSION),
    ):
        assert json.loads(parse_safetensors(data)[0][FORMAT])["format_version"] == version


def test_part_without_changes_is_listed_and_checked() -> None:
    base, target = _pair("BF16", (40, 10), density=0.0)
    target.bits[5] ^= 1  # only the first rows change
    cut = encode_tensor("w", base, target, "cond", part_bytes=160)
    assert cut is not None and cut.entry.parts is not None
    assert [p.count for p in cut.entry.parts] == [1] + [0] * (len(cut.entry.parts) - 1)
    other = copy_view({"w": base})
    other["w"].bits[-1] ^= 1  # a block without changes differs from its base: not the patch's base
    patch = read_patch(build_patch([cut], "cond"))
    with pytest.raises(BaseMismatchError):
        patch.delta("w", other["w"])
    # An engine staging on its live bits decodes without hashing the whole base first (base_verified) and relies on
    # the decode to prove every block's target, the unchanged ones too.
    with pytest.raises(BaseMismatchError):
        patch.delta("w", other["w"], base_verified=True)
    decoded = patch.delta("w", base, base_verified=True)
    assert decoded.positions.tolist() == [5]


def _reindex(data: bytes, mutate: Callable[[list[dict]], object], version: str = PARTS_FORMAT_VERSION) -> bytes:
    """``data`` with its index entries changed by ``mutate`` (in place) and the header's format version set."""
    meta, tensors = parse_safetensors(data)
    entries = json.loads(zstandard.ZstdDecompressor().decompress(tensors[INDEX_KEY].bits.tobytes()))
    mutate(entries)
    index = zstandard.ZstdCompressor(write_content_size=True).compress(json.dumps(entries).encode())
    header = {**json.loads(meta[FORMAT]), "format_version": version}
    return serialize_safetensors(
        {
            INDEX_KEY: RawTensor("U8", (len(index),), np.frombuffer(index, dtype=np.uint8)),
            PAYLOAD_KEY: tensors[PAYLOAD_KEY],
        },
        {FORMAT: json.dumps(header)},
    )


def _set(index: int, key: str, value: object) -> Callable[[list[dict]], None]:
    return lambda entries: entries[0]["parts"][index].__setitem__(key, value)


MALFORMED: dict[str, tuple[Callable[[list[dict]], object], str]] = {
    "gap between parts": (_set(1, "start", 18), "tile the tensor"),
    "overlap": (_set(1, "start", 16), "tile the tensor"),
    "short of the extent": (_set(2, "stop", 49), "extent"),
    "mixed dims": (_set(1, "dim", 0), "same for every part"),
    "bad dim": (lambda e: [p.__setitem__("dim", 2) for p in e[0]["parts"]], "dim must be 0 or 1"),
    "empty part": (_set(1, "stop", 17), "tile the tensor"),
    "count over the block": (_set(1, "count", 121), "changes in a block"),
    "counts do not add up": (_set(0, "count", 1), "add up"),
    "stream too short": (_set(0, "bytes", 2), "cannot hold"),
    "bad digest": (_set(0, "base", "xyz"), "lowercase hex"),
    "digest of another part": (_set(0, "target", "0" * 32), "xxh3_128_parts"),
    "extra key": (_set(0, "rank", 3), "exactly the keys"),
    "not a list": (lambda e: e[0].__setitem__("parts", {}), "non-empty list"),
    "float field": (_set(0, "start", 0.0), "integers"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_parts_are_refused_before_any_write(case: str) -> None:
    mutate, match = MALFORMED[case]
    base, target = _pair("BF16", (120, 50))
    data = _reindex(_columns(base, target, [0, 17, 18, 50], "cond"), mutate)
    view = copy_view({"w": base})
    with pytest.raises(PatchFormatError, match=match):
        apply_patch(view, read_patch(data))
    assert same_bits(view, {"w": base})


def test_parts_in_a_version_1_patch_are_refused() -> None:
    base, target = _pair("BF16", (120, 50))
    with pytest.raises(PatchFormatError, match="keys"):
        read_patch(_reindex(_columns(base, target, [0, 25, 50], "xor"), lambda e: None, version=FORMAT_VERSION))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_corrupt_part_stream_writes_nothing(encoding: str) -> None:
    base, target = _pair("BF16", (120, 50))
    cut = encode_tensor("w", base, target, encoding, part_bytes=2000)  # type: ignore[arg-type]
    assert cut is not None and cut.entry.parts is not None
    data = bytearray(build_patch([cut], encoding))  # type: ignore[arg-type]
    data[-3] ^= 0x5A  # inside the last part's stream (cond) or the payload frame (xor, overwrite)
    view = copy_view({"w": base})
    with pytest.raises(PatchError):
        apply_patch(view, read_patch(bytes(data)))
    assert same_bits(view, {"w": base})


def test_part_decoding_to_another_target_is_found_before_writing() -> None:
    base, target = _pair("BF16", (120, 50))
    wrong = RawTensor("BF16", target.shape, target.bits.copy())
    wrong.bits[3000] ^= 1  # the second block's stream takes it elsewhere than its recorded target digest

    def encoded(t: RawTensor, a: int, b: int) -> parts.EncodedBlock:
        return parts.encode_part(
            RawTensor("BF16", (), parts.block(base.bits, base.shape, 0, a, b)),
            RawTensor("BF16", (), parts.block(t.bits, base.shape, 0, a, b)),
            0,
            a,
            b,
            "cond",
        )

    first, forged, true = encoded(target, 0, 60), encoded(wrong, 60, 120), encoded(target, 60, 120)
    lie = parts.EncodedBlock(
        parts.Part(0, 60, 120, forged.part.count, true.part.base, true.part.target, forged.part.bytes),
        forged.stream,
        b"",
    )
    patch = read_patch(build_patch([encoded_from_parts("w", "BF16", base.shape, [first, lie])], "cond"))
    view = copy_view({"w": base})
    with pytest.raises(TargetMismatchError):
        apply_patch(view, patch)
    assert same_bits(view, {"w": base})


def test_row_layout_and_matches() -> None:
    assert parts.row_layout((10, 4), 2, 16) == ((0, 0, 2), (0, 2, 4), (0, 4, 6), (0, 6, 8), (0, 8, 10))
    assert parts.row_layout((3,), 4, 1000) == ((0, 0, 3),)
    assert parts.row_layout((), 2, 1) == ((0, 0, 1),)
    base, _ = _pair("BF16", (30, 7))
    layout = ((1, 0, 3), (1, 3, 7))
    want = {parts.XXH3_128_PARTS: parts.layout_checksum(base.bits, base.shape, layout)}
    assert parts.matches(base.bits, base.shape, want, layout)
    assert not parts.matches(base.bits, base.shape, want, ((1, 0, 4), (1, 4, 7)))
    with pytest.raises(PatchFormatError):
        parts.matches(base.bits, base.shape, {"sha256": "0" * 64}, None)


def test_same_checksum_compares_the_algorithm_both_carry() -> None:
    whole, parted = {"xxh3_128": "a" * 32}, {parts.XXH3_128_PARTS: "b" * 32}
    assert parts.same_checksum(whole, {**whole, **parted}) and parts.same_checksum(parted, {**whole, **parted})
    assert not parts.same_checksum(whole, {"xxh3_128": "c" * 32, **parted})
    assert not parts.same_checksum(whole, parted)  # nothing in common: not shown equal


def test_layouts_an_engine_call_names_are_read_or_refused_by_name() -> None:
    """The layouts a sidecar hands to an engine's checksum call and snapshot load (JSON lists) come back as
    tuples; a malformed one is refused naming the call and the tensor, before anything is hashed."""
    assert parts.layouts_from_json(None, "stitch_checksums") == {}
    assert parts.layouts_from_json({"w": [[0, 0, 3], [0, 3, 8]]}, "x") == {"w": ((0, 0, 3), (0, 3, 8))}
    for bad in ({"w": []}, {"w": [[2, 0, 3]]}, {"w": [[0, 3, 3]]}, {"w": [[0, 0, "3"]]}, {"w": [[0, 1]]}, [1]):
        with pytest.raises(ValueError, match="stitch_checksums: layouts must map"):
            parts.layouts_from_json(bad, "stitch_checksums")
