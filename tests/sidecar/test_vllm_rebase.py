"""A staged anchor route on the real vLLM engine (the worker extension, CPU backend).

The sidecar builds an anchor route's target and sends one ``overwrite`` patch of every tensor
whose checksum differs from the engine's (:mod:`stitchboard.sidecar.rebase`); the engine stages
it while serving like any delta and the pause writes those tensors. Checked here: the engine
takes such a patch (full-tensor overwrites, fused and tied parameters included) and ends bit
for bit at the target.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from stitchboard.proto.schema import FileRef, TensorSpec, VersionManifest, VersionStats
from stitchboard.sidecar.fetch import FetchedPlan, FetchedStep
from stitchboard.sidecar.rebase import build_rebase
from tests.sidecar.vllm_fixtures import view_sums


def test_a_staged_anchor_route_commits_bit_exact(vllm_adapter, vllm_views, vllm_snapshot, vllm_workdir):
    vllm_adapter.pause()
    try:
        vllm_adapter.load_snapshot(vllm_snapshot(0), 0, view_sums(vllm_views[0]))
    finally:
        vllm_adapter.resume()
    target = vllm_views[2]
    shards = [Path(p) for p in vllm_snapshot(2)]
    files = [
        FileRef(
            path=p.name, sha256=hashlib.sha256(p.read_bytes()).hexdigest(), size_bytes=p.stat().st_size, role="snapshot"
        )
        for p in shards
    ]
    tensors = [
        TensorSpec(name=n, dtype=t.dtype, shape=list(t.shape), checksums={"xxh3_128": s})
        for (n, t), s in zip(sorted(target.items()), [view_sums(target)[n] for n in sorted(target)], strict=True)
    ]
    stats = VersionStats(changed_elements=0, total_elements=sum(t.numel for t in target.values()), encoded_bytes=0)
    manifest = VersionManifest(
        run_id="rebase", version=2, base_version=1, snapshot=True, tensors=tensors, files=files, stats=stats
    )
    plan = FetchedPlan(None, 2, [FetchedStep(2, "snapshot", shards[0].parent, shards, manifest)])
    held = vllm_adapter.checksums(sorted(target))
    path, listed = build_rebase(plan, held, vllm_workdir / "rebase-v2")
    assert (
        path is not None
        and listed == sum(1 for n in target if held[n] != view_sums(target)[n])
        and listed < len(target)
    )
    staged = vllm_adapter.stage_patches([([str(path)], 0, 2)])
    assert vllm_adapter.state().version == 0 and staged["tensors"] == listed
    paused = time.perf_counter()
    vllm_adapter.pause()
    try:
        vllm_adapter.commit_staged(2)
        vllm_adapter.reset_prefix_cache()
    finally:
        vllm_adapter.resume()
    staged_pause = time.perf_counter() - paused
    assert vllm_adapter.state().version == 2 and vllm_adapter.checksums(sorted(target)) == view_sums(target)
    paused = time.perf_counter()
    vllm_adapter.pause()
    try:  # the same target loaded inside the pause, as the unstaged anchor route does
        vllm_adapter.load_snapshot(vllm_snapshot(2), 2, view_sums(target))
        vllm_adapter.reset_prefix_cache()
    finally:
        vllm_adapter.resume()
    print(
        f"anchor route 0 -> 2 on vLLM: pause {staged_pause:.3f} s staged ({listed} of {len(target)} tensors), "
        f"{time.perf_counter() - paused:.3f} s loading the snapshot in the pause"
    )
