"""SidecarRollout as TRL's rollout_func: a real GRPOTrainer (tiny model) generating through real sidecars on
loopback, in front of the token-level fake engine (the adapter seam we own), with a real bulletin.

Checks round-robin over sidecars, one request with ``n`` per group, token-id prompts made with the
trainer's chat template, the per-token ``weight_versions`` the reward functions receive, failover past
an unreachable sidecar, and the error of a rollout whose version does not come within its wait.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.processes import free_socket
from stitchboard.trainer_client.errors import RolloutVersionError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.trl.callback import PublishCallback
from stitchboard.trainer_client.trl.rollout import SidecarRollout, expand_spans, group_runs
from tests.support.fault_proxy import FaultProxy, Rule
from tests.trainer_client.trl_tiny import (
    PROMPTS,
    TokenEngine,
    grpo_trainer,
    length_reward,
    serve_sidecar,
    tiny_tokenizer,
)

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
    publisher = Publisher(proxy.url, run, client=BulletinClient(proxy.url, retries=1, backoff_s=0.01))
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
    publisher = Publisher(proxy.url, run, client=BulletinClient(proxy.url, retries=1, backoff_s=0.01))
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
