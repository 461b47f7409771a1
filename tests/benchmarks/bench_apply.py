"""Engine pause for one real RL step: in-place patch vs full snapshot load, same engine, same run.

Starts one vLLM server (CPU build, SmolLM2-135M, the stitchboard worker extension), takes real
AdamW steps with :class:`tests.support.training.CpuTrainer`, and for each step measures the time
the engine is paused (pause -> apply -> reset prefix cache -> resume) three ways through the same
:class:`~stitchboard.sidecar.engines.vllm.adapter.VllmEngine` adapter:

* **staged patch** (what the sidecar does): the step's patch file (``diff_views`` of the served
  views) is staged while the engine serves (decode, base and target checks on a host copy, GEMM
  copies packed), then the pause only writes the changed elements, installs the packed copies
  and verifies;
* **one-call patch**: the same patch staged and committed inside the pause (``apply_patch``);
* **snapshot**: the step's full checkpoint (the same shards an anchor holds), loaded in place
  (write, re-pack every linear layer, verify).

All read their files from the memory-backed hand-off folder and are verified bit-exact by the
engine. Prints one line per step and the medians with the breakdown (hand-off read, checksums,
host copy, packing or re-packing the CPU GEMM copies, index writes, verify, prefix-cache reset).
Needs vLLM in the running interpreter: ``.venv/bin/python -m tests.benchmarks.bench_apply
--steps 30`` (``make venv`` installs it; exits 0 with a note when vLLM is absent). Targets on
CPU: staged patch pause <= 0.5x snapshot pause (medians); staged pause p95 <= 0.15 s and p95 <=
3x its p50 (the tail, issue 27 E). The last line reads ``apply: steps=N pause_p50_s=
pause_p95_s= p95_over_p50= reload_p50_s= ratio=`` (pause: the staged patch's; reload: the
snapshot's; ratio: pause p50 / reload p50; p95: the nearest-rank 95th percentile).
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from stitchboard.sidecar.engines.vllm.launch import vllm_env
from tests.support.vllm_server import VllmServer, vllm_importable

#: TTL of the benchmark's engine lease, seconds: longer than a run, so that no renewal lands inside a timed pause.
LEASE_TTL_S = 3600.0


def _paused(engine, action) -> tuple[dict, float, float]:
    """Pause, run ``action``, reset the prefix cache, resume; returns (report, pause s, reset s).

    The report is the action's plus ``pause_call_s`` and ``resume_call_s`` (the two HTTP calls).
    """
    t0 = time.perf_counter()
    engine.pause()
    pause_call_s = time.perf_counter() - t0
    try:
        report = action()
        t = time.perf_counter()
        engine.reset_prefix_cache()
        reset_s = time.perf_counter() - t
    finally:
        t = time.perf_counter()
        engine.resume()
        end = time.perf_counter()
    return {**report, "pause_call_s": pause_call_s, "resume_call_s": end - t}, end - t0, reset_s


def _calls(report: dict, pause_s: float, reset_s: float) -> str:
    """Where a staged pause went, ms: the HTTP calls, and inside the commit call the worker's write and verify."""
    ms = {k: report[k] * 1e3 for k in ("pause_call_s", "rpc_s", "write_s", "verify_s", "resume_call_s")}
    return (
        f"pause call {ms['pause_call_s']:.0f}, commit call {ms['rpc_s']:.0f} (write {ms['write_s']:.0f}, "
        f"verify {ms['verify_s']:.0f}), cache reset {reset_s * 1e3:.0f}, resume call {ms['resume_call_s']:.0f}"
    )


