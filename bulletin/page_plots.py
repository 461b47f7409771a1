"""The status page's plots, drawn by matplotlib as inline SVG (text kept as text, so it can be read and searched).

* :func:`timeline_svg`: bytes per version (deltas and anchors' snapshots, log scale) and the
  share of elements each version changed.
* :func:`convergence_svg`: replicas at or past each recent version over time, and the fleet's
  lag (versions behind the newest) over time, from the replicas' applied-version histories
  and the versions' commit times.

Figures are built with the object API (no pyplot, no GUI backend), so pages render in worker threads.
"""

from __future__ import annotations

import io
from bisect import bisect_right
from datetime import datetime

import matplotlib
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from stitchboard.proto.fleet import FleetView
from stitchboard.proto.schema import VersionInfo

#: Versions whose convergence is drawn (the most recent ones).
CONVERGENCE_VERSIONS = 6


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg") :]  # inline: no XML prolog or doctype


def committed_at(info: VersionInfo) -> float | None:
    """A version's commit time, Unix seconds (None if unknown)."""
    if not info.committed_at:
        return None
    return datetime.fromisoformat(info.committed_at).timestamp()


def timeline_svg(versions: list[VersionInfo], changed_pct: dict[int, float]) -> str:
    """Bytes per version (anchors' snapshots marked) and % of elements changed, as an SVG element."""
    fig = Figure(figsize=(9, 3.2))
    ax = fig.subplots()
    xs = [v.version for v in versions]
    ax.bar(xs, [max(v.size_bytes, 1) for v in versions], color="#4878a8", label="delta bytes")
    anchors = [v for v in versions if v.snapshot]
    if anchors:
        ax.bar(
            [v.version for v in anchors],
            [max(v.snapshot_bytes, 1) for v in anchors],
            color="#e0a030",
            alpha=0.8,
            label="anchor snapshot bytes",
        )
    ax.set_yscale("log")
    ax.set_xlabel("version")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("bytes")
    ax.set_title(f"version timeline: {len(versions)} versions, latest {xs[-1] if xs else 'none'}")
    twin = ax.twinx()
    twin.plot(xs, [changed_pct.get(x, 0.0) for x in xs], color="#c03030", marker=".", label="% elements changed")
    twin.set_ylabel("% elements changed")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    return _svg(fig)


def _applied_at(history: list[tuple[int, float]], t: float) -> int | None:
    i = bisect_right([at for _, at in history], t)
    return history[i - 1][0] if i else None


def convergence_svg(view: FleetView, versions: list[VersionInfo]) -> str:
    """Replicas at >= v over time for the last versions, and the fleet's lag over time, as an SVG element."""
    fig = Figure(figsize=(9, 5.2))
    top, bottom = fig.subplots(2, 1, sharex=True)
    commits = sorted((t, v.version) for v in versions if (t := committed_at(v)) is not None)
    histories = [sorted(r.report.history, key=lambda h: h[1]) for r in view.replicas if r.report.history]
    times = sorted({t for t, _ in commits} | {at for h in histories for _, at in h})
    recent = [v.version for v in versions][-CONVERGENCE_VERSIONS:]
    top.set_title(
        f"fleet convergence: {sum(r.live for r in view.replicas)} live replicas, latest version {view.latest_version}"
    )
    if times:
        now = view.time
        times.append(now)
        rel = [t - now for t in times]
        for version in recent:
            counts = [sum(1 for h in histories if (a := _applied_at(h, t)) is not None and a >= version) for t in times]
            top.step(rel, counts, where="post", label=f">= v{version}")
        lags_max, lags_median = [], []
        for t in times:
            i = bisect_right([c for c, _ in commits], t)
            latest = commits[i - 1][1] if i else None
            lags = sorted(
                max(0, latest - a) for h in histories if latest is not None and (a := _applied_at(h, t)) is not None
            )
            lags_max.append(lags[-1] if lags else 0)
            lags_median.append(lags[len(lags) // 2] if lags else 0)
        bottom.step(rel, lags_max, where="post", color="#c03030", label="max lag")
        bottom.step(rel, lags_median, where="post", color="#4878a8", label="median lag")
        top.legend(loc="upper left", fontsize=8, ncol=3)
        bottom.legend(loc="upper left", fontsize=8)
    top.set_ylabel("replicas at >= version")
    bottom.set_ylabel("versions behind newest")
    for axis in (top, bottom):
        axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("seconds before now")
    return _svg(fig)
