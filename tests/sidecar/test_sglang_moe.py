"""MoE expert tensors patched in place on real SGLang (CPU): the bit-exact oracle through the adapter.

The tiny Qwen3-MoE preset (expert width 80: SGLang's CPU path pads it to 96 at TP = 1, so every
expert's gate and up rows and down columns have zero padding that is never addressed) is trained
with real AdamW steps on the CPU and published by the trainer SDK under the checkpoint's
per-expert names (:class:`tests.sidecar.moe_fixtures.MoeRun`). Patches between the published
versions (``cond``, encoded with the codec from ``stitchboard pull``'s folders) go through the
adapter and stitchboard's loader into the engine's fused ``w13_weight`` / ``w2_weight``
(:mod:`stitchboard.sidecar.engines.sglang.experts`): two full steps in one catch-up commit, then
a step touching a single expert of a single layer. The engine's greedy tokens and logprobs then
equal those of a fresh SGLang started from the pulled folder of the last version and differ from
version 0's; every tensor's checksum, read through the map in checkpoint coordinates, equals the
manifest's.

Routing replay on SGLang's own ``return_routed_experts`` (the capturer stitchboard's loader
installs, :mod:`stitchboard.sidecar.engines.sglang.routing`): on both engines, a request's
``sglext.routed_experts`` (prompt and output rows, cache salted) is the same streamed and plain,
changes once the routers changed, and the patched engine's equals the fresh engine's (started
with the loader too, which installs the capturer at its first call). A request generating while
the routers' version is committed (retracted in the pause, its sequence computed again on
resume) answers, for the positions before SGLang's own span boundary, the routing of the old
version that its tokens were sampled from (the loader keeps each position's first routing), and
the new version's from the boundary on.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.proto.container import RawTensor
from stitchboard.proto.diff import diff_views
from stitchboard.sidecar.engines.sglang.adapter import SglangEngine
from stitchboard.sidecar.errors import ApplyRefusedError
from tests.sidecar.moe_fixtures import MoeRun
from tests.sidecar.sglang_helpers import SglangServer, require_sglang
from tests.support import lease
from tests.support.vllm_server import PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.engine]

#: Tensor classes the first versions must change (substring of the checkpoint name).
CLASSES = {"experts": ".experts.", "router": ".gate.weight", "attention": ".self_attn.", "embedding": "embed_tokens"}


def patch_file(folder: Path, base: dict[str, RawTensor], target: dict[str, RawTensor], name: str) -> list[str]:
    """``base`` -> ``target`` encoded (cond) into ``folder/name``; returns ``[path]``."""
    path = folder / name
    path.write_bytes(diff_views(base, target, "cond").patch)
    return [str(path)]


def commit(engine: SglangEngine, steps: list[tuple[list[str], int, int]]) -> dict:
    """What the sidecar does for one plan: check while serving, pause, write, flush, resume."""
    engine.stage_patches(steps)
    engine.pause()
    try:
        report = engine.commit_staged(steps[-1][2])
        engine.reset_prefix_cache()
    finally:
        engine.resume()
    return report


def redraw_routers(run: MoeRun, seed: int) -> int:
    """Every layer's router redrawn from ``seed`` (so that the routing changes: AdamW steps at the
    fixture's rate move no top-k choice), published; returns the new version."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in run.trainer.model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    run.trainer.steps += 1  # new bits: a step of their own (the bulletin refuses other bits under a published step)
    return run.publisher.publish(run.trainer.model, step=run.trainer.steps).version


def routing(server: SglangServer, prompt: str, *, stream: bool = False) -> np.ndarray:
    """The engine's routing of ``prompt`` (greedy, 4 tokens, its own cache salt): int32 [rows, layers, top_k]."""
    config = json.loads((Path(server.model) / "config.json").read_text())
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "return_routed_experts": True,
        "cache_salt": uuid.uuid4().hex,
        "stream": stream,
    }
    if not stream:
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        encoded, usage = answer["sglext"]["routed_experts"], answer["usage"]
    else:
        encoded, usage = None, {"prompt_tokens": 0, "completion_tokens": 0}
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                event = json.loads(line[6:]) if line.startswith("data: {") else {}
                encoded = (event.get("sglext") or {}).get("routed_experts") or encoded
                usage = event.get("usage") or usage
    assert encoded, f"no routed_experts in the answer of {server.url} (stream={stream})"
    rows = np.frombuffer(base64.b64decode(encoded), np.int32).reshape(
        -1, config["num_hidden_layers"], config["num_experts_per_tok"]
    )
    assert len(rows) == usage["prompt_tokens"] + usage["completion_tokens"] - 1, (rows.shape, usage)
    return rows


