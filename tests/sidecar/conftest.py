"""Fixtures of the sidecar service tests: a real bulletin on loopback, a publisher, sidecars over fake engines.

Fixture names start with ``sc_`` so they do not collide with the real-vLLM tests in this folder.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stitchboard.bulletin.app import create_app as create_bulletin
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.sidecar_wire import COMMIT_STATES
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import FAST_SIDECAR, AppServer, Publisher, wait_for


class _DropShutdownCancels(logging.Filter):
    """Hide uvicorn's report of long-polls cut short when a test's bulletin stops (expected at teardown)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError) and "graceful shutdown exceeded" not in record.getMessage()


logging.getLogger("uvicorn.error").addFilter(_DropShutdownCancels())


@pytest.fixture
def sc_bulletin(tmp_path: Path) -> Iterator[AppServer]:
    """A bulletin over a file store, served on loopback."""
    server = AppServer(create_bulletin(BulletinSettings(store=f"file://{tmp_path / 'store'}", poll_interval_s=0.05)))
    yield server
    server.stop()


@pytest.fixture
def sc_client(sc_bulletin: AppServer) -> Iterator[BulletinClient]:
    with BulletinClient(sc_bulletin.url, retries=1, backoff_s=0.01) as client:
        yield client


@pytest.fixture
def sc_publisher(sc_client: BulletinClient, tmp_path: Path) -> Publisher:
    """Publishes versions of a fresh run."""
    return Publisher(sc_client, f"run-{uuid.uuid4().hex[:8]}", tmp_path)


@dataclass
class Sidecar:
    """A sidecar served on loopback over ``engine``."""

    server: AppServer
    engine: FakeEngine
    http: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def app(self):
        return self.server.server.config.app

    def status(self) -> dict:
        return self.http.get("/v1/stitch/status").json()

    def wait_applied(self, version: int, timeout_s: float = 60.0) -> dict:
        """Wait until the sidecar reports ``version`` applied and its commit finished (the engine
        resumed: the version is marked applied just before the resume); returns the status."""
        return wait_for(
            lambda: (s := self.status())["applied_version"] == version and s["state"] not in COMMIT_STATES and s,
            timeout_s,
            f"version {version} applied (status {self.status()})",
        )

    def stop(self) -> None:
        self.http.close()
        self.server.stop()


@pytest.fixture
def sc_start(sc_bulletin: AppServer, sc_publisher: Publisher, tmp_path: Path) -> Iterator[Callable[..., Sidecar]]:
    """Factory: ``sc_start(engine, client=None, **settings)`` serves a sidecar (and the engine's HTTP API) on
    loopback."""
    started: list[tuple[Sidecar | None, AppServer]] = []
    clients: list[BulletinClient] = []

    def start(engine: FakeEngine, /, client: BulletinClient | None = None, **overrides) -> Sidecar:
        if not engine.url:
            engine_server = AppServer(engine.app())
            engine.url = engine_server.url
            started.append((None, engine_server))
        values = {
            "bulletin": sc_bulletin.url,
            "run": sc_publisher.run,
            "engine_url": engine.url,
            "handoff_dir": str(tmp_path / "handoff"),
            **FAST_SIDECAR,
            **overrides,
        }
        settings = SidecarSettings(**values)
        if client is None:
            client = BulletinClient(sc_bulletin.url, retries=1, backoff_s=0.01)
            clients.append(client)
        server = AppServer(create_sidecar(settings, engine=engine, client=client))
        sidecar = Sidecar(server, engine, httpx.Client(base_url=server.url, timeout=30))
        started.append((sidecar, server))
        return sidecar

    yield start
    for sidecar, server in reversed(started):
        if sidecar is not None:
            sidecar.stop()
        else:
            server.stop()
    for client in clients:
        client.close()


# --- real SGLang (test_sglang_*.py): one server shared by those modules, see sglang_helpers.py
from tests.sidecar.sglang_helpers import SharedSglang, sglang_engine, sglang_workdir, shared_sglang  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def _no_idle_sglang(request: pytest.FixtureRequest, shared_sglang: SharedSglang) -> None:  # noqa: F811
    """Stop the shared SGLang server when a module that is not an SGLang one (``test_sglang_*``)
    starts: the modules after them run vLLM engines, which need the memory and the cores."""
    if not request.path.name.startswith("test_sglang_"):
        shared_sglang.release()


# --- real vLLM (test_vllm_engine.py, test_sidecar_vllm.py): one server per session, see vllm_fixtures.py
from tests.sidecar.vllm_fixtures import (  # noqa: F401
    vllm_adapter,
    vllm_engine,
    vllm_fresh_greedy,
    vllm_run,
    vllm_run_engine,
    vllm_sidecars,
    vllm_snapshot,
    vllm_views,
    vllm_workdir,
)
