"""Routing replay through the sidecar in front of a real vLLM (CPU) serving the tiny Qwen3-MoE.

One engine (``A``, the worker extension loaded: the ``tiny-qwen3-moe`` TP 1 engine the oracle
tests in test_vllm_moe.py leave at version 0's bits, ``moe_engines``) serves the preset behind a
sidecar following a run on a loopback bulletin; versions change only the routers (every layer's
``mlp.gate.weight`` redrawn from a seed), so each version routes differently.

* The routing returned for a prompt (every position of prompt and output, SGLang's
  ``sglext.routed_experts``) changes with a version whose routers changed; streamed and plain
  answers carry the same rows (``/v1/completions`` and ``/v1/chat/completions``, asked by body
  field or header). That it equals a fresh engine's at the same version is checked by the
  oracle tests (test_vllm_moe.py, at TP 1: the fresh engine started there from the pulled
  version, an AdamW-trained one), which saves this module an engine start.
* A prompt already in the prefix cache is routed again (its rows are those of the uncached
  answer; the engine's prefix-cache hit counter does not move).
* A plain and a streamed request crossing a commit carry the old version for the rows read
  before the engine's count at the pause and the new one after it; the old rows equal the old
  version's routing of the same tokens and the first new row the new version's.
* A dense model is refused with a 400 naming it (in test_sidecar_vllm.py, on the session's SmolLM2 engine).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.sidecar.commit_overlap import HeldPublish, LatchedClient, LongRequests
from tests.sidecar.moe_fixtures import ASK_ROUTING, ROUTING_PROMPT, MoeEngines, complete, moe_engines, routed_rows  # noqa: F401 - fixture
from tests.sidecar.vllm_fixtures import SidecarProcess
from tests.support.vllm_server import VllmServer, require_vllm

pytestmark = pytest.mark.slow

PROMPT = ROUTING_PROMPT
ASK = ASK_ROUTING
#: Output tokens of the requests that cross a commit (they fit the shared engine's context,
#: ``MOE_CONTEXT``): two at once take ~7 s on 2 cores (1,948 took 23 s), against the ~0.3 s from
#: the commit's release to its version applied (it landed at their ~13th token), so the stream is
#: still generating when it lands.
CROSSING_TOKENS = 600


@pytest.fixture(autouse=True)
def _needs_vllm() -> None:
    require_vllm()


class RouterRun:
    """A bulletin on loopback and one run whose versions redraw the MoE routers (trainer SDK).

    Args:
        model_dir: the tiny MoE checkpoint (version 0).
        folder: the bulletin's store and the publisher's work files.
    """

    def __init__(self, model_dir: Path, folder: Path) -> None:
        from safetensors.torch import load_file

        from stitchboard.bulletin.settings import BulletinSettings
        from stitchboard.trainer_client.publisher import Publisher
        from tests.bulletin.bulletin_helpers import ProcessServer

        self.run, self.model_dir, self.folder = "moe-routing", model_dir, folder
        self.bulletin = ProcessServer(BulletinSettings(store=f"file://{folder / 'store'}", poll_interval_s=0.05))
        self.client = LatchedClient(self.bulletin.url, retries=1, backoff_s=0.05)
        self.publisher = Publisher(self.bulletin.url, self.run, client=self.client, workdir=folder / "publisher")
        self.views = {0: load_file(str(model_dir / "model.safetensors"))}
        self.publisher.publish(self.views[0], step=0)

    def view(self, version: int) -> dict:
        """Version ``version``'s tensors: version 0's with every router redrawn (seed = version)."""
        import torch

        if version not in self.views:
            gen = torch.Generator().manual_seed(version)
            view = dict(self.views[0])
            for name in sorted(n for n in view if n.endswith(".mlp.gate.weight")):
                view[name] = (torch.randn(view[name].shape, generator=gen) * 0.5).to(torch.bfloat16)
            self.views[version] = view
        return self.views[version]

    def publish(self) -> int:
        """Publish the next version; returns it."""
        version = self.publisher.last_version + 1
        return self.publisher.publish(self.view(version), step=version).version

    def close(self) -> None:
        self.publisher.close()
        self.client.close()
        self.bulletin.kill()


class Routing:
    """The module's run and engine: ``a`` behind ``sidecar``."""

    def __init__(self, run: RouterRun, a: VllmServer, sidecar: SidecarProcess) -> None:
        self.run, self.a, self.sidecar = run, a, sidecar


