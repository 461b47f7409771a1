"""A long-poll whose client hangs up ends at once (``bulletin/hangup.py``): the latest version's, on its
fast path and on the route, and the fleet's; under the bulletin's own server protocol (its
connection-closed future) and under uvicorn's stock one (a listener on ``receive``).

N clients wait with ``wait_s=60`` on a run where nothing comes, then close their connections: the
watcher's count of waiters, polled, must fall to 0 well before ``wait_s`` (it stayed until
``wait_s`` before).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import httpx
import pytest

from stitchboard.bulletin.app import create_app
from stitchboard.bulletin.deps import BulletinState
from stitchboard.bulletin.settings import BulletinSettings
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.sidecar.sidecar_helpers import wait_for
from tests.support.app_server import AppServer

CLIENTS = 50
RUN = "hangup-run"
#: Each long-poll: its path and query, and the count of waiters it adds to.
POLLS: dict[str, tuple[str, Callable[[BulletinState], int]]] = {
    "latest (fast path)": (f"/v1/runs/{RUN}/versions/latest?after=5&wait_s=60", lambda s: s.watcher.waiting),
    # an extra query parameter: the fast path passes it to the app's route, which ignores the parameter
    "latest (route)": (f"/v1/runs/{RUN}/versions/latest?after=5&wait_s=60&via=route", lambda s: s.watcher.waiting),
    "fleet": (f"/v1/runs/{RUN}/fleet?version=5&min_replicas=1&wait_s=60", lambda s: s.fleet.waiting),
}


@pytest.fixture(params=["bulletin protocol", "stock uvicorn"])
def served(request: pytest.FixtureRequest, tmp_path) -> Iterator[tuple[str, BulletinState]]:
    """A bulletin on loopback (``bulletin serve``'s protocol, or uvicorn's own): its URL and state."""
    settings = BulletinSettings(store=f"file://{tmp_path / 'store'}", poll_interval_s=0.05, fleet_poll_interval_s=0.05)
    if request.param == "bulletin protocol":
        server: AppServer = ThreadServer(settings)
        app = server.app  # type: ignore[attr-defined]
    else:
        app = create_app(settings)
        server = AppServer(app, graceful_shutdown_s=1)
    yield server.url, app.state.bulletin
    server.stop()


@pytest.mark.parametrize("poll", list(POLLS))
def test_waiters_leave_with_their_clients(served, poll):
    url, state = served
    path, waiting = POLLS[poll]
    host, port = httpx.URL(url).host, httpx.URL(url).port
    clients = []
    try:
        for _ in range(CLIENTS):
            sock = socket.create_connection((host, port))
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            clients.append(sock)
        wait_for(lambda: waiting(state) == CLIENTS, 30, f"{CLIENTS} waiters")
    finally:
        for sock in clients:
            sock.close()  # the clients hang up
    wait_for(lambda: waiting(state) == 0, 5, "the waiters gone with their clients")
    if poll.startswith("latest"):
        assert "stitch_bulletin_waiters 0.0" in httpx.get(f"{url}/metrics").text
    # the service still answers long-polls: one that runs out, as it did before
    r = httpx.get(f"{url}{path.replace('wait_s=60', 'wait_s=0.2')}", timeout=10)
    assert r.status_code == (204 if poll.startswith("latest") else 200), r.text
