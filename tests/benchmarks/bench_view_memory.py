"""Host memory of a delta publish: the streamed path against the whole-view path, in one run.

Run: ``python -m tests.benchmarks.bench_view_memory [--view-mb 1024] [--tensor-mb 16] [--steps 2]``
(from the repo root, in .venv).

A synthetic bf16 state dict of ``--view-mb`` MB (tensors of ``--tensor-mb`` MB; the served view is its bf16
copy, the same size) is published as version 0 to a bulletin in another process (file store on loopback).
Then, per step, 1 % of its elements get new random values and one delta is published by each path:
``Publisher.publish`` (streamed: the kept view plus one tensor, trainer_client/stream.py) and
``Publisher.publish_async(...).result()`` (the whole-view path: a whole new host copy of the view, diffed
against the kept one). For each call: peak RSS growth during the call (the kernel's high-water mark, reset
before the call through ``/proc/self/clear_refs``) over the view's bytes, plus 1 for the kept view; and its
seconds. glibc is told to serve allocations of 1 MiB or more with mmap (``mallopt``), so freed tensors leave
the RSS at once instead of staying in the heap. Finally the last version is pulled (rebuilt from the
bulletin) and compared bit for bit with the trainer's served view. Last line::

    view_memory: view_mb=<n> stream_rss_over_view=<x> whole_rss_over_view=<x> bit_exact=<true|false>

Target: ``stream_rss_over_view <= 1.15`` (issue #32 item 2).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import served_view
from tests.bulletin.bulletin_helpers import ProcessServer

#: glibc ``mallopt`` parameter: the size from which malloc maps memory of its own (freed at once).
M_MMAP_THRESHOLD = -3


@dataclass(frozen=True)
class Measured:
    """One publish call: peak RSS growth during it (bytes) and its seconds."""

    growth_bytes: int
    seconds: float


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(call: Callable[[], object]) -> Measured:
    """Run ``call``; the peak RSS growth during it (high-water mark reset first) and its seconds."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    return Measured((_status_kb("VmHWM") - before) * 1024, seconds)


def synthetic_state(view_mb: int, tensor_mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A bf16 state dict of about ``view_mb`` MB in tensors of ``tensor_mb`` MB (rows of 1024 elements)."""
    gen = torch.Generator().manual_seed(seed)
    rows = max(1, tensor_mb * 2**20 // 2048)
    count = max(1, view_mb // tensor_mb)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(rows, 1024, generator=gen).to(torch.bfloat16)
        for i in range(count)
    }


def rl_step(state: dict[str, torch.Tensor], step: int, density: float = 0.01) -> None:
    """Give ``density`` of each tensor's elements new random values, in place (an RL step's sparse change)."""
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for t in state.values():
            flat = t.view(-1)
            at = torch.randint(0, flat.numel(), (int(flat.numel() * density),), generator=gen)
            flat[at] = torch.randn(at.numel(), generator=gen).to(torch.bfloat16)


def run(view_mb: int, tensor_mb: int, steps: int) -> dict[str, float | bool | int]:
    """Publish version 0 and ``steps`` deltas by each path; the figures of the summary line."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    state = synthetic_state(view_mb, tensor_mb)
    view_bytes = sum(t.numel() * 2 for t in state.values())
    store = tempfile.mkdtemp(prefix="bench-view-memory-store-")
    work = tempfile.mkdtemp(prefix="bench-view-memory-work-")
    server = ProcessServer(BulletinSettings(store=f"file://{store}"))
    stream: list[Measured] = []
    whole: list[Measured] = []
    try:
        with Publisher(server.url, "bench", snapshot_every=1000, workdir=work) as pub:
            pub.publish(state, step=0)
            for step in range(1, steps + 1):
                rl_step(state, 2 * step)
                stream.append(measure(lambda s=2 * step: pub.publish(state, step=s)))
                rl_step(state, 2 * step + 1)
                whole.append(measure(lambda s=2 * step + 1: pub.publish_async(state, step=s).result()))
            last = pub.last_version
            pulled = rebuild_version(pub.client, "bench", last, workdir=work).view
            want = served_view(state)
            bit_exact = set(pulled) == set(want) and all(np.array_equal(pulled[n].bits, want[n].bits) for n in want)
    finally:
        server.kill()
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'path':<8} {'call':>5} {'rss growth MB':>14} {'rss/view':>9} {'seconds':>8}")
    for name, rows in (("stream", stream), ("whole", whole)):
        for i, m in enumerate(rows):
            ratio = 1 + m.growth_bytes / view_bytes
            print(f"{name:<8} {i + 1:>5} {m.growth_bytes / 2**20:>14.1f} {ratio:>9.3f} {m.seconds:>8.2f}")
    return {
        "view_mb": round(view_bytes / 2**20),
        "stream_rss_over_view": 1 + max(m.growth_bytes for m in stream) / view_bytes,
        "whole_rss_over_view": 1 + max(m.growth_bytes for m in whole) / view_bytes,
        "bit_exact": bit_exact,
    }


def summary_line(figures: dict[str, float | bool | int]) -> str:
    """The last line of the benchmark."""
    return (
        f"view_memory: view_mb={figures['view_mb']} stream_rss_over_view={figures['stream_rss_over_view']:.3f} "
        f"whole_rss_over_view={figures['whole_rss_over_view']:.3f} bit_exact={str(figures['bit_exact']).lower()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--view-mb", type=int, default=1024, help="served view size, MB (default 1024)")
    parser.add_argument("--tensor-mb", type=int, default=16, help="size of each tensor, MB (default 16)")
    parser.add_argument("--steps", type=int, default=2, help="deltas published by each path (default 2)")
    args = parser.parse_args()
    print(summary_line(run(args.view_mb, args.tensor_mb, args.steps)))


if __name__ == "__main__":
    main()
