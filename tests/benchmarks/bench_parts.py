"""Patches in parts on real SmolLM2-135M steps: bytes and decode time per part size, and the link
speed where ``cond`` and ``xor`` break even.

Run: ``python -m tests.benchmarks.bench_parts [--steps 4] [--sizes 0,4194304,...]`` (repo root, .venv;
~1 minute on 2 cores). Per step (a real AdamW step of :class:`tests.support.training.CpuTrainer`, batch
1 x 32 tokens) and per part size (``0``: one stream per tensor, today's patches) it encodes the bf16
served view's delta with ``cond`` and ``xor`` and decodes it tensor after tensor as an engine worker
does (:meth:`Patch.delta` on the whole base, the base already verified; parts on the part threads,
one per core), best of 3. It prints the medians per size: patch bytes (and the ratio to one stream
per tensor), decode seconds, and the break-even link speed

    L = (bytes_xor - bytes_cond) / (decode_s_cond - decode_s_xor)

above which ``xor``'s faster decode beats ``cond``'s smaller transfer (with this machine's cores
decoding). Last line::

    parts: part_bytes=<n> cond_bytes_ratio=<x> decode_speedup=<x> break_even_bytes_per_s=<n> cores=<n> density=<x>

for the size given by ``--pick`` (the publisher's default, :data:`~stitchboard.trainer_client.link.PART_BYTES`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from stitchboard.trainer_client.link import PART_BYTES
from tests.support.training import CpuTrainer


def _raw(view: dict[str, torch.Tensor]) -> dict[str, RawTensor]:
    return {
        n: RawTensor("BF16", tuple(t.shape), t.reshape(-1).view(torch.int16).numpy().view(np.uint16).copy())
        for n, t in view.items()
    }


def _decode_s(base: dict[str, RawTensor], data: bytes) -> float:
    """Seconds to read and decode every tensor's delta one tensor after another (best of 3)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        patch = read_patch(data)
        for name in patch.entries:
            patch.delta(name, base[name], base_verified=True)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sizes", default="0,8388608,4194304,2097152,1048576,524288,262144")
    parser.add_argument("--pick", type=int, default=PART_BYTES)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.pick not in sizes:
        sizes.append(args.pick)
    trainer = CpuTrainer(build_smollm2_checkpoint(), batch_size=1, seq_len=32)
    prev = _raw(trainer.served_view())
    rows: dict[int, list[dict[str, float]]] = {s: [] for s in sizes}
    for _ in range(args.steps):
        trainer.step()
        cur = _raw(trainer.served_view())
        for size in sizes:
            row: dict[str, float] = {}
            for enc in ("cond", "xor"):
                diff = diff_views(prev, cur, enc, part_bytes=size or None)
                row[f"{enc}_bytes"] = len(diff.patch)
                row[f"{enc}_s"] = _decode_s(prev, diff.patch)
                row["density"] = diff.changed_elements / diff.total_elements
            rows[size].append(row)
        prev = cur
    med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in rows.items()}
    one = med[0]
    heads = ("part_bytes", "cond B", "ratio", "cond s", "xor B", "xor s", "break-even B/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (10, 9, 6, 7, 9, 7, 15), strict=True)))
    for size, m in med.items():
        gain = m["cond_s"] - m["xor_s"]
        even = (m["xor_bytes"] - m["cond_bytes"]) / gain if gain > 0 else float("inf")
        m["even"] = even
        print(
            f"{size:>10} {m['cond_bytes']:>9.0f} {m['cond_bytes'] / one['cond_bytes']:>6.3f} {m['cond_s']:>7.3f} "
            f"{m['xor_bytes']:>9.0f} {m['xor_s']:>7.3f} {even:>15.0f}"
        )
    pick = med[args.pick]
    print(
        f"parts: part_bytes={args.pick} cond_bytes_ratio={pick['cond_bytes'] / one['cond_bytes']:.3f} "
        f"decode_speedup={one['cond_s'] / pick['cond_s']:.2f} break_even_bytes_per_s={pick['even']:.0f} "
        f"cores={os.cpu_count()} density={pick['density']:.4f}"
    )


if __name__ == "__main__":
    main()
