"""A third engine kind, registered from the tests, served by the sidecar as it is: the sidecar
builds its adapter from the registry, forwards only its routes, gates and stamps its answers
(plain and streamed), and commits new versions into it bit for bit.

A real bulletin, a real sidecar and the third kind's engine (:mod:`.engine`) on loopback.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.sidecar_wire import COMMIT_STATES
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.fake_engine import fingerprint
from tests.sidecar.sidecar_helpers import FAST_SIDECAR, AppServer, make_view, same_bits, wait_for
from tests.sidecar.third_engine.engine import SERVING, ThirdEngine


@pytest.fixture
def third(sc_bulletin, sc_publisher, tmp_path) -> Iterator[tuple[ThirdEngine, httpx.Client]]:
    """A third-kind engine at version 0 behind a sidecar whose adapter comes from the registry."""
    sc_publisher.publish(make_view(0))
    engine = ThirdEngine(token_delay_s=0.01)
    engine_server = AppServer(engine.app())
    SERVING[engine_server.url] = engine
    settings = SidecarSettings(
        bulletin=sc_bulletin.url,
        run=sc_publisher.run,
        engine="third",
        engine_url=engine_server.url,
        handoff_dir=str(tmp_path / "handoff"),
        **FAST_SIDECAR,
    )
    client = BulletinClient(sc_bulletin.url, retries=1, backoff_s=0.01)
    sidecar = AppServer(create_sidecar(settings, client=client))  # no engine passed: built by the kind's factory
    http = httpx.Client(base_url=sidecar.url, timeout=30)
    try:
        _wait_applied(http, 0)
        yield engine, http
    finally:
        http.close()
        sidecar.stop()
        engine_server.stop()
        client.close()
        SERVING.pop(engine_server.url, None)


def _wait_applied(http: httpx.Client, version: int) -> None:
    wait_for(
        lambda: (
            (s := http.get("/v1/stitch/status").json())["applied_version"] == version
            and s["state"] not in COMMIT_STATES
        ),
        what=f"version {version} applied",
    )


def test_only_the_kinds_routes_are_forwarded(third):
    engine, http = third
    assert http.get("/info").json() == {"kind": "third", "tensors": len(engine.weights)}
    for method, path in (("POST", "/swap"), ("POST", "/v1/completions"), ("GET", "/server_info")):
        r = http.request(method, path, json={})
        assert r.status_code == 403 and r.json()["type"] == "RouteForbidden", (method, path)
    assert engine.swaps == 0 and engine.started == 0


def test_answers_are_stamped_plain_and_streamed(third, sc_publisher):
    _, http = third
    r = http.post("/infer", json={"input": "x", "steps": 2})
    assert r.status_code == 200
    body = r.json()
    assert body["weight_version_start"] == body["weight_version_end"] == 0
    assert r.headers["x-stitch-version-start"] == r.headers["x-stitch-version-end"] == "0"
    assert all(fingerprint(sc_publisher.views[0]) in t for t in body["output"])
    r = http.post("/infer", json={"input": "x", "steps": 3, "stream": True})
    events = [e.strip()[len("data: ") :] for e in r.text.split("\n\n") if e.strip()]
    assert [json.loads(e)["token"] for e in events[:3]] == [
        f" t{i}@{fingerprint(sc_publisher.views[0])}" for i in range(3)
    ]
    stamp = json.loads(events[3])
    assert (stamp["weight_version_start"], stamp["weight_version_end"]) == (0, 0) and events[4] == "[DONE]"


def test_a_request_for_the_next_version_is_held_until_its_commit(third, sc_publisher):
    engine, http = third
    out: dict = {}
    held = threading.Thread(
        target=lambda: out.update(
            r=http.post("/infer", json={"input": "x", "weight_version": {"min_version": 1, "wait_s": 60}})
        ),
        daemon=True,
    )
    held.start()
    wait_for(lambda: http.get("/v1/stitch/status").json()["requests_waiting"] == 1, what="the request held")
    assert engine.started == 0
    sc_publisher.step(1)
    held.join(60)
    r = out["r"]
    assert r.status_code == 200 and r.json()["weight_version_start"] == r.json()["weight_version_end"] == 1
    assert "weight_version" not in r.json()["echo_body"], "the constraint is the sidecar's, not the engine's"
    assert same_bits(engine.weights, sc_publisher.views[1]), "the commit wrote version 1's bits"
    r = http.post("/infer", json={"input": "x"}, headers={"X-Stitch-Exact-Version": "0", "X-Stitch-Wait-S": "1"})
    assert r.status_code == 409 and r.json()["type"] == "WeightVersionPassed"
