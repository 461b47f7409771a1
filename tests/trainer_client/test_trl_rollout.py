"""SidecarRollout as TRL's rollout_func: a real GRPOTrainer (tiny model) generating through real sidecars on
loopback, in front of the token-level fake engine (the adapter seam we own), with a real bulletin.

Checks round-robin over sidecars, one request with ``n`` per group, token-id prompts made with the
trainer's chat template, the per-token ``weight_versions`` the reward functions receive, failover past
an unreachable sidecar, and the error of a rollout whose version does not come within its wait.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import TrainerCallback

from stitchboard.demo.processes import free_socket
from stitchboard.trainer_client.errors import RolloutError, RolloutVersionError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.trl.callback import PublishCallback
from stitchboard.trainer_client.trl.rollout import SidecarRollout, group_runs
from stitchboard.trainer_client.trl.rollout_answers import expand_spans
from tests.support.app_server import AppServer
from tests.support.fault_proxy import FaultProxy, Rule
from tests.trainer_client.trl_tiny import (
    PROMPTS,
    TokenEngine,
    grpo_trainer,
    length_reward,
    serve_sidecar,
    tiny_tokenizer,
)

#: Trains with TRL's GRPOTrainer: real training steps (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

pytest.importorskip("trl")


class Sidecars:
    """Sidecars over token engines, served on loopback for one test."""

    def __init__(self, bulletin: str, run: str, workdir: Path) -> None:
        self.bulletin, self.run, self.workdir = bulletin, run, workdir
        self.engines: list[TokenEngine] = []
        self.urls: list[str] = []
        self._stop: list[Any] = []

    def start(self, **settings: Any) -> TokenEngine:
        engine = TokenEngine()
        sidecar, engine_server, client = serve_sidecar(
            self.bulletin, self.run, engine, self.workdir / f"sc{len(self.engines)}", **settings
        )
        self.engines.append(engine)
        self.urls.append(sidecar.url)
        self._stop += [sidecar.stop, engine_server.stop, client.close]
        return engine

    def stop(self) -> None:
        for stop in self._stop:
            stop()


@pytest.fixture
def sidecars(bulletin, run, tmp_path: Path) -> Iterator[Sidecars]:
    out = Sidecars(bulletin.url, run, tmp_path)
    yield out
    out.stop()


class Seen:
    """A reward function that also keeps what TRL passed it (the rollout's extra fields, the step)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.__name__ = "length"

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float]:
        self.calls.append({"step": kwargs["trainer_state"].global_step, **kwargs})
        return length_reward(completions)


def test_round_robin_groups_token_ids_and_versions(bulletin, run, sidecars: Sidecars, tmp_path: Path) -> None:
    a, b = sidecars.start(), sidecars.start()
    with Publisher(bulletin.url, run, client=bulletin.client()) as publisher:
        callback = PublishCallback(publisher)
        rollout = SidecarRollout(sidecars.urls, callback=callback, wait_s=30)
        seen = Seen()
        trainer = grpo_trainer(
            tmp_path, steps=3, callbacks=[callback], rollout_func=rollout, conversational=True, reward=seen
        )
        trainer.train()
        rollout.close()
    # each group of num_generations equal prompts went as one request with n, its prompt as token ids
    tokenizer = tiny_tokenizer()
    expected = {
        tuple(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)["input_ids"])
        for p in PROMPTS
    }
    bodies = a.requests + b.requests
    assert len(bodies) == 3 * 2  # 3 steps x 2 groups of 2
    assert all(body["n"] == 2 and tuple(body["prompt"]) in expected for body in bodies)
    assert len(a.requests) == len(b.requests) == 3  # round-robin over the two sidecars
    # the reward functions got per-token versions: the version of the step just published, on every token
    assert [c["step"] for c in seen.calls] == [0, 1, 2]
    for call in seen.calls:
        version = callback.version_for_step(call["step"], timeout_s=1)
        assert version == call["step"]
        assert len(call["weight_versions"]) == 4
        for per_token, ids in zip(call["weight_versions"], call["completion_ids"], strict=True):
            assert per_token == [version] * len(ids)
        assert all(start >= version for start in call["weight_version_start"])


