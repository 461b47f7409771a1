"""The status page at scale and with bad data: the convergence plot's aggregation equals a direct count,
the page's work grows linearly with the replicas (1,000 vs 100: at most 15x, counted in Python calls,
which machine load cannot change), a plot that fails becomes a note, and a replica record with absurd
times written straight to the store does not fail the page."""

from __future__ import annotations

import json
import sys
import time
import uuid
from bisect import bisect_right
from datetime import datetime

import httpx
import numpy as np
import pytest

from stitchboard.bulletin import page
from stitchboard.bulletin.fleet import replica_key
from stitchboard.bulletin.page_plots import CONVERGENCE_VERSIONS, convergence, convergence_svg
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.fleet import FleetView, ReplicaReport
from stitchboard.proto.schema import VersionInfo
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.bulletin.fleet_helpers import NOW, synthetic_fleet
from tests.sidecar.sidecar_helpers import Publisher, make_view


def direct_count(view: FleetView, versions: list[VersionInfo], at: np.ndarray) -> dict[str, list[int]]:
    """The convergence at each instant of ``at``, counted replica by replica (the page's first implementation)."""
    commits = sorted((datetime.fromisoformat(v.committed_at).timestamp(), v.version) for v in versions)
    histories = [sorted(r.report.history, key=lambda h: h[1]) for r in view.replicas if r.report.history]

    def applied(history, t):
        i = bisect_right([a for _, a in history], t)
        return history[i - 1][0] if i else None

    out: dict[str, list[int]] = {"max": [], "median": []}
    recent = [v.version for v in versions][-CONVERGENCE_VERSIONS:]
    for t in at:
        held = [applied(h, t) for h in histories]
        for v in recent:
            out.setdefault(f">= v{v}", []).append(sum(1 for a in held if a is not None and a >= v))
        i = bisect_right([c for c, _ in commits], t)
        latest = commits[i - 1][1] if i else None
        lags = sorted(max(0, latest - a) for a in held if latest is not None and a is not None)
        out["max"].append(lags[-1] if lags else 0)
        out["median"].append(lags[len(lags) // 2] if lags else 0)
    return out


@pytest.mark.parametrize("points", [100_000, 50], ids=["every event", "sampled"])
def test_convergence_equals_a_direct_count(points):
    view, versions = synthetic_fleet(40)
    drawn = convergence(view, versions, points=points)
    assert drawn is not None
    events = {t for r in view.replicas for _, t in r.report.history} | {
        datetime.fromisoformat(v.committed_at).timestamp() for v in versions
    }
    if points > len(events):
        assert drawn.at.tolist() == [*sorted(events), NOW]  # every event is an instant, and now
    else:
        assert len(drawn.at) == points and drawn.at[0] == min(events) and drawn.at[-1] == NOW
    expected = direct_count(view, versions, drawn.at)
    got = {f">= v{v}": c.tolist() for v, c in drawn.at_or_above.items()}
    assert got == {k: v for k, v in expected.items() if k.startswith(">=")}
    assert drawn.lag_max.tolist() == expected["max"] and drawn.lag_median.tolist() == expected["median"]
    assert max(expected["max"]) > 0 and max(got[f">= v{versions[-1].version}"]) > 0  # the data moves


class _Budget(BaseException):  # not an Exception: the page's guard around each plot must not take it
    pass


def _calls(work, budget: int) -> int:
    """Python and C function calls made by ``work()`` (stops it with :class:`_Budget` past ``budget``)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1
            if count > budget:
                raise _Budget

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return count


def test_page_work_grows_linearly_with_replicas():
    def render(n: int):
        view, versions = synthetic_fleet(n)
        changed = {v.version: 0.5 for v in versions}
        return lambda: page._render("r", view, versions, changed, True)

    small = _calls(render(100), budget=10**9)
    try:
        large = _calls(render(1000), budget=15 * small)
    except _Budget:
        pytest.fail(f"rendering 1,000 replicas made over 15x the {small:,} calls of 100 replicas")
    assert large <= 15 * small


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the absurd times it feeds matplotlib
def test_a_plot_that_fails_is_a_note_and_the_page_is_served():
    view, versions = synthetic_fleet(3)
    bad = ReplicaReport.model_construct(  # what validation would refuse: only a record older than it
        **{**view.replicas[0].report.model_dump(), "history": [(1, 1e308), (2, -1e308)]}
    )
    broken = view.model_copy(update={"replicas": [view.replicas[0].model_copy(update={"report": bad})]})
    with pytest.raises(ValueError):
        convergence_svg(broken, versions)
    html = page._render("r", broken, versions, {}, True)
    assert "the fleet convergence plot could not be drawn (ValueError" in html
    assert html.count("<svg") == 1 and "version timeline: 200 versions" in html  # the other plot is drawn
    assert 'data-replica="rep-00000"' in html  # and the table lists the replica


def test_a_record_with_absurd_times_in_the_store_does_not_fail_the_page(tmp_path, caplog):
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", fleet_poll_interval_s=0.1))
    run = f"run-{uuid.uuid4().hex[:8]}"
    try:
        with server.client() as client:
            Publisher(client, run, tmp_path).publish(make_view(0))
        good = ReplicaReport(
            replica_id="good", engine="vllm", applied_version=0, target_version=0, state="idle", lag_versions=0,
            healthy=True, history=[(0, time.time())], started_at=time.time(),
        )  # fmt: skip
        bad = {**good.model_dump(mode="json"), "replica_id": "bad", "history": [[0, 1e308], [0, -1e308]]}
        record = tmp_path / "bad.json"
        record.write_text(json.dumps({"lease_s": 30.0, "report": bad}))
        server.app.state.bulletin.store.put_file(replica_key(run, "bad"), record)  # as an older bulletin kept it
        assert httpx.put(f"{server.url}/v1/runs/{run}/replicas/good", content=good.model_dump_json()).status_code == 200
        answer = httpx.get(f"{server.url}/status/runs/{run}")
        assert answer.status_code == 200, answer.text[:500]
        assert 'data-replica="good"' in answer.text and answer.text.count("<svg") == 2
        assert "ignoring the unreadable replica record" in caplog.text and "bad.json" in caplog.text
    finally:
        server.stop()
