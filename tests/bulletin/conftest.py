"""Fixtures of the bulletin tests: both store backends (local folder, S3 over HTTP via moto's server mode), and radosgw.

``radosgw`` (a real S3 server, :mod:`tests.support.radosgw`) judges what moto cannot: signatures, payload digests.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from moto.server import ThreadedMotoServer

from tests.bulletin.bulletin_helpers import S3_ENV, Backend, ThreadServer, free_port, make_backend
from tests.support.radosgw import radosgw  # noqa: F401 - the session's radosgw, a fixture


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3 endpoint over HTTP on loopback (moto's threaded server)."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(autouse=True)
def _s3_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    """Each test using it runs once per store backend."""
    return make_backend(request.param, request, tmp_path)


@pytest.fixture
def server(backend: Backend) -> Iterator[ThreadServer]:
    """A bulletin over ``backend`` served on loopback."""
    srv = ThreadServer(backend.settings)
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ThreadServer):
    with server.client() as c:
        yield c


@pytest.fixture
def run() -> str:
    """A fresh run id."""
    return f"run-{uuid.uuid4().hex[:10]}"