def test_failover_and_one_request_per_completion(bulletin, run, sidecars: Sidecars, tmp_path: Path) -> None:
    engine = sidecars.start()
    sock = free_socket()
    dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: connections are refused
    with Publisher(bulletin.url, run, client=bulletin.client()) as publisher:
        callback = PublishCallback(publisher)
        rollout = SidecarRollout([dead, sidecars.urls[0]], callback=callback, wait_s=30, group_requests=False)
        seen = Seen()
        grpo_trainer(tmp_path, steps=2, callbacks=[callback], rollout_func=rollout, reward=seen).train()
        rollout.close()
    sock.close()
    assert rollout.last["sidecars"] == [sidecars.urls[0]] * 4
    assert len(engine.requests) == 2 * 4 and all(body["n"] == 1 for body in engine.requests)
    assert all(v == [call["step"]] * 4 for call in seen.calls for v in call["weight_versions"])


def test_a_version_not_applied_in_time_names_step_version_and_sidecar(
    bulletin, run, sidecars: Sidecars, tmp_path: Path
) -> None:
    engine = sidecars.start()
    engine.refuse_versions = {1}  # the engine refuses version 1's patch: the sidecar never applies it
    trainer = grpo_trainer(tmp_path)
    with Publisher(bulletin.url, run, client=bulletin.client()) as publisher:
        publisher.publish(trainer.model, step=0)
        trainer.model.model.norm.weight.data += 1.0
        publisher.publish(trainer.model, step=1)
    rollout = SidecarRollout(sidecars.urls, bulletin=bulletin.url, run=run, wait_s=1.0)
    trainer.state.global_step = 1
    with pytest.raises(RolloutVersionError) as info:
        rollout(PROMPTS[:1] * 2, trainer)
    assert info.value.details | {"applied_version": None} == {
        "step": 1,
        "min_version": 1,
        "sidecar": sidecars.urls[0],
        "applied_version": None,
    }
    assert "step 1" in str(info.value) and "version 1" in str(info.value) and sidecars.urls[0] in str(info.value)
    trainer.state.global_step = 5  # no version of step 5 at all
    with pytest.raises(RolloutVersionError, match="no version of step 5"):
        rollout(PROMPTS[:1] * 2, trainer)
    rollout.staleness_steps = 1  # step 0's version is applied: one step of staleness is served
    trainer.state.global_step = 1
    out = rollout(PROMPTS[:1] * 2, trainer)
    assert out["weight_versions"] == [[0] * 4] * 2 and rollout.last["requests"] == 1
    rollout.close()


