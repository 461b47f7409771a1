"""The layout the ranks of a shard-local publish agree on (trainer_client/local_shards.py), from their records alone."""

from __future__ import annotations

import pytest
import torch

from stitchboard.trainer_client.errors import ReplicaMismatchError, ServedViewError
from stitchboard.trainer_client.local_shards import LocalEntry, Placement, local_pieces, plan_layout


def block(dim: int, start: int, stop: int, shape: tuple[int, ...], dtype: str = "BF16") -> LocalEntry:
    return LocalEntry(dtype, shape, Placement(dim, start, stop), "")


def whole(shape: tuple[int, ...], digest: str, dtype: str = "BF16") -> LocalEntry:
    return LocalEntry(dtype, shape, None, digest)


def test_uneven_and_empty_row_shards_tile_the_tensor():
    # FSDP2 over 3 ranks of a [5, 4] tensor: 2, 2, 1 rows; of a [1, 4] tensor: 1, 0, 0 rows
    ranks = [
        {"w": block(0, 0, 2, (2, 4)), "b": block(0, 0, 1, (1, 4))},
        {"w": block(0, 2, 4, (2, 4)), "b": block(0, 1, 1, (0, 4))},
        {"w": block(0, 4, 5, (1, 4)), "b": block(0, 1, 1, (0, 4))},
    ]
    plan = plan_layout(ranks)
    assert plan["w"].shape == (5, 4) and plan["w"].owner == -1
    assert [(r, b.start, b.stop) for r, b in plan["w"].parts] == [(0, 0, 2), (1, 2, 4), (2, 4, 5)]
    assert plan["b"].shape == (1, 4)
    assert [(r, b.start, b.stop) for r, b in plan["b"].parts] == [(0, 0, 1)]  # empty shards are no part


def test_column_shards_give_the_full_width():
    plan = plan_layout([{"w": block(1, 0, 3, (4, 3))}, {"w": block(1, 3, 6, (4, 3))}])
    assert plan["w"].shape == (4, 6) and [b.dim for _, b in plan["w"].parts] == [1, 1]


def test_a_gap_or_mixed_dims_are_refused_by_name():
    with pytest.raises(ServedViewError, match=r"'w'.*gap or overlaps at 2"):
        plan_layout([{"w": block(0, 0, 2, (2, 4))}, {"w": block(0, 3, 5, (2, 4))}])
    with pytest.raises(ServedViewError, match=r"'w'.*one dim"):
        plan_layout([{"w": block(0, 0, 2, (2, 4))}, {"w": block(1, 4, 8, (4, 4))}])


def test_replicas_are_published_once_and_must_agree():
    same = [{"norm": whole((8,), "a" * 32), "emb": whole((16, 8), "b" * 32)}, {"norm": whole((8,), "a" * 32)}]
    plan = plan_layout(same)
    assert plan["emb"].owner == 0 and plan["norm"].owner == 1  # the largest first to the least loaded holder
    stage_only = plan_layout([{"layers.0.w": whole((4, 4), "c" * 32)}, {"layers.1.w": whole((4, 4), "d" * 32)}])
    assert [stage_only[n].owner for n in ("layers.0.w", "layers.1.w")] == [0, 1]  # each stage its own layers
    with pytest.raises(ReplicaMismatchError, match=r"'norm' is replicated on ranks \[0, 1\]") as refused:
        plan_layout([{"norm": whole((8,), "a" * 32)}, {"norm": whole((8,), "e" * 32)}])
    assert refused.value.details == {"name": "norm", "ranks": [0, 1]}


def test_whole_on_one_rank_and_sharded_on_another_is_refused():
    with pytest.raises(ServedViewError, match=r"'w' is whole on rank\(s\) \[1\]"):
        plan_layout([{"w": block(0, 0, 2, (2, 4))}, {"w": whole((4, 4), "a" * 32)}])


def test_fp8_scale_blocks_across_a_shard_edge_are_refused_by_name():
    def fp8(cut: int) -> list[dict[str, LocalEntry]]:
        scales = whole((3, 2), "f" * 32, "F32")
        return [
            {"x.weight": block(0, 0, cut, (cut, 256), "F8_E4M3"), "x.weight_scale_inv": scales},
            {"x.weight": block(0, cut, 300, (300 - cut, 256), "F8_E4M3"), "x.weight_scale_inv": scales},
        ]

    assert plan_layout(fp8(256))["x.weight"].shape == (300, 256)  # cut on a block edge; the last block is partial
    with pytest.raises(ServedViewError, match=r"'x.weight': its shard edge 150 .* 'x.weight_scale_inv'"):
        plan_layout(fp8(150))


def test_declared_placements_of_plain_tensors():
    state = {"w": torch.zeros(3, 4), "n": torch.zeros(4)}
    pieces = local_pieces(state, {"w": Placement(0, 6, 9)})
    assert pieces["w"][1] == Placement(0, 6, 9) and pieces["n"][1] is None
    with pytest.raises(ServedViewError, match=r"'w': declared .* does not match the local shape \[3, 4\]"):
        local_pieces(state, {"w": Placement(0, 6, 8)})
    with pytest.raises(ServedViewError, match=r"'n'.*declared dim 1 is not a part dim"):
        local_pieces(state, {"n": Placement(1, 0, 4)})
