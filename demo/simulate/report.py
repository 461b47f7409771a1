"""What ``stitchboard simulate`` writes: the scenarios it runs, their table, the figures' sources and the plot of
replicas at version N over time (runs in the operator's process; matplotlib's Agg backend, no display).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .figures import Fleet
from .model import Scenario, StepModel, StepResult


def fixed_backoff(attempt: int, base_s: float, rng: object = None) -> float:
    """The download path's wait before issue #33: ``min(10, base * 2**attempt)`` seconds, the same for every
    replica (kept to show, in the table, what full jitter changes)."""
    return min(10.0, base_s * 2**attempt)


@dataclass(frozen=True)
class Row:
    """One row of the table: a label and the scenario it ran."""

    label: str
    scenario: Scenario


def scenarios(fleet: Fleet) -> list[Row]:
    """The table's rows: ``cond`` and ``xor`` with and without the cache tier, then the key layout's rows (a fresh
    run's one-partition prefix against a partitioned one, and the fixed backoff, at 16 files at once per replica:
    enough GETs to pass S3's per-prefix rate)."""
    busy = fleet.with_values(fetch_concurrency=16)
    warm = busy.with_values(store_partitions=16)
    rows = [Row(f"{e}, {c}", Scenario(fleet, e, cache)) for e in ("cond", "xor") for c, cache in _TIERS]
    return [
        *rows,
        Row("cond, origin only, 16 files at once, fresh prefix (1 partition)", Scenario(busy, "cond", cache=False)),
        Row("same, prefix partitioned (16 partitions)", Scenario(warm, "cond", cache=False)),
        Row("same as fresh prefix, fixed backoff (before issue #33)", Scenario(busy, "cond", False, 0, fixed_backoff)),
    ]


_TIERS = (("cache tier", True), ("origin only", False))


def run_all(fleet: Fleet) -> list[tuple[Row, StepResult]]:
    """Every row's step, simulated."""
    return [(row, StepModel(row.scenario).run()) for row in scenarios(fleet)]


def table(results: list[tuple[Row, StepResult]]) -> str:
    """The results as a Markdown table (times in seconds from the commit, egress in GB, requests per step)."""
    head = (
        "| scenario | t50 s | t99 s | t100 s | origin egress GB | store GETs | 503 SlowDown | bulletin requests "
        "| peak retries/s | failed syncs | anchor routes |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    lines = [head]
    for row, r in results:
        lines.append(
            f"| {row.label} | {r.time_to(0.5):.1f} | {r.time_to(0.99):.1f} | {r.time_to(1.0):.1f} | "
            f"{r.origin_egress_bytes / 1e9:,.1f} | {r.store_gets:,} | {r.store_slowdowns:,} | "
            f"{r.bulletin_requests:,} | {r.peak_retry_rate():,.0f} | {r.failed_syncs:,} | {r.anchor_routes:,} |"
        )
    return "\n".join(lines)


def sources(fleet: Fleet) -> str:
    """Every figure with its value, unit, kind and source, as a Markdown table."""
    lines = ["| figure | value | unit | kind | source |", "| --- | ---: | --- | --- | --- |"]
    for name, f in fleet.figures().items():
        lines.append(f"| `{name}` | {f.value:.4g} | {f.unit} | {f.kind} | {f.source} |")
    return "\n".join(lines)


def plot(results: list[tuple[Row, StepResult]], path: Path) -> None:
    """Replicas at version N against seconds from the commit, one line per scenario of the first four, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    try:
        for row, r in results[:4]:
            times = [0.0, *r.at_version_s]
            ax.step(times, range(len(times)), where="post", label=row.label)
        ax.set_xlabel("seconds from the commit of version N")
        ax.set_ylabel("replicas serving version N")
        ax.set_title(f"{len(results[0][1].at_version_s):,} replicas, one step (simulated)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
