"""The sidecar's gating and stamps in front of a real SGLang server (CPU, TP = 1), the engine the SGLang modules share.

A real bulletin and an in-process sidecar (``engine=sglang``) over a real SGLang 0.5.23 serving
SmolLM2; versions are published trainer-free (the checkpoint's bits, then ~1 % of every
tensor's elements changed by an ulp or so per version). The tests run in file order and each
publishes the versions it needs:

* held / 409 / exact-version gating with stamps on native ``/generate`` and the OpenAI routes;
* a ``/generate`` stream and an OpenAI completion in flight across a commit finish normally
  (never aborted), stamped start != end, and SGLang's own spans show both versions;
* the same long prompt across three versions, its KV from the version before in the radix cache
  and a stream in flight during each commit: greedy with logprobs equals a fresh SGLang at each
  version (a plain server booted from the checkpoint with the engine, moved to each version by
  SGLang's own ``/update_weights_from_disk``, which loads the full checkpoint and flushes its
  cache), and the versions' answers differ;
* SGLang's control routes get 403 and reach nothing;
* an engine whose version is changed behind the sidecar's back is never served as the held one.
"""

from __future__ import annotations

import json
import shutil
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stitchboard.bulletin.app import create_app as create_bulletin
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.proto.container import read_safetensors
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.client import SidecarClient
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.fake_sglang import SGLANG_CONTROL_ROUTES
from tests.sidecar.sglang_helpers import SglangServer, SharedSglang, require_sglang
from tests.sidecar.sidecar_helpers import AppServer, Publisher, mutate, wait_for
from tests.sidecar.vllm_fixtures import copy_model_files

pytestmark = pytest.mark.slow

#: ~250 tokens, reused across versions: its KV from an older version, if reused, would show in the logprobs.
LONG_PROMPT = "Notes. " + " ".join(
    f"Item {i}: the {w} river flows past the old mill and the quiet village."
    for i, w in enumerate(["north", "south", "east", "west", "red", "blue", "green"] * 2)
)


@dataclass
class Stack:
    """The module's bulletin, publisher, SGLang engine and sidecar, and the oracle server."""

    publisher: Publisher
    engine_url: str
    sidecar: AppServer
    http: httpx.Client
    workdir: Path
    model_dir: Path
    fresh_url: str  # a plain SGLang (no stitchboard loader) booted from the checkpoint: the oracle

    def applied(self, version: int) -> None:
        with SidecarClient(self.sidecar.url) as client:
            client.wait_applied(version, 120)


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, sglang_workdir: Path, shared_sglang: SharedSglang) -> Iterator[Stack]:
    require_sglang()
    bulletin = AppServer(
        create_bulletin(BulletinSettings(store=f"file://{sglang_workdir / 'store'}", poll_interval_s=0.05))
    )
    client = BulletinClient(bulletin.url, retries=1, backoff_s=0.01)
    publisher = Publisher(client, f"run-{uuid.uuid4().hex[:8]}", sglang_workdir)
    publisher.publish(read_safetensors(smollm2_dir / "model.safetensors")[1])
    fresh = SglangServer(
        smollm2_dir, sglang_workdir / "fresh.log", loader=False
    )  # starts while the shared engine is taken
    try:
        engine = shared_sglang.take(smollm2_dir)
        fresh.wait_ready()
        settings = SidecarSettings(
            bulletin=bulletin.url,
            run=publisher.run,
            engine="sglang",
            engine_url=engine.url,
            boot_version=0,
            handoff_dir=str(sglang_workdir / "handoff"),
            poll_wait_s=5.0,
            request_wait_s=5.0,
            retry_after_s=1,
        )
        sidecar = AppServer(create_sidecar(settings, client=client))
        http = httpx.Client(base_url=sidecar.url, timeout=300)
        try:
            stack = Stack(publisher, engine.url, sidecar, http, sglang_workdir, smollm2_dir, fresh.url)
            stack.applied(0)
            yield stack
        finally:
            http.close()
            sidecar.stop()
    finally:
        client.close()
        bulletin.stop()
        fresh.stop()  # fails the test if the sgl_kernel stand-in was called (the shared engine: when it stops)


def _generate(http: httpx.Client, text: str, tokens: int, headers: dict | None = None, **extra) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}, **extra}
    return http.post("/generate", json=body, headers=headers or {})


def _in_thread(fn):
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("result", fn()), daemon=True)
    t.start()
    return t, out


