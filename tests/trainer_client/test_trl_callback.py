"""PublishCallback driving a real TRL GRPOTrainer (tiny model) against a real bulletin on loopback.

Checks the versions and steps published, that each version's bits are the served view of the
trainer's model after that step, and the three fault policies with the bulletin unreachable
(a proxy in front of it dropping every connection).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from stitchboard.bulletin.errors import UnavailableError
from stitchboard.proto.container import RawTensor
from stitchboard.trainer_client.errors import ResumeError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.trl.callback import PublishCallback
from tests.support.fault_proxy import FaultProxy, Rule
from tests.trainer_client.trl_tiny import grpo_trainer

#: Trains with TRL's GRPOTrainer: real training steps (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

pytest.importorskip("trl")


class Snapshots(TrainerCallback):
    """Keeps the served view of the model after each step (runs after the PublishCallback)."""

    def __init__(self) -> None:
        self.views: dict[int, dict[str, RawTensor]] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        self.views[state.global_step] = served_view(model)

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self.views[state.global_step] = served_view(model)


class Outage(TrainerCallback):
    """Before the PublishCallback sees step ``at``: waits for the publishes in flight (so the outage
    hits step ``at``'s publish first), then makes the proxy drop every connection. Before it sees
    step ``at + 1``: waits until step ``at``'s publish has failed, then lets connections through
    again ``heal_after_s`` later (0: at once; None: never)."""

    def __init__(self, proxy: FaultProxy, callback: PublishCallback, at: int, heal_after_s: float | None) -> None:
        self.proxy, self.callback, self.at, self.heal_after_s = proxy, callback, at, heal_after_s
        self.rule = Rule("drop", times=None)

    def _wait_in_flight(self) -> None:
        for p in list(self.callback.published):
            if p.future is not None:
                p.future.exception()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.at:
            self._wait_in_flight()
            self.proxy.add(self.rule)
        if state.global_step == self.at + 1 and self.heal_after_s is not None:
            self._wait_in_flight()
            if self.heal_after_s == 0:
                self.heal()
            else:
                threading.Timer(self.heal_after_s, self.heal).start()

    def heal(self) -> None:
        self.rule.times = 0


def steps_of(client, run: str) -> dict[int, int]:
    """version -> the training step its manifest records."""
    out = {}
    for info in client.versions(run):
        out[info.version] = client.manifest(run, info.version).metadata["step"]
    return out


def same_bits(a: dict[str, RawTensor], b: dict[str, RawTensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].bits.tobytes() == b[k].bits.tobytes() for k in a)


def test_publishes_every_step_with_its_step_and_bits(bulletin, run, tmp_path: Path) -> None:
    client = bulletin.client()
    publisher = Publisher(bulletin.url, run, client=client, encoding="xor")
    callback = PublishCallback(publisher)
    snapshots = Snapshots()
    trainer = grpo_trainer(tmp_path, steps=3, callbacks=[callback, snapshots])
    trainer.train()
    assert steps_of(client, run) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert [(p.step, p.version, p.failed) for p in callback.published] == [(s, s, False) for s in range(4)]
    assert not same_bits(snapshots.views[0], snapshots.views[3])  # the training moved the weights
    for version in range(4):
        assert same_bits(rebuild_version(client, run, version).view, snapshots.views[version]), version
    assert callback.version_for_step(2, timeout_s=1) == 2
    assert callback.version_for_step(4, timeout_s=1) is None
    publisher.close()


def test_resumed_run_publishes_no_second_anchor(bulletin, run, tmp_path: Path) -> None:
    client = bulletin.client()
    first = grpo_trainer(tmp_path)
    with Publisher(bulletin.url, run, client=client) as publisher:
        publisher.publish(first.model, step=0)
    publisher = Publisher(bulletin.url, run, client=client)  # the user's own version 0 is resumed from
    callback = PublishCallback(lambda: publisher)
    grpo_trainer(tmp_path, steps=1, callbacks=[callback]).train()
    assert steps_of(client, run) == {0: 0, 1: 1}
    publisher.close()


@pytest.mark.parametrize("on_fault", ["block", "skip"])
def test_a_trainer_behind_the_runs_last_step_is_refused_at_once(bulletin, run, tmp_path: Path, on_fault: str) -> None:
    client = bulletin.client()
    trainer = grpo_trainer(tmp_path, steps=1)
    with Publisher(bulletin.url, run, client=client) as publisher:  # a first life that reached step 2
        publisher.publish(trainer.model, step=0)
        trainer.model.model.norm.weight.data += 1.0
        publisher.publish(trainer.model, step=2)
    publisher = Publisher(bulletin.url, run, client=client)
    trainer = grpo_trainer(tmp_path, steps=1, callbacks=[PublishCallback(publisher, on_fault=on_fault)])
    with pytest.raises(ResumeError) as info:  # it starts at step 0: a conflict, whatever the fault policy
        trainer.train()
    message = str(info.value)
    assert run in message and "last version 1 is at training step 2" in message and "starts at step 0" in message
    assert "checkpoint of step 2 or later" in message and "new run id" in message
    assert info.value.details == {"run": run, "version": 1, "version_step": 2, "trainer_step": 0}
    assert steps_of(client, run) == {0: 0, 1: 2}  # nothing published
    publisher.close()


class CutCommit(TrainerCallback):
    """Before the PublishCallback sees step ``at``: the bulletin commits that step's version, but each of the
    client's attempts has its answer cut (a commit whose answer was lost)."""

    def __init__(self, proxy: FaultProxy, at: int) -> None:
        self.proxy, self.at = proxy, at

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.at:
            self.proxy.add(Rule("cut", path=r"/versions$", method="POST", times=2))


def test_skip_takes_a_lost_commit_off_the_skipped_steps(bulletin, run, tmp_path: Path) -> None:
    proxy = FaultProxy(bulletin.url)
    client = bulletin.client()
    publisher = Publisher(proxy.url, run, retries=1, backoff_s=0.01)
    callback = PublishCallback(publisher, on_fault="skip", background=False)
    try:
        grpo_trainer(tmp_path, steps=3, callbacks=[CutCommit(proxy, 2), callback]).train()
    finally:
        proxy.stop()
        publisher.close()
    assert steps_of(client, run) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert callback.skipped_steps == []  # step 2 is version 2: found when version 3 committed
    assert [(p.step, p.version) for p in callback.published if not p.failed] == [(s, s) for s in range(4)]


class OutageAtEnd(TrainerCallback):
    """The bulletin unreachable from step ``at``'s end (the last) until the training ends."""

    def __init__(self, proxy: FaultProxy, at: int) -> None:
        self.proxy, self.at = proxy, at
        self.rule = Rule("drop", times=None)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.at:
            self.proxy.add(self.rule)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self.rule.times = 0


def test_skip_publishes_the_final_weights_again_at_the_train_end(bulletin, run, tmp_path: Path) -> None:
    proxy = FaultProxy(bulletin.url)
    client = bulletin.client()
    publisher = Publisher(proxy.url, run, retries=1, backoff_s=0.01)
    callback = PublishCallback(publisher, on_fault="skip", background=False)
    snapshots = Snapshots()
    try:
        grpo_trainer(tmp_path, steps=2, callbacks=[OutageAtEnd(proxy, 2), callback, snapshots]).train()
    finally:
        proxy.stop()
        publisher.close()
    assert steps_of(client, run) == {0: 0, 1: 1, 2: 2}  # no next version would have carried step 2
    assert callback.skipped_steps == []
    assert same_bits(rebuild_version(client, run).view, snapshots.views[2])


def _outage_run(bulletin, run, tmp_path: Path, on_fault: str, heal_after_s: float | None, **kwargs: Any):
    proxy = FaultProxy(bulletin.url)
    client = bulletin.client()
    publisher = Publisher(proxy.url, run, retries=1, backoff_s=0.01, encoding="xor")
    callback = PublishCallback(publisher, on_fault=on_fault, retry_interval_s=0.2, **kwargs)
    snapshots = Snapshots()
    trainer = grpo_trainer(tmp_path, steps=4, callbacks=[Outage(proxy, callback, 2, heal_after_s), callback, snapshots])
    return proxy, client, publisher, callback, snapshots, trainer


@pytest.mark.parametrize("background", [True, False])
def test_skip_logs_and_goes_on(bulletin, run, tmp_path: Path, caplog, background: bool) -> None:
    proxy, client, publisher, callback, snapshots, trainer = _outage_run(
        bulletin, run, tmp_path, "skip", 0.0, background=background
    )
    caplog.set_level(logging.WARNING, "stitchboard.trainer_client.trl")
    try:
        trainer.train()
    finally:
        proxy.stop()
    assert any("step 2: not published" in r.getMessage() for r in caplog.records)
    assert callback.skipped_steps == [2]
    assert sorted(steps_of(client, run).values()) == [0, 1, 3, 4]
    assert same_bits(rebuild_version(client, run).view, snapshots.views[4])
    publisher.close()


def test_block_waits_for_the_bulletin_then_publishes(bulletin, run, tmp_path: Path) -> None:
    proxy, client, publisher, _callback, snapshots, trainer = _outage_run(
        bulletin, run, tmp_path, "block", 1.5, block_timeout_s=60
    )
    try:
        trainer.train()
    finally:
        proxy.stop()
    steps = steps_of(client, run)
    assert 3 in steps.values() and 4 in steps.values()  # step 3's publish waited for the bulletin, then went
    assert same_bits(rebuild_version(client, run).view, snapshots.views[4])
    publisher.close()


def test_block_gives_up_after_its_timeout_without_crashing(bulletin, run, tmp_path: Path, caplog) -> None:
    proxy, client, publisher, callback, _snapshots, trainer = _outage_run(
        bulletin, run, tmp_path, "block", None, block_timeout_s=0.5, background=False
    )
    caplog.set_level(logging.WARNING, "stitchboard.trainer_client.trl")
    try:
        trainer.train()
    finally:
        proxy.stop()
    assert callback.skipped_steps == [2, 3, 4]
    assert sorted(steps_of(client, run).values()) == [0, 1]
    assert any("retrying for up to" in r.getMessage() for r in caplog.records)
    publisher.close()


def test_raise_stops_the_training(bulletin, run, tmp_path: Path) -> None:
    proxy, client, publisher, _callback, _snapshots, trainer = _outage_run(bulletin, run, tmp_path, "raise", None)
    try:
        with pytest.raises(UnavailableError):
            trainer.train()
    finally:
        proxy.stop()
    assert sorted(steps_of(client, run).values()) == [0, 1]
    publisher.close()


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="on_fault"):
        PublishCallback(lambda: None, on_fault="ignore")  # type: ignore[arg-type]
