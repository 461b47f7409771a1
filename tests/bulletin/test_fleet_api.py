"""The fleet routes in one process: the replica token scope, refused reports never stopping a sync,
``Publisher.wait_for_fleet`` and publish pacing (``FleetPacing``) against a sidecar over a fake engine;
reports with non-finite or absurd times refused; the cap on live replicas per run; counts indexed
once per snapshot."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import httpx
import pytest
import torch

from stitchboard.bulletin import fleet_watch
from stitchboard.bulletin.fleet_client import FleetClient
from stitchboard.bulletin.settings import BulletinSettings, TokenGrant
from stitchboard.proto.fleet import ReplicaReport
from stitchboard.trainer_client import FleetPacing, FleetTimeoutError, Publisher
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.bulletin.fleet_helpers import start_sidecar
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import Publisher as ViewPublisher
from tests.sidecar.sidecar_helpers import make_view, wait_for

TOKENS = {
    "pub": TokenGrant(scopes=["publish"]),
    "rep": TokenGrant(scopes=["replica"]),
    "ro": TokenGrant(scopes=["read"]),
}


def _report(replica_id: str = "r1", **fields) -> ReplicaReport:
    values = {
        "replica_id": replica_id,
        "engine": "vllm",
        "applied_version": None,
        "target_version": None,
        "state": "starting",
        "lag_versions": None,
        "healthy": False,
        "started_at": time.time(),
    }
    return ReplicaReport(**{**values, **fields})


@pytest.fixture
def secured(tmp_path):
    server = ThreadServer(
        BulletinSettings(store=f"file://{tmp_path / 'store'}", tokens=TOKENS, fleet_poll_interval_s=0.1)
    )
    yield server
    server.stop()


def test_replica_scope_reports_and_reads_but_does_not_publish(secured, tmp_path):
    run = f"run-{uuid.uuid4().hex[:8]}"
    with secured.client("pub") as pub:
        ViewPublisher(pub, run, tmp_path).publish(make_view(0))
    put = lambda token, report, rid=None: httpx.put(
        f"{secured.url}/v1/runs/{run}/replicas/{rid or report.replica_id}",
        content=report.model_dump_json(),
        headers={"authorization": f"Bearer {token}"},
    )
    answer = put("rep", _report(applied_version=0, target_version=0, state="idle", healthy=True))
    assert answer.status_code == 200 and answer.json() == {"lease_s": 30.0, "renew_s": 10.0}
    for token in ("ro", "pub"):  # reading or publishing is not reporting
        refused = put(token, _report("r2"))
        assert refused.status_code == 403 and refused.json()["scope"] == "replica"
    assert put("rep", _report("r2"), rid="r3").status_code == 422  # the body names another replica
    assert put("rep", _report("r2"), rid="..bad").status_code == 422
    with secured.client("rep") as rep:
        assert rep.latest(run) == 0  # replica implies read
        with pytest.raises(Exception, match="needs 'publish'"):
            ViewPublisher(rep, run, tmp_path).publish(make_view(1))
        view = FleetClient(rep).replicas(run)
    assert [(r.report.replica_id, r.report.applied_version, r.live, r.behind_latest) for r in view.replicas] == [
        ("r1", 0, True, 0)
    ]
    with secured.client("ro") as ro:
        count = FleetClient(ro).count(run, 0, min_replicas=1)
    assert (count.live, count.at_or_above, count.met) == (1, 1, True)


def test_refused_reports_are_retried_and_never_stop_syncing(secured, tmp_path, caplog):
    run = f"run-{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING, "stitchboard.sidecar")
    with secured.client("pub") as pub:
        views = ViewPublisher(pub, run, tmp_path)
        views.publish(make_view(0))
        sidecar = start_sidecar(
            secured.url, run, "ro-replica", FakeEngine(), tmp_path / "handoff", token="ro"
        )  # may read, not report
        try:
            wait_for(lambda: sidecar.status()["applied_version"] == 0, 30, "version 0 applied")
            views.step(1)
            wait_for(lambda: sidecar.status()["applied_version"] == 1, 30, "version 1 applied")
            wait_for(lambda: "fleet view failed (Forbidden" in caplog.text, 10, "the refused report logged")
        finally:
            sidecar.stop(engine_too=True)
        assert FleetClient(pub).replicas(run).replicas == []


def test_wait_for_fleet_and_pacing_on_a_publisher(tmp_path):
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", fleet_poll_interval_s=0.1))
    run = f"run-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    state = {"model.w": torch.randn(64, 64), "model.v": torch.randn(128)}
    sidecar = None
    try:
        with Publisher(
            server.url,
            run,
            encoding="xor",
            pacing=FleetPacing(max_lag=0, min_replicas=1, timeout_s=1.5),
            workdir=tmp_path / "pub",
        ) as publisher:
            publisher.publish(state)  # version 0 waits for nothing
            state["model.w"][0, :8] += 1.0
            t0 = time.monotonic()
            with pytest.raises(
                FleetTimeoutError, match=r"publishing version 1 .* max_lag=0 .* no live replica reports"
            ):
                publisher.publish(state)
            assert time.monotonic() - t0 >= 1.4  # it waited its timeout
            assert publisher.last_version == 0  # nothing was published
            sidecar = start_sidecar(server.url, run, "r1", FakeEngine(), tmp_path / "handoff")
            assert publisher.publish(state).version == 1  # paced: r1 reached version 0 first
            count = publisher.wait_for_fleet(1, timeout_s=30)
            assert (count.live, count.at_or_above, count.needed) == (1, 1, 1)
            sidecar.engine.refuse_versions = {2}  # r1 cannot take version 2: held version 1 keeps serving
            state["model.v"][:4] -= 1.0
            publisher.publish(state)  # version 2 needs version 1 only
            with pytest.raises(FleetTimeoutError) as timeout:
                publisher.wait_for_fleet(2, min_replicas=1, timeout_s=1.5)
            assert "r1 at version 1" in str(timeout.value) and timeout.value.details["laggards"] == ["r1"]
    finally:
        if sidecar is not None:
            sidecar.stop(engine_too=True)
        server.stop()


def _put(url: str, run: str, replica_id: str, body: str | bytes, token: str = "rep") -> httpx.Response:
    return httpx.put(
        f"{url}/v1/runs/{run}/replicas/{replica_id}", content=body, headers={"authorization": f"Bearer {token}"}
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("history", "[[1, 1e308]]"),
        ("history", "[[1, -1e308]]"),
        ("history", "[[1, NaN]]"),
        ("history", "[[1, Infinity]]"),
        ("history", "[[1, 1e309]]"),
        ("history", "[[1, 1700000000], [2, 5e9]]"),  # the year 2128
        ("started_at", "-1"),
        ("started_at", "NaN"),
        ("last_sync", ('{"to_version": 1, "bytes_fetched": 1, "total_seconds": Infinity, "pause_seconds": 0.1, '
                       '"route": "delta", "finished_at": 1700000000}')),
        ("last_sync", ('{"to_version": 1, "bytes_fetched": 1, "total_seconds": 1.0, "pause_seconds": 0.1, '
                       '"route": "delta", "finished_at": 1e300}')),
        ("last_error", '{"type": "X", "message": "m", "at": -Infinity}'),
    ],
)  # fmt: skip
def test_reports_with_non_finite_or_absurd_times_are_refused(secured, field, value):
    run = f"run-{uuid.uuid4().hex[:8]}"
    good = _report("r1", applied_version=1, target_version=1, state="idle", healthy=True)
    body = json.loads(good.model_dump_json())
    body[field] = "@@"
    text = json.dumps(body).replace('"@@"', value)
    answer = _put(secured.url, run, "r1", text)
    assert answer.status_code == 422, answer.text
    refusal = answer.json()
    assert refusal["type"] == "InvalidRequest" and f"invalid report of replica 'r1': {field}" in refusal["message"]
    assert _put(secured.url, run, "r1", good.model_dump_json()).status_code == 200  # the same report, sound
    with secured.client("ro") as ro:
        assert [r.report for r in FleetClient(ro).replicas(run).replicas] == [good]  # nothing else was stored


def _capped(tmp_path, **settings) -> ThreadServer:
    values = {"store": f"file://{tmp_path / 'store'}", "tokens": TOKENS, "fleet_poll_interval_s": 0.1}
    return ThreadServer(BulletinSettings(**{**values, **settings}))


def test_live_replicas_past_the_cap_are_refused_and_renewals_never_are(tmp_path):
    assert BulletinSettings().max_live_replicas == 1000
    run = f"run-{uuid.uuid4().hex[:8]}"
    server = _capped(tmp_path, max_live_replicas=3, replica_lease_s=2.0)
    other = None
    try:
        reports = {f"r{i}": _report(f"r{i}", applied_version=0, target_version=0) for i in range(4)}
        for rid in ("r0", "r1", "r2"):
            assert _put(server.url, run, rid, reports[rid].model_dump_json()).status_code == 200
        refused = _put(server.url, run, "r3", reports["r3"].model_dump_json())
        assert refused.status_code == 422, refused.text
        body = refused.json()
        assert body["type"] == "TooManyReplicas" and "STITCH_BULLETIN_MAX_LIVE_REPLICAS=3" in body["message"]
        assert (body["setting"], body["limit"], body["replica_id"]) == ("STITCH_BULLETIN_MAX_LIVE_REPLICAS", 3, "r3")
        assert _put(server.url, run, "r0", reports["r0"].model_dump_json()).status_code == 200  # a renewal
        moved = _report("r1", applied_version=1, target_version=1, state="idle", healthy=True)
        assert _put(server.url, run, "r1", moved.model_dump_json()).status_code == 200  # a change of a live one
        # another bulletin process over the same store counts the live records it reads
        other = _capped(tmp_path, max_live_replicas=3, replica_lease_s=2.0)
        assert _put(other.url, run, "r3", reports["r3"].model_dump_json()).json()["type"] == "TooManyReplicas"
        assert _put(other.url, run, "r2", reports["r2"].model_dump_json()).status_code == 200  # renewed there
        # r1's and r2's leases run out while r0 keeps renewing: expired replicas do not count
        with server.client("ro") as ro:
            renew = lambda: _put(server.url, run, "r0", reports["r0"].model_dump_json()).status_code == 200
            wait_for(lambda: renew() and FleetClient(ro).count(run, 0).live == 1, 30, "r1 and r2 expired")
        assert _put(server.url, run, "r3", reports["r3"].model_dump_json()).status_code == 200
        assert _put(server.url, run, "r4", _report("r4").model_dump_json()).status_code == 200
        assert _put(server.url, run, "r5", _report("r5").model_dump_json()).json()["type"] == "TooManyReplicas"
    finally:
        server.stop()
        if other is not None:
            other.stop()


def test_concurrent_new_replicas_get_exactly_the_free_places(tmp_path):
    run = f"run-{uuid.uuid4().hex[:8]}"
    server = _capped(tmp_path, max_live_replicas=5)

    async def report_all() -> list[int]:
        async with httpx.AsyncClient(headers={"authorization": "Bearer rep"}, timeout=30) as http:
            answers = await asyncio.gather(
                *(
                    http.put(f"{server.url}/v1/runs/{run}/replicas/n{i}", content=_report(f"n{i}").model_dump_json())
                    for i in range(20)
                )
            )
        return [a.status_code for a in answers]

    try:
        statuses = asyncio.run(report_all())
        assert sorted(statuses) == [200] * 5 + [422] * 15
        with server.client("ro") as ro:
            assert FleetClient(ro).count(run, 0).live == 5
    finally:
        server.stop()


def test_counts_are_indexed_once_per_snapshot(tmp_path, monkeypatch):
    built: list[int] = []

    class CountedIndex(fleet_watch.LiveIndex):
        def __init__(self, run, records, now):
            super().__init__(run, records, now)
            built.append(len(records))

    monkeypatch.setattr(fleet_watch, "LiveIndex", CountedIndex)
    run = f"run-{uuid.uuid4().hex[:8]}"
    server = _capped(tmp_path, fleet_poll_interval_s=3600.0)  # one read of the store: every change is a report
    try:
        reports = [_report(f"r{i}", applied_version=i, target_version=2) for i in range(3)]
        for report in reports:
            assert _put(server.url, run, report.replica_id, report.model_dump_json()).status_code == 200
        with server.client("ro") as ro:
            fleet = FleetClient(ro)
            before = len(built)
            counts = [fleet.count(run, v % 3) for v in range(30)]
            assert [c.at_or_above for c in counts[:3]] == [3, 2, 1] and counts[2].laggards[0].replica_id == "r0"
            assert len(built) == before + 1  # 30 queries, one index
            assert _put(server.url, run, "r0", reports[0].model_dump_json()).status_code == 200  # a renewal
            assert [fleet.count(run, 1).at_or_above for _ in range(10)] == [2] * 10
            assert len(built) == before + 1  # a renewal of the same report changes no count
            moved = _report("r0", applied_version=2, target_version=2)
            assert _put(server.url, run, "r0", moved.model_dump_json()).status_code == 200
            assert [fleet.count(run, 1).at_or_above for _ in range(10)] == [3] * 10
            assert len(built) == before + 2
    finally:
        server.stop()
