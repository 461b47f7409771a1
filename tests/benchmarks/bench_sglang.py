"""SGLang on the CPU: publish -> applied over real steps, and a patch's pause vs SGLang's own full reload.

Run: ``python -m tests.benchmarks.bench_sglang`` (needs .venv-sglang: ``make venv-sglang``).
One run measures, on one SGLang server (TP = 1, stitchboard's loader) with SmolLM2-135M:

1. publish -> applied over ``STEPS`` real AdamW steps (batch 1 x 32 tokens) published by the
   trainer SDK and applied by a ``stitchboard sidecar run --engine sglang`` subprocess: from the
   start of ``Publisher.publish`` (encode, upload, commit) and from its return (the commit) to
   the sidecar reporting the version applied; p50 and max; the sidecar's pause per commit.
2. ``ROUNDS`` more real steps' patches, each staged while serving (the loader's stager) and
   committed by the adapter as the sidecar does (pause, the stager's write and flush, the version
   set, state, the flush call when still needed, continue: each call timed),
   against ``/update_weights_from_disk`` of the same
   version's full checkpoint (SGLang's own reload) and a snapshot load through the loader, in the
   same run; medians printed.
Targets on CPU (issue 12): pause <= 0.5 x the full reload; publish -> applied p50 <= 1.5 s.
"""

from __future__ import annotations

import itertools
import shutil
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
from tests.support import lease

STEPS = 20
#: Steps whose patch pause and full reload are timed (medians printed).
ROUNDS = 8
#: SGLang full reloads timed after each of those steps (its time varies several-fold between calls).
RELOADS = 3
STAGE_KEYS = ("read_s", "check_s", "decode_s", "index_s")
COMMIT_KEYS = ("park_s", "write_s", "stager_s", "label_s")


def _raw_view(trainer) -> dict:
    import numpy as np
    import torch

    from stitchboard.proto.container import RawTensor

    return {
        n: RawTensor("BF16", tuple(t.shape), t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1))
        for n, t in trainer.served_view().items()
    }


