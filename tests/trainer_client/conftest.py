"""Fixtures of the trainer SDK tests: one live bulletin (file store) on loopback for the session."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stitchboard.bulletin.settings import BulletinSettings
from tests.bulletin.bulletin_helpers import ThreadServer


@pytest.fixture(scope="session")
def bulletin_store(tmp_path_factory) -> Path:
    """Folder of the session bulletin's file store."""
    return tmp_path_factory.mktemp("bulletin-store")


@pytest.fixture(scope="session")
def bulletin(bulletin_store: Path) -> Iterator[ThreadServer]:
    """A real bulletin over HTTP on loopback, shared by the session (each test uses its own run)."""
    server = ThreadServer(BulletinSettings(store=f"file://{bulletin_store}", poll_interval_s=0.1))
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _close_bulletin_clients(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the session bulletin, close the clients it made with ``bulletin.client()``."""
    yield
    if "bulletin" in request.fixturenames:
        request.getfixturevalue("bulletin").close_clients()


@pytest.fixture
def run() -> str:
    """A fresh run id."""
    return f"run-{uuid.uuid4().hex[:10]}"
