"""Benchmark: the sidecar's fetch-time check of one real SmolLM2 step (prints figures; not a test).

One AdamW step of SmolLM2-135M on the CPU (``tests.support.training``), its patch in each encoding
and the bf16 snapshot, checked the way :mod:`stitchboard.sidecar.fetch` did before issue #28
item 3 (the patch parsed whole and, for ``xor``/``overwrite``, every position decoded; every
snapshot tensor hashed) and does now (the container and index only, by ranged reads; the
snapshot's names, dtypes and shapes). Same files, one run, medians of ``--repeat``.

Run: ``python -m tests.benchmarks.bench_fetch_check [--repeat 7]`` (~1 min, 3.5 GB while training).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.proto.codec import checksum
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from stitchboard.sidecar.fetch import patch_index
from stitchboard.trainer_client.served_view import to_raw
from tests.support.training import CpuTrainer


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _decoded(path: Path) -> None:
    patch = read_patch(path.read_bytes(), what=str(path))
    if patch.encoding != "cond":
        patch.deltas()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    checkpoint = build_smollm2_checkpoint()
    trainer = CpuTrainer(checkpoint)
    base = {n: to_raw(t) for n, t in trainer.served_view().items()}
    trainer.step()
    target = {n: to_raw(t) for n, t in trainer.served_view().items()}
    with tempfile.TemporaryDirectory() as folder:
        for encoding in ("xor", "overwrite", "cond"):
            diff = diff_views(base, target, encoding)
            path = Path(folder) / f"{encoding}.patch"
            path.write_bytes(diff.patch)
            before = _median_ms(lambda path=path: _decoded(path), args.repeat)
            after = _median_ms(lambda path=path: patch_index(path), args.repeat)
            print(
                f"{encoding}: {len(diff.patch) / 1e6:.2f} MB, {100 * diff.changed_elements / diff.total_elements:.2f} "
                f"% of elements changed; fetch check before {before:.1f} ms, after {after:.2f} ms"
            )
    tensors = load_checkpoint(checkpoint)
    before = _median_ms(lambda: [checksum(t) for t in load_checkpoint(checkpoint).values()], args.repeat)
    after = _median_ms(lambda: [(t.dtype, t.shape) for t in load_checkpoint(checkpoint).values()], args.repeat)
    size = sum(t.nbytes for t in tensors.values()) / 1e6
    print(f"snapshot ({size:.0f} MB): fetch check before {before:.1f} ms, after {after:.1f} ms")


if __name__ == "__main__":
    main()