@pytest.fixture(scope="module")
def routing(moe_engines: MoeEngines) -> Iterator[Routing]:  # noqa: F811
    from stitchboard.demo.moe_models import moe_preset_checkpoint

    # In memory where there is /dev/shm: the bulletin's and sidecar's fsyncs waited up to 5 s behind
    # the disk's writeback on this kind of VM while both engines ran, longer than the crossing test's stream.
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(prefix="stitch-moe-routing-", dir=shm if shm.is_dir() else None))
    run = RouterRun(moe_preset_checkpoint("tiny-qwen3-moe"), folder)
    sidecar = None
    try:
        a = moe_engines("tiny-qwen3-moe", 1)  # the oracle tests' engine (test_vllm_moe.py), or a new one
        sidecar = SidecarProcess(run, a.url, folder, {"STITCH_SIDECAR_BOOT_VERSION": "0"})
        sidecar.proc.wait_healthy(300)
        sidecar.wait_applied(0)
        yield Routing(run, a, sidecar)
    finally:
        if sidecar is not None:
            sidecar.stop()
        moe_engines.release("tiny-qwen3-moe", 1)
        run.close()
        shutil.rmtree(folder, ignore_errors=True)


def _streamed(url: str, model: str, prompt: str, tokens: int, **body) -> tuple[list[int], dict]:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        **body,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=600) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert not any("usage" in e for e in events), "the usage chunk the sidecar asked for was sent on"
    return [t for e in events[:-1] for c in e.get("choices", []) for t in c.get("token_ids") or []], events[-1]


def _prefix_hits(engine_url: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=30).text
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^vllm:prefix_cache_hits_total(?:{[^}]*})? ([0-9.e+]+)$", text, re.MULTILINE)
    )


def test_routing_changes_with_the_router_and_streamed_equals_plain(routing: Routing):
    """Version 0, then 1: full-sequence rows change with the routers, streamed = plain, cached prompts routed again."""
    sidecar, model, tokens = routing.sidecar, routing.a.model, 12
    plain = complete(sidecar.url, model, PROMPT, tokens, **ASK)
    n_prompt = plain["usage"]["prompt_tokens"]
    rows0 = routed_rows(plain)
    assert rows0.shape == (n_prompt + tokens - 1, 2, 2) and plain["routed_experts_weight_versions"] == [
        {"version": 0, "start": 0, "end": n_prompt + tokens - 1}
    ]
    assert ((rows0 >= 0) & (rows0 < 8)).all() and (rows0[:, :, 0] != rows0[:, :, 1]).all()
    ids, stamp = _streamed(sidecar.url, model, PROMPT, tokens, **ASK)
    assert ids == plain["choices"][0]["token_ids"] and np.array_equal(routed_rows(stamp), rows0)
    assert stamp["routed_experts_weight_versions"] == plain["routed_experts_weight_versions"]
    tail = complete(sidecar.url, model, PROMPT, tokens, routed_experts_start_len=n_prompt, **ASK)
    assert np.array_equal(routed_rows(tail), rows0[n_prompt:]) and tail["routed_experts_start_len"] == n_prompt
    chat_body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    chat = httpx.post(
        f"{sidecar.url}/v1/chat/completions",
        headers={"X-Stitch-Return-Routed-Experts": "1"},
        json=chat_body,
        timeout=600,
    ).json()
    chat_rows = chat["usage"]["prompt_tokens"] + tokens - 1
    assert routed_rows(chat).shape == (chat_rows, 2, 2) and chat["routed_experts_weight_versions"] == [
        {"version": 0, "start": 0, "end": chat_rows}
    ]
    with httpx.stream(
        "POST", f"{sidecar.url}/v1/chat/completions", json={**chat_body, **ASK, "stream": True}, timeout=600
    ) as r:
        chat_stamp = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert np.array_equal(routed_rows(chat_stamp), routed_rows(chat)), (
        "a streamed chat answer routed otherwise than the plain one"
    )

    complete(sidecar.url, model, PROMPT, 1)  # caches the prompt's blocks
    hits = _prefix_hits(routing.a.url)
    again = complete(sidecar.url, model, PROMPT, tokens, **ASK)
    time.sleep(0.5)  # the engine's counters are updated just after its answer
    assert _prefix_hits(routing.a.url) == hits, "a request asking for its prompt's routing read the prefix cache"
    assert np.array_equal(routed_rows(again), rows0)

    assert routing.run.publish() == 1
    sidecar.wait_applied(1)
    one = complete(sidecar.url, model, PROMPT, tokens, **ASK)
    rows1 = routed_rows(one)
    assert one["routed_experts_weight_versions"] == [{"version": 1, "start": 0, "end": n_prompt + tokens - 1}]
    changed = float((rows1 != rows0).any(axis=(1, 2)).mean())
    assert changed > 0.5, f"only {changed:.0%} of the positions route differently after the routers changed"
    print(f"{len(rows1)} positions: {changed:.0%} routed differently after the routers changed")


