"""A patch in parts carrying only ``xxh3_128_parts`` (what a sharded publish writes) staged and committed by
the SGLang loader's in-place path on a real parameter (no server: :mod:`.inplace` is plain torch and numpy):
the base and target checks use the parts checksum, the commit verifies it on the live weights, and a base
that differs in one block is refused before any write."""

from __future__ import annotations

import hashlib
import types

import numpy as np
import pytest
import torch

from stitchboard.proto import parts
from stitchboard.proto.codec import build_patch, encoded_from_parts
from stitchboard.proto.container import RawTensor
from stitchboard.proto.errors import BaseMismatchError
from stitchboard.sidecar.engines.sglang.inplace import Ranks, commit, stage
from stitchboard.sidecar.engines.sglang.slot import Slot

ROWS, COLS = 48, 40


def _setup(tmp_path, encoding: str) -> tuple[Ranks, torch.nn.Parameter, np.ndarray, list[tuple[list[str], list[str]]]]:
    gen = torch.Generator().manual_seed(3)
    param = torch.nn.Parameter(torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16), requires_grad=False)
    base = param.data.view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()
    target = base.copy()
    rng = np.random.default_rng(3)
    hit = rng.choice(base.size, 60, replace=False)
    target[hit] ^= np.uint16(1)
    blocks = [
        parts.encode_part(
            RawTensor("BF16", (), parts.block(base, (ROWS, COLS), 1, a, b)),
            RawTensor("BF16", (), parts.block(target, (ROWS, COLS), 1, a, b)),
            1,
            a,
            b,
            encoding,  # type: ignore[arg-type]
        )
        for a, b in ((0, 16), (16, 40))
    ]
    data = build_patch([encoded_from_parts("w.weight", "BF16", (ROWS, COLS), blocks)], encoding)  # type: ignore[arg-type]
    path = tmp_path / "delta.safetensors"
    path.write_bytes(data)
    slot = Slot("w.weight", "w.weight", "BF16", (ROWS, COLS), 0, ((0, ROWS),), 0, 0, 0, param)
    layout = types.SimpleNamespace(place=lambda name: slot)  # our seam: the layout maps the one name
    return Ranks(layout=layout, group=None), param, target, [([str(path)], [hashlib.sha256(data).hexdigest()])]  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ["cond", "xor", "overwrite"])
def test_parts_only_patch_is_checked_and_verified_by_its_parts_checksum(tmp_path, encoding: str) -> None:
    ranks, param, target, steps = _setup(tmp_path, encoding)
    writes, report = stage(ranks, steps)
    assert report["elements"] == 60 and writes[0].layout == ((1, 0, 16), (1, 16, 40))
    commit(ranks, writes, lambda phase: None, "writing 1->2", verify="full")
    assert np.array_equal(param.data.view(torch.int16).numpy().view(np.uint16).reshape(-1), target)


def test_a_base_differing_in_one_block_is_refused_unwritten(tmp_path) -> None:
    ranks, param, _, steps = _setup(tmp_path, "cond")
    param.data.view(torch.int16)[ROWS - 1, COLS - 1] ^= 4  # in the second block
    before = param.data.clone()
    with pytest.raises(BaseMismatchError):
        stage(ranks, steps)
    assert torch.equal(param.data.view(torch.int16), before.view(torch.int16))
