"""Per-token version spans and the version-salted prefix cache, through the sidecar in front of a real vLLM (CPU).

* Spans: a streamed (``n`` 2, both greedy: spans per choice, each split at its own child request's count)
  and a plain greedy completion in flight across a commit ask for ``return_weight_versions``;
  their spans split at the engine's own count of output tokens at the pause (``b``). The
  committed version is the held one with the final norm's sign flipped, so its logits are the
  old ones negated: the old weights' greedy tokens are the new weights' least likely and the
  other way round. Each output's tokens, ranked in the new version's distribution (one
  teacher-forced pass, ``prompt_logprobs``), must then rank in the bottom half before ``b`` and
  in the top 5 from ``b`` on: which weights made every token, robust to the last-bit differences
  of vLLM's CPU GEMMs between batch shapes (the outputs decode together, the check runs alone; a
  near-tie may move a token's rank by one or two, never across the vocabulary).
* Salt (``salt_cache``): one long prompt at three versions. At each version its first answer
  reuses nothing cached under another version (the engine's prefix-cache hit counter) and is
  bit for bit (token ids and logprobs) the answer computed with nothing cached (a salt no request
  ever used), its second answer hits the cache and has the same tokens (its logprobs differ in
  the last bits: vLLM's CPU prefill of the suffix alone runs other GEMM shapes than the whole
  prompt's, with or without stitchboard); the old version's blocks are still cached (the commit
  did not reset: a request sent to the engine with the old salt hits them).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from tests.sidecar.commit_overlap import LongRequests
from tests.support.vllm_server import require_vllm

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea,"
#: Two greedy choices (vLLM refuses ``n`` > 1 at temperature 0; top-k 1 samples the argmax).
TWO_GREEDY = {"n": 2, "temperature": 1.0, "top_k": 1}
LONG_PROMPT = " ".join(
    f"Item {i}: the harbour master counted {i * 7 % 13} boats and {i * 5 % 11} nets." for i in range(24)
)


@pytest.fixture(autouse=True)
def _needs_vllm() -> None:
    require_vllm()


def _complete(url: str, model: str, prompt: str | list[int], tokens: int, **body) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **body,
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text
    return r.json()


class SpanRequests(LongRequests):
    """:class:`LongRequests` asking for spans and token ids."""

    def __init__(self, url: str, model: str, prompt: str, tokens: int) -> None:
        self.extra = {"return_weight_versions": True, "return_token_ids": True}
        super().__init__(url, model, prompt, tokens)

    def _stream(self) -> None:
        body = {**self.body, **self.extra, **TWO_GREEDY, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", self.url, json=body, timeout=600) as r:
            if r.status_code != 200:
                self.failures.append(f"streamed: {r.status_code} {r.read().decode(errors='replace')[:2000]}")
                return
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line[6:]))

    def _plain(self) -> None:
        self.plain = httpx.post(self.url, json={**self.body, **self.extra}, timeout=600)
        if self.plain.status_code != 200:
            self.failures.append(f"plain: {self.plain.status_code} {self.plain.text[:2000]}")


def _ranks(url: str, model: str, prompt_ids: list[int], ids: list[int], version: int) -> list[int]:
    """The rank of each of ``ids`` (after ``prompt_ids``) in version ``version``'s next-token
    distribution, teacher-forced in one pass (vLLM's ``prompt_logprobs`` carry each prompt token's rank)."""
    answer = _complete(url, model, prompt_ids + ids, 1, prompt_logprobs=1, weight_version={"exact_version": version})
    entries = answer["choices"][0]["prompt_logprobs"][len(prompt_ids) :]
    return [entry[str(t)]["rank"] for entry, t in zip(entries, ids, strict=True)]


def _check_crossing(spans: list[dict], ids: list[int], v: int, ranks: list[int], vocab: int) -> int:
    """Spans ``[v: 0..b), [v + 1: b..n)``; tokens before ``b`` ranked in the bottom half by version
    ``v + 1`` (made by the old weights), tokens from ``b`` on in its top 5 (made by the new)."""
    assert (
        [s["version"] for s in spans] == [v, v + 1]
        and spans[0]["start"] == 0
        and spans[0]["end"] == spans[1]["start"]
        and spans[1]["end"] == len(ids)
    ), spans
    b = spans[0]["end"]
    assert 0 < b < len(ids), spans
    early = [i for i in range(b) if ranks[i] <= vocab // 2]
    assert not early, (
        f"tokens {early[:10]} before the boundary {b} rank high under version {v + 1}: they were not made by version "
        f"{v}"
    )
    late = [i for i in range(b, len(ids)) if ranks[i] > 5]
    assert not late, (
        f"tokens {late[:10]} from the boundary {b} on are not among version {v + 1}'s 5 likeliest: they were not made "
        "by it"
    )
    return b


def test_spans_of_requests_crossing_a_commit_split_at_the_engines_count(vllm_run_engine, vllm_run, vllm_sidecars):
    """Both requests cross the commit: spans [v: 0..b), [v+1: b..n) with b the engine's count at the pause."""
    sidecar = vllm_sidecars(vllm_run_engine.url)
    model, tokens = vllm_run_engine.model, 120  # the sync applies within ~10 of them on 2 cores
    v = vllm_run.latest
    sidecar.wait_applied(v)
    single = _complete(sidecar.url, model, PROMPT, 4, return_weight_versions=True)
    assert single["weight_versions"] == [{"version": v, "start": 0, "end": 4}] and single["weight_version_start"] == v
    pair = _complete(sidecar.url, model, PROMPT, 4, return_weight_versions=True, **TWO_GREEDY)
    assert (
        pair["weight_versions"] is None
        and [c["weight_versions"] for c in pair["choices"]] == [[{"version": v, "start": 0, "end": 4}]] * 2
    ), pair
    prompts = [PROMPT, "def fibonacci(n):"]  # several prompts of one completion: an output each
    several = _complete(sidecar.url, model, prompts, 4, return_weight_versions=True, **TWO_GREEDY)
    assert several["weight_versions"] is None and sorted(c["index"] for c in several["choices"]) == [0, 1, 2, 3], (
        several
    )
    assert [c["weight_versions"] for c in several["choices"]] == [[{"version": v, "start": 0, "end": 4}]] * 4, several
    body = {
        "model": model,
        "prompt": prompts,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "return_weight_versions": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{sidecar.url}/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        streamed = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert streamed[-1]["choices"] == [
        {"index": i, "weight_versions": [{"version": v, "start": 0, "end": 3}]} for i in range(2)
    ], streamed[-1]
    prompt_ids = _complete(sidecar.url, model, PROMPT, 1, echo=True)["choices"][0]["prompt_token_ids"]
    norm = vllm_run.trainer.model.model.norm.weight
    with torch.no_grad():  # the next version: the final norm's sign flipped (logits negated)
        norm.neg_()
    vllm_run.trainer.steps += 1  # other bits: a step of their own (the bulletin refuses them under a published step)
    held = vllm_run.publish_held()
    try:
        try:
            held.wait_ready()  # encoded and uploaded: the trainer's norm goes back for the module's next tests
        finally:
            with torch.no_grad():
                norm.neg_()
        requests = SpanRequests(sidecar.url, model, PROMPT, tokens)
        requests.wait_generating(sidecar.status)
    except BaseException:
        held.abort()
        raise
    assert held.commit() == v + 1
    sidecar.wait_applied(v + 1)
    crossed = requests.alive()
    requests.join()
    assert not requests.failures, requests.failures
    if not crossed:
        pytest.fail(
            f"the requests ended before version {v + 1} was applied ({len(requests.events)} events): the commit did "
            "not overlap them"
        )

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    plain = requests.plain.json()
    plain_ids = plain["choices"][0]["token_ids"]
    b_plain = _check_crossing(
        plain["weight_versions"], plain_ids, v, _ranks(sidecar.url, model, prompt_ids, plain_ids, v + 1), vocab
    )
    events = requests.events
    stamp = events[-1]
    assert stamp["weight_versions"] is None and [c["index"] for c in stamp["choices"]] == [0, 1], stamp
    b_stream = []
    for choice in stamp["choices"]:
        ids = [
            t
            for e in events[:-1]
            for c in e.get("choices", [])
            if c["index"] == choice["index"]
            for t in c.get("token_ids") or []
        ]
        b_stream.append(
            _check_crossing(
                choice["weight_versions"], ids, v, _ranks(sidecar.url, model, prompt_ids, ids, v + 1), vocab
            )
        )
    assert (stamp["weight_version_start"], stamp["weight_version_end"]) == (v, v + 1)
    print(f"boundaries: plain {b_plain}, stream (n 2) {b_stream} of {tokens} tokens")


def _engine_counter(engine_url: str, name: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=30).text
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^vllm:{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE)
    )


