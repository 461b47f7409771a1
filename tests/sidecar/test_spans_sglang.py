"""Per-token version spans through the sidecar in front of a real SGLang (CPU, TP = 1): SGLang's own spans, normalised.

A ``/generate`` stream and a plain ``/v1/completions`` answer in flight across a commit ask for
``return_weight_versions``: each carries ``weight_versions`` with integer versions, split where
SGLang counted its output tokens at the commit (``b``, strictly inside the answer), and the
tokens before ``b`` are the old version's greedy tokens for the same prompt. An answer that
crossed nothing gets one span over all its tokens. (The OpenAI answer names no token ids: its
spans are checked for their split only.)
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stitchboard.bulletin.app import create_app as create_bulletin
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.container import read_safetensors
from stitchboard.sidecar.app import create_app as create_sidecar
from stitchboard.sidecar.client import SidecarClient
from stitchboard.sidecar.settings import SidecarSettings
from tests.sidecar.sglang_helpers import SglangServer, require_sglang
from tests.sidecar.sidecar_helpers import AppServer, Publisher, mutate, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_sglang() -> None:
    require_sglang()


TOKENS = 64
STREAM_PROMPT = "Count from 1 to 50: 1, 2,"
PLAIN_PROMPT = "Once upon a time"


@pytest.fixture
def stack(smollm2_dir: Path, sglang_engine: SglangServer, sglang_workdir: Path) -> Iterator[tuple[httpx.Client, Publisher, str]]:
    bulletin = AppServer(create_bulletin(BulletinSettings(store=f"file://{sglang_workdir / 'store'}", poll_interval_s=0.05)))
    client = BulletinClient(bulletin.url, retries=1, backoff_s=0.01)
    publisher = Publisher(client, f"run-{uuid.uuid4().hex[:8]}", sglang_workdir)
    publisher.publish(read_safetensors(smollm2_dir / "model.safetensors")[1])
    settings = SidecarSettings(bulletin=bulletin.url, run=publisher.run, engine="sglang", engine_url=sglang_engine.url, boot_version=0, handoff_dir=str(sglang_workdir / "handoff"), poll_wait_s=5.0)
    sidecar = AppServer(create_sidecar(settings, client=client))
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


def _generate_ids(http: httpx.Client, text: str) -> list[int]:
    r = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _check(spans: list[dict], ids: list[int], old: list[int], start: int, version: int) -> int:
    assert [s["version"] for s in spans] == [start, version] and spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == len(ids) == TOKENS, spans
    b = spans[0]["end"]
    assert 0 < b < TOKENS and ids[:b] == old[:b], f"the tokens before SGLang's boundary {b} are not the old version's greedy tokens"
    return b


def test_sglang_spans_of_requests_crossing_a_commit(stack):
    http, publisher, _ = stack
    one = http.post("/v1/completions", json={"model": "x", "prompt": PLAIN_PROMPT, "max_tokens": 3, "temperature": 0, "return_weight_versions": True})
    assert one.status_code == 200 and one.json()["weight_versions"] == [{"version": 0, "start": 0, "end": 3}], one.text
    old_stream = _generate_ids(http, STREAM_PROMPT)
    plain: dict = {}
    body = {"model": "x", "prompt": PLAIN_PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "return_weight_versions": True}
    plain_t = threading.Thread(target=lambda: plain.setdefault("r", http.post("/v1/completions", json=body)), daemon=True)
    events: list[str] = []

    def stream() -> None:
        payload = {"text": STREAM_PROMPT, "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}, "stream": True, "return_weight_versions": True}
        with http.stream("POST", "/generate", json=payload) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line[len("data: ") :])

    stream_t = threading.Thread(target=stream, daemon=True)
    plain_t.start()
    stream_t.start()
    # Both admitted, and the stream's first tokens out (on a slow machine a commit before the first
    # decode step would leave every token under the new version: no split to check).
    wait_for(lambda: http.get("/v1/stitch/status").json()["requests_in_flight"] == 2 and len(events) >= 4, 120, "both requests decoding")
    publisher.publish(mutate(publisher.views[-1], 5))
    plain_t.join(180)
    stream_t.join(180)
    final = json.loads(events[-2])
    assert events[-1] == "[DONE]" and (final["weight_version_start"], final["weight_version_end"]) == (0, 1), final
    b_stream = _check(final["weight_versions"], final["output_ids"], old_stream, 0, 1)
    answer = plain["r"].json()
    assert (answer["weight_version_start"], answer["weight_version_end"]) == (0, 1), answer
    spans = answer["weight_versions"]
    assert [s["version"] for s in spans] == [0, 1] and spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == answer["usage"]["completion_tokens"] == TOKENS, spans
    b_plain = spans[0]["end"]
    assert 0 < b_plain < TOKENS
    print(f"SGLang's boundaries: stream {b_stream}, plain {b_plain} of {TOKENS}")