class RoutedRequests(LongRequests):
    """:class:`LongRequests` asking for routing, spans and token ids."""

    def __init__(self, url: str, model: str, prompt: str, tokens: int) -> None:
        self.extra = {**ASK, "return_weight_versions": True, "return_token_ids": True}
        super().__init__(url, model, prompt, tokens)

    def _stream(self) -> None:
        self.body = {**self.body, **self.extra}
        super()._stream()

    def _plain(self) -> None:
        self.plain = httpx.post(self.url, json={**self.body, **self.extra}, timeout=600)
        if self.plain.status_code != 200:
            self.failures.append(f"plain: {self.plain.status_code} {self.plain.text[:2000]}")

    def wait_streaming(self, timeout_s: float = 300.0) -> None:
        """Wait until the stream's first tokens arrived (the tiny model's 900 tokens take ~3 s:
        waiting for both to be counted in flight too let the stream end first in a CI-like run)."""
        deadline = time.monotonic() + timeout_s
        while len(self.events) < 3 and time.monotonic() < deadline:
            assert self.threads[0].is_alive(), f"the stream ended before it was generating: {self.failures}"
            time.sleep(0.02)
        assert len(self.events) >= 3, f"the stream sent no tokens in {timeout_s} s"


def _row_versions(spans: list[dict], n_prompt: int) -> list[dict]:
    """The versions of the rows of an answer whose output tokens have ``spans``: output token ``i``
    came from the forward pass that read position ``n_prompt - 1 + i`` (the prompt's rows from the first's)."""
    return [
        {"version": s["version"], "start": 0 if i == 0 else n_prompt - 1 + s["start"], "end": n_prompt - 1 + s["end"]}
        for i, s in enumerate(spans)
    ]


