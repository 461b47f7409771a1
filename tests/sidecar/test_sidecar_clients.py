"""What OpenAI clients see from the sidecar (fake engine, real HTTP, the official ``openai`` client).

Answers a retry cannot fix carry ``x-should-retry: false`` (the client does not retry them);
answers a retry can fix carry ``Retry-After`` (the client waits that long). An engine that
breaks off a stream (killed mid-answer) ends the client's stream with the stamp event and an
error event, which the client raises as ``openai.APIError``.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import make_view, wait_for


@pytest.fixture
def at_v1(sc_publisher, sc_start):
    """A sidecar at version 1 (version 0 has passed)."""
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    sidecar = sc_start(FakeEngine(token_delay_s=0.001))
    sidecar.wait_applied(1)
    return sidecar


def _rejected(sidecar, reason: str) -> float:
    m = re.search(
        rf'stitch_sidecar_requests_rejected_total\{{reason="{reason}"\}} (\S+)', sidecar.http.get("/metrics").text
    )
    return float(m.group(1)) if m else 0.0


def _client(sidecar, max_retries: int = 2) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sidecar.url}/v1", api_key="none", max_retries=max_retries, timeout=30)


def test_answers_a_retry_cannot_fix_are_not_retried(at_v1):
    client = _client(at_v1)
    with pytest.raises(openai.ConflictError) as passed:
        client.completions.create(model="fake", prompt="x", max_tokens=1, extra_headers={"X-Stitch-Exact-Version": "0"})
    assert (
        passed.value.response.headers["x-should-retry"] == "false"
        and passed.value.body["type"] == "WeightVersionPassed"
    )
    assert _rejected(at_v1, "WeightVersionPassed") == 1, (
        "the permanent 409 was retried"
    )  # a retry is a second rejection
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(
            model="fake", prompt="x", max_tokens=1, extra_body={"weight_version": {"min_version": -1}}
        )
    assert bad.value.response.headers["x-should-retry"] == "false" and _rejected(at_v1, "InvalidVersionConstraint") == 1
    with pytest.raises(openai.PermissionDeniedError) as forbidden:
        client.post("/load_lora_adapter", body={}, cast_to=object)
    assert forbidden.value.response.headers["x-should-retry"] == "false"
    answer = client.completions.create(
        model="fake", prompt="x", max_tokens=1, extra_headers={"X-Stitch-Exact-Version": "1"}
    )
    assert (answer.model_extra["weight_version_start"], answer.model_extra["weight_version_end"]) == (1, 1)


def test_answers_a_retry_can_fix_carry_retry_after(at_v1):
    client = _client(at_v1, max_retries=1)
    start = time.monotonic()
    with pytest.raises(openai.ConflictError) as not_yet:
        client.completions.create(
            model="fake",
            prompt="x",
            max_tokens=1,
            extra_headers={"X-Stitch-Min-Version": "5", "X-Stitch-Wait-S": "0.1"},
        )
    elapsed = time.monotonic() - start
    headers = not_yet.value.response.headers
    assert (
        not_yet.value.body["type"] == "WeightVersionNotReady"
        and headers["retry-after"] == "1"
        and headers["x-should-retry"] == "true"
    )
    assert _rejected(at_v1, "WeightVersionNotReady") == 2 and elapsed >= 1.0, "one retry, after Retry-After (1 s)"


def test_not_ready_503_is_retried_after_retry_after(sc_start):
    sidecar = sc_start(FakeEngine())  # nothing published: no verified version
    client = _client(sidecar, max_retries=1)
    with pytest.raises(openai.InternalServerError) as unavailable:
        client.completions.create(model="fake", prompt="x", max_tokens=1, extra_headers={"X-Stitch-Wait-S": "0"})
    assert unavailable.value.status_code == 503 and unavailable.value.response.headers["retry-after"] == "1"
    assert _rejected(sidecar, "NotReady") == 2


@pytest.mark.parametrize("chat", [False, True])
def test_an_engine_killed_mid_stream_ends_the_stream_with_an_error(at_v1, chat):
    """The fake engine drops the connection after 2 tokens (as a killed engine does)."""
    at_v1.engine.break_stream_after = 2
    client = _client(at_v1, max_retries=0)
    got = []
    with pytest.raises(openai.APIError) as broke:
        if chat:
            stream = client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=5, stream=True
            )
        else:
            stream = client.completions.create(model="fake", prompt="x", max_tokens=5, stream=True)
        got.extend(stream)  # appends each chunk as it comes, up to the error
    assert "broke off the stream" in broke.value.message and broke.value.body["type"] == "EngineUnavailable"
    assert len([c for c in got if c.choices]) == 2
    assert (got[-1].model_extra["weight_version_start"], got[-1].model_extra["weight_version_end"]) == (1, 1), (
        "the stamp event comes before the error"
    )
    with httpx.stream(
        "POST", f"{at_v1.url}/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True}, timeout=30
    ) as r:
        events = [e.strip()[len("data: ") :] for e in r.read().decode().split("\n\n") if e.strip()]
    assert (
        "[DONE]" not in events
        and json.loads(events[-1])["error"]["code"] == 503
        and json.loads(events[-2])["weight_version_end"] == 1
    )
    wait_for(lambda: at_v1.status()["requests_in_flight"] == 0, what="the broken-off requests released")
