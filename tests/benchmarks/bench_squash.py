"""Squash benchmark on real training steps of SmolLM2-135M (CPU, fp32 master, AdamW lr 3e-6; the codec bench's trainer).

Run: ``python -m tests.benchmarks.bench_squash [--warmup N] [--steps K]`` (repo root, .venv);
the defaults (10 warm-up steps, then 9 measured) take ~3 minutes of CPU on 2 cores.

The trainer's path is measured as it runs in the publisher: each measured step is encoded as a
delta (``cond`` and ``xor``) and noted in a :class:`~stitchboard.trainer_client.squash.RecentViews`
(reverse records); then, at the last step L, the squash L-k -> L is encoded for k = 2, 5 and 9
(and the suggested depths) from the rebuilt view of L-k. Printed per k: bytes of the squash and of the chain of k deltas
(their ratio), elements changed in the squash and summed over the chain, and the squash's
encode time (view rebuild + encode) against one delta's encode. Then the publisher's extra cost
per version for the suggested depths (:data:`SUGGESTED_SQUASH_DEPTHS`; none by default): the reverse record plus one
squash per depth, against the delta's encode.
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.proto.container import RawTensor
from stitchboard.proto.diff import diff_views
from stitchboard.proto.schema import FileRef, TensorSpec, VersionManifest, VersionStats
from stitchboard.trainer_client.squash import SUGGESTED_SQUASH_DEPTHS, RecentViews, encode_squash
from tests.benchmarks.bench_codec import raw_view
from tests.support.training import CpuTrainer

SPANS = (2, 5, 9)
ENCODINGS = ("cond", "xor")


def manifest_of(
    version: int, view: dict[str, RawTensor], checksums: dict[str, str], patch_bytes: int, changed: int
) -> VersionManifest:
    """The manifest a publisher would commit for ``view`` (a stand-in patch file of ``patch_bytes``)."""
    patch = FileRef(path="patch.safetensors", sha256="0" * 64, size_bytes=patch_bytes, role="patch")
    return VersionManifest(
        run_id="bench",
        version=version,
        base_version=version - 1,
        snapshot=False,
        tensors=[
            TensorSpec(name=n, dtype=t.dtype, shape=list(t.shape), checksums={"xxh3_128": checksums[n]})
            for n, t in sorted(view.items())
        ],
        files=[patch],
        stats=VersionStats(
            changed_elements=changed, total_elements=sum(t.numel for t in view.values()), encoded_bytes=patch_bytes
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--warmup", type=int, default=10, help="steps before the measured ones (the masters start on the bf16 grid)"
    )
    parser.add_argument("--steps", type=int, default=max(SPANS))
    args = parser.parse_args()
    console = Console(width=200)
    trainer = CpuTrainer(build_smollm2_checkpoint(), batch_size=1, seq_len=32)
    for _ in range(args.warmup):
        trainer.step()
    first = 1000  # version numbers: any consecutive run
    prev = {n: t.clone() for n, t in trainer.served_view().items()}
    recent = {enc: RecentViews(args.steps) for enc in ENCODINGS}
    sums = diff_views(raw_view(prev), raw_view(prev), "xor").target_checksums
    for enc in ENCODINGS:
        recent[enc].start(manifest_of(first, raw_view(prev), sums, 1, 0))
    deltas: dict[str, list[tuple[int, int, float]]] = {enc: [] for enc in ENCODINGS}
    record_s: list[float] = []
    for step in range(1, args.steps + 1):
        trainer.step()
        cur = {n: t.clone() for n, t in trainer.served_view().items()}
        old_raw, new_raw = raw_view(prev), raw_view(cur)
        for enc in ENCODINGS:
            t0 = time.perf_counter()
            diff = diff_views(old_raw, new_raw, enc, base_checksums=sums)
            deltas[enc].append((len(diff.patch), diff.changed_elements, time.perf_counter() - t0))
            t0 = time.perf_counter()
            recent[enc].record(
                manifest_of(first + step, new_raw, diff.target_checksums, len(diff.patch), diff.changed_elements),
                old_raw,
                new_raw,
                sums,
            )
            if enc == "cond":
                record_s.append(time.perf_counter() - t0)
        sums, prev = diff.target_checksums, cur
    latest = raw_view(prev)
    table = Table(
        "k",
        *(f"{enc} {col}" for enc in ENCODINGS for col in ("squash KB", "chain KB", "squash/chain")),
        "changed: squash / chain",
        "cond squash encode s",
        "vs one delta encode",
        title=f"squash L-k -> L vs the chain of k deltas (real steps {args.warmup + 1}..{args.warmup + args.steps})",
    )
    encode_s: dict[int, float] = {}
    ratios: dict[str, list[float]] = {enc: [] for enc in ENCODINGS}
    spans = sorted(k for k in set(SPANS) | set(SUGGESTED_SQUASH_DEPTHS) if k <= args.steps)
    for k in spans:
        cells, base = [], first + args.steps - k
        for enc in ENCODINGS:
            t0 = time.perf_counter()
            data, changed = encode_squash(recent[enc], base, latest, sums, enc, {})
            if enc == "cond":
                encode_s[k] = time.perf_counter() - t0
                squash_changed, chain_changed = changed, sum(d[1] for d in deltas[enc][-k:])
            chain = sum(d[0] for d in deltas[enc][-k:])
            ratios[enc].append(len(data) / chain)
            cells += [f"{len(data) / 1024:.0f}", f"{chain / 1024:.0f}", f"{len(data) / chain:.2f}"]
        delta_s = statistics.median(d[2] for d in deltas["cond"])
        table.add_row(
            str(k),
            *cells,
            f"{squash_changed:,} / {chain_changed:,}",
            f"{encode_s[k]:.2f}",
            f"{encode_s[k] / delta_s:.1f}x",
        )
    console.print(table)
    delta_s = statistics.median(d[2] for d in deltas["cond"])
    record = statistics.median(record_s)
    extra = record + sum(encode_s.get(d, 0.0) for d in SUGGESTED_SQUASH_DEPTHS)
    shown = [d for d in SUGGESTED_SQUASH_DEPTHS if d in encode_s]
    console.print(
        f"cond squash/chain bytes: {', '.join(f'k={k} {r:.2f}' for k, r in zip(spans, ratios['cond'], strict=True))}; "
        f"per published version: delta encode {delta_s:.2f} s (median), reverse record {record:.2f} s; "
        f"suggested depths {SUGGESTED_SQUASH_DEPTHS} (off by default): about {extra:.2f} s more per version "
        f"({extra / delta_s:.1f}x the delta's encode"
        + (
            ""
            if len(shown) == len(SUGGESTED_SQUASH_DEPTHS)
            else f"; depths without a measured span counted as 0: {sorted(set(SUGGESTED_SQUASH_DEPTHS) - set(shown))}"
        )
        + ")"
    )


if __name__ == "__main__":
    main()
