"""The status page's login guard: a login posted from another origin is refused (in a real headless
Chromium, and header by header over HTTP), a login without Origin or Referer is taken only without
cookies, a logout from another origin is refused too, and failed logins from one address are slowed
down (429 with Retry-After)."""

from __future__ import annotations

import uuid

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route

from stitchboard.bulletin.page_login import FIRST_LOCK_S, FREE_FAILURES, MAX_LOCK_S, LoginLimiter
from stitchboard.bulletin.settings import BulletinSettings, TokenGrant
from stitchboard.demo.browser import browser_page
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.support.app_server import AppServer

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

TOKENS = {"viewer": TokenGrant(scopes=["read"]), "attacker": TokenGrant(scopes=["read"], runs=["attackers-run"])}


@pytest.fixture
def bulletin(tmp_path):
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", tokens=TOKENS))
    yield server
    server.stop()


def _login(url: str, token: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/status/login", data={"token": token}, headers=headers)


def _attacker_site(bulletin: str) -> AppServer:
    """A page on another origin whose form logs its visitor into the bulletin with the attacker's token."""
    page = f"""<!doctype html><html><body>
<form method="post" action="{bulletin}/status/login"><input name="token" value="attacker"></form>
<script>document.forms[0].submit()</script></body></html>"""
    return AppServer(Starlette(routes=[Route("/", lambda request: HTMLResponse(page))]))


def test_a_login_posted_from_another_origin_is_refused_in_chromium(bulletin):
    attacker = _attacker_site(bulletin.url)
    try:
        with browser_page() as page:
            with page.expect_response(f"{bulletin.url}/status/login") as posted:
                page.goto(attacker.url)
            page.wait_for_load_state()
            assert posted.value.status == 403
            assert "log in from this bulletin's own page" in page.inner_text("#login-error")
            assert not [c for c in page.context.cookies() if c["name"] == "stitch_token"]
            # the bulletin's own form still logs in (the browser sends the bulletin's own Origin)
            page.goto(f"{bulletin.url}/status")
            page.fill("#token", "viewer")
            page.click("#login")
            page.wait_for_load_state()
            assert [c["value"] for c in page.context.cookies() if c["name"] == "stitch_token"] == ["viewer"]
    finally:
        attacker.stop()


def test_origin_and_referer_are_checked_against_the_host(bulletin):
    url, host = bulletin.url, bulletin.url.removeprefix("http://")
    refused = [
        {"origin": "http://evil.example"},
        {"origin": f"http://{host.split(':')[0]}:1"},  # same host, another port: another origin
        {"origin": "null"},
        {"referer": "http://evil.example/status"},
        {"cookie": "stitch_token=viewer"},  # a browser's cookies without Origin or Referer
        {"origin": "http://evil.example", "referer": f"{url}/status"},  # Origin wins
    ]
    for headers in refused:
        answer = _login(url, "viewer", **headers)
        assert answer.status_code == 403, headers
        assert "set-cookie" not in answer.headers and "login-error" in answer.text
    allowed = [
        {"origin": url},
        {"origin": f"https://{host}"},  # behind a TLS-terminating proxy the scheme differs, the host does not
        {"referer": f"{url}/status"},
        {},  # curl: no Origin, no Referer, no cookie
    ]
    for headers in allowed:
        answer = _login(url, "viewer", **headers)
        assert answer.status_code == 303 and "stitch_token=viewer" in answer.headers["set-cookie"], headers


def test_a_logout_posted_from_another_origin_is_refused(bulletin):
    url = bulletin.url
    for headers in ({"origin": "http://evil.example"}, {"cookie": "stitch_token=viewer"}):
        answer = httpx.post(f"{url}/status/logout", headers=headers)
        assert answer.status_code == 403 and "set-cookie" not in answer.headers, headers
    answer = httpx.post(f"{url}/status/logout", headers={"origin": url, "cookie": "stitch_token=viewer"})
    assert answer.status_code == 303 and 'stitch_token=""' in answer.headers["set-cookie"]


def test_failed_logins_from_one_address_are_slowed_down(bulletin):
    now = [1000.0]
    bulletin.app.state.login_limiter = LoginLimiter(clock=lambda: now[0])  # the app's limiter, on a test clock
    url = bulletin.url
    for _ in range(FREE_FAILURES):
        assert _login(url, f"guess-{uuid.uuid4().hex}").status_code == 401
    assert _login(url, "one-guess-too-many").status_code == 401  # counted: the address is now locked
    for token in ("another-guess", "viewer"):  # while locked even the right token is not looked at
        locked = _login(url, token)
        assert locked.status_code == 429 and locked.headers["retry-after"] == str(int(FIRST_LOCK_S))
        assert "too many failed logins from 127.0.0.1" in locked.text and "set-cookie" not in locked.headers
    now[0] += FIRST_LOCK_S
    assert _login(url, "guess-again").status_code == 401
    assert _login(url, "viewer").headers["retry-after"] == str(int(2 * FIRST_LOCK_S))  # each failure doubles it
    for _ in range(20):
        now[0] += MAX_LOCK_S
        assert _login(url, "guess").status_code == 401
    assert _login(url, "viewer").headers["retry-after"] == str(int(MAX_LOCK_S))  # up to the longest lock
    now[0] += MAX_LOCK_S
    assert _login(url, "viewer").status_code == 303  # a good login clears the address
    for _ in range(FREE_FAILURES):
        assert _login(url, "guess").status_code == 401
    assert _login(url, "viewer").status_code == 303
