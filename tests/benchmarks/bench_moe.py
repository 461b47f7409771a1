"""What real AdamW steps change in a tiny MoE, what their patches weigh, and the engine pause they cost.

Run: ``python -m tests.benchmarks.bench_moe [--steps 5] [--presets tiny-qwen3-moe,tiny-mixtral]
[--no-engine]`` (from the repo root, in .venv; the engine part runs vLLM: take the engine lock).

Per preset (:mod:`stitchboard.demo.moe_models`, built on first use), one run:

1. ``--steps`` real AdamW steps (:class:`tests.support.training.CpuTrainer`: fp32 masters, lr
   ``--lr``, batch ``--batch`` x ``--seq-len`` tokens of English text). Per step: the % of the
   bf16 served view's elements whose bits changed, per tensor class (**experts**: the per-expert
   ``gate/up/down_proj`` or ``w1/w2/w3``; **router**: ``mlp.gate`` / ``block_sparse_moe.gate``;
   **attention**: ``self_attn.*``; **embedding**: ``embed_tokens`` (only the rows of tokens in
   the batch get a gradient); **lm_head** (untied); **other**: the norms),
   the ``cond`` patch's bytes (the publisher's default encoding) and the
   full checkpoint's bytes over them.
2. Unless ``--no-engine``: one vLLM server (TP = 1, stitchboard's worker extension) on the
   preset takes version 0 as a snapshot, then each step's patch as the sidecar applies it:
   staged while serving, then the **pause** (``/pause``, commit of the staged update with its
   checksum verification, prefix-cache reset, ``/resume``), timed here; then the last version
   again as a **full snapshot load** in the same kind of pause (the alternative to a patch).
   The engine's checksums of every tensor must equal the trainer's view at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from stitchboard.demo.moe_models import PRESETS, moe_preset_checkpoint
from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor
from stitchboard.proto.diff import diff_views
from tests.benchmarks.bench_codec import raw_view
from tests.support import lease

#: Tensor classes, in table order.
CLASSES = ("experts", "router", "attention", "embedding", "lm_head", "other")


def tensor_class(name: str) -> str:
    """The class of checkpoint tensor ``name`` (see the module docstring)."""
    if ".experts." in name:
        return "experts"
    if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
        return "router"
    if ".self_attn." in name:
        return "attention"
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    return "other"


@dataclass
class StepFigures:
    """One step of one preset."""

    step: int
    changed: dict[str, tuple[int, int]]  # class -> (changed, total) elements
    patch_bytes: int
    full_bytes: int
    pause_s: float | None = None
    stage_s: float | None = None
    report: dict = field(default_factory=dict)

    def pct(self, cls: str) -> float:
        c, n = self.changed[cls]
        return 100.0 * c / n if n else 0.0

    @property
    def total_pct(self) -> float:
        c = sum(v[0] for v in self.changed.values())
        return 100.0 * c / sum(v[1] for v in self.changed.values())


def copy_view(view: dict[str, RawTensor]) -> dict[str, RawTensor]:
    return {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in view.items()}


def measure(step: int, old: dict[str, RawTensor], new: dict[str, RawTensor]) -> tuple[StepFigures, bytes]:
    """The step's figures and its ``cond`` patch."""
    counts = {c: [0, 0] for c in CLASSES}
    for name, t in new.items():
        cls = tensor_class(name)
        counts[cls][0] += int(np.count_nonzero(old[name].bits != t.bits))
        counts[cls][1] += t.bits.size
    patch = diff_views(old, new, "cond").patch
    full = sum(t.bits.nbytes for t in new.values())
    return StepFigures(step, {c: (v[0], v[1]) for c, v in counts.items()}, len(patch), full), patch


