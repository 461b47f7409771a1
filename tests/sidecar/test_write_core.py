"""The in-engine write core (sidecar/engines/write_core.py) on CPU tensors (and CUDA when present):
a TP slice's positions, block and whole-tensor bytes, and write_verified's all-or-nothing rule."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import xxhash

from stitchboard.proto.errors import TargetMismatchError
from stitchboard.sidecar.engines.write_core import TpSlice, agreed, write_verified
from stitchboard.sidecar.errors import ApplyFailedError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _slice(split_dim: int, rank: int, shape: tuple[int, ...] = (6, 4)) -> TpSlice:
    """Rank ``rank`` of 2 splitting ``shape`` evenly along ``split_dim``."""
    half = shape[split_dim] // 2
    return TpSlice("t", "p", "BF16", shape, split_dim, ((0, half), (half, half)), rank, 0)


@pytest.mark.parametrize(("split_dim", "rank"), [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_select_maps_positions_into_the_rank_block(split_dim: int, rank: int) -> None:
    s = _slice(split_dim, rank)
    full = torch.arange(24, dtype=torch.int64)
    block = s.local_block(full).reshape(-1)
    positions = np.array([0, 3, 5, 9, 14, 17, 22, 23], dtype=np.int64)
    selected, index = s.select(positions)
    grid = full.reshape(6, 4).numpy()
    start, length = s.local_span
    held = [p for p in positions if start <= (p // 4 if split_dim == 0 else p % 4) < start + length]
    assert positions[selected].tolist() == held
    assert block[torch.from_numpy(index)].tolist() == [int(grid.reshape(-1)[p]) for p in held]


@pytest.mark.parametrize("device", DEVICES)
def test_gather_whole_without_group_is_the_block_bytes(device: str) -> None:
    s = TpSlice("t", "p", "BF16", (5,), 0, ((0, 5),), 0, 0)
    block = torch.randn(5, dtype=torch.bfloat16, device=device)
    got = s.gather_whole(block, None)
    want = block.cpu().view(torch.uint8).numpy()
    assert got.dtype == np.uint8 and got.tolist() == want.tolist()
    assert s.checksum(block, None) == xxhash.xxh3_128_hexdigest(want.tobytes())


def _rig(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    live = torch.arange(16, dtype=torch.int16, device=device)
    index = torch.tensor([1, 4, 9], device=device)
    new = torch.tensor([-1, -2, -3], dtype=torch.int16, device=device)
    return live, index, new, live[index].clone()


def _digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.cpu().numpy().tobytes())


def _run(
    device: str, target: str | None = None, undo: bool = True, fail_at: str | None = None, undo_fails: bool = False
) -> tuple[torch.Tensor, list[str], Callable[[], dict[str, float]]]:
    live, index, new, old = _rig(device)
    after = live.clone()
    after[index] = new
    phases: list[str] = []

    def hook(phase: str) -> None:
        phases.append(phase)
        if phase == fail_at:
            raise RuntimeError(f"injected at {phase}")

    def write(h: Callable[[str], None]) -> None:
        live[index[:1]] = new[:1]
        h("half-written")
        live[index[1:]] = new[1:]

    def restore() -> None:
        if undo_fails:
            raise OSError("cannot write")
        live[index] = old

    targets = [("t", lambda: _digest(live), target or _digest(after))]

    def call() -> dict[str, float]:
        return write_verified(
            "writing versions 1->2", write, targets, hook, lambda f, w: f(), restore if undo else None
        )

    return live, phases, call


@pytest.mark.parametrize("device", DEVICES)
def test_write_verified_writes_and_verifies(device: str) -> None:
    live, phases, call = _run(device)
    timing = call()
    assert set(timing) == {"write_s", "verify_s"}
    assert phases == ["staged", "half-written", "written-unverified"]
    assert live[torch.tensor([1, 4, 9], device=device)].tolist() == [-1, -2, -3]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fail_at", [None, "half-written", "written-unverified"])
def test_write_verified_restores_the_old_bits(device: str, fail_at: str | None) -> None:
    live, _, call = _run(device, target=None if fail_at else "0" * 32, fail_at=fail_at)
    before = torch.arange(16, dtype=torch.int16)
    with pytest.raises(ApplyFailedError) as info:
        call()
    assert info.value.details["restored"] is True
    assert isinstance(info.value.__cause__, TargetMismatchError if fail_at is None else RuntimeError)
    assert live.cpu().tolist() == before.tolist()


def test_write_verified_without_undo_or_with_a_failed_undo_is_not_restored() -> None:
    for undo, undo_fails in ((False, False), (True, True)):
        _, _, call = _run("cpu", target="0" * 32, undo=undo, undo_fails=undo_fails)
        with pytest.raises(ApplyFailedError) as info:
            call()
        assert info.value.details["restored"] is False


def test_write_verified_writes_nothing_when_staged_hook_fails() -> None:
    live, phases, call = _run("cpu", fail_at="staged")
    with pytest.raises(RuntimeError):
        call()
    assert phases == ["staged"] and live.tolist() == list(range(16))


def test_agreed_without_group_runs_the_step() -> None:
    assert agreed(None, lambda: 7, "x") == 7
    with pytest.raises(KeyError):
        agreed(None, lambda: {}["k"], "x")