#: Output tokens of the request that crosses the routers' commit (the preset's context is 2,048).
CROSSING_TOKENS = 600


def generate(
    url: str, prompt_ids: list[int], tokens: int, *, start_len: int = 0, events: list[dict] | None = None
) -> dict:
    """SGLang's native ``/generate`` of ``tokens`` greedy tokens after ``prompt_ids``, asking for
    its routing (its own cache salt); streamed into ``events`` when given. Returns the last answer."""
    body = {
        "input_ids": prompt_ids, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        "return_routed_experts": True, "routed_experts_start_len": start_len, "cache_salt": uuid.uuid4().hex,
        "stream": events is not None,
    }  # fmt: skip
    if events is None:
        r = httpx.post(f"{url}/generate", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events[-1]


def rows_of(answer: dict, config: dict) -> np.ndarray:
    """``meta_info.routed_experts`` of a native answer: int32 [rows, layers, top_k]."""
    encoded = answer["meta_info"]["routed_experts"]
    assert encoded, f"no routed_experts in {answer['meta_info']}"
    return np.frombuffer(base64.b64decode(encoded), np.int32).reshape(
        -1, config["num_hidden_layers"], config["num_experts_per_tok"]
    )


def check_crossing_rows(
    engine: SglangServer, adapter: SglangEngine, steps: list[tuple[list[str], int, int]], config: dict
) -> None:
    """Commit ``steps`` (they redraw the routers) while a streamed request generates; its rows
    before SGLang's span boundary must be the old version's routing of the same tokens, the
    first row after it the new version's."""
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(engine.model)(PROMPTS[2])["input_ids"]
    n_prompt, old_version, new_version = len(prompt_ids), steps[0][1], steps[-1][2]
    old = generate(engine.url, prompt_ids, CROSSING_TOKENS)
    events: list[dict] = []
    worker = threading.Thread(
        target=lambda: generate(engine.url, prompt_ids, CROSSING_TOKENS, events=events), daemon=True
    )
    worker.start()
    deadline = time.monotonic() + 300
    while len(events) < 3 and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(events) >= 3 and worker.is_alive(), (
        f"the request was not generating before the commit ({len(events)} chunks)"
    )
    commit(adapter, steps)
    worker.join(600)
    crossed = events[-1]
    spans = crossed["meta_info"].get("weight_versions")
    assert [int(s["version"]) for s in spans or []] == [old_version, new_version], (
        f"the request did not cross the commit: {spans}"
    )
    b = spans[0]["end"]
    cut = n_prompt - 1 + b  # output token b was sampled from position cut's pass, the first under the new weights
    ids, rows, old_rows = crossed["output_ids"], rows_of(crossed, config), rows_of(old, config)
    assert len(rows) == n_prompt + CROSSING_TOKENS - 1 and ids[:b] == old["output_ids"][:b]
    assert np.array_equal(rows[:cut], old_rows[:cut]), (
        f"rows before the boundary ({cut}) are not the routing version {old_version}'s tokens were sampled from"
    )
    after = rows_of(generate(engine.url, prompt_ids + ids[:b], 1, start_len=cut), config)
    assert np.array_equal(rows[cut : cut + 1], after), (
        f"row {cut}, the first after the commit, is not version {new_version}'s routing"
    )
    assert not np.array_equal(after, old_rows[cut : cut + 1]), (
        "the commit did not change the routing of the boundary's position"
    )
    print(
        f"crossing: rows [0, {cut}) version {old_version}'s first routing, [{cut}, {len(rows)}) version {new_version}'s"
    )


#: Seconds the routing requests took (printed: what they add to the test).
ROUTING_S = [0.0]


def routings(server: SglangServer) -> list[np.ndarray]:
    """The routing of two oracle prompts (plain), checked equal to the streamed one."""
    began = time.monotonic()
    plain = [routing(server, p) for p in PROMPTS[:2]]
    streamed = [routing(server, p, stream=True) for p in PROMPTS[:2]]
    for a, b in zip(plain, streamed, strict=True):
        assert np.array_equal(a, b), "streamed and plain answers carry different routing"
    ROUTING_S[0] += time.monotonic() - began
    return plain


def test_qwen3_moe_expert_patches_equal_a_fresh_sglang(tmp_path: Path) -> None:
    check_moe_oracle("tiny-qwen3-moe", 1, tmp_path)


def check_moe_oracle(preset: str, tp: int, folder: Path) -> None:
    """The oracle on ``preset`` at TP = ``tp``: one patched server from version 0 and one fresh
    server of the last version, both started at once (the versions are trained first)."""
    require_sglang()
    run = MoeRun(preset, folder / "run")
    try:
        for _ in range(2):
            run.step()
        touched = run.changed(1) | run.changed(2)
        for what, mark in CLASSES.items():
            assert any(mark in n for n in touched), f"no {what} tensor changed in versions 1-2"
        redrawn = redraw_routers(run, seed=3)
        single, expert = run.step_one_expert(layer=1)
        names = run.changed(single)
        assert names and all(re.search(rf"layers\.1\.\w+\.experts\.{expert}\.", n) for n in names), names
        views = {v: load_checkpoint(run.pull(v)) for v in range(single + 1)}
        config = json.loads((run.model_dir / "config.json").read_text())
        engine = SglangServer(run.model_dir, folder / "engine.log", tp=tp)
        fresh = SglangServer(
            run.pull(single), folder / "fresh.log", tp=tp
        )  # the loader: its first call installs the capturer
        try:
            try:
                engine.wait_ready()
                adapter = SglangEngine(engine.url, folder / "records", timeout_s=120)
                try:
                    lease.take(adapter, "moe")
                    adapter.set_version(0, None)
                    assert adapter.checksums(sorted(run.sums(0))) == run.sums(0), (
                        "the boot weights read through the map are not version 0's"
                    )
                    at_v0 = engine.greedy()
                    routed_v0 = routings(engine)  # the capturer was installed by the loader calls above

                    count = config.get("num_experts") or config["num_local_experts"]
                    real = min(names)
                    stray = {re.sub(r"\.experts\.\d+\.", f".experts.{count}.", real): views[0][real]}
                    moved = {n: RawTensor(t.dtype, t.shape, t.bits ^ np.uint16(1)) for n, t in stray.items()}
                    with pytest.raises(ApplyRefusedError) as refused:
                        commit(adapter, [(patch_file(folder, stray, moved, "no-such-expert.patch"), 0, 1)])
                    assert refused.value.details["cause"] == "UnmappedTensor", refused.value
                    assert f"expert {count}" in str(refused.value), refused.value

                    report = commit(
                        adapter, [(patch_file(folder, views[v - 1], views[v], f"v{v}.patch"), v - 1, v) for v in (1, 2)]
                    )
                    assert report["tensors"] > 0
                    check_crossing_rows(
                        engine,
                        adapter,
                        [(patch_file(folder, views[2], views[redrawn], f"v{redrawn}.patch"), 2, redrawn)],
                        config,
                    )
                    assert adapter.checksums(sorted(run.sums(redrawn))) == run.sums(redrawn)
                    report = commit(
                        adapter,
                        [(patch_file(folder, views[redrawn], views[single], f"v{single}.patch"), redrawn, single)],
                    )
                    assert report["tensors"] == len(names), report
                    assert adapter.state().version == single
                    assert adapter.checksums(sorted(run.sums(single))) == run.sums(single)
                    patched = engine.greedy()
                    routed = routings(engine)
                finally:
                    adapter.close()
            finally:
                engine.stop()
            assert patched != at_v0, "the patched engine answers as at version 0"
            changed = np.mean([(a != b).any(axis=(1, 2)).mean() for a, b in zip(routed_v0, routed, strict=True)])
            assert changed > 0.5, f"only {changed:.0%} of the positions route differently after the routers changed"
            fresh.wait_ready()
            assert patched == fresh.greedy(), (
                f"the patched engine differs from a fresh SGLang at version {single} (TP = {tp})"
            )
            fresh_adapter = SglangEngine(fresh.url, folder / "fresh-records", timeout_s=120)
            try:
                fresh_adapter.state()
            finally:
                fresh_adapter.close()
            for a, b in zip(routed, routings(fresh), strict=True):
                assert np.array_equal(a, b), (
                    f"the patched engine routes differently from a fresh SGLang at version {single} (TP = {tp})"
                )
            print(
                f"routing: {changed:.0%} of the positions routed differently after the routers changed; equal to the "
                f"fresh engine's; requests {ROUTING_S[0]:.1f} s"
            )
        finally:
            fresh.stop()
    finally:
        run.close()
