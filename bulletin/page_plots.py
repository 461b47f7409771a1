"""The status page's plots, drawn by matplotlib as inline SVG (text kept as text, so it can be read and searched).

* :func:`timeline_svg`: bytes per version (deltas and anchors' snapshots, log scale) and the
  share of elements each version changed.
* :func:`convergence_svg`: replicas at or past each recent version over time, and the fleet's
  lag (versions behind the newest) over time, from the replicas' applied-version histories
  and the versions' commit times.

The convergence is aggregated before it is drawn (:func:`convergence`): the replicas' applied
versions are read at most :data:`PLOT_POINTS` instants, each replica's history searched once
per instant (numpy), so a page costs time linear in the replicas and draws a bounded number of
points whatever their number. Up to :data:`PLOT_POINTS` distinct event times (commits and
applies) every event is an instant and the steps are exact; past that the instants are evenly
spaced from the oldest event to now (about a pixel apart on the page).

Figures are built with the object API (no pyplot, no GUI backend), so pages render in worker threads.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import datetime

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from stitchboard.proto.fleet import FleetView
from stitchboard.proto.schema import VersionInfo

#: Versions whose convergence is drawn (the most recent ones).
CONVERGENCE_VERSIONS = 6
#: The most instants the convergence plot is evaluated at (see the module docstring).
PLOT_POINTS = 600


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


@dataclass(frozen=True)
class Convergence:
    """The fleet's convergence at ``P`` instants, oldest first (what :func:`convergence_svg` draws).

    Attributes:
        at: float64 [P], the instants, Unix seconds; the last is the view's time.
        at_or_above: version -> int64 [P], replicas whose applied version is >= it at each instant.
        lag_max, lag_median: int64 [P], versions behind the newest committed version at each
            instant over the replicas that had applied one (the median is the upper one; 0 when none).
    """

    at: np.ndarray
    at_or_above: dict[int, np.ndarray]
    lag_max: np.ndarray
    lag_median: np.ndarray


def _applied(history: list[tuple[int, float]], at: np.ndarray) -> np.ndarray:
    """int64 [P]: the version a replica held at each instant of ``at`` (-1: none yet)."""
    times = np.array([t for _, t in history], dtype=np.float64)
    order = np.argsort(times, kind="stable")
    held = np.searchsorted(times[order], at, side="right") - 1
    versions = np.array([v for v, _ in history], dtype=np.int64)[order]
    return np.where(held >= 0, versions[np.maximum(held, 0)], -1)


def convergence(view: FleetView, versions: list[VersionInfo], points: int = PLOT_POINTS) -> Convergence | None:
    """The convergence of ``view``'s replicas (every replica with a history) over ``versions`` (None: no event).

    Args:
        view: the run's replicas; their ``history`` ([version, applied_at] pairs) is read.
        versions: the run's versions (commit times; the last :data:`CONVERGENCE_VERSIONS` are counted).
        points: the most instants (see the module docstring).

    Costs O(R * P * log HISTORY_LEN) for R replicas, plus sorting the events once.
    """
    commits = sorted((t, v.version) for v in versions if (t := committed_at(v)) is not None)
    histories = [r.report.history for r in view.replicas if r.report.history]
    events = np.unique(np.array([t for t, _ in commits] + [t for h in histories for _, t in h], dtype=np.float64))
    if not events.size:
        return None
    if events.size <= points:
        at = np.append(events, view.time)
    else:
        at = np.linspace(events[0], max(view.time, events[0]), points)
    applied = np.stack([_applied(h, at) for h in histories]) if histories else np.empty((0, at.size), np.int64)
    commit_times = np.array([t for t, _ in commits], dtype=np.float64)
    committed = np.array([v for _, v in commits], dtype=np.int64)
    i = np.searchsorted(commit_times, at, side="right") - 1
    latest = np.where(i >= 0, committed[np.maximum(i, 0)], -1) if commits else np.full(at.size, -1)
    counted = (applied >= 0) & (latest >= 0)
    lags = np.where(counted, np.maximum(latest - applied, 0), np.iinfo(np.int64).max)
    n = counted.sum(axis=0)
    ranked = np.sort(lags, axis=0)
    column = np.arange(at.size)
    none = np.zeros(at.size, np.int64)
    lag_max = np.where(n > 0, ranked[np.maximum(n - 1, 0), column], 0) if histories else none
    lag_median = np.where(n > 0, ranked[n // 2, column], 0) if histories else none
    recent = [v.version for v in versions][-CONVERGENCE_VERSIONS:]
    return Convergence(at, {v: (applied >= v).sum(axis=0) for v in recent}, lag_max, lag_median)


def convergence_svg(view: FleetView, versions: list[VersionInfo]) -> str:
    """Replicas at >= v over time for the last versions, and the fleet's lag over time, as an SVG element."""
    fig = Figure(figsize=(9, 5.2))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.set_title(
        f"fleet convergence: {sum(r.live for r in view.replicas)} live replicas, latest version {view.latest_version}"
    )
    drawn = convergence(view, versions)
    if drawn is not None:
        rel = drawn.at - view.time
        for version, counts in drawn.at_or_above.items():
            top.step(rel, counts, where="post", label=f">= v{version}")
        bottom.step(rel, drawn.lag_max, where="post", color="#c03030", label="max lag")
        bottom.step(rel, drawn.lag_median, where="post", color="#4878a8", label="median lag")
        top.legend(loc="upper left", fontsize=8, ncol=3)
        bottom.legend(loc="upper left", fontsize=8)
    top.set_ylabel("replicas at >= version")
    bottom.set_ylabel("versions behind newest")
    for axis in (top, bottom):
        axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("seconds before now")
    return _svg(fig)
