"""patched_checksum: the checksum of a tensor with a delta applied, computed without a fresh copy, equals the checksum
of the applied copy bit for bit (xxh3_128 and xxh3_128_parts over row and column layouts, a range copied whole into
its thread's buffer or hashed in chunks), and leaves the base as it was."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from stitchboard.proto import patched_digest
from stitchboard.proto.parts import row_layout, tensor_checksum
from stitchboard.proto.patched_digest import patched_checksum

SHAPES = [(7,), (513, 300), (64, 4099), (3, 5, 1000)]


def _delta(rng: np.random.Generator, numel: int, density: float) -> np.ndarray:
    count = int(numel * density)
    return np.sort(rng.choice(numel, size=count, replace=False)).astype(np.int64)


@pytest.fixture(params=["whole", "chunks"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Ranges copied whole into the thread's buffer (the default for these sizes), or hashed in 1 KiB chunks."""
    if request.param == "chunks":
        monkeypatch.setattr(patched_digest, "WHOLE_BYTES", 0)
        monkeypatch.setattr(patched_digest, "CHUNK_BYTES", 1024)
    return request.param


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("xor", [False, True])
@pytest.mark.parametrize("density", [0.0, 0.0005, 0.01, 1.0])
def test_equals_the_checksum_of_the_applied_copy(shape: tuple[int, ...], xor: bool, density: float, way: str) -> None:
    rng = np.random.default_rng(hash((shape, xor, density)) % 2**32)
    numel = int(np.prod(shape))
    base = rng.integers(-(2**15), 2**15, size=numel, dtype=np.int16)
    kept = base.copy()
    positions = _delta(rng, numel, density)
    values = rng.integers(1, 2**15, size=positions.size, dtype=np.int16)
    applied = base.copy()
    if xor:
        applied[positions] ^= values
    else:
        applied[positions] = values
    rows = row_layout(shape, 2, 4096)  # row parts of ~4 KiB
    cols = ((1, 0, 2), (1, 2, int(np.prod(shape[1:])) if len(shape) > 1 else 1))
    layouts = [None, rows] + ([cols] if len(shape) > 1 else [])
    for layout in layouts:
        got = patched_checksum(base, shape, positions, values, xor=xor, layout=layout)
        assert got == tensor_checksum(applied, shape, layout), layout
    assert np.array_equal(base, kept)  # the base is only read


def test_chunks_smaller_than_the_tensor_are_stitched_by_the_streaming_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 64-byte chunks a 10,000-element tensor is hashed in 313 steps, some untouched (hashed in place)."""
    monkeypatch.setattr(patched_digest, "WHOLE_BYTES", 39_999)  # one byte short of the tensor: chunks
    monkeypatch.setattr(patched_digest, "CHUNK_BYTES", 64)
    rng = np.random.default_rng(3)
    base = rng.integers(0, 2**31, size=10_000, dtype=np.int32)
    positions = np.array([0, 31, 32, 5000, 9999], dtype=np.int64)
    values = np.array([1, 2, 3, 4, 5], dtype=np.int32)
    applied = base.copy()
    applied[positions] = values
    assert patched_checksum(base, (10_000,), positions, values, xor=False) == tensor_checksum(applied, (10_000,), None)
    assert patched_checksum(base, (10_000,), positions[:0], values[:0], xor=False) == tensor_checksum(
        base, (10_000,), None
    )


@pytest.mark.parametrize("shape", [(1, 8), (8,), (4, 6)])
def test_a_column_block_that_is_contiguous_is_still_copied(shape: tuple[int, ...]) -> None:
    """A one-row tensor, a 1-D one or a part spanning every column makes a contiguous column block; the delta is
    spliced into a copy of it, never into the base (the engine's live bits)."""
    rng = np.random.default_rng(5)
    numel = int(np.prod(shape))
    cols = numel // shape[0]
    base = rng.integers(0, 2**15, size=numel, dtype=np.int16)
    kept = base.copy()
    positions = np.arange(0, numel, 3, dtype=np.int64)
    values = (base[positions] ^ 0x55).astype(np.int16)
    applied = base.copy()
    applied[positions] = values
    for layout in (((1, 0, cols),), ((1, 0, cols // 2), (1, cols // 2, cols))):
        assert patched_checksum(base, shape, positions, values, layout=layout) == tensor_checksum(
            applied, shape, layout
        )
        assert np.array_equal(base, kept), layout


def test_mismatched_inputs_are_refused() -> None:
    bits = np.zeros(10, dtype=np.int16)
    with pytest.raises(ValueError, match="2 positions for 1 values"):
        patched_checksum(bits, (10,), np.array([1, 2]), np.array([1], dtype=np.int16), xor=False)
    with pytest.raises(ValueError, match="flat, contiguous"):
        patched_checksum(bits.reshape(2, 5), (2, 5), np.array([1]), np.array([1], dtype=np.int16), xor=False)
    with pytest.raises(ValueError, match="element sizes"):
        patched_checksum(bits, (10,), np.array([1, 2]), np.array([1, 2], dtype=np.int8))


def test_each_thread_reuses_its_own_buffer() -> None:
    """Threads checking side by side, tensors growing and shrinking: every digest is the applied copy's, and a
    thread's buffer is allocated once per size it grows to (not per call)."""
    rng = np.random.default_rng(11)
    cases = []
    for numel in (50_000, 300, 120_000, 7, 120_000, 40_000) * 4:
        base = rng.integers(-(2**15), 2**15, size=numel, dtype=np.int16)
        positions = _delta(rng, numel, 0.02)
        values = rng.integers(1, 2**15, size=positions.size, dtype=np.int16)
        applied = base.copy()
        applied[positions] = values
        cases.append((base, positions, values, tensor_checksum(applied, (numel,), None)))
    wrong: list[int] = []
    buffers: dict[int, list[np.ndarray]] = {}  # the buffers themselves: held, no two share an id

    def check(index: int) -> None:
        for base, positions, values, want in cases[index::2]:
            if patched_checksum(base, base.shape, positions, values) != want:
                wrong.append(index)
            buffers.setdefault(index, []).append(patched_digest._scratch.buf)

    threads = [threading.Thread(target=check, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    grown = {index: len({id(buf) for buf in held}) for index, held in buffers.items()}
    assert grown == {0: 2, 1: 2}, grown  # thread 0: 50,000 then 120,000 elements; thread 1: 300 then 40,000
