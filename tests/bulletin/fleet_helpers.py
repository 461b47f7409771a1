"""Helpers of the fleet tests: sidecars over fake engines on loopback, reporting to a bulletin."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stitchboard.bulletin.client import BulletinClient
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
    """Serve a sidecar of ``run`` reporting as ``replica_id`` to ``bulletin`` (and the engine's HTTP API, unless it is served)."""
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
