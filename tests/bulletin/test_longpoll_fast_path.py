"""The long-poll's ASGI fast path answers as the route does: versions, 204 on timeout, the route's refusals
for bad input and tokens, store errors as JSON, and the latency metric under the route's template."""

from __future__ import annotations

import uuid

import httpx
import pytest

from stitchboard.bulletin.settings import BulletinSettings, TokenGrant
from tests.bulletin.bulletin_helpers import ThreadServer, upload_version
from tests.sidecar.sidecar_helpers import wait_for

TOKENS = {
    "pub": TokenGrant(scopes=["publish", "metrics"]),
    "ro": TokenGrant(scopes=["read"], runs=["fast-run"]),
    "met": TokenGrant(scopes=["metrics"]),
}


@pytest.fixture
def served(tmp_path):
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", tokens=TOKENS, poll_interval_s=0.05))
    yield server
    server.stop()


def test_fast_path_answers_as_the_route(served):
    run = "fast-run"
    with served.client("pub") as pub:
        upload_version(pub, run, 0, snapshot_bytes=10)
    url, ro = f"{served.url}/v1/runs/{run}/versions/latest", {"authorization": "Bearer ro"}
    r = httpx.get(url, params={"after": -1, "wait_s": 1}, headers=ro)
    assert r.status_code == 200 and r.json()["version"] == 0 and r.headers["content-type"] == "application/json"
    assert httpx.get(url, headers=ro).json()["version"] == 0  # no query at all
    r = httpx.get(url, params={"after": 0, "wait_s": 0.2}, headers=ro)
    assert r.status_code == 204 and r.content == b""
    for params in ({"after": -2}, {"after": "x"}, {"wait_s": -1}):  # the route's validation answers
        r = httpx.get(url, params=params, headers=ro)
        assert r.status_code == 422 and r.json()["type"] == "InvalidRequest", (params, r.text)
    assert (
        httpx.get(url, params={"after": 0, "wait_s": 0.1, "extra": 1}, headers=ro).status_code == 204
    )  # unknown parameters ignored, as by the route
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"authorization": "Bearer met"}).status_code == 403
    other = httpx.get(f"{served.url}/v1/runs/run-{uuid.uuid4().hex[:6]}/versions/latest", headers=ro)
    assert other.status_code == 403 and other.json()["type"] == "Forbidden"
    metrics = httpx.get(f"{served.url}/metrics", headers={"authorization": "Bearer pub"}).text
    assert (
        'route="/v1/runs/{run}/versions/latest",status="200"' in metrics
        and 'route="/v1/runs/{run}/versions/latest",status="204"' in metrics
    )


def test_fast_path_store_errors_are_json(served, tmp_path, monkeypatch):
    state = served.app.state.bulletin

    def broken(run: str):
        from stitchboard.bulletin.errors import UnavailableError

        raise UnavailableError("the store is down (test)")

    monkeypatch.setattr(state.ledger, "latest", broken)
    r = httpx.get(
        f"{served.url}/v1/runs/fast-run/versions/latest", params={"wait_s": 1}, headers={"authorization": "Bearer ro"}
    )
    assert r.status_code == 503 and r.json() == {"type": "Unavailable", "message": "the store is down (test)"}


def test_waiters_answered_by_the_fan_out(served, monkeypatch):
    """Waiters registered before a publish all get the new version from the watcher's one-pass fan-out,
    sent whole (the server's protocol is ``bulletin serve``'s); one that hung up before it has left
    (nothing is sent to it, its request is counted as 499); the waiters' count drops back to zero and
    the latency metric counts every answer."""
    import asyncio

    from stitchboard.bulletin import http_protocol

    sent_whole: list[bool] = []

    def recorded(cycle_ref, state, answer) -> bool:
        sent_whole.append(real(cycle_ref, state, answer))
        return sent_whole[-1]

    real = http_protocol.send_whole
    monkeypatch.setattr(http_protocol, "send_whole", recorded)
    run = "fast-run"
    with served.client("pub") as pub:
        upload_version(pub, run, 0, snapshot_bytes=10)
        url, ro = f"{served.url}/v1/runs/{run}/versions/latest", {"authorization": "Bearer ro"}

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(headers=ro, timeout=30) as http:
                polls = [asyncio.create_task(http.get(url, params={"after": 0, "wait_s": 20})) for _ in range(30)]
                gone = asyncio.create_task(http.get(url, params={"after": 0, "wait_s": 20}))
                watcher = served.app.state.bulletin.watcher
                while sum(len(w) for w in watcher._direct.values()) < 31:
                    await asyncio.sleep(0.02)
                gone.cancel()  # the client hangs up: its waiter leaves
                while sum(len(w) for w in watcher._direct.values()) > 30:
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(upload_version, pub, run, 1, patch_bytes=10)
                return await asyncio.gather(*polls)

        answers = asyncio.run(scenario())
    assert [(r.status_code, r.json()["version"]) for r in answers] == [(200, 1)] * 30
    assert sent_whole == [True] * 30, sent_whole
    waiting = lambda: (
        "stitch_bulletin_waiters 0.0"
        in httpx.get(f"{served.url}/metrics", headers={"authorization": "Bearer pub"}).text
    )
    wait_for(waiting, 10, "no waiter left")
    metrics = httpx.get(f"{served.url}/metrics", headers={"authorization": "Bearer pub"}).text
    assert (
        'stitch_bulletin_request_seconds_count{method="GET",route="/v1/runs/{run}/versions/latest",status="200"} 30.0'
        in metrics
        and 'stitch_bulletin_request_seconds_count{method="GET",route="/v1/runs/{run}/versions/latest",status="499"} '
        "1.0"
        in metrics
    )
