"""Hostile requests at the sidecar, over real HTTP (fake engine): media types in any letter case,
dot segments and percent-encoded paths, oversized bodies.

Paths are sent with :mod:`http.client`, which sends them byte for byte (httpx would resolve
the dot segments on the client side, which is not what a hostile client does).
"""

from __future__ import annotations

import http.client
import json

import httpx
import pytest

from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import make_view


@pytest.fixture
def at_v0(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine(token_delay_s=0.001), max_body_bytes=4096)
    sidecar.wait_applied(0)
    return sidecar


def _raw(
    sidecar, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    url = httpx.URL(sidecar.url)
    conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        return r.status, {
            "headers": {k.lower(): v for k, v in r.getheaders()},
            "body": json.loads(data) if data.startswith(b"{") else data,
        }
    finally:
        conn.close()


def test_weight_version_in_the_body_is_honoured_whatever_the_media_type_case(at_v0):
    """The engine (FastAPI) reads these bodies as JSON, so the sidecar must read their
    weight_version field too: 409 after the wait, never served by version 0."""
    body = json.dumps({"prompt": "x", "max_tokens": 1, "weight_version": {"min_version": 3, "wait_s": 0.1}}).encode()
    for content_type in [
        "Application/JSON",
        "APPLICATION/JSON; charset=utf-8",
        "application/json;charset=UTF-8",
        "application/vnd.stitch+JSON",
        None,
    ]:
        status, answer = _raw(
            at_v0, "POST", "/v1/completions", body, {"Content-Type": content_type} if content_type else {}
        )
        assert status == 409 and answer["body"]["type"] == "WeightVersionNotReady", (content_type, answer)
    assert at_v0.engine.started == 0


DOT_PATHS = [
    "/v1/models/../../server_info",
    "/v1/models/%2e%2e/%2e%2e/server_info",
    "/v1/models/%2E%2E/%2E%2E/server_info",
    "/v1/models/.%2e/.%2E/server_info",
    "/v1/models/%252e%252e/%252e%252e/server_info",
    "/v1/models/..%2f..%2fserver_info",
    "/v1/models/./fake",
    "/v1/completions/../../pause",
]


def test_dot_segments_are_refused_before_the_allow_list(at_v0):
    for path, method in [(p, m) for p in DOT_PATHS for m in ("GET", "POST")]:
        status, answer = _raw(
            at_v0, method, path, b"{}" if method == "POST" else None, {"Content-Type": "application/json"}
        )
        assert (
            status == 400 and answer["body"]["type"] == "InvalidPath" and answer["headers"]["x-should-retry"] == "false"
        ), (method, path, status, answer)
    assert at_v0.engine.http_control_calls == []


def test_paths_are_matched_as_normalised(at_v0):
    status, answer = _raw(at_v0, "GET", "/v1//models")
    assert status == 200 and answer["body"]["data"][0]["id"] == "fake"
    status, answer = _raw(
        at_v0,
        "POST",
        "//v1/completions",
        json.dumps({"prompt": "x"}).encode(),
        {"Content-Type": "application/json", "X-Stitch-Min-Version": "4", "X-Stitch-Wait-S": "0.1"},
    )
    assert status == 409, "a doubled slash reaches the gate, not the engine ungated"
    status, answer = _raw(at_v0, "GET", "/%73erver_info")  # percent-encoded letters name the same (forbidden) route
    assert status == 403 and answer["body"]["type"] == "RouteForbidden"
    assert at_v0.engine.http_control_calls == [] and at_v0.engine.started == 0


def test_bodies_over_the_limit_get_413(at_v0):
    big = json.dumps({"prompt": "x" * 5000}).encode()
    r = at_v0.http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert (
        r.status_code == 413
        and r.json()["type"] == "BodyTooLarge"
        and r.json()["limit_bytes"] == 4096
        and r.headers["x-should-retry"] == "false"
    )

    def chunks():  # no Content-Length: the cap applies to the bytes received
        for _ in range(10):
            yield b" " * 1000

    r = at_v0.http.post("/tokenize", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["type"] == "BodyTooLarge"
    assert at_v0.engine.started == 0
    r = at_v0.http.post("/v1/completions", json={"prompt": "x" * 1000, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["weight_version_end"] == 0
    assert 'stitch_sidecar_requests_rejected_total{reason="BodyTooLarge"} 2.0' in at_v0.http.get("/metrics").text
