"""SGLang on the CPU: publish -> applied over real steps, and a patch's pause vs SGLang's own full reload.

Run: ``python -m tests.benchmarks.bench_sglang`` (needs .venv-sglang: ``make venv-sglang``).
One run measures, on one SGLang server (TP = 1, stitchboard's loader) with SmolLM2-135M:

1. publish -> applied over ``STEPS`` real AdamW steps (batch 1 x 32 tokens) published by the
   trainer SDK and applied by a ``stitchboard sidecar run --engine sglang`` subprocess: from the
   start of ``Publisher.publish`` (encode, upload, commit) and from its return (the commit) to
   the sidecar reporting the version applied; p50 and max; the sidecar's pause per commit.
2. one more real step's patch applied by the adapter as the sidecar does (pause, write, flush,
   resume) with the loader's breakdown, against ``/update_weights_from_disk`` of the full
   checkpoint (SGLang's own reload) and a snapshot load through the loader, in the same run.
Targets on CPU (issue 12): pause <= 0.5 x the full reload; publish -> applied p50 <= 1.5 s.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.proto.diff import diff_views
from stitchboard.sidecar.engines.sglang.adapter import SglangEngine
from tests.sidecar.sglang_helpers import SglangServer
from tests.sidecar.vllm_fixtures import SidecarProcess, VllmRun, copy_model_files, view_sums

STEPS = 20


def _raw_view(trainer) -> dict:
    import numpy as np
    import torch

    from stitchboard.proto.container import RawTensor

    return {n: RawTensor("BF16", tuple(t.shape), t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)) for n, t in trainer.served_view().items()}


def main() -> int:
    model_dir = build_smollm2_checkpoint()
    folder = Path(tempfile.mkdtemp(prefix="bench-sglang-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    engine = SglangServer(model_dir, folder / "engine.log")
    run = None
    try:
        t = time.perf_counter()
        engine.wait_ready()
        print(f"SGLang TP=1 ready in {time.perf_counter() - t:.1f} s")
        run = VllmRun(model_dir, folder / "run")
        sidecar = SidecarProcess(run, engine.url, folder, {"STITCH_SIDECAR_ENGINE": "sglang", "STITCH_SIDECAR_BOOT_VERSION": "0"})
        sidecar.wait_applied(0, 600)
        from_start, from_commit, pauses = [], [], []
        for _ in range(STEPS):
            run.train()
            t0 = time.perf_counter()
            v = run.publish()
            t1 = time.perf_counter()
            status = sidecar.wait_status(lambda s, v=v: s["applied_version"] == v, f"version {v} applied", 300)
            t2 = time.perf_counter()
            from_start.append(t2 - t0)
            from_commit.append(t2 - t1)
            pauses.append(status["last_sync"]["pause_seconds"])
        print(
            f"publish -> applied over {STEPS} real steps: p50 {statistics.median(from_start):.3f} s from publish() start (max {max(from_start):.3f}), p50 {statistics.median(from_commit):.3f} s from the commit (max {max(from_commit):.3f}); sidecar pause p50 {statistics.median(pauses):.3f} s (max {max(pauses):.3f})"
        )
        sidecar.stop()

        adapter = SglangEngine(engine.url, folder / "records", timeout_s=120)
        base = _raw_view(run.trainer)
        run.train()
        target = _raw_view(run.trainer)
        patch = folder / "next.patch"
        d = diff_views(base, target, "cond")
        patch.write_bytes(d.patch)
        v = adapter.state().version or 0
        t = time.perf_counter()
        adapter.stage_patches([([str(patch)], v, v + 1)])
        stage_s = time.perf_counter() - t
        t = time.perf_counter()
        adapter.pause()
        try:
            report = adapter.commit_staged(v + 1)
            adapter.reset_prefix_cache()
        finally:
            adapter.resume()
        pause_s = time.perf_counter() - t
        checkpoint = folder / "checkpoint"
        save_checkpoint(checkpoint, target)
        copy_model_files(model_dir, checkpoint)
        t = time.perf_counter()
        answer = httpx.post(f"{engine.url}/update_weights_from_disk", json={"model_path": str(checkpoint)}, timeout=900)
        reload_s = time.perf_counter() - t
        assert answer.status_code == 200 and answer.json()["success"], answer.text
        adapter.pause()
        t = time.perf_counter()
        try:
            snap = adapter.load_snapshot([str(p) for p in sorted(checkpoint.glob("*.safetensors"))], v + 1, view_sums(target))
            adapter.reset_prefix_cache()
        finally:
            adapter.resume()
        snapshot_s = time.perf_counter() - t
        adapter.close()
        keys = ("read_s", "check_s", "decode_s", "write_s", "verify_s")
        print(
            f"one real step's patch ({d.changed_elements:,} changed elements, {len(d.patch):,} bytes, cond): checked while serving {stage_s:.3f} s; "
            f"engine pause {pause_s:.3f} s (loader: {', '.join(f'{k} {report[k]:.3f}' for k in keys)}; update call {report['rpc_s']:.3f} s)"
        )
        print(
            f"SGLang /update_weights_from_disk of the full checkpoint: {reload_s:.3f} s; snapshot load through the loader: {snapshot_s:.3f} s (read {snap['read_s']:.3f}, write {snap['write_s']:.3f}, verify {snap['verify_s']:.3f})"
        )
        print(f"pause / full reload: {pause_s / reload_s:.2f} (target <= 0.5); publish -> applied p50 {statistics.median(from_start):.3f} s (target <= 1.5 s)")
        calls = engine.stub_calls()
        print(f"sgl_kernel stand-in calls: {len(calls)}")
        return 0 if not calls else 1
    finally:
        if run is not None:
            run.close()
        engine.stop()


if __name__ == "__main__":
    sys.exit(main())