def _p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile (of 30 values: the 29th smallest)."""
    return sorted(values)[max(0, math.ceil(0.95 * len(values)) - 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (each measured both ways)")
    args = parser.parse_args()
    if not vllm_importable():
        print("bench_apply: vLLM is not importable in this interpreter; run it with .venv/bin/python after `make venv`")
        return 0
    import torch

    from stitchboard.demo.smollm2 import build_smollm2_checkpoint
    from stitchboard.proto.checkpoint import save_checkpoint
    from stitchboard.proto.codec import checksum
    from stitchboard.proto.container import RawTensor
    from stitchboard.proto.diff import diff_views
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
    from tests.support.training import CpuTrainer

    def raw(view: dict) -> dict[str, RawTensor]:
        return {
            n: RawTensor("BF16", tuple(t.shape), t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1))
            for n, t in view.items()
        }

    model_dir = build_smollm2_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="stitch-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    server = VllmServer(model_dir, work / "engine.log")
    try:
        t = time.perf_counter()
        server.wait_ready()
        print(f"vLLM ready in {time.perf_counter() - t:.1f} s (engine environment {vllm_env()})")
        engine = VllmEngine(server.url, timeout_s=60)
        engine.take_lease("bench-apply", LEASE_TTL_S)
        trainer = CpuTrainer(model_dir)
        view = raw(trainer.served_view())
        engine.set_version(0)
        rows = []

        def back_to(version: int) -> None:  # unmeasured: reload the base by snapshot
            engine.pause()
            try:
                engine.load_snapshot(
                    sorted(str(p) for p in (work / f"snapshot-v{version}").glob("*.safetensors"))
                    if version
                    else [str(model_dir / "model.safetensors")],
                    version,
                )
            finally:
                engine.resume()

        for step in range(1, args.steps + 1):
            trainer.step()
            nxt = raw(trainer.served_view())
            diff = diff_views(view, nxt)
            patch_path = work / f"v{step}.patch"
            patch_path.write_bytes(diff.patch)
            shards = [
                p
                for p in save_checkpoint(work / f"snapshot-v{step}", nxt, max_shard_bytes=128 * 1024**2)
                if p.suffix == ".safetensors"
            ]
            sums = {n: checksum(t) for n, t in nxt.items()}
            row = {}
            t = time.perf_counter()
            row["stage"] = engine.stage_patches([([str(patch_path)], step - 1, step)])
            row["stage_s"] = time.perf_counter() - t
            row["staged"] = _paused(engine, lambda step=step: engine.commit_staged(step))
            back_to(step - 1)
            row["one_call"] = _paused(
                engine, lambda step=step, patch_path=patch_path: engine.apply_patch(str(patch_path), step - 1, step)
            )
            back_to(step - 1)
            row["snapshot"] = _paused(
                engine,
                lambda step=step, shards=shards, sums=sums: engine.load_snapshot([str(p) for p in shards], step, sums),
            )
            rows.append(row)
            print(
                f"step {step}: {diff.changed_elements / diff.total_elements:.2%} changed, "
                f"patch {len(diff.patch) / 1e6:.2f} MB: "
                f"staged while serving {row['stage_s'] * 1e3:.0f} ms, then paused {row['staged'][1] * 1e3:.0f} ms "
                f"({_calls(*row['staged'])}) | "
                f"one call in the pause {row['one_call'][1] * 1e3:.0f} ms | snapshot "
                f"{row['snapshot'][0]['bytes'] / 1e6:.1f} MB paused "
                f"{row['snapshot'][1] * 1e3:.0f} ms | ratio {row['staged'][1] / row['snapshot'][1]:.2f}"
            )
            view = nxt
        med = lambda xs: statistics.median(xs) * 1e3
        stage_keys = ("read_s", "check_s", "build_s", "pack_s")
        print(
            f"staging (engine serving): {med([r['stage_s'] for r in rows]):.0f} ms median ("
            + ", ".join(f"{k[:-2]} {med([r['stage'][k] for r in rows]):.0f}" for k in stage_keys)
            + ")"
        )
        for label, keys in (
            ("staged", ("write_s", "swap_s", "verify_s")),
            ("one_call", stage_keys + ("write_s", "swap_s", "verify_s")),
            ("snapshot", ("read_s", "write_s", "repack_s", "verify_s")),
        ):
            reps = [r[label][0] for r in rows]
            parts = ", ".join(f"{k[:-2]} {med([x[k] for x in reps]):.0f}" for k in keys)
            print(
                f"{label:8s}: paused {med([r[label][1] for r in rows]):.0f} ms median = rpc "
                f"{med([x['rpc_s'] for x in reps]):.0f} ms "
                f"({parts}) + prefix-cache reset {med([r[label][2] for r in rows]):.0f} ms + pause/resume calls"
            )
        ratio = statistics.median(r["staged"][1] for r in rows) / statistics.median(r["snapshot"][1] for r in rows)
        one_call = statistics.median(r["one_call"][1] for r in rows) / statistics.median(r["snapshot"][1] for r in rows)
        print(
            f"patch / snapshot pause: {ratio:.2f}x staged (target <= 0.5x); "
            f"{one_call:.2f}x when staged inside the pause"
        )
        pauses = [r["staged"][1] for r in rows]
        p50, p95 = statistics.median(pauses), _p95(pauses)
        reload_p50 = statistics.median(r["snapshot"][1] for r in rows)
        print(f"staged pauses (s, sorted): {' '.join(f'{x:.3f}' for x in sorted(pauses))}")
        print(
            f"apply: steps={len(rows)} pause_p50_s={p50:.4f} pause_p95_s={p95:.4f} p95_over_p50={p95 / p50:.2f} "
            f"reload_p50_s={reload_p50:.4f} ratio={p50 / reload_p50:.2f}"
        )
        engine.close()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
