"""SGLang's routes through the sidecar, over a fake engine that answers as SGLang does.

What a real SGLang cannot be made to do on demand: answer under a version the sidecar did not
hold (a restarted engine's ``"default"``, an engine ahead of the sidecar). The same routes on a
real SGLang: ``test_sglang_gate.py``. Real bulletin, real sidecar, real HTTP over loopback.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import pytest

from tests.sidecar.conftest import Sidecar
from tests.sidecar.fake_engine import CONTROL_ROUTES
from tests.sidecar.fake_sglang import SGLANG_CONTROL_ROUTES, FakeSglang
from tests.sidecar.sidecar_helpers import make_view, wait_for


@pytest.fixture
def sg_start(sc_start) -> Callable[..., Sidecar]:
    """Factory: a sidecar with ``engine=sglang`` over a :class:`FakeSglang` (``sc_start`` with that setting)."""
    return lambda engine, **overrides: sc_start(engine, engine="sglang", **overrides)


@pytest.fixture
def at_v0(sc_publisher, sg_start) -> Sidecar:
    sc_publisher.publish(make_view(0))
    sidecar = sg_start(FakeSglang(token_delay_s=0.01), engine_call_timeout_s=3.0)
    sidecar.wait_applied(0)
    return sidecar


def _events(text: str) -> list[str]:
    return [e.strip()[len("data: ") :] for e in text.split("\n\n") if e.strip()]


def _in_thread(fn):
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("result", fn()), daemon=True)
    t.start()
    return t, out


def test_control_routes_are_refused_and_reads_forwarded(at_v0):
    for route in SGLANG_CONTROL_ROUTES + CONTROL_ROUTES:
        for method in ("POST", "GET"):
            r = at_v0.http.request(method, route, json={})
            assert r.status_code == 403 and r.json()["type"] == "RouteForbidden", (method, route)
    assert at_v0.engine.http_control_calls == []
    assert at_v0.http.get("/v1/models").json()["data"][0]["id"] == "fake"
    assert at_v0.http.post("/tokenize", json={"prompt": "ab"}).json() == {"tokens": [97, 98]}


def test_generate_is_gated_and_stamped(at_v0, sc_publisher):
    r = at_v0.http.post(
        "/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 2}, "weight_version": {"exact_version": 0}},
    )
    assert r.status_code == 200 and r.headers["x-stitch-version-start"] == r.headers["x-stitch-version-end"] == "0"
    body = r.json()
    assert (body["weight_version_start"], body["weight_version_end"], body["meta_info"]["weight_version"]) == (
        0,
        0,
        "0",
    )
    assert "weight_version" not in body["echo_body"], "the constraint field is stripped before the engine sees it"
    batch = at_v0.http.post("/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}}).json()
    assert [(b["weight_version_start"], b["weight_version_end"]) for b in batch] == [(0, 0), (0, 0)]
    r = at_v0.http.post(
        "/generate", json={"text": "x"}, headers={"X-Stitch-Min-Version": "1", "X-Stitch-Wait-S": "0.1"}
    )
    assert r.status_code == 409 and r.json()["type"] == "WeightVersionNotReady"
    sc_publisher.step(1)
    at_v0.wait_applied(1)
    r = at_v0.http.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Stitch-Exact-Version": "0"}
    )
    assert r.status_code == 409 and r.json()["type"] == "WeightVersionPassed"
    body = at_v0.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()
    assert (body["weight_version_start"], body["weight_version_end"], body["metadata"]["weight_version"]) == (1, 1, "1")


def test_generate_stream_stamps_its_final_chunk(at_v0):
    with at_v0.http.stream(
        "POST", "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3}, "stream": True}
    ) as r:
        assert r.headers["x-stitch-version-start"] == "0" and "x-stitch-version-end" not in r.headers
        events = _events(r.read().decode())
    assert events[-1] == "[DONE]" and len(events) == 4, "no extra event: the final chunk carries the stamps"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("weight_version_start" not in c for c in chunks[:-1])
    assert (
        chunks[-1]["weight_version_start"],
        chunks[-1]["weight_version_end"],
        chunks[-1]["meta_info"]["finish_reason"]["type"],
    ) == (0, 0, "length")
    with at_v0.http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
        events = _events(r.read().decode())
    assert (
        events[-1] == "[DONE]"
        and json.loads(events[-2])["choices"] == []
        and json.loads(events[-2])["weight_version_end"] == 0
    )


def test_answer_under_a_version_the_sidecar_did_not_hold_is_withheld(at_v0):
    at_v0.engine.report = "default"  # as a restarted SGLang names its weights
    for route, body in [
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ]:
        r = at_v0.http.post(route, json=body)
        assert (
            r.status_code == 503
            and r.json()["type"] == "AnswerVersionMismatch"
            and r.json()["reported_version"] == "default"
        ), (route, r.text)
        assert r.headers["x-should-retry"] == "true"
    with at_v0.http.stream(
        "POST", "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3}, "stream": True}
    ) as r:
        events = _events(r.read().decode())
    assert len(events) == 2 and "[DONE]" not in events, "no engine event under the wrong version is forwarded"
    assert (
        json.loads(events[0])["weight_version_end"] == 0
        and json.loads(events[1])["error"]["type"] == "AnswerVersionMismatch"
    )
    assert (
        'stitch_sidecar_requests_rejected_total{reason="AnswerVersionMismatch"} 3.0' in at_v0.http.get("/metrics").text
    )


def test_engine_ahead_of_the_sidecar_waits_for_its_commit(at_v0, sc_publisher):
    at_v0.engine.report = "1"  # the engine names version 1 before the sidecar marked it applied
    t, out = _in_thread(
        lambda: at_v0.http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
    )
    wait_for(lambda: at_v0.engine.completed == 1, what="the engine answered")
    sc_publisher.step(1)
    t.join(30)
    body = out["result"].json()
    assert (body["weight_version_start"], body["weight_version_end"]) == (0, 1), body
    at_v0.engine.report = "2"  # and never catches up: withheld after engine_call_timeout_s
    r = at_v0.http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 503 and r.json()["type"] == "AnswerVersionMismatch"


def test_openai_stream_is_vouched_for_by_an_engine_check(at_v0, sc_publisher):
    engine = at_v0.engine
    engine.token_delay_s = 0.05
    t, out = _in_thread(
        lambda: at_v0.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, "stream": True})
    )
    wait_for(lambda: engine.first_tokens == 1, what="the stream's first token")
    engine.restart(sc_publisher.views[0])  # same bits, but a new instance: the sidecar verified nothing of it
    t.join(30)
    events = _events(out["result"].text)
    assert "[DONE]" not in events and json.loads(events[-1])["error"]["type"] == "AnswerVersionMismatch"