def _cross_a_commit(routing: Routing, tokens: int) -> tuple[int, dict, RoutedRequests] | None:
    """Version ``v``'s plain answer, then a stream and a plain request sent while version ``v + 1``
    is committed (held at its commit until the stream generates); returns ``(v, before,
    requests)``, or None when the stream ended before the engine applied ``v + 1``."""
    sidecar, run = routing.sidecar, routing.run
    v = run.publisher.last_version
    sidecar.wait_applied(v)
    before = complete(sidecar.url, routing.a.model, PROMPT, tokens, **ASK)
    held = HeldPublish(run.client, run.publish)
    try:
        held.wait_ready()
        requests = RoutedRequests(sidecar.url, routing.a.model, PROMPT, tokens)
        requests.wait_streaming()
    except BaseException:
        held.abort()
        raise
    released = time.monotonic()
    assert held.commit() == v + 1
    sidecar.wait_applied(v + 1)
    applied = time.monotonic() - released
    requests.join()
    assert not requests.failures, requests.failures
    print(
        f"version {v + 1} applied {applied:.2f} s after its commit was released; requests done "
        f"{time.monotonic() - released:.2f} s after"
    )
    if [s["version"] for s in requests.events[-1]["weight_versions"]] == [v]:
        return None
    return v, before, requests


#: Tries at a stream still generating when the commit is applied. The engines run niced
#: (``engine_nice``): at the default priority, this CPU build generating the tiny MoE left the
#: sidecar's process almost no CPU (a 0.19 s loop took 7.1 s), so its staging and pause landed
#: after the ~8 s streams. Niced, the version is applied ~0.2-0.3 s after its commit is released.
CROSSING_TRIES = 2


def test_requests_crossing_a_commit_carry_each_rows_version(routing: Routing):
    """Rows read before the engine's count at the pause carry version v, later ones v + 1 (the
    stream crosses the commit; the plain answer, sent beside it, is checked the same way when it
    crossed too, and in any case its rows' versions follow its spans). A stream that ended before
    the commit reached the engine crossed nothing: the try is repeated on the next version, and
    the test fails when none of :data:`CROSSING_TRIES` crossed."""
    sidecar, model, tokens = routing.sidecar, routing.a.model, CROSSING_TOKENS
    prompt_ids = complete(sidecar.url, model, PROMPT, 1, echo=True)["choices"][0]["prompt_token_ids"]
    for attempt in range(CROSSING_TRIES):
        crossed = _cross_a_commit(routing, tokens)
        if crossed is not None:
            break
        print(f"try {attempt + 1}: the stream ended before the commit was applied")
    else:
        pytest.fail(
            f"in {CROSSING_TRIES} tries the stream ended before the commit reached the engine: the sidecar's sync is "
            f"slower than a {CROSSING_TOKENS}-token stream"
        )
    v, before, requests = crossed
    old_ids, old_rows, n_prompt = (
        before["choices"][0]["token_ids"],
        routed_rows(before),
        before["usage"]["prompt_tokens"],
    )
    stamp = requests.events[-1]
    stream_ids = [t for e in requests.events[:-1] for c in e.get("choices", []) for t in c.get("token_ids") or []]
    plain = requests.plain.json()
    assert [s["version"] for s in stamp["weight_versions"]] == [v, v + 1], stamp["weight_versions"]
    for name, answer, ids in (("plain", plain, plain["choices"][0]["token_ids"]), ("stream", stamp, stream_ids)):
        spans, rows = answer["weight_versions"], routed_rows(answer)
        assert (
            answer["routed_experts_weight_versions"] == _row_versions(spans, n_prompt)
            and len(rows) == n_prompt + tokens - 1
        ), (name, spans)
        if len(spans) == 1:
            print(f"{name}: did not cross the commit, rows all version {spans[0]['version']}")
            continue
        b = spans[0]["end"]  # output tokens [0, b) were made under v: read at positions < n_prompt - 1 + b
        cut = n_prompt - 1 + b
        assert ids[:b] == old_ids[:b] and np.array_equal(rows[:cut], old_rows[:cut]), (
            f"{name}: the rows before the commit are not version {v}'s"
        )
        after = complete(sidecar.url, model, prompt_ids + ids[:b], 1, routed_experts_start_len=cut, **ASK)
        assert np.array_equal(rows[cut : cut + 1], routed_rows(after)), (
            f"{name}: the first row after the commit is not version {v + 1}'s"
        )
        print(f"{name}: rows [0, {cut}) version {v}, [{cut}, {len(rows)}) version {v + 1}")
