"""The fleet view over real processes: 3+ sidecars reporting to 2 bulletin processes on one moto S3 store.

Counts stay right through a sidecar restart, a stuck replica (every apply fails) and an expired
lease; both bulletins give the same answer; ``wait_for_fleet`` returns once the fleet converges
and times out naming the laggards.
"""

from __future__ import annotations

import time
import uuid

import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.fleet_client import FleetClient
from stitchboard.trainer_client.errors import FleetTimeoutError
from stitchboard.trainer_client.fleet import wait_for_fleet
from tests.bulletin.bulletin_helpers import ProcessServer, make_backend
from tests.bulletin.fleet_helpers import FleetSidecar, start_sidecar
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import Publisher, make_view, wait_for

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

LEASE_S = 3.0


def _rows(client: BulletinClient, run: str) -> list[tuple[str, int | None, bool]]:
    return [(r.report.replica_id, r.report.applied_version, r.live) for r in FleetClient(client).replicas(run).replicas]


def test_fleet_counts_through_restart_stuck_replica_and_expired_lease(request, tmp_path):
    backend = make_backend("s3", request, tmp_path, replica_lease_s=LEASE_S, fleet_poll_interval_s=0.2)
    run = f"run-{uuid.uuid4().hex[:8]}"
    a, b = ProcessServer(backend.settings), ProcessServer(backend.settings)
    sidecars: dict[str, FleetSidecar] = {}
    try:
        with BulletinClient(a.url, retries=1) as ca, BulletinClient(b.url, retries=1) as cb:
            pub = Publisher(ca, run, tmp_path)
            pub.publish(make_view(0))
            for rid, url in (("r1", a.url), ("r2", b.url), ("r3", a.url)):
                sidecars[rid] = start_sidecar(url, run, rid, FakeEngine(), tmp_path / "handoff")
            count = wait_for_fleet(cb, run, 0, min_replicas=3, timeout_s=60)
            assert (count.live, count.at_or_above, count.laggards) == (3, 3, [])
            pub.step(1)
            pub.step(2)
            wait_for_fleet(ca, run, 2, timeout_s=60)  # every live replica
            assert _rows(ca, run) == _rows(cb, run) == [("r1", 2, True), ("r2", 2, True), ("r3", 2, True)]
            view = FleetClient(cb).replicas(run)
            assert view.latest_version == 2 and all(
                r.behind_latest == 0 and r.report.engine == "vllm" for r in view.replicas
            )
            assert all(r.report.last_sync is not None and r.report.last_sync.to_version == 2 for r in view.replicas)

            # a stuck replica: every write of r3's engine fails (it recovers from the anchor, then fails again)
            sidecars["r3"].engine.fail_apply = 10**6
            pub.step(3)
            with pytest.raises(FleetTimeoutError) as timeout:
                wait_for_fleet(cb, run, 3, min_replicas=3, timeout_s=4)
            message = str(timeout.value)
            assert "only 2 of 3 live replicas" in message and "r3 at version" in message and "last error" in message, (
                message
            )
            assert "r1" not in message and "r2" not in message, message
            assert timeout.value.details["laggards"] == ["r3"]
            for client in (ca, cb):
                count = FleetClient(client).count(run, 3)
                assert (count.live, count.at_or_above, [lag.replica_id for lag in count.laggards]) == (3, 2, ["r3"])
                assert count.laggards[0].error and count.laggards[0].state in (
                    "retrying",
                    "unhealthy",
                    "recovering",
                    "staging",
                    "committing",
                )

            # r1 restarts (same replica id, same engine), now reporting through the other bulletin
            before = {r.report.replica_id: r.report.started_at for r in FleetClient(ca).replicas(run).replicas}
            old = sidecars.pop("r1")
            old.stop()
            sidecars["r1"] = start_sidecar(b.url, run, "r1", old.engine, tmp_path / "handoff")
            sidecars["r1"].owned = old.owned

            def restarted() -> bool:
                r1 = next(r.report for r in FleetClient(ca).replicas(run).replicas if r.report.replica_id == "r1")
                return r1.started_at > before["r1"] and r1.applied_version == 3

            wait_for(restarted, 30, "r1 back at version 3 after its restart")
            count = FleetClient(ca).count(run, 3)
            assert (count.live, count.at_or_above) == (3, 2), count

            # r2 goes away: its lease expires and it stops counting
            sidecars.pop("r2").stop(engine_too=True)
            t0 = time.monotonic()
            count = wait_for(
                lambda: (c := FleetClient(cb).count(run, 3)).expired == ["r2"] and c, LEASE_S + 10, "r2's lease expired"
            )
            assert time.monotonic() - t0 >= LEASE_S - 2.5  # not before its lease ran out (1 s store clock resolution)
            assert (count.live, count.at_or_above) == (2, 1)
            assert ("r2", 3, False) in _rows(ca, run)

            # the stuck replica recovers: the live fleet converges
            sidecars["r3"].engine.fail_apply = 0
            count = wait_for_fleet(ca, run, 3, timeout_s=60)
            assert (count.live, count.at_or_above, count.expired) == (2, 2, ["r2"])
    finally:
        for sidecar in sidecars.values():
            sidecar.stop(engine_too=True)
        a.kill()
        b.kill()
