"""Per-token version spans through the sidecar in front of a real SGLang (CPU, TP = 1): SGLang's own spans, normalised.

A ``/generate`` stream and a plain ``/v1/completions`` answer in flight across a commit ask for
``return_weight_versions``: each carries ``weight_versions`` with integer versions, split where
SGLang counted its output tokens at the commit (``b``, strictly inside the answer), and the
tokens before ``b`` are the old version's greedy tokens for the same prompt. An answer that
crossed nothing gets one span over all its tokens. (The plain OpenAI answer names no token ids:
its spans are checked for their split only.) A streamed ``/v1/completions`` crossing the same
commit (its chunks name no versions) is split at the count stitchboard's loader read in the
paused engine: the tokens before it are the old version's greedy tokens, the one at it the new
version's greedy continuation of the prompt and those tokens. So is each choice of a greedy
OpenAI stream of two prompts with ``n`` = 2 (SGLang gives each output its own rid: the mark
travels in ``custom_params`` and the scheduler's arrival order names the choice): the first
prompt's choices cross the commit, the second's finish before it (one span of the old version).

With ``salt_cache`` the same long prompt at three versions reuses nothing cached under another
version (SGLang's ``meta_info.cached_tokens``), equals bit for bit (token ids and logprobs) its
answer computed with nothing cached, and hits within its version; the old version's prefix stays
cached (the commit skipped ``/flush_cache``).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from stitchboard.bulletin.app import create_app as create_bulletin
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.container import RawTensor, read_safetensors
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.client import SidecarClient
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.fake_engine import copy_view
from tests.sidecar.sglang_helpers import SglangServer, require_sglang
from tests.sidecar.sidecar_helpers import AppServer, Publisher, mutate, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_sglang() -> None:
    require_sglang()


TOKENS = 64
STREAM_PROMPT = "Count from 1 to 50: 1, 2,"
PLAIN_PROMPT = "Once upon a time"


@contextmanager
def _serve(
    smollm2_dir: Path, engine: SglangServer, workdir: Path, **settings: object
) -> Iterator[tuple[httpx.Client, Publisher, str]]:
    bulletin = AppServer(create_bulletin(BulletinSettings(store=f"file://{workdir / 'store'}", poll_interval_s=0.05)))
    client = BulletinClient(bulletin.url, retries=1, backoff_s=0.01)
    publisher = Publisher(client, f"run-{uuid.uuid4().hex[:8]}", workdir)
    publisher.publish(read_safetensors(smollm2_dir / "model.safetensors")[1])
    config = SidecarSettings(
        bulletin=bulletin.url,
        run=publisher.run,
        engine="sglang",
        engine_url=engine.url,
        boot_version=0,
        handoff_dir=str(workdir / "handoff"),
        poll_wait_s=5.0,
        **settings,
    )  # type: ignore[arg-type]
    sidecar = AppServer(create_sidecar(config, client=client))
    http = httpx.Client(base_url=sidecar.url, timeout=300)
    try:
        with SidecarClient(sidecar.url) as sc:
            sc.wait_applied(0, 120)
        yield http, publisher, sidecar.url
    finally:
        http.close()
        sidecar.stop()
        client.close()
        bulletin.stop()


@pytest.fixture
def stack(
    smollm2_dir: Path, sglang_engine: SglangServer, sglang_workdir: Path
) -> Iterator[tuple[httpx.Client, Publisher, str]]:
    with _serve(smollm2_dir, sglang_engine, sglang_workdir) as served:
        yield served


def _generate_ids(http: httpx.Client, text: str) -> list[int]:
    r = http.post(
        "/generate",
        json={"text": text, "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}},
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _check(spans: list[dict], ids: list[int], old: list[int], start: int, version: int) -> int:
    assert (
        [s["version"] for s in spans] == [start, version]
        and spans[0]["start"] == 0
        and spans[0]["end"] == spans[1]["start"]
        and spans[1]["end"] == len(ids) == TOKENS
    ), spans
    b = spans[0]["end"]
    assert 0 < b < TOKENS and ids[:b] == old[:b], (
        f"the tokens before SGLang's boundary {b} are not the old version's greedy tokens"
    )
    return b


def test_sglang_spans_of_requests_crossing_a_commit(stack):
    http, publisher, _ = stack
    one = http.post(
        "/v1/completions",
        json={"model": "x", "prompt": PLAIN_PROMPT, "max_tokens": 3, "temperature": 0, "return_weight_versions": True},
    )
    assert one.status_code == 200 and one.json()["weight_versions"] == [{"version": 0, "start": 0, "end": 3}], one.text
    old_stream = _generate_ids(http, STREAM_PROMPT)
    plain: dict = {}
    body = {
        "model": "x",
        "prompt": PLAIN_PROMPT,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_weight_versions": True,
    }
    events: list[str] = []

    def stream() -> None:
        payload = {
            "text": STREAM_PROMPT,
            "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
            "stream": True,
            "return_weight_versions": True,
        }
        with http.stream("POST", "/generate", json=payload) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line[len("data: ") :])

    openai_events: list[dict] = []

    def openai_stream() -> None:
        payload = {
            "model": "x",
            "prompt": STREAM_PROMPT,
            "max_tokens": TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
            "return_weight_versions": True,
        }
        with http.stream("POST", "/v1/completions", json=payload) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    openai_events.append(json.loads(line[len("data: ") :]))

    threads = [
        threading.Thread(target=f, daemon=True)
        for f in (lambda: plain.setdefault("r", http.post("/v1/completions", json=body)), stream, openai_stream)
    ]
    for t in threads:
        t.start()
    # All admitted, and the streams' first tokens out (on a slow machine a commit before the first
    # decode step would leave every token under the new version: no split to check).
    wait_for(
        lambda: (
            http.get("/v1/stitch/status").json()["requests_in_flight"] == 3
            and len(events) >= 4
            and len(openai_events) >= 4
        ),
        120,
        "the requests decoding",
    )
    publisher.publish(mutate(publisher.views[-1], 5))
    for t in threads:
        t.join(180)
    final = json.loads(events[-2])
    assert events[-1] == "[DONE]" and (final["weight_version_start"], final["weight_version_end"]) == (0, 1), final
    b_stream = _check(final["weight_versions"], final["output_ids"], old_stream, 0, 1)
    answer = plain["r"].json()
    assert (answer["weight_version_start"], answer["weight_version_end"]) == (0, 1), answer
    spans = answer["weight_versions"]
    assert (
        [s["version"] for s in spans] == [0, 1]
        and spans[0]["start"] == 0
        and spans[0]["end"] == spans[1]["start"]
        and spans[1]["end"] == answer["usage"]["completion_tokens"] == TOKENS
    ), spans
    b_plain = spans[0]["end"]
    assert 0 < b_plain < TOKENS
    # SGLang's OpenAI stream names no versions: split at the count stitchboard's loader read in the paused engine.
    stamp = openai_events[-1]
    assert (stamp["weight_version_start"], stamp["weight_version_end"]) == (0, 1) and all(
        e.get("usage") is None for e in openai_events
    ), stamp
    ids = [t for e in openai_events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    b_openai = _check(stamp["weight_versions"], ids, old_stream, 0, 1)
    prompt_ids = openai_events[0]["choices"][0]["prompt_token_ids"]
    after = http.post(
        "/generate",
        json={"input_ids": prompt_ids + ids[:b_openai], "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
    )
    assert after.status_code == 200 and after.json()["output_ids"] == [ids[b_openai]], (
        "token b, the first after the commit, is not the new version's greedy continuation"
    )
    print(
        f"boundaries: SGLang's own: /generate stream {b_stream}, plain {b_plain}; counted: OpenAI stream {b_openai} "
        f"of {TOKENS}"
    )


LONG_PROMPT = " ".join(
    f"Item {i}: the harbour master counted {i * 7 % 13} boats and {i * 5 % 11} nets." for i in range(16)
)


def _long_answer(url: str, **body: object) -> tuple[dict, int]:
    payload = {
        "text": LONG_PROMPT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        **body,
    }
    r = httpx.post(f"{url}/generate", json=payload, timeout=300)
    assert r.status_code == 200, r.text
    info = r.json()["meta_info"]
    return {"ids": r.json()["output_ids"], "logprobs": info["output_token_logprobs"]}, info["cached_tokens"]


def test_sglang_salted_prefix_cache_never_reuses_kv_across_versions(smollm2_dir, sglang_engine, sglang_workdir):
    """salt_cache on SGLang: no commit flushes the radix cache, yet no answer reuses KV of another version."""
    (sglang_workdir / "salted").mkdir(exist_ok=True)
    with _serve(smollm2_dir, sglang_engine, sglang_workdir / "salted", salt_cache=True) as (_, publisher, url):
        answers = {}
        for v in range(3):
            if v:
                publisher.publish(mutate(publisher.views[-1], 20 + v))
                with SidecarClient(url) as sc:
                    sc.wait_applied(v, 120)
            first, first_hits = _long_answer(url)
            assert first_hits == 0, (
                f"version {v}: the long prompt reused {first_hits} tokens cached under another version"
            )
            again, again_hits = _long_answer(url)
            assert again_hits > 0 and again["ids"] == first["ids"], (
                f"version {v}: the second answer did not hit the version's cache ({again_hits}) or differs"
            )
            fresh, fresh_hits = _long_answer(url, cache_salt=f"oracle-{uuid.uuid4().hex}")
            assert fresh_hits == 0 and fresh == first, (
                f"version {v}: the salted answer differs from the one computed with nothing cached"
            )
            if v:
                _, old_hits = _long_answer(sglang_engine.url, cache_salt=f"stitch-v{v - 1}")
                assert old_hits > 0, "the commit flushed the radix cache: the old version's prefix is gone"
            answers[v] = first
        assert len({repr(a) for a in answers.values()}) == 3, "each version answers differently"


SHORT_PROMPT = "The capital of France is"  # greedy " Paris." then more: stopped at the "." token


def _negated_logits(view: dict[str, RawTensor]) -> dict[str, RawTensor]:
    # The final norm's weight with its sign bits flipped: the (tied, bias-free) LM head's logits are the
    # old ones negated, so after any prefix the new version's greedy token is never the old version's.
    out = copy_view(view)
    out["model.norm.weight"].bits[...] ^= np.uint16(0x8000)
    return out


def test_sglang_openai_stream_with_two_outputs_per_prompt_splits_each_choice_at_its_count(stack):
    """Two prompts, n = 2 (greedy): SGLang gives each of the 4 outputs a fresh rid; the sidecar's
    mark in ``custom_params`` and the scheduler's arrival order name each output's choice. The
    first prompt's two choices cross a commit to weights whose greedy token always differs from
    the old one's, so the engine's count at the pause is exactly where a choice's tokens first
    leave the old version's greedy tokens: each split must be there. The second prompt's choices
    stop before the commit (finished inside the engine: one span of the old version)."""
    http, publisher, _ = stack
    old = _generate_ids(http, STREAM_PROMPT)
    short = http.post(
        "/generate", json={"text": SHORT_PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    ).json()["output_ids"]
    assert short[1] not in old, "the stop token of the short prompt is among the long one's tokens"
    events: list[dict] = []

    def stream() -> None:
        payload = {
            "model": "x",
            "prompt": [STREAM_PROMPT, SHORT_PROMPT],
            "max_tokens": TOKENS,
            "temperature": 0,
            "stop_token_ids": [short[1]],
            "stream": True,
            "n": 2,
            "return_token_ids": True,
            "return_weight_versions": True,
        }
        with http.stream("POST", "/v1/completions", json=payload) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: ") :]))

    def choices(index: int) -> list[dict]:
        return [c for e in list(events) for c in e.get("choices") or [] if c.get("index") == index]

    def tokens(index: int) -> list[int]:
        return [t for c in choices(index) for t in c.get("token_ids") or []]

    def ready() -> bool:
        return min(len(tokens(0)), len(tokens(1))) >= 4 and all(
            any(c.get("finish_reason") for c in choices(i)) for i in (2, 3)
        )

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    wait_for(ready, 120, "the first prompt's outputs decoding, the second's finished")
    publisher.publish(_negated_logits(publisher.views[-1]))
    thread.join(180)
    stamp = events[-1]
    assert (stamp["weight_version_start"], stamp["weight_version_end"]) == (0, 1) and stamp[
        "weight_versions"
    ] is None, stamp
    spans = {c["index"]: c["weight_versions"] for c in stamp["choices"]}
    assert sorted(spans) == [0, 1, 2, 3], stamp
    for index in (2, 3):
        assert tokens(index) == short and spans[index] == [{"version": 0, "start": 0, "end": 2}], (
            index,
            spans[index],
            tokens(index),
        )
    bounds = []
    for index in (0, 1):
        ids = tokens(index)
        b = _check(spans[index], ids, old, 0, 1)
        assert ids[b] != old[b], (
            f"choice {index}: split at {b}, but the old version's greedy tokens go on after it (the engine counted "
            "more)"
        )
        prompt_ids = next(c["prompt_token_ids"] for c in choices(index) if c.get("prompt_token_ids"))
        after = http.post(
            "/generate",
            json={"input_ids": prompt_ids + ids[:b], "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        )
        assert after.status_code == 200 and after.json()["output_ids"] == [ids[b]], (
            f"choice {index}: token {b}, the first after the commit, is not the new version's greedy continuation"
        )
        bounds.append(b)
    print(
        f"2 prompts x n = 2 OpenAI stream: boundaries of the crossing choices {bounds} of {TOKENS}; the others "
        "stopped at 2 tokens"
    )
