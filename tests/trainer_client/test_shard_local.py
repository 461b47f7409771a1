"""Shard-local publish with 2 processes on the CPU (gloo): FSDP2 with uneven and empty shards through AdamW
steps, TP DTensors (Shard(0), Shard(1), Replicate), a pipeline split with a tied embedding, refused replicas,
a rank that dies or hangs mid-publish. Each version is pulled from the bulletin and compared bit for bit with the full
weights gathered from the same ranks at the same step (shard_local_worker.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from stitchboard.proto.apply import apply_patch
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.proto.decode import read_patch
from stitchboard.proto.schema import XXH3_128, XXH3_128_PARTS
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.squash_cli import rebuild_squashes
from tests.trainer_client.ranks import run_ranks

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("shard_local_worker.py")


def _pulled_bit_exact(client, run: str, out: Path) -> list[dict]:
    """Every version of ``run`` rebuilt from the bulletin equals the reference the ranks saved, bit for bit."""
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for r in results:
        rebuilt = rebuild_version(client, run, r["version"])
        reference = load_checkpoint(out / f"ref-{r['version']}")
        assert set(rebuilt.view) == set(reference)
        for name, t in reference.items():
            assert tuple(rebuilt.view[name].shape) == tuple(t.shape), (r["version"], name, "shape")
            assert np.array_equal(rebuilt.view[name].bits, t.bits), (r["version"], name)
    return results


def _squash_bit_exact(client, run: str, base: int, target: int, out: Path) -> dict:
    """Squash ``base -> target`` of ``run`` (one file per rank) applied to version ``base`` rebuilt from the bulletin
    gives the reference the ranks saved for ``target``, bit for bit; its entries by tensor name."""
    squash = next(s for s in client.squashes(run) if (s.base_version, s.target_version) == (base, target))
    assert sorted(f.path for f in squash.files) == [f"squash-v{base}-v{target}-r{r}.safetensors" for r in (0, 1)]
    view = rebuild_version(client, run, base).view
    entries = {}
    for f in squash.files:
        path = client.download_blob(run, f.sha256, out / "downloads" / f.path, f.size_bytes)
        patch = read_patch(path.read_bytes())
        entries.update(patch.entries)
        apply_patch(view, patch)  # base and target checksums checked as it is applied
    for name, t in load_checkpoint(out / f"ref-{target}").items():
        assert np.array_equal(view[name].bits, t.bits), (base, target, name)
    return entries


def test_fsdp_tp_squash_and_pipeline_versions_pull_bit_exact(bulletin, run, tmp_path):
    run_ranks(["fsdp,tp,squash,pipeline", bulletin.url, run, str(tmp_path)], tmp_path, worker=WORKER)
    with bulletin.client() as client:
        results = _pulled_bit_exact(client, f"{run}-fsdp", tmp_path / "fsdp")
        assert [(r["version"], r["snapshot"]) for r in results] == [(0, True), (1, False), (2, False), (3, True)]
        manifest = client.manifest(f"{run}-fsdp", 2)
        specs = manifest.tensor_map()
        # FSDP2 rows: 63 = 32 + 31, 47 = 24 + 23, and [1, 47]: rank 1's shard is empty (no part)
        assert specs["0.weight"].parts == [(0, 0, 32), (0, 32, 63)] and XXH3_128_PARTS in specs["0.weight"].checksums
        assert specs["2.weight"].parts == [(0, 0, 1)]
        patches = manifest.files_of("patch")
        assert patches and all(f.path.startswith("patch-v2-r") for f in patches)
        for f in patches:  # each tensor's parts assembled in one entry, by its writer rank
            data = client.download_blob(f"{run}-fsdp", f.sha256, tmp_path / "dl" / f.path, f.size_bytes).read_bytes()
            for entry in read_patch(data).entries.values():
                assert entry.layout == tuple(specs[entry.name].parts)
        assert results[1]["changed_elements"] > 0

        results = _pulled_bit_exact(client, f"{run}-tp", tmp_path / "tp")
        specs = client.manifest(f"{run}-tp", 1).tensor_map()
        assert specs["col.weight"].parts == [(0, 0, 6), (0, 6, 12)]
        assert specs["row.weight"].parts == [(1, 0, 6), (1, 6, 12)]
        assert specs["norm.weight"].parts is None and XXH3_128 in specs["norm.weight"].checksums  # replicated: once

        _pulled_bit_exact(client, f"{run}-squash", tmp_path / "squash")
        specs = client.manifest(f"{run}-squash", 4).tensor_map()
        squashes = {(s.base_version, s.target_version): s for s in client.squashes(f"{run}-squash")}
        assert set(squashes) == {(0, 2), (1, 3)}  # 2 -> 4 and 3 -> 5 failed their checks (wrong records)
        logs = "".join((tmp_path / f"rank{r}.stderr").read_text() for r in (0, 1))
        assert re.search(r"squash 2 -> 4 of run .* failed its check on its writer rank \d \(tensor '(col|row).weight': "
                         r"the ranks' rebuilt blocks are not the base version's\)", logs), logs[-3000:]  # fmt: skip
        assert re.search(r"squash 3 -> 5 of run .* failed its check against rank \d's views \(.*norm.weight", logs), (
            logs[-3000:]
        )
        for base, target in squashes:
            entries = _squash_bit_exact(client, f"{run}-squash", base, target, tmp_path / "squash")
            assert {n: e.layout for n, e in entries.items() if e.layout} == {
                "col.weight": ((0, 0, 6), (0, 6, 12)),
                "row.weight": ((1, 0, 6), (1, 6, 12)),
            }  # each sharded tensor's parts in one entry, assembled by its writer
            assert "norm.weight" in entries and not entries["norm.weight"].layout  # replicated: whole, once
            assert [p.count > 0 for p in entries["col.weight"].parts] == [True, False]  # rank 1's rows: no change
        assert specs["col.weight"].parts == [(0, 0, 6), (0, 6, 12)]
        with pytest.raises(ValueError, match=r"holds tensors in parts \(\['col.weight', 'row.weight'\]"):
            rebuild_squashes(client, f"{run}-squash", (2,))  # its publisher makes them, not `squash rebuild`

        _pulled_bit_exact(client, f"{run}-pipeline", tmp_path / "pipeline")
        assert [i.version for i in client.versions(f"{run}-pipeline")] == [0, 1]  # the refused publish left nothing


@pytest.mark.heavy  # three gloo jobs, ~40-100 s on the 2-core machine: past the fast tier's share of issue #32
def test_a_dead_rank_leaves_no_version_and_a_job_of_another_size_resumes(bulletin, run, tmp_path):
    codes = run_ranks(["dies", bulletin.url, run, str(tmp_path)], tmp_path, worker=WORKER, expect=17)
    assert codes == [0, 17]  # rank 0 saw the failure (asserted there); rank 1 died after its upload
    with bulletin.client() as client:
        assert [i.version for i in client.versions(run)] == [0]
    (tmp_path / "after").mkdir()
    run_ranks(["after_death", bulletin.url, run, str(tmp_path / "after")], tmp_path / "after", worker=WORKER)
    with bulletin.client() as client:
        assert [i.version for i in client.versions(run)] == [0, 1]
        _pulled_bit_exact(client, run, tmp_path / "after")
    (
        tmp_path / "one"
    ).mkdir()  # one rank resumes what two published: it cuts its (whole-row) block from the rebuilt view
    run_ranks(["resized", bulletin.url, run, str(tmp_path / "one")], tmp_path / "one", world=1, worker=WORKER)
    with bulletin.client() as client:
        _pulled_bit_exact(client, run, tmp_path / "one")


def test_a_hung_rank_fails_every_rank_within_the_exchange_timeout(bulletin, run, tmp_path):
    """Not gloo's 30 minutes: rank 0 gives up after exchange_timeout_s, the hung rank once it wakes; nothing is
    committed, and new publishers on the same ranks publish the version bit-exact (shard_local_worker.hangs)."""
    run_ranks(["hangs", bulletin.url, run, str(tmp_path)], tmp_path, worker=WORKER)
    with bulletin.client() as client:
        assert [i.version for i in client.versions(run)] == [0, 1]
        _pulled_bit_exact(client, run, tmp_path)


@pytest.mark.heavy  # SmolLM2-135M on 2 gloo ranks with FSDP2: ~1-2 minutes on the 2-core machine
def test_smollm2_under_fsdp2_through_adamw_steps_pulls_bit_exact(bulletin, run, tmp_path, smollm2_dir, monkeypatch):
    monkeypatch.setenv("SMOLLM2_DIR", str(smollm2_dir))
    run_ranks(["smollm2", bulletin.url, run, str(tmp_path)], tmp_path, worker=WORKER, timeout_s=400)
    with bulletin.client() as client:
        results = _pulled_bit_exact(client, run, tmp_path)
        assert [r["version"] for r in results] == [0, 1, 2]
        assert all(0 < r["changed_elements"] < r["total_elements"] for r in results[1:])
        specs = client.manifest(run, 2).tensor_map()
        assert "lm_head.weight" not in specs  # tied: published once, as the embedding
        assert specs["model.embed_tokens.weight"].parts == [(0, 0, 24576), (0, 24576, 49152)]
        assert [(s.base_version, s.target_version) for s in client.squashes(run)] == [(0, 2)]
        entries = _squash_bit_exact(client, run, 0, 2, tmp_path)
        assert entries["model.embed_tokens.weight"].layout == ((0, 0, 24576), (0, 24576, 49152))
