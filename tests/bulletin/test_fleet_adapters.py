"""Resident adapters per replica (issue #31): a sidecar's report lists the adapter versions its engine holds; the
fleet view answers them and the status page shows them in the replica's row (real bulletin over loopback)."""

from __future__ import annotations

import time
import uuid

import httpx

from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.fleet import ReplicaReport
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.sidecar.sidecar_helpers import Publisher, make_view


def test_fleet_view_and_status_page_show_resident_adapters(tmp_path) -> None:
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", fleet_poll_interval_s=0.1))
    run = f"run-{uuid.uuid4().hex[:8]}"
    try:
        with server.client() as client:
            Publisher(client, run, tmp_path).publish(make_view(0))
        now = time.time()
        common = {"engine": "vllm", "state": "idle", "lag_versions": 0, "healthy": True, "started_at": now}
        reports = [
            ReplicaReport(replica_id="a", applied_version=0, target_version=0, adapters=[f"{run}@0"], **common),
            ReplicaReport(replica_id="b", applied_version=0, target_version=0, **common),
        ]
        for report in reports:
            url = f"{server.url}/v1/runs/{run}/replicas/{report.replica_id}"
            assert httpx.put(url, content=report.model_dump_json()).status_code == 200
        fleet = httpx.get(f"{server.url}/v1/runs/{run}/replicas").json()
        assert {r["report"]["replica_id"]: r["report"]["adapters"] for r in fleet["replicas"]} == {
            "a": [f"{run}@0"],
            "b": [],
        }
        bad = {**reports[1].model_dump(mode="json"), "adapters": [run]}  # a resident adapter names its version
        answer = httpx.put(f"{server.url}/v1/runs/{run}/replicas/b", json=bad)
        assert answer.status_code == 422 and "names no version" in answer.text
        html = httpx.get(f"{server.url}/status/runs/{run}").text
        row_a = html.split('data-replica="a"')[1].split("</tr>")[0]
        row_b = html.split('data-replica="b"')[1].split("</tr>")[0]
        assert f'<td class="adapters">{run}@0</td>' in row_a and '<td class="adapters">-</td>' in row_b
    finally:
        server.stop()