def test_groups_and_spans_helpers() -> None:
    assert group_runs([[1], [1], [2], [2], [2], [1]], 2) == [(0, 2), (2, 2), (4, 1), (5, 1)]
    spans = [{"version": 3, "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 3}]
    assert expand_spans(spans, 4) == [3, 3, 4, -1]
    assert expand_spans(None, 2) == [-1, -1]


def test_version_published_before_the_callback_is_found_at_the_bulletin(
    bulletin, run, sidecars: Sidecars, tmp_path: Path
) -> None:
    sidecars.start()
    trainer = grpo_trainer(tmp_path)
    with Publisher(bulletin.url, run, client=bulletin.client()) as publisher:
        publisher.publish(trainer.model, step=0)  # the user's own version 0: the callback never published it
        rollout = SidecarRollout(sidecars.urls, callback=PublishCallback(publisher), wait_s=5)
        out = rollout(PROMPTS[:1] * 2, trainer)
        rollout.close()
    assert rollout.last["min_version"] == 0 and out["weight_versions"] == [[0] * 4] * 2


class OutageAt(TrainerCallback):
    """Before the PublishCallback sees step ``at``: waits for the publishes in flight, then makes the proxy
    drop every connection for ``heal_after_s`` seconds (so step ``at``'s background publish fails)."""

    def __init__(self, proxy: FaultProxy, callback: PublishCallback, at: int, heal_after_s: float) -> None:
        self.proxy, self.callback, self.at = proxy, callback, at
        self.rule = Rule("drop", times=None)
        self.timer = threading.Timer(heal_after_s, self.heal)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.at:
            for p in list(self.callback.published):
                if p.future is not None:
                    p.future.exception()
            self.proxy.add(self.rule)
            self.timer.start()

    def heal(self) -> None:
        self.rule.times = 0
        self.timer.cancel()


def test_under_block_a_failed_publish_is_redone_before_the_rollout_waits_for_it(
    bulletin, run, sidecars: Sidecars, tmp_path: Path
) -> None:
    sidecars.start()
    proxy = FaultProxy(bulletin.url)
    publisher = Publisher(proxy.url, run, retries=1, backoff_s=0.01)
    callback = PublishCallback(publisher, on_fault="block", retry_interval_s=0.2)
    rollout = SidecarRollout(sidecars.urls, callback=callback, wait_s=20)
    seen = Seen()
    outage = OutageAt(proxy, callback, 2, heal_after_s=1.0)
    try:
        grpo_trainer(tmp_path, steps=3, callbacks=[outage, callback], rollout_func=rollout, reward=seen).train()
    finally:
        outage.heal()
        rollout.close()
        proxy.stop()
        publisher.close()
    assert [p.step for p in callback.published if p.failed] == [2]  # its background publish failed ...
    done = [(p.step, p.version) for p in callback.published if not p.failed]
    assert done == [(0, 0), (1, 1), (2, 2), (3, 3)]  # ... and was redone when the rollout of step 3 asked for it
    assert callback.skipped_steps == []  # so step 2 has its version
    assert [c["step"] for c in seen.calls] == [0, 1, 2]
    assert all(v == [2] * 4 for v in seen.calls[2]["weight_versions"])


def test_under_skip_a_rollout_without_its_version_says_why(bulletin, run, sidecars: Sidecars, tmp_path: Path) -> None:
    sidecars.start()
    proxy = FaultProxy(bulletin.url)
    publisher = Publisher(proxy.url, run, retries=1, backoff_s=0.01)
    callback = PublishCallback(publisher, on_fault="skip")
    rollout = SidecarRollout(sidecars.urls, callback=callback, wait_s=1)
    outage = OutageAt(proxy, callback, 2, heal_after_s=60)
    trainer = grpo_trainer(tmp_path, steps=3, callbacks=[outage, callback], rollout_func=rollout)
    try:
        with pytest.raises(
            RolloutVersionError, match=r"no version of step 2 or later .*skipped by the callback: \[2\].*unreachable"
        ) as info:
            trainer.train()
    finally:
        outage.heal()
        rollout.close()
        proxy.stop()
        publisher.close()
    assert info.value.details["step"] == 2 and info.value.details["sidecar"] is None


def test_under_block_the_rollout_waits_no_longer_than_wait_s(bulletin, run, tmp_path: Path) -> None:
    proxy = FaultProxy(bulletin.url)
    publisher = Publisher(proxy.url, run, retries=1, backoff_s=0.01)
    callback = PublishCallback(publisher, on_fault="block", block_timeout_s=120, retry_interval_s=0.2)
    trainer = grpo_trainer(tmp_path)
    rollout = SidecarRollout(["http://127.0.0.1:9"], callback=callback, wait_s=1)
    state = trainer.state
    try:
        callback.on_train_begin(trainer.args, state, trainer.control, model=trainer.model)
        proxy.add(Rule("drop", times=None))  # the bulletin unreachable from step 1's publish on
        state.global_step = 1
        callback.on_step_end(trainer.args, state, trainer.control, model=trainer.model)
        t0 = time.monotonic()
        with pytest.raises(RolloutVersionError, match=r"no version of step 1 or later within 1 s"):
            rollout.version_for_step(1)
        waited_s = time.monotonic() - t0
    finally:
        rollout.close()
        proxy.stop()
        publisher.close()
    assert waited_s < 30  # the republish under block stops at the rollout's deadline, not block_timeout_s (120 s)
    assert callback.skipped_steps == [1]  # listed once: the failed publish and its failed republish


class Hostile:
    """A stand-in sidecar of ``run`` whose ``/v1/completions`` answers as ``mode`` says (a broken or hostile one)."""

    def __init__(self, run: str, stamp: int) -> None:
        self.mode, self.run, self.stamp = "ok", run, stamp
        self.server = AppServer(self.app())
        self.url = self.server.url

    def app(self) -> FastAPI:
        app = FastAPI()
        me = self

        @app.get("/v1/stitch/status")
        async def status() -> dict[str, Any]:
            return {"run_id": me.run}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            n, m, v = (await request.json())["n"], me.mode, me.stamp
            stamps = {"weight_version_start": v, "weight_version_end": v}
            bad_ids = {"oob": [3, 10**9], "negative": [3, -5], "str": ["x", 4], "float": [3.0, 4.0]}
            ids: list[Any] = bad_ids.get(m, [3, 4])
            lp: list[Any] = [None, "x"] if m == "logprobs" else [-1.0, -1.0]
            choices = [{"index": i, "token_ids": ids, "logprobs": {"token_logprobs": lp}} for i in range(n)]
            if m == "duplicate":
                choices = [{**c, "index": 0} for c in choices]
            if m == "nostamps":
                stamps = {}
            if m == "stale":
                stamps = {"weight_version_start": v - 1, "weight_version_end": v}
            if m == "slow":
                await asyncio.sleep(3)
            if m == "cut":

                async def cut() -> AsyncIterator[bytes]:
                    yield b'{"choices": ['
                    raise RuntimeError("cut")

                return StreamingResponse(cut(), media_type="application/json")
            return JSONResponse({**stamps, "choices": choices})

        return app


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("ok", None),
        ("nostamps", r"asked for version 2 or later .*weight_version_start=None"),
        ("stale", r"asked for version 2 or later .*weight_version_start=1"),
        ("oob", r"token ids \[1000000000\] are not ints in \[0, 33\)"),
        ("negative", r"token ids \[-5\]"),
        ("str", r"token ids \['x'\]"),
        ("float", r"token ids \[3.0, 4.0\]"),
        ("duplicate", r"choice indexes \[0, 0\] for n=2"),
        ("logprobs", r"logprobs .* are not one number per token"),
        ("slow", r"the request failed after it was sent \(ReadTimeout"),
        ("cut", r"the request failed after it was sent"),
    ],
)
def test_a_wrong_answer_is_refused_naming_the_sidecar(
    bulletin, run, tmp_path: Path, mode: str, error: str | None
) -> None:
    trainer = grpo_trainer(tmp_path)
    with Publisher(bulletin.url, run, client=bulletin.client()) as publisher:
        for step in range(3):
            trainer.model.model.norm.weight.data += 1.0
            publisher.publish(trainer.model, step=step)
    trainer.state.global_step = 2  # asks for version 2
    sidecar = Hostile(run, stamp=2)
    sidecar.mode = mode
    rollout = SidecarRollout([sidecar.url], bulletin=bulletin.url, run=run, wait_s=5, timeout_s=1, model="m")
    try:
        if error is None:
            assert rollout(PROMPTS[:1] * 2, trainer)["completion_ids"] == [[3, 4]] * 2
        else:
            with pytest.raises(RolloutError, match=error) as info:
                rollout(PROMPTS[:1] * 2, trainer)
            assert sidecar.url in str(info.value) and info.value.details["sidecar"] == sidecar.url
    finally:
        rollout.close()
        sidecar.server.stop()