def _stream(http: httpx.Client, text: str, tokens: int) -> tuple[threading.Thread, list[str], dict]:
    """A greedy ``/generate`` stream in a thread: the thread, the events' payloads as they come, and its headers (once
    sent)."""
    events: list[str] = []
    out: dict = {}

    def run() -> None:
        with http.stream(
            "POST",
            "/generate",
            json={
                "text": text,
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
                "stream": True,
            },
        ) as r:
            out["headers"] = r.headers
            for line in r.iter_lines():
                if line:
                    events.append(line[len("data: ") :])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, events, out


def _in_flight(stack: Stack) -> int:
    return stack.http.get("/v1/stitch/status").json()["requests_in_flight"]


def _publish(stack: Stack, seed: int) -> int:
    stack.publisher.publish(mutate(stack.publisher.views[-1], seed))
    return len(stack.publisher.views) - 1


def test_gating_and_stamps_on_generate_and_openai_routes(stack: Stack):
    http = stack.http
    r = _generate(http, "The capital of France is", 2, weight_version={"exact_version": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["weight_version_start"], body["weight_version_end"], body["meta_info"]["weight_version"]) == (
        0,
        0,
        "0",
    )
    assert r.headers["x-stitch-version-start"] == r.headers["x-stitch-version-end"] == "0"
    r = http.post(
        "/v1/chat/completions",
        json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"X-Stitch-Exact-Version": "0"},
    )
    assert r.status_code == 200 and (r.json()["weight_version_start"], r.json()["metadata"]["weight_version"]) == (
        0,
        "0",
    ), r.text
    r = http.post(
        "/v1/completions",
        json={"model": "x", "prompt": "x", "max_tokens": 1},
        headers={"X-Stitch-Min-Version": "1", "X-Stitch-Wait-S": "0.2"},
    )
    assert r.status_code == 409 and r.json()["type"] == "WeightVersionNotReady" and r.json()["applied_version"] == 0
    held_t, held = _in_thread(
        lambda: _generate(http, "Count: 1, 2,", 2, {"X-Stitch-Min-Version": "1", "X-Stitch-Wait-S": "120"})
    )
    wait_for(
        lambda: http.get("/v1/stitch/status").json()["requests_waiting"] == 1, what="the request for version 1 held"
    )
    version = _publish(stack, seed=1)
    held_t.join(120)
    body = held["result"].json()
    assert (body["weight_version_start"], body["weight_version_end"], body["meta_info"]["weight_version"]) == (
        version,
        version,
        str(version),
    ), body
    r = http.post(
        "/v1/completions",
        json={"model": "x", "prompt": "x", "max_tokens": 1},
        headers={"X-Stitch-Exact-Version": "0", "X-Stitch-Wait-S": "30"},
    )
    assert r.status_code == 409 and r.json()["type"] == "WeightVersionPassed"
    r = http.post(
        "/v1/completions",
        json={"model": "x", "prompt": "x", "max_tokens": 1, "weight_version": {"exact_version": version}},
    )
    assert (
        r.status_code == 200
        and r.json()["metadata"]["weight_version"] == str(version)
        and r.json()["weight_version_end"] == version
    )


