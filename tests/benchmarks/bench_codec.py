"""Codec benchmark on real training steps of SmolLM2-135M (CPU, fp32 master, AdamW lr 3e-6).

Run: ``python tests/benchmarks/bench_codec.py [--steps N]`` (from the repo root, in .venv).

Per step it prints: % of served-view (bf16) elements whose bits changed; bytes per changed
element of the whole patch file for our encodings (``xor``, ``overwrite``) and, in the same
run and computed the same way, two baselines: int32 flat index + bf16 value uncompressed, and
whole-tensor XOR compressed with zstd level 1; encode and decode (read + apply + verify) time
relative to one ``Tensor.copy_`` of the served view into preallocated tensors, and the fp32 ->
bf16 cast time. Targets (issue "Foundation"): xor <= 1.5 bytes per changed element, encode
<= 3x one copy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import zstandard
from rich.console import Console
from rich.table import Table

from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.proto.apply import apply_patch
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from tests.support.training import CpuTrainer


def raw_view(view: dict[str, torch.Tensor]) -> dict[str, RawTensor]:
    """bf16 torch tensors -> RawTensor views sharing memory."""
    return {n: RawTensor("BF16", tuple(t.shape), t.reshape(-1).view(torch.int16).numpy().view(np.uint16)) for n, t in view.items()}


def baseline_index_value(base: dict[str, RawTensor], target: dict[str, RawTensor]) -> int:
    """Bytes of int32 flat indices + bf16 values, uncompressed (TRL's published format)."""
    total = 0
    for n in target:
        idx = np.flatnonzero(base[n].bits != target[n].bits).astype(np.int32)
        total += idx.nbytes + target[n].bits[idx].nbytes
    return total


def baseline_xor_zstd(base: dict[str, RawTensor], target: dict[str, RawTensor]) -> int:
    """Bytes of whole-tensor XOR compressed with zstd level 1 (the Stitch/slime approach)."""
    z = zstandard.ZstdCompressor(level=1)
    return sum(len(z.compress((base[n].bits ^ target[n].bits).tobytes())) for n in target)


def best_of(fn, repeats: int = 3) -> float:
    """Smallest wall time of ``fn()`` over ``repeats`` runs, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    console = Console(width=200)
    trainer = CpuTrainer(build_smollm2_checkpoint())
    prev = {n: t.clone() for n, t in trainer.served_view().items()}
    dst = {n: torch.empty_like(t) for n, t in prev.items()}
    full_bytes = sum(t.numel() * 2 for t in prev.values())
    prev_sums = None
    table = Table("step", "% changed", "xor B/chg", "overwrite B/chg", "idx+val B/chg", "xor+zstd B/chg",
                  "encode / copy", "decode / copy", "copy ms", "encode ms", "cast ms", "patch KB")
    rows = []
    for step in range(1, args.steps + 1):
        trainer.step()
        master = dict(trainer.model.named_parameters())
        cast_s = best_of(lambda: [p.detach().to(torch.bfloat16) for p in master.values()])
        cur = trainer.served_view()
        base_raw, cur_raw = raw_view(prev), raw_view(cur)
        copy_s = best_of(lambda: [dst[n].copy_(cur[n]) for n in cur])
        sums = prev_sums
        encode_s = best_of(lambda: diff_views(base_raw, cur_raw, "xor", base_checksums=sums))
        xor = diff_views(base_raw, cur_raw, "xor", base_checksums=sums)
        over = diff_views(base_raw, cur_raw, "overwrite", base_checksums=sums)
        n = xor.changed_elements

        def decode() -> None:
            view = {k: RawTensor(v.dtype, v.shape, v.bits.copy()) for k, v in base_raw.items() if k in xor.changed_tensors}
            t0 = time.perf_counter()
            apply_patch(view, read_patch(xor.patch))
            decode.seconds = min(getattr(decode, "seconds", 1e9), time.perf_counter() - t0)

        for _ in range(3):
            decode()
        row = {
            "pct": 100 * n / xor.total_elements,
            "xor": len(xor.patch) / n,
            "over": len(over.patch) / n,
            "iv": baseline_index_value(base_raw, cur_raw) / n,
            "xz": baseline_xor_zstd(base_raw, cur_raw) / n,
            "enc": encode_s / copy_s,
            "dec": decode.seconds / copy_s,
        }
        rows.append(row)
        table.add_row(str(step), f"{row['pct']:.3f}", f"{row['xor']:.3f}", f"{row['over']:.3f}", f"{row['iv']:.3f}", f"{row['xz']:.3f}",
                      f"{row['enc']:.2f}x", f"{row['dec']:.2f}x", f"{1e3 * copy_s:.1f}", f"{1e3 * encode_s:.1f}", f"{1e3 * cast_s:.1f}", f"{len(xor.patch) / 1024:.0f}")
        prev, prev_sums = {k: v.clone() for k, v in cur.items()}, xor.target_checksums
    console.print(table)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    console.print(f"served view: {full_bytes / 1e6:.1f} MB bf16; medians over {len(rows)} steps: xor {med['xor']:.3f} B/changed element "
                  f"(target <= 1.5, goal 1.25), overwrite {med['over']:.3f}, idx+val {med['iv']:.3f}, xor+zstd {med['xz']:.3f}; "
                  f"encode {med['enc']:.2f}x copy (target <= 3x), decode {med['dec']:.2f}x copy; "
                  f"patch is {full_bytes / (med['xor'] * med['pct'] / 100 * full_bytes / 2):.0f}x smaller than the full view")
    ok = med["xor"] <= 1.5 and med["enc"] <= 3.0
    console.print("[green]targets met[/green]" if ok else "[red]targets missed[/red]")


if __name__ == "__main__":
    main()
