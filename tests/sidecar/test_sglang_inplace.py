"""The SGLang loader's in-place commit on a real parameter (no server: :mod:`.inplace` is plain
torch and numpy): staged writes go in chunk by chunk, each chunk read back as it is written, and
a chunk that does not read back as its new bits ends with the old bits everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stitchboard.sidecar.engines import write_core
from stitchboard.sidecar.engines.sglang.inplace import Ranks, _Write, commit
from stitchboard.sidecar.engines.sglang.slot import Slot
from stitchboard.sidecar.errors import ApplyFailedError

ROWS, COLS = 96, 64


def _writes(seed: int) -> tuple[list[_Write], np.ndarray]:
    # Two bf16 tensors' writes into one parameter [ROWS, COLS] (rows 0-47 and 48-95), ~1 in 5
    # elements each, and the parameter's bits before them (int16, flat).
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16), requires_grad=False)
    rng = np.random.default_rng(seed)
    writes = []
    for i, rows in enumerate((ROWS // 2, ROWS // 2)):
        slot = Slot(f"t{i}.weight", "p.weight", "BF16", (rows, COLS), 0, ((0, rows),), 0, i * rows, 0, param)
        index = slot.flat_index(*np.divmod(np.sort(rng.choice(rows * COLS, rows * COLS // 5, replace=False)), COLS))
        new = rng.integers(-(2**15), 2**15, index.size, dtype=np.int64).astype(np.int16)
        writes.append(_Write(slot, index, new, slot.gather(index), "unused"))
    return writes, writes[0].slot.flat_bits().numpy().copy()


def test_written_elements_are_read_back_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(write_core, "READ_BACK_CHUNK", 100)  # several chunks per tensor
    writes, before = _writes(1)
    phases: list[str] = []
    timing = commit(Ranks(layout=None, group=None), writes, phases.append, "writing 1->2", verify="written")  # type: ignore[arg-type]
    expected = before.copy()
    for w in writes:
        expected[w.index] = w.new
    assert np.array_equal(writes[0].slot.flat_bits().numpy(), expected)
    assert not np.array_equal(expected, before)
    assert phases == ["staged", "half-written", "written-unverified"]
    assert set(timing) == {"write_s", "verify_s"}


def test_a_chunk_that_does_not_read_back_restores_every_old_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(write_core, "READ_BACK_CHUNK", 100)
    writes, before = _writes(2)
    real_accessors, calls = Slot.accessors, []

    def losing_accessors(self: Slot) -> tuple:
        # The third chunk of the second tensor loses its first element's write (as if another
        # writer raced it); every other write, the restore included, goes through.
        scatter, gather = real_accessors(self)

        def losing_scatter(index: np.ndarray, values: np.ndarray) -> None:
            calls.append(self.name)
            if self.name == "t1.weight" and calls.count("t1.weight") == 3:
                scatter(index[1:], values[1:])
            else:
                scatter(index, values)

        return losing_scatter, gather

    monkeypatch.setattr(Slot, "accessors", losing_accessors)
    with pytest.raises(ApplyFailedError) as err:
        commit(Ranks(layout=None, group=None), writes, lambda phase: None, "writing 1->2", verify="written")  # type: ignore[arg-type]
    assert err.value.details["restored"] is True and err.value.details["name"] == "t1.weight"
    assert "do not read back" in str(err.value)
    assert np.array_equal(writes[0].slot.flat_bits().numpy(), before)
