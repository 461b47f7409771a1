"""Publishing cost on real training steps of SmolLM2-135M (CPU, fp32 master, AdamW lr 3e-6).

Run: ``python -m tests.benchmarks.bench_publish [--off N] [--on N]`` (from the repo root, in .venv).

In one run and one process: version 0 (the anchor) is published, then ``--off`` training steps
are timed without publishing, then ``--on`` steps each followed by ``Publisher.publish_async``
(the time of a step includes the call: the bf16 snapshot on the training thread and any
backpressure wait). The bulletin runs as a separate process on loopback (file store), as it
would on another host. Prints per publish: changed %, patch and snapshot bytes against the full
bf16 view, and the seconds of cast, diff+encode, snapshot write, upload and commit; then the
step-time ratio (target <= 1.1).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from rich.console import Console
from rich.table import Table

from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.trainer_client.publisher import Publisher
from tests.bulletin.bulletin_helpers import ProcessServer
from tests.support.training import CpuTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--off", type=int, default=8, help="timed steps without publishing")
    parser.add_argument(
        "--on", type=int, default=10, help="timed steps with publish_async after each (version 10 is an anchor)"
    )
    args = parser.parse_args()

    checkpoint = build_smollm2_checkpoint()
    store = tempfile.mkdtemp(prefix="bench-publish-store-")
    server = ProcessServer(BulletinSettings(store=f"file://{store}"))
    trainer = CpuTrainer(checkpoint)
    try:
        with Publisher(server.url, "bench", assets=checkpoint) as pub:
            first = pub.publish(trainer.model, step=0)
            trainer.step()  # the first step is slow (allocations); not timed
            off = []
            for _ in range(args.off):
                t0 = time.perf_counter()
                trainer.step()
                off.append(time.perf_counter() - t0)
            on, futures = [], []
            for step in range(args.on):
                t0 = time.perf_counter()
                trainer.step()
                futures.append(pub.publish_async(trainer.model, step=step + 1))
                on.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pub.flush()
            tail = time.perf_counter() - t0
        results = [first] + [f.result() for f in futures]
    finally:
        server.kill()

    table = Table(title="publish per version (SmolLM2-135M, bf16 view 269 MB)")
    for col in (
        "version",
        "anchor",
        "changed %",
        "patch bytes",
        "patch/view %",
        "snapshot bytes",
        "cast s",
        "diff+enc s",
        "write s",
        "upload s",
        "commit s",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r.version),
            "yes" if r.snapshot else "",
            f"{100 * r.changed_fraction:.3f}",
            f"{r.encoded_bytes:,}",
            f"{100 * r.encoded_bytes / r.view_bytes:.3f}",
            f"{r.snapshot_bytes:,}" if r.snapshot else "",
            f"{r.cast_s:.3f}",
            f"{r.diff_s:.3f}",
            f"{r.write_s:.3f}",
            f"{r.upload_s:.3f}",
            f"{r.commit_s:.3f}",
        )
    console = Console(width=160)
    console.print(table)
    deltas = [r for r in results if r.version and not r.snapshot]
    if deltas:
        console.print(
            f"deltas: median patch {statistics.median(r.encoded_bytes for r in deltas):,.0f} bytes "
            f"({100 * statistics.median(r.encoded_bytes / r.view_bytes for r in deltas):.3f} % of the "
            f"{results[0].view_bytes:,}-byte view); "
            f"median diff+encode {statistics.median(r.diff_s for r in deltas):.3f} s, "
            f"upload {statistics.median(r.upload_s for r in deltas):.3f} s, "
            f"commit {statistics.median(r.commit_s for r in deltas):.3f} s, cast (on the training thread) "
            f"{statistics.median(r.cast_s for r in deltas):.3f} s"
        )
    mean_off, mean_on = statistics.mean(off), statistics.mean(on)
    console.print(
        f"step time without publishing: mean {mean_off:.3f} s, median {statistics.median(off):.3f} s ({len(off)} steps)"
    )
    console.print(
        f"step time with publish_async: mean {mean_on:.3f} s, median {statistics.median(on):.3f} s ({len(on)} "
        f"steps); final flush {tail:.3f} s"
    )
    console.print(
        f"ratio with/without publishing: means {mean_on / mean_off:.3f}, "
        f"medians {statistics.median(on) / statistics.median(off):.3f} "
        f"(target <= 1.1); means counting the final flush {(sum(on) + tail) / len(on) / mean_off:.3f}"
    )


if __name__ == "__main__":
    main()