def test_a_sidecar_of_another_run_or_a_plain_engine_is_refused(
    bulletin, run, sidecars: Sidecars, tmp_path: Path
) -> None:
    engine = sidecars.start()
    trainer = grpo_trainer(tmp_path)
    other = f"{run}-other"
    with Publisher(bulletin.url, other, client=bulletin.client()) as publisher:
        publisher.publish(trainer.model, step=0)
    for url, why in ((sidecars.urls[0], f"follows run '{run}'"), (engine.url, "answered 404")):
        rollout = SidecarRollout([url], bulletin=bulletin.url, run=other, wait_s=5)
        with pytest.raises(RolloutError, match=why) as info:
            rollout(PROMPTS[:1] * 2, trainer)
        assert f"trains run '{other}'" in str(info.value) and url in str(info.value)
        rollout.close()
    assert engine.requests == []  # no work was sent


def test_a_refused_token_in_the_step_lookup_says_so(bulletin, run) -> None:
    refuse = Rule("status", path=r"/versions", method="GET", times=None, status=401, code="Unauthorized")
    proxy = FaultProxy(bulletin.url, [refuse])
    rollout = SidecarRollout(["http://127.0.0.1:9"], bulletin=proxy.url, run=run, wait_s=5)
    try:
        with pytest.raises(RolloutError, match="the bulletin refused the token of the step lookup"):
            rollout.version_for_step(0)
    finally:
        rollout.close()
        proxy.stop()