def test_requests_in_flight_across_a_commit_finish_with_both_versions(stack: Stack):
    http = stack.http
    start = len(stack.publisher.views) - 1
    plain_t, plain = _in_thread(
        lambda: http.post(
            "/v1/completions",
            json={"model": "x", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
        )
    )
    stream_t, events, streamed = _stream(http, "Count from 1 to 50: 1, 2,", 24)
    wait_for(lambda: len(events) >= 2 and _in_flight(stack) == 2, 120, "both requests decoding")
    version = _publish(stack, seed=2)
    stack.applied(version)
    plain_t.join(180)
    stream_t.join(180)
    body = plain["result"].json()
    assert body["choices"][0]["finish_reason"] == "length" and (
        body["weight_version_start"],
        body["weight_version_end"],
    ) == (start, version), body
    assert [s["version"] for s in body["metadata"]["weight_versions"]] == [str(start), str(version)], (
        "SGLang's own spans: tokens from both versions"
    )
    assert streamed["headers"]["x-stitch-version-start"] == str(start) and events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 24
    assert (final["weight_version_start"], final["weight_version_end"]) == (start, version)
    assert [s["version"] for s in final["meta_info"]["weight_versions"]] == [str(start), str(version)]


def _greedy_long(http: httpx.Client, headers: dict | None = None) -> dict:
    r = _generate(http, LONG_PROMPT, 4, headers, return_logprob=True, top_logprobs_num=5)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return {
        "ids": r.json()["output_ids"],
        "logprobs": meta["output_token_logprobs"],
        "top": meta["output_top_logprobs"],
        "cached": meta["cached_tokens"],
    }


def test_long_prompt_across_three_commits_equals_a_fresh_server(stack: Stack):
    """The long prompt's KV from the version before sits in the radix cache at every commit, and a
    stream (another prompt) is in flight then, so a plain ``/flush_cache`` would fail; the long
    prompt asked again at the new version must be computed afresh under it. (A cache hit changes
    SGLang's logprobs even under the same weights on the CPU, so fresh answers are compared with
    the fresh server's uncached ones.)"""
    http = stack.http
    answers: dict[int, dict] = {}
    assert _greedy_long(http)["ids"]
    assert _greedy_long(http)["cached"] > 0, "the long prompt is in the engine's radix cache before the first commit"
    for seed in (11, 12, 13):
        before = len(stack.publisher.views) - 1
        stream_t, events, _ = _stream(http, "def fibonacci(n):", 24)
        wait_for(lambda: len(events) >= 2, 120, "the stream decoding")  # noqa: B023 - waited for in this iteration
        version = _publish(stack, seed)
        stack.applied(version)
        stream_t.join(180)
        final = json.loads(events[-2])
        assert events[-1] == "[DONE]" and final["meta_info"]["finish_reason"]["type"] == "length"
        assert (final["weight_version_start"], final["weight_version_end"]) == (before, version)
        assert [s["version"] for s in final["meta_info"]["weight_versions"]] == [str(before), str(version)], (
            "the stream was in flight during the commit"
        )
        answers[version] = _greedy_long(http, {"X-Stitch-Exact-Version": str(version)})
        assert answers[version].pop("cached") == 0, (
            f"version {version}: the long prompt reused KV cached before the commit"
        )
    assert len({json.dumps(a) for a in answers.values()}) == 3, "each version answers differently"
    with httpx.Client(base_url=stack.fresh_url, timeout=300) as fresh:
        for v, answer in answers.items():
            folder = stack.workdir / f"checkpoint-v{v}"
            save_checkpoint(folder, stack.publisher.views[v])
            copy_model_files(stack.model_dir, folder)
            r = fresh.post("/update_weights_from_disk", json={"model_path": str(folder)})
            assert r.status_code == 200 and r.json()["success"], r.text
            reference = _greedy_long(fresh)
            assert reference.pop("cached") == 0
            assert reference == answer, f"version {v}: the patched engine differs from a fresh SGLang"
            shutil.rmtree(folder, ignore_errors=True)


def test_control_routes_are_refused_on_a_real_sglang(stack: Stack):
    held = len(stack.publisher.views) - 1
    for route in SGLANG_CONTROL_ROUTES:
        r = stack.http.post(route, json={"new_version": "99", "abort_all_requests": True, "model_path": "/nonexistent"})
        assert r.status_code == 403 and r.json()["type"] == "RouteForbidden", route
    assert httpx.get(f"{stack.engine_url}/model_info").json()["weight_version"] == str(held), (
        "no control call reached the engine"
    )
    assert stack.http.get("/model_info").json()["weight_version"] == str(held)
    body = _generate(stack.http, "Hi", 1).json()
    assert (body["weight_version_start"], body["meta_info"]["weight_version"]) == (held, str(held))


def test_version_changed_behind_the_sidecar_is_never_served_as_held(stack: Stack):
    held = len(stack.publisher.views) - 1
    r = httpx.post(f"{stack.engine_url}/update_weight_version", json={"new_version": "99", "abort_all_requests": False})
    assert r.status_code == 200, r.text
    r = _generate(stack.http, "Hi", 1, {"X-Stitch-Wait-S": "0"})
    assert r.status_code == 503 and r.json()["type"] in ("AnswerVersionMismatch", "NotReady"), r.text
    body = wait_for(
        lambda: (a := _generate(stack.http, "Hi", 1, {"X-Stitch-Wait-S": "5"})).status_code == 200 and a.json(),
        240,
        "the sidecar serving again",
    )
    assert (body["weight_version_start"], body["meta_info"]["weight_version"]) == (held, str(held)), (
        "back at the held version, set by the sidecar"
    )
