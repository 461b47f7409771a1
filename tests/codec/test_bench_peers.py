"""The peers benchmark's core (tests/benchmarks/bench_peers.py) on a tiny model's real AdamW steps.

Every encoding it compares (stitchboard's, verl's ``delta_sharded`` bytes, Miles' disk-delta files)
decodes back bit-exact, verl's flush carries exactly 4 + 2 bytes per changed element plus its
manifest, and the last line parses.
"""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
import torch

from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor
from tests.benchmarks.bench_peers import MILES, VERL, codings, compare, mean_bpe, summary_line, verl_encode
from tests.trainer_client.miles_writer import INDEX_NAME
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of

SUMMARY = re.compile(r"peers: cond_bpe=(\d+\.\d{3}) verl_bpe=(\d+\.\d{3}) miles_bpe=(\d+\.\d{3})")


@pytest.fixture(scope="module")
def views() -> list[dict[str, RawTensor]]:
    """The served (bf16) views of the toy model before and after each of 3 AdamW steps."""
    trainer = ToyTrainer()
    out = [view_of(trainer.model)]
    for _ in range(3):
        trainer.step()
        out.append(view_of(trainer.model))
    return out


def test_each_encoding_decodes_bit_exact(views: list[dict[str, RawTensor]]) -> None:
    base, target = views[0], views[1]
    sums = {n: checksum(t) for n, t in base.items()}
    for coding in codings():
        decoded = {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in base.items()}
        coding.decode(decoded, coding.encode(base, target, sums))
        assert_same_view(decoded, target)


def test_verl_flush_is_int32_positions_and_bf16_values(views: list[dict[str, RawTensor]]) -> None:
    base, target = views[1], views[2]
    changed = {n: np.flatnonzero(base[n].bits != t.bits) for n, t in target.items()}
    flush = verl_encode(base, target, {})
    params = pickle.loads(flush.meta)["spec"]["params"]
    assert [p["name"] for p in params] == [n for n, idx in changed.items() if idx.size]
    for p in params:
        positions = flush.positions[p["pos_start"] : p["pos_end"]].numpy().view("<i4")
        assert np.array_equal(positions, changed[p["name"]])
        values = flush.values[p["val_start"] : p["val_end"]].view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(values, target[p["name"]].bits[changed[p["name"]]])
    total = sum(idx.size for idx in changed.values())
    assert flush.size_bytes == len("bucket_metadata") + len(flush.meta) + 6 * total


def test_summary_line_parses(views: list[dict[str, RawTensor]]) -> None:
    results = compare(views, repeats=1)
    assert {r.version for r in results} == {1, 2, 3}
    assert len({r.coding for r in results}) == len(codings())
    cond, verl, miles = (float(x) for x in SUMMARY.fullmatch(summary_line(results)).groups())  # type: ignore[union-attr]
    assert (cond, verl, miles) == tuple(round(mean_bpe(results, c), 3) for c in ("cond", VERL, MILES))
    assert cond < miles < verl


def test_miles_decode_refuses_a_wrong_checksum(views: list[dict[str, RawTensor]]) -> None:
    base, target = views[2], views[3]
    miles = next(c for c in codings() if c.name == MILES)
    files = dict(miles.encode(base, target, {}))
    shard = next(name for name in files if name != INDEX_NAME)
    header_sum = re.search(rb'"([0-9.a-z_]+)":"([0-9a-f]{32})"', files[shard])
    assert header_sum is not None
    wrong = header_sum[2][::-1]
    files[shard] = files[shard].replace(header_sum[2], wrong, 1)
    decoded = {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in base.items()}
    with pytest.raises(ValueError, match="checksum"):
        miles.decode(decoded, files)
