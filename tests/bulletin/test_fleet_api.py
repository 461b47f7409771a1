"""The fleet routes in one process: the replica token scope, refused reports never stopping a sync,
``Publisher.wait_for_fleet`` and publish pacing (``FleetPacing``) against a sidecar over a fake engine."""

from __future__ import annotations

import logging
import time
import uuid

import httpx
import pytest
import torch

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
