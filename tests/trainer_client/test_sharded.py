"""Sharded publish with 2 processes on the CPU (gloo, FSDP2): disjoint parts, one manifest per version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.sharded import assign_owners

WORKER = Path(__file__).with_name("sharded_worker.py")


def test_assign_owners_is_disjoint_and_balanced():
    sizes = {f"t{i}": s for i, s in enumerate([100, 90, 50, 40, 10, 10])}
    owners = assign_owners(sizes, 2)
    assert set(owners) == set(sizes)
    loads = [sum(sizes[n] for n, r in owners.items() if r == rank) for rank in range(2)]
    assert sorted(loads) == [150, 150]
    assert assign_owners(sizes, 2) == owners  # same on every rank


def test_two_ranks_publish_one_manifest_per_version(bulletin, run, tmp_path):
    steps = 4
    env = {**os.environ, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # the ranks meet through a file store in tmp_path (sharded_worker.py)
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), bulletin.url, run, str(tmp_path), str(steps)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE)
        for r in range(2)
    ]
    errors = [p.communicate(timeout=180)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors

    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["version"] for r in results] == list(range(steps))
    assert [r["snapshot"] for r in results] == [True, False, False, True]
    with bulletin.client() as client:
        assert [i.version for i in client.versions(run)] == list(range(steps))
        for version in range(steps):
            manifest = client.manifest(run, version)
            patches = sorted(f.path for f in manifest.files_of("patch"))
            assert patches == ([] if version == 0 else [f"patch-v{version}-r0.safetensors", f"patch-v{version}-r1.safetensors"])
            if manifest.snapshot:
                paths = {f.path for f in manifest.files_of("snapshot")}
                assert "model.safetensors.index.json" in paths and len(paths) > 2
                assert [f.path for f in manifest.files_of("asset")] == ["config.json"]
            rebuilt = rebuild_version(client, run, version)
            reference = load_checkpoint(tmp_path / f"ref-{version}")
            assert set(rebuilt.view) == set(reference) == {t.name for t in manifest.tensors}
            for name, t in reference.items():
                assert np.array_equal(rebuilt.view[name].bits, t.bits), (version, name)
