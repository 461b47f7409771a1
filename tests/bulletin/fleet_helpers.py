"""Helpers of the fleet tests: sidecars over fake engines on loopback, reporting to a bulletin; a synthetic fleet."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.fleet import FleetView, ReplicaReport, ReplicaView
from stitchboard.proto.schema import VersionInfo
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.fake_engine import FakeEngine
from tests.support.app_server import AppServer


@dataclass
class FleetSidecar:
    """A sidecar (``replica_id``) served on loopback over ``engine``; :meth:`stop` also stops what it started."""

    replica_id: str
    engine: FakeEngine
    server: AppServer
    client: BulletinClient
    owned: list[AppServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    def status(self) -> dict:
        return httpx.get(f"{self.url}/v1/stitch/status", timeout=10).json()

    def stop(self, *, engine_too: bool = False) -> None:
        self.server.stop()
        self.client.close()
        if engine_too:
            for server in self.owned:
                server.stop()


def start_sidecar(
    bulletin: str, run: str, replica_id: str, engine: FakeEngine, handoff: Path, token: str | None = None, **overrides
) -> FleetSidecar:
    """Serve a sidecar of ``run`` reporting as ``replica_id`` to ``bulletin`` (and the engine's HTTP API,
    unless it is served)."""
    owned = []
    if not engine.url:
        server = AppServer(engine.app())
        engine.url = server.url
        owned.append(server)
    values = {
        "bulletin": bulletin,
        "run": run,
        "token": token,
        "engine_url": engine.url,
        "handoff_dir": str(handoff / replica_id),
        "replica_id": replica_id,
        "poll_wait_s": 5.0,
        "retry_backoff_s": 0.05,
        "max_backoff_s": 0.2,
        "bulletin_retries": 1,
        "report_min_interval_s": 0.2,
        "report_max_backoff_s": 0.5,
        **overrides,
    }
    client = BulletinClient(bulletin, token, retries=1, backoff_s=0.01)
    server = AppServer(create_sidecar(SidecarSettings(**values), engine=engine, client=client))
    return FleetSidecar(replica_id, engine, server, client, owned)


#: The synthetic fleet's now, Unix seconds.
NOW = 1_700_000_000.0


def synthetic_fleet(
    replicas: int, versions: int = 200, seed: int = 0, now: float = NOW
) -> tuple[FleetView, list[VersionInfo]]:
    """A run of ``versions`` versions (one every 10 s up to ``now``, Unix s) and ``replicas`` replicas that each
    applied the last 32 at their own pace, some restarted (a lower version after a higher one), some expired."""
    rng = random.Random(seed)
    infos = [
        VersionInfo(
            run_id="r", version=v, snapshot=v % 50 == 0, manifest_sha256="0" * 64, size_bytes=1000 + v,
            committed_at=datetime.fromtimestamp(now - (versions - v) * 10, UTC).isoformat(),
            snapshot_bytes=10**6 if v % 50 == 0 else 0,
        )
        for v in range(versions)
    ]  # fmt: skip
    views = []
    for i in range(replicas):
        history = [(v, now - (versions - v) * 10 + rng.uniform(0.1, 25)) for v in range(versions - 32, versions)]
        if i % 7 == 3:  # a restart: back at an older version
            history[-1] = (versions - 40, history[-1][1])
        report = ReplicaReport(
            replica_id=f"rep-{i:05d}", engine="vllm", applied_version=history[-1][0], target_version=versions - 1,
            state="idle", lag_versions=0, healthy=True, history=history, started_at=now - 5000,
        )  # fmt: skip
        live = i % 11 != 5
        views.append(ReplicaView(report=report, live=live, reported_at=now, lease_expires_at=now + 30, behind_latest=0))
    return FleetView(run_id="r", latest_version=versions - 1, replicas=views, time=now), infos
