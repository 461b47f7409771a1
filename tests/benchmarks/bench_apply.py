"""Engine pause for one real RL step: in-place patch vs full snapshot load, same engine, same run.

Starts one vLLM server (CPU build, SmolLM2-135M, the stitchboard worker extension), takes real
AdamW steps with :class:`tests.support.training.CpuTrainer`, and for each step measures the time
the engine is paused (pause -> apply -> reset prefix cache -> resume) two ways through the same
:class:`~stitchboard.sidecar.engine.VllmEngine` adapter:

* **patch**: the step's patch file (``diff_views`` of the served views), applied in place;
* **snapshot**: the step's full checkpoint (the same shards an anchor holds), loaded in place.

Both read their files from the memory-backed hand-off folder and are verified bit-exact by the
engine. Prints one line per step and the medians with the breakdown (hand-off read, base check,
index writes, re-pack of the CPU GEMM copies, verify, prefix-cache reset). Needs vLLM in the
running interpreter: ``.venv-vllm/bin/python tests/benchmarks/bench_apply.py`` (exits 0 with a
note when vLLM is absent). Target on CPU: patch pause <= 0.5x snapshot pause.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.vllm_server import VllmServer, vllm_importable  # noqa: E402


def _paused(engine, action) -> tuple[dict, float, float]:
    """Pause, run ``action``, reset the prefix cache, resume; returns (report, pause s, reset s)."""
    t0 = time.perf_counter()
    engine.pause()
    try:
        report = action()
        t = time.perf_counter()
        engine.reset_prefix_cache()
        reset_s = time.perf_counter() - t
    finally:
        engine.resume()
    return report, time.perf_counter() - t0, reset_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (each measured both ways)")
    args = parser.parse_args()
    if not vllm_importable():
        print("bench_apply: vLLM is not importable in this interpreter; run it with .venv-vllm/bin/python")
        return 0
    import torch
    from support.training import CpuTrainer

    from stitchboard.proto.checkpoint import save_checkpoint
    from stitchboard.proto.codec import checksum
    from stitchboard.proto.container import RawTensor
    from stitchboard.proto.diff import diff_views
    from stitchboard.sidecar.engine import VllmEngine
    from stitchboard.trainer_client.smollm2 import build_smollm2_checkpoint

    def raw(view: dict) -> dict[str, RawTensor]:
        return {n: RawTensor("BF16", tuple(t.shape), t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)) for n, t in view.items()}

    model_dir = build_smollm2_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="stitch-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    server = VllmServer(model_dir, work / "engine.log")
    try:
        t = time.perf_counter()
        server.wait_ready()
        print(f"vLLM ready in {time.perf_counter() - t:.1f} s")
        engine = VllmEngine(server.url, timeout_s=60)
        trainer = CpuTrainer(model_dir)
        view = raw(trainer.served_view())
        engine.set_version(0)
        rows = []
        for step in range(1, args.steps + 1):
            trainer.step()
            nxt = raw(trainer.served_view())
            diff = diff_views(view, nxt)
            patch_path = work / f"v{step}.patch"
            patch_path.write_bytes(diff.patch)
            shards = [p for p in save_checkpoint(work / f"snapshot-v{step}", nxt, max_shard_bytes=128 * 1024**2) if p.suffix == ".safetensors"]
            sums = {n: checksum(t) for n, t in nxt.items()}
            p_rep, p_pause, p_reset = _paused(engine, lambda: engine.apply_patch(str(patch_path), step - 1, step))
            # Back to the step's base by snapshot, then the same step by snapshot.
            engine.pause()
            engine.load_snapshot(sorted(str(p) for p in (work / f"snapshot-v{step - 1}").glob("*.safetensors")) if step > 1 else [str(model_dir / "model.safetensors")], step - 1)
            engine.resume()
            s_rep, s_pause, s_reset = _paused(engine, lambda: engine.load_snapshot([str(p) for p in shards], step, sums))
            rows.append((p_rep, p_pause, p_reset, s_rep, s_pause, s_reset))
            print(
                f"step {step}: {diff.changed_elements / diff.total_elements:.2%} changed; "
                f"patch {p_rep['bytes'] / 1e6:.2f} MB paused {p_pause * 1e3:.0f} ms | "
                f"snapshot {s_rep['bytes'] / 1e6:.1f} MB paused {s_pause * 1e3:.0f} ms | ratio {p_pause / s_pause:.2f}"
            )
            view = nxt
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        for label, rep_i, pause_i, reset_i, keys in (
            ("patch", 0, 1, 2, ("read_s", "base_check_s", "write_s", "repack_s", "verify_s")),
            ("snapshot", 3, 4, 5, ("read_s", "write_s", "repack_s", "verify_s")),
        ):
            parts = ", ".join(f"{k[:-2]} {med([r[rep_i][k] for r in rows]):.0f}" for k in keys)
            print(
                f"{label:8s}: paused {med([r[pause_i] for r in rows]):.0f} ms median = rpc {med([r[rep_i]['rpc_s'] for r in rows]):.0f} ms "
                f"({parts}) + prefix-cache reset {med([r[reset_i] for r in rows]):.0f} ms + pause/resume calls"
            )
        ratio = statistics.median(r[1] for r in rows) / statistics.median(r[4] for r in rows)
        print(f"patch / snapshot pause: {ratio:.2f}x (target <= 0.5x)")
        engine.close()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
