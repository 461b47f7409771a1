"""Sharded publish with 2 processes on the CPU (gloo, FSDP2): disjoint parts, one manifest per version,
one squash record per span."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stitchboard.proto.apply import apply_patch
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.proto.decode import read_patch
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.shard_local import ShardLocalPublisher
from stitchboard.trainer_client.sharded import ShardedPublisher, assign_owners
from tests.trainer_client.ranks import run_ranks

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow


def test_assign_owners_is_disjoint_and_balanced():
    sizes = {f"t{i}": s for i, s in enumerate([100, 90, 50, 40, 10, 10])}
    owners = assign_owners(sizes, 2)
    assert set(owners) == set(sizes)
    loads = [sum(sizes[n] for n, r in owners.items() if r == rank) for rank in range(2)]
    assert sorted(loads) == [150, 150]
    assert assign_owners(sizes, 2) == owners  # same on every rank


@pytest.mark.parametrize("publisher", [ShardedPublisher, ShardLocalPublisher])
@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan")])
def test_an_exchange_timeout_that_is_not_positive_is_refused_before_anything_starts(publisher, timeout_s):
    with pytest.raises(ValueError, match=r"exchange_timeout_s must be a positive number of seconds"):
        publisher("http://127.0.0.1:9", "run", exchange_timeout_s=timeout_s)  # no process group, no bulletin needed


def test_two_ranks_publish_one_manifest_per_version(bulletin, run, tmp_path):
    steps = 4
    run_ranks(
        ["steps", bulletin.url, run, str(tmp_path), str(steps)], tmp_path
    )  # the ranks meet through a file store in tmp_path

    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["version"] for r in results] == list(range(steps))
    assert [r["snapshot"] for r in results] == [True, False, False, True]
    with bulletin.client() as client:
        assert [i.version for i in client.versions(run)] == list(range(steps))
        for version in range(steps):
            manifest = client.manifest(run, version)
            patches = sorted(f.path for f in manifest.files_of("patch"))
            assert patches == (
                [] if version == 0 else [f"patch-v{version}-r0.safetensors", f"patch-v{version}-r1.safetensors"]
            )
            if manifest.snapshot:
                paths = {f.path for f in manifest.files_of("snapshot")}
                assert "model.safetensors.index.json" in paths and len(paths) > 2
                assert [f.path for f in manifest.files_of("asset")] == ["config.json"]
            rebuilt = rebuild_version(client, run, version)
            reference = load_checkpoint(tmp_path / f"ref-{version}")
            assert set(rebuilt.view) == set(reference) == {t.name for t in manifest.tensors}
            for name, t in reference.items():
                assert np.array_equal(rebuilt.view[name].bits, t.bits), (version, name)
        squashes = {(s.base_version, s.target_version): s for s in client.squashes(run)}
        assert set(squashes) == {(0, 2), (1, 3)}
        for (
            base,
            target,
        ), squash in squashes.items():  # one file per rank; together they take the base to the target, bit for bit
            assert sorted(f.path for f in squash.files) == [
                f"squash-v{base}-v{target}-r{r}.safetensors" for r in (0, 1)
            ]
            view = rebuild_version(client, run, base).view
            for f in squash.files:
                path = client.download_blob(run, f.sha256, tmp_path / "squash" / f.path, f.size_bytes)
                apply_patch(view, read_patch(path.read_bytes()))
            for name, t in load_checkpoint(tmp_path / f"ref-{target}").items():
                assert np.array_equal(view[name].bits, t.bits), (base, target, name)


def test_a_rank_that_cannot_upload_fails_every_rank_and_commits_nothing(bulletin, run, tmp_path):
    run_ranks(
        ["rank_failure", bulletin.url, run, str(tmp_path)], tmp_path
    )  # the assertions run on both ranks (sharded_worker.py)
