"""The gated proxy over real HTTP: holds, 409s, stamps (plain and streamed), 403s, 503s, aborts.

Every test runs a real bulletin, a sidecar and a fake engine on loopback; versions are
published trainer-free (views of RawTensors diffed with the codec).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.sidecar.fake_engine import CONTROL_ROUTES, FakeEngine, fingerprint
from tests.sidecar.sidecar_helpers import make_view, wait_for


@pytest.fixture
def at_v0(sc_publisher, sc_start):
    """A sidecar whose fake engine holds version 0 (loaded from the anchor)."""
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine(token_delay_s=0.01))
    sidecar.wait_applied(0)
    return sidecar


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised by the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _sse_events(text: str) -> list[str]:
    return [e.strip()[len("data: ") :] for e in text.split("\n\n") if e.strip()]


def test_min_version_held_then_served_with_stamps(at_v0, sc_publisher):
    t, out = _in_thread(
        lambda: at_v0.http.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers={"X-Stitch-Min-Version": "1", "X-Stitch-Wait-S": "60"},
        )
    )
    wait_for(
        lambda: at_v0.status()["requests_waiting"] == 1,
        what="the request for version 1 held while version 0 is applied",
    )
    assert t.is_alive() and at_v0.engine.completed == 0 and at_v0.status()["requests_in_flight"] == 0
    sc_publisher.step(1)
    t.join(60)
    assert not t.is_alive(), "the held request was not served within 60 s of version 1's publish"
    r = out["result"]
    assert r.status_code == 200
    body = r.json()
    assert body["weight_version_start"] == body["weight_version_end"] == 1
    assert r.headers["x-stitch-version-start"] == r.headers["x-stitch-version-end"] == "1"
    assert fingerprint(sc_publisher.views[1]) in body["choices"][0]["text"]
    assert (
        "stitch_sidecar_requests_held_total 1.0" in at_v0.http.get("/metrics").text
        and at_v0.status()["requests_waiting"] == 0
    )


def test_body_constraint_is_stripped_and_honoured(at_v0, sc_publisher):
    r = at_v0.http.post(
        "/v1/chat/completions", json={"messages": [], "max_tokens": 1, "weight_version": {"min_version": 0}}
    )
    assert r.status_code == 200
    assert "weight_version" not in r.json()["echo_body"]
    r = at_v0.http.post("/v1/completions", json={"prompt": "x", "weight_version": {"min_version": 3, "wait_s": 0.1}})
    assert r.status_code == 409
    assert r.json()["min_version"] == 3


def test_short_wait_gets_409_with_versions(at_v0):
    r = at_v0.http.post(
        "/v1/completions", json={"prompt": "x"}, headers={"X-Stitch-Min-Version": "5", "X-Stitch-Wait-S": "0.2"}
    )
    assert r.status_code == 409
    body = r.json()
    assert body["type"] == "WeightVersionNotReady"
    assert body["applied_version"] == 0 and body["target_version"] == 0 and body["min_version"] == 5
    assert at_v0.engine.completed == 0
    assert (
        'stitch_sidecar_requests_rejected_total{reason="WeightVersionNotReady"} 1.0' in at_v0.http.get("/metrics").text
    )


def test_exact_version_that_has_passed_gets_409(at_v0, sc_publisher):
    sc_publisher.step(1)
    at_v0.wait_applied(1)
    start = time.monotonic()
    r = at_v0.http.post(
        "/v1/completions", json={"prompt": "x"}, headers={"X-Stitch-Exact-Version": "0", "X-Stitch-Wait-S": "60"}
    )
    assert r.status_code == 409 and r.json()["type"] == "WeightVersionPassed"
    assert time.monotonic() - start < 30, "a passed pin is refused at once, not held"
    assert (
        at_v0.http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Stitch-Exact-Version": "1"}
        ).json()["weight_version_end"]
        == 1
    )


def test_bad_constraints_get_400(at_v0):
    for headers, body in [
        ({"X-Stitch-Min-Version": "abc"}, {}),
        ({"X-Stitch-Min-Version": "-1"}, {}),
        ({}, {"weight_version": {"min": 1}}),
        ({"X-Stitch-Min-Version": "2"}, {"weight_version": {"min_version": 3}}),
        ({"X-Stitch-Min-Version": "3", "X-Stitch-Exact-Version": "2"}, {}),
    ]:
        r = at_v0.http.post("/v1/completions", json={"prompt": "x", **body}, headers=headers)
        assert r.status_code == 400 and r.json()["type"] == "InvalidVersionConstraint", (headers, body, r.text)


def test_requests_in_flight_across_a_commit_complete_with_both_stamps(at_v0, sc_publisher):
    engine = at_v0.engine
    engine.token_delay_s = (
        0.05  # 400 tokens: 20 s, ample for a publish and commit even on a loaded machine; sped up once it is applied
    )
    fp0 = engine.fp
    plain_t, plain = _in_thread(lambda: at_v0.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 400}))
    stream_t, streamed = _in_thread(
        lambda: at_v0.http.post("/v1/chat/completions", json={"messages": [], "max_tokens": 400, "stream": True})
    )
    wait_for(lambda: engine.fp == fp0 and at_v0.status()["requests_in_flight"] == 2, what="two requests in flight")
    wait_for(lambda: engine.first_tokens == 2, what="both requests' first token from version 0")
    sc_publisher.step(1)
    at_v0.wait_applied(1)
    engine.token_delay_s = 0.001
    plain_t.join(60)
    stream_t.join(60)
    assert not plain_t.is_alive() and not stream_t.is_alive(), "the requests did not complete within 60 s of the commit"
    body = plain["result"].json()
    assert (body["weight_version_start"], body["weight_version_end"]) == (0, 1)
    text = body["choices"][0]["text"]
    fp1 = fingerprint(sc_publisher.views[1])
    assert fp0 in text and fp1 in text and text.index(fp0) < text.index(fp1), (
        "tokens before the commit from v0, after it from v1"
    )
    assert text.count("@") == 400, "no token lost across the pause"
    events = _sse_events(streamed["result"].text)
    assert streamed["result"].headers["x-stitch-version-start"] == "0"
    stamp = json.loads(events[-2])
    assert (stamp["weight_version_start"], stamp["weight_version_end"]) == (0, 1)
    assert engine.count("pause") == engine.count("resume") == 2  # anchor load + this commit
    assert engine.aborted == 0


def test_streaming_events_pass_through_and_end_with_the_stamp(at_v0):
    with at_v0.http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-stitch-version-start"] == "0"
        assert "x-stitch-version-end" not in r.headers
        text = r.read().decode()
    events = _sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"].split("@")[0] for c in chunks[:-1]] == [f" t{i}" for i in range(5)]
    assert chunks[-1] == {
        "id": chunks[0]["id"],
        "object": "text_completion",
        "created": 1,
        "model": "fake",
        "choices": [],
        "weight_version_start": 0,
        "weight_version_end": 0,
    }


def test_first_event_arrives_before_the_stream_ends(at_v0):
    at_v0.engine.token_delay_s = 0.5  # 6 tokens: the last event comes 2.5 s of engine time after the first
    arrived: list[tuple[str, float]] = []
    with at_v0.http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 6, "stream": True}) as r:
        for line in r.iter_lines():
            if line:
                arrived.append((line, time.monotonic()))
    assert arrived[0][0].startswith("data: ") and arrived[-1][0] == "data: [DONE]"
    assert arrived[0][1] < arrived[-1][1] - 1.0, "events are forwarded as they come, not buffered until the stream ends"


def test_control_routes_are_refused(at_v0):
    for route in CONTROL_ROUTES + ["/v1/load_lora_adapter", "/server_info", "/engine/pause"]:
        r = at_v0.http.post(route, json={})
        assert r.status_code == 403 and r.json()["type"] == "RouteForbidden", route
    assert at_v0.engine.http_control_calls == []
    assert at_v0.http.get("/v1/models").json()["data"][0]["id"] == "fake"
    assert at_v0.http.post("/tokenize", json={"prompt": "ab"}).json() == {"tokens": [97, 98]}
    assert "fake_engine_completed_total" in at_v0.http.get("/engine/metrics").text


def test_engine_down_gets_503_with_retry_after(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    engine = FakeEngine()
    engine.url = "http://127.0.0.1:9"  # nothing listens: the adapter works, the engine's HTTP server is down
    sidecar = sc_start(engine)
    sidecar.wait_applied(0)
    r = sidecar.http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["type"] == "EngineUnavailable"
    assert r.headers["retry-after"] == "1"


def test_health_and_not_ready_before_the_first_version(sc_publisher, sc_start):
    sidecar = sc_start(FakeEngine())
    r = sidecar.http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "starting"
    r = sidecar.http.post("/v1/completions", json={"prompt": "x"}, headers={"X-Stitch-Wait-S": "0.1"})
    assert r.status_code == 503 and r.json()["type"] == "NotReady" and "retry-after" in r.headers
    sc_publisher.publish(make_view(0))
    sidecar.wait_applied(0)
    body = sidecar.http.get("/health").json()
    lease = body.pop("lease")
    assert body == {"applied_version": 0, "state": "idle", "status": "ok"}
    assert lease["held"] and lease["holder"] == lease["owner"] and lease["holder_expires_in_s"] > 0
    metrics = sidecar.http.get("/metrics").text
    for line in (
        "stitch_sidecar_applied_version 0.0",
        "stitch_sidecar_lag_versions 0.0",
        'stitch_sidecar_pause_seconds_count{route="anchor"} 1.0',
        "stitch_sidecar_apply_seconds_count 1.0",
    ):
        assert line in metrics
    assert float(metrics.split("\nstitch_sidecar_bytes_fetched_total ")[1].split()[0]) > 0


def test_client_disconnect_aborts_the_upstream_request(at_v0):
    engine = at_v0.engine
    engine.token_delay_s = 0.05
    with (
        httpx.Client(base_url=at_v0.url) as c,
        c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True}) as r,
    ):
        next(r.iter_lines())
    wait_for(lambda: engine.aborted == 1, what="the streamed request aborted at the engine")
    body = json.dumps({"prompt": "x", "max_tokens": 200}).encode()
    with socket.create_connection(
        ("127.0.0.1", httpx.URL(at_v0.url).port)
    ) as sock:  # a plain request whose client leaves once the engine works on it
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\nContent-Length: "
            b"%d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(lambda: engine.started == 2, what="the plain request started at the engine")
    wait_for(lambda: engine.aborted == 2, what="the plain request aborted at the engine")
    wait_for(lambda: at_v0.status()["requests_in_flight"] == 0, what="in-flight count back to 0")
    assert engine.completed == 0


def test_client_that_leaves_while_held_is_not_forwarded(at_v0, sc_publisher):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{at_v0.url}/v1/completions", json={"prompt": "x"}, headers={"X-Stitch-Min-Version": "1"}, timeout=0.3
        )
    sc_publisher.step(1)
    at_v0.wait_applied(1)
    time.sleep(0.2)
    assert at_v0.engine.completed == 0 and at_v0.engine.aborted == 0
    assert at_v0.status()["requests_in_flight"] == 0