def run_engine(
    checkpoint: Path, views: list[dict[str, RawTensor]], patches: list[Path], folder: Path, figures: list[StepFigures]
) -> tuple[float, float, dict]:
    """Apply every patch on a real vLLM (pause timed per step into ``figures``); returns the
    first snapshot load's pause, the final one's and the final one's report, seconds."""
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
    from tests.support.vllm_server import VllmServer

    server = VllmServer(checkpoint, folder / "engine.log")
    try:
        t = time.perf_counter()
        server.wait_ready()
        print(f"  vLLM ready in {time.perf_counter() - t:.0f} s")
        engine = VllmEngine(server.url, timeout_s=60)
        lease.take(engine, "bench")

        def snapshot(version: int) -> tuple[float, dict]:
            shards = folder / f"snapshot-v{version}"
            paths = [str(p) for p in save_checkpoint(shards, views[version])]
            sums = {n: checksum(t) for n, t in views[version].items()}
            t = time.perf_counter()
            engine.pause()
            try:
                report = engine.load_snapshot(paths, version, sums)
                engine.reset_prefix_cache()
            finally:
                engine.resume()
            return time.perf_counter() - t, report

        boot_s, _ = snapshot(0)
        for fig, patch in zip(figures, patches, strict=True):
            t = time.perf_counter()
            engine.stage_patches([([str(patch)], fig.step - 1, fig.step)])
            fig.stage_s = time.perf_counter() - t
            t = time.perf_counter()
            engine.pause()
            try:
                fig.report = engine.commit_staged(fig.step)
                engine.reset_prefix_cache()
            finally:
                engine.resume()
            fig.pause_s = time.perf_counter() - t
        last = len(views) - 1
        held = engine.checksums(sorted(views[last]))
        want = {n: checksum(t) for n, t in views[last].items()}
        wrong = [n for n in want if held.get(n) != want[n]]
        if wrong:
            raise SystemExit(f"the engine's tensors differ from version {last}'s view: {wrong[:5]}")
        snapshot_s, snap_report = snapshot(last)
        engine.close()
        return boot_s, snapshot_s, snap_report
    finally:
        server.stop()


def table(preset: str, figures: list[StepFigures]) -> Table:
    t = Table(title=f"{preset}: per real AdamW step")
    for col in ("step", *(f"{c} %" for c in CLASSES), "all %", "patch bytes", "full / patch", "stage ms", "pause ms"):
        t.add_column(col, justify="right")
    for f in figures:
        ms = lambda s: f"{1000 * s:.1f}" if s is not None else "-"
        t.add_row(
            str(f.step),
            *(f"{f.pct(c):.3f}" for c in CLASSES),
            f"{f.total_pct:.3f}",
            f"{f.patch_bytes:,}",
            f"{f.full_bytes / f.patch_bytes:.1f}",
            ms(f.stage_s),
            ms(f.pause_s),
        )
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated, of {', '.join(PRESETS)}")
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--no-engine", action="store_true", help="skip the vLLM part (pauses)")
    args = parser.parse_args()
    from tests.support.training import CpuTrainer

    console = Console(width=160)
    for preset in args.presets.split(","):
        checkpoint = moe_preset_checkpoint(preset)
        trainer = CpuTrainer(checkpoint, batch_size=args.batch, seq_len=args.seq_len, lr=args.lr)
        views = [copy_view(raw_view(trainer.served_view()))]
        figures: list[StepFigures] = []
        with tempfile.TemporaryDirectory(
            prefix="bench-moe-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        ) as tmp:
            patches = []
            for step in range(1, args.steps + 1):
                t = time.perf_counter()
                trainer.step()
                train_s = time.perf_counter() - t
                views.append(copy_view(raw_view(trainer.served_view())))
                fig, patch = measure(step, views[-2], views[-1])
                figures.append(fig)
                patches.append(Path(tmp) / f"v{step}.patch")
                patches[-1].write_bytes(patch)
                console.print(
                    f"{preset} step {step}: trained in {train_s:.2f} s, {fig.total_pct:.3f} % changed, "
                    f"patch {fig.patch_bytes:,} B"
                )
            snapshot = None
            if not args.no_engine:
                snapshot = run_engine(checkpoint, views, patches, Path(tmp), figures)
        console.print(table(preset, figures))
        full = figures[0].full_bytes
        console.print(
            f"{preset}: full view {full:,} B, {sum(v[1] for v in figures[0].changed.values()):,} elements; "
            f"patch median {int(statistics.median(f.patch_bytes for f in figures)):,} B (full / patch "
            f"{full / statistics.median(f.patch_bytes for f in figures):.1f}); "
            f"experts changed median {statistics.median(f.pct('experts') for f in figures):.3f} %"
        )
        if snapshot is not None:
            boot_s, snapshot_s, report = snapshot
            pause = statistics.median(f.pause_s for f in figures if f.pause_s is not None)
            console.print(
                f"{preset}: engine pause per patch p50 {1000 * pause:.1f} ms (max "
                f"{1000 * max(f.pause_s or 0.0 for f in figures):.1f}); "
                f"full snapshot load of the last version {1000 * snapshot_s:.1f} ms (read "
                f"{1000 * report.get('read_s', 0):.1f}, write {1000 * report.get('write_s', 0):.1f}, "
                f"repack {1000 * report.get('repack_s', 0):.1f}, verify {1000 * report.get('verify_s', 0):.1f}; "
                f"version 0's at boot {1000 * boot_s:.1f}); "
                f"patch pause / snapshot pause {pause / snapshot_s:.2f}"
            )


if __name__ == "__main__":
    main()