def _one_step(adapter: SglangEngine, run: VllmRun, model_dir: Path, folder: Path, url: str) -> dict:
    """One more real step: its patch staged while serving, then committed as the sidecar does
    (pause, update, state, flush, continue: each call timed); then SGLang's own reload of the
    same version's full checkpoint, and a snapshot load of it through the loader."""
    folder.mkdir()
    base = _raw_view(run.trainer)
    run.train()
    target = _raw_view(run.trainer)
    patch = folder / "next.patch"
    d = diff_views(base, target, "cond")
    patch.write_bytes(d.patch)
    v = adapter.state().version or 0
    t = time.perf_counter()
    staged = adapter.stage_patches([([str(patch)], v, v + 1)])
    out: dict = {
        "stage_s": time.perf_counter() - t,
        "in_engine": staged["in_engine"],
        "changed": d.changed_elements,
        "bytes": len(d.patch),
    }
    out.update({k: float(staged.get(k, 0.0)) for k in STAGE_KEYS})
    marks = [time.perf_counter()]
    adapter.pause()
    marks.append(time.perf_counter())
    try:
        report = adapter.commit_staged(v + 1)
        marks.append(time.perf_counter())
        assert adapter.state().version == v + 1
        marks.append(time.perf_counter())
        adapter.reset_prefix_cache()
        marks.append(time.perf_counter())
    finally:
        adapter.resume()
    marks.append(time.perf_counter())
    steps = [b - a for a, b in itertools.pairwise(marks)]
    out.update(
        pause_s=marks[-1] - marks[0],
        pause_call_s=steps[0],
        commit_s=steps[1],
        state_s=steps[2],
        flush_s=steps[3],
        resume_s=steps[4],
    )
    out.update(
        {k: float(report.get(k, 0.0)) for k in COMMIT_KEYS},
        committed=bool(report["committed"]),
        flushed=bool(report.get("flushed")),
        stager_flush_s=float(report.get("flush_s", 0.0)),
    )
    checkpoint = folder / "checkpoint"
    save_checkpoint(checkpoint, target)
    copy_model_files(model_dir, checkpoint)
    out["reloads"] = []
    for _ in range(RELOADS):
        t = time.perf_counter()
        answer = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(checkpoint)}, timeout=900)
        out["reloads"].append(time.perf_counter() - t)
        assert answer.status_code == 200 and answer.json()["success"], answer.text
    adapter.pause()
    t = time.perf_counter()
    try:
        adapter.load_snapshot([str(p) for p in sorted(checkpoint.glob("*.safetensors"))], v + 1, view_sums(target))
        adapter.reset_prefix_cache()
    finally:
        adapter.resume()
    out["snapshot_s"] = time.perf_counter() - t
    return out


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
        sidecar = SidecarProcess(
            run, engine.url, folder, {"STITCH_SIDECAR_ENGINE": "sglang", "STITCH_SIDECAR_BOOT_VERSION": "0"}
        )
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
            f"publish -> applied over {STEPS} real steps: p50 {statistics.median(from_start):.3f} s from publish() "
            f"start (max {max(from_start):.3f}), p50 {statistics.median(from_commit):.3f} s from the commit (max "
            f"{max(from_commit):.3f}); sidecar pause p50 {statistics.median(pauses):.3f} s (max {max(pauses):.3f})"
        )
        sidecar.stop()

        adapter = SglangEngine(engine.url, folder / "records", timeout_s=120)
        lease.take(adapter, "bench")  # the sidecar released it at its clean stop
        rounds = [_one_step(adapter, run, model_dir, folder / f"step{i}", engine.url) for i in range(ROUNDS)]
        adapter.close()
        median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if isinstance(rounds[0][k], float)}
        last = rounds[-1]
        print(
            f"one real step's patch ({last['changed']:,} changed elements, {last['bytes']:,} bytes, cond), "
            f"medians of {ROUNDS} steps: "
            f"staged while serving {median['stage_s']:.3f} s (in the engine's stager: "
            f"{', '.join(f'{k} {median[k]:.3f}' for k in STAGE_KEYS)}; staged while serving: "
            f"{all(r['in_engine'] for r in rounds)})"
        )
        print(
            f"engine pause {median['pause_s']:.3f} s: pause call {median['pause_call_s']:.4f}, "
            f"commit {median['commit_s']:.4f} "
            f"(the stager's call {median['stager_s']:.4f}: scheduler held {median['park_s']:.4f}, write, "
            f"each chunk read back at once, {median['write_s']:.4f}, "
            f"cache flushed {median['stager_flush_s']:.4f}; version set {median['label_s']:.4f}), "
            f"state {median['state_s']:.4f}, flush call {median['flush_s']:.4f}, "
            f"continue {median['resume_s']:.4f}; "
            f"written and flushed by the stager in every round: {all(r['committed'] and r['flushed'] for r in rounds)}"
        )
        reloads = [x for r in rounds for x in r["reloads"]]
        pauses_ = [r["pause_s"] for r in rounds]
        print(
            f"SGLang /update_weights_from_disk of the full checkpoint ({len(reloads)} calls): "
            f"median {statistics.median(reloads):.3f} s, min {min(reloads):.3f}, max {max(reloads):.3f}; "
            f"engine pause ({ROUNDS} steps): median {median['pause_s']:.3f} s, min {min(pauses_):.3f}, "
            f"max {max(pauses_):.3f}; snapshot load through the loader: {median['snapshot_s']:.3f} s"
        )
        print(
            f"pause / full reload: {median['pause_s'] / statistics.median(reloads):.2f} (medians; "
            f"fastest pause / fastest reload {min(pauses_) / min(reloads):.2f}; target <= 0.5); "
            f"publish -> applied p50 {statistics.median(from_start):.3f} s (target <= 1.5 s)"
        )
        calls = engine.stub_calls()
        print(f"sgl_kernel stand-in calls: {len(calls)}")
        return 0 if not calls else 1
    finally:
        if run is not None:
            run.close()
        engine.stop()
        shutil.rmtree(folder, ignore_errors=True)  # /dev/shm is memory: 1-2 GB of checkpoints and patches per run


if __name__ == "__main__":
    sys.exit(main())