def _long_answer(url: str, model: str, engine_url: str, **body) -> tuple[dict, float]:
    hits = _engine_counter(engine_url, "prefix_cache_hits")
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": LONG_PROMPT,
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": 5,
            "return_token_ids": True,
            **body,
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    time.sleep(0.5)  # the engine's counters are updated just after its answer
    return {"ids": choice["token_ids"], "logprobs": choice["logprobs"]}, _engine_counter(
        engine_url, "prefix_cache_hits"
    ) - hits


def test_salted_prefix_cache_never_reuses_kv_across_versions(vllm_run_engine, vllm_run, vllm_sidecars):
    """salt_cache: no commit resets the cache, yet no answer reuses KV of another version's weights."""
    sidecar = vllm_sidecars(vllm_run_engine.url, salt_cache="true")
    model, engine = vllm_run_engine.model, vllm_run_engine.url
    answers = {}
    for i in range(3):
        vllm_run.step()  # a real AdamW step at each version (the one before may be another test's)
        v = vllm_run.latest
        sidecar.wait_applied(v)
        first, first_hits = _long_answer(sidecar.url, model, engine)
        assert first_hits == 0, f"version {v}: the long prompt reused {first_hits} tokens cached under another version"
        again, again_hits = _long_answer(sidecar.url, model, engine)
        assert again_hits > 0 and again["ids"] == first["ids"], (
            f"version {v}: the second answer did not hit the version's cache ({again_hits}) or differs"
        )
        fresh, fresh_hits = _long_answer(sidecar.url, model, engine, cache_salt=f"oracle-{uuid.uuid4().hex}")
        assert fresh_hits == 0 and fresh == first, (
            f"version {v}: the salted answer differs from the one computed with nothing cached"
        )
        if i:
            _, old_hits = _long_answer(engine, model, engine, cache_salt=f"stitch-v{v - 1}")
            assert old_hits > 0, "the commit reset the prefix cache: the old version's blocks are gone"
            _long_answer(engine, model, engine, cache_salt=f"oracle-{uuid.uuid4().hex}")  # keep nothing else
        answers[v] = first
    assert len({repr(a) for a in answers.values()}) == 3, "each version answers differently"
