"""The status page in a real headless Chromium (Debian's, driven by playwright): the token form sets an
HttpOnly, SameSite=Strict cookie; the page's replica count, table and latest version match the
fleet API; the plots are SVG with their titles as text; a screenshot is saved."""

from __future__ import annotations

import uuid

import httpx
import pytest

from stitchboard.bulletin.fleet_client import FleetClient
from stitchboard.bulletin.settings import BulletinSettings, TokenGrant
from stitchboard.demo.browser import browser_page, read_status_page
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.bulletin.fleet_helpers import start_sidecar
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import Publisher, make_view, wait_for

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

TOKENS = {
    "pub": TokenGrant(scopes=["publish"]),
    "rep": TokenGrant(scopes=["replica"]),
    "viewer": TokenGrant(scopes=["read"]),
    "other-run": TokenGrant(scopes=["read"], runs=["elsewhere"]),
}


def test_status_page_in_chromium(tmp_path, request):
    server = ThreadServer(
        BulletinSettings(store=f"file://{tmp_path / 'store'}", tokens=TOKENS, fleet_poll_interval_s=0.1)
    )
    run = f"run-{uuid.uuid4().hex[:8]}"
    sidecars = []
    try:
        with server.client("pub") as pub:
            views = Publisher(pub, run, tmp_path)
            views.publish(make_view(0))
            sidecars = [
                start_sidecar(server.url, run, f"replica-{i}", FakeEngine(), tmp_path / "handoff", token="rep")
                for i in range(3)
            ]
            for seed in (1, 2, 3):
                views.step(seed)
            views.publish(views.views[-1], anchor=True)  # version 4: an anchor
            sidecars[2].engine.refuse_versions = {5}  # replica-2 stays at 4 and shows why
            views.step(5)
            with server.client("viewer") as viewer:
                FleetClient(viewer).count(run, 5, min_replicas=2, wait_s=30)
                refused = lambda: (
                    (r := FleetClient(viewer).replicas(run).replicas[2].report).applied_version == 4
                    and r.last_error is not None
                )
                wait_for(refused, 30, "replica-2 reporting the refused version 5")
                fleet = FleetClient(viewer).replicas(run)
            assert fleet.latest_version == 5

            # without a token: the login form, 401; a token of another run cannot see this one
            assert httpx.get(f"{server.url}/status").status_code == 401
            assert (
                httpx.get(f"{server.url}/status/runs/{run}", headers={"authorization": "Bearer other-run"}).status_code
                == 403
            )
            assert httpx.post(f"{server.url}/status/login", data={"token": "wrong"}).status_code == 401

            with browser_page() as page:
                screenshot = tmp_path / "status.png"
                shown = read_status_page(page, server.url, run, "viewer", screenshot)
                cookie = next(c for c in page.context.cookies() if c["name"] == "stitch_token")
                assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/status"
                assert page.evaluate("document.cookie") == ""  # not readable by scripts
                table_errors = page.locator("tr[data-replica='replica-2'] td.error").all_inner_texts()
            live = [r for r in fleet.replicas if r.live]
            assert shown.latest_version == str(fleet.latest_version) == "5"
            assert shown.live_replicas == len(live) == 3
            assert shown.at_latest == sum(r.report.applied_version == 5 for r in live) == 2
            assert (
                shown.rows
                == [(r.report.replica_id, str(r.report.applied_version)) for r in fleet.replicas]
                == [("replica-0", "5"), ("replica-1", "5"), ("replica-2", "4")]
            )
            assert any("PlanRefused" in text and "4->5" in text for text in table_errors), table_errors
            assert shown.svgs >= 2
            assert "version timeline: 6 versions, latest 5" in shown.svg_texts
            assert "fleet convergence: 3 live replicas, latest version 5" in shown.svg_texts
            assert ">= v5" in shown.svg_texts
            assert screenshot.stat().st_size > 10_000
            (request.config.rootpath / "build").mkdir(exist_ok=True)
            (request.config.rootpath / "build" / "status-page-test.png").write_bytes(screenshot.read_bytes())
    finally:
        for sidecar in sidecars:
            sidecar.stop(engine_too=True)
        server.stop()


def test_page_refuses_a_missing_run(tmp_path):
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}"))
    try:
        answer = httpx.get(f"{server.url}/status/runs/nothing-here")
        assert answer.status_code == 404 and answer.json()["type"] == "NotFound"
    finally:
        server.stop()
