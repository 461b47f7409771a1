"""The verl checkpoint engine's own rules, without verl (trainer_client/verl_sync.py), over a real bulletin on loopback:
the streamed view equal to the one publish takes (Publisher.view_of_stream),
a step published once, the same step again a no-op with the same bits and refused with others (the latest step and
an older one), only the committer publishing, and a receiver returning once a real sidecar (over a fake engine)
applied the step's version, or raising a typed error naming the step, the version and the replicas seen.

The backend driven by verl's own classes (its CheckpointEngineManager on a local Ray cluster) and real vLLM:
tests/sidecar/test_verl_vllm.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stitchboard.trainer_client.errors import (
    CheckpointNameError,
    FleetTimeoutError,
    StepConflictError,
    StepTimeoutError,
)
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.verl_sync import StepPublisher, VerlOptions, wait_for_step
from tests.bulletin.fleet_helpers import start_sidecar
from tests.sidecar.fake_engine import FakeEngine
from tests.trainer_client.toy import ToyTrainer, assert_same_view


def _stream(model: torch.nn.Module):
    """What verl's ``get_per_tensor_param`` yields: (name, tensor) pairs, one at a time."""
    yield from model.state_dict().items()


@pytest.fixture
def sender(bulletin, run, tmp_path):
    publisher = StepPublisher(VerlOptions(bulletin=bulletin.url, run=run, workdir=str(tmp_path / "pub")), True)
    yield publisher
    publisher.close()


def test_the_streamed_view_is_the_view_publish_takes(sender) -> None:
    trainer = ToyTrainer()
    trainer.step()
    assert_same_view(sender.publisher.view_of_stream(_stream(trainer.model)), served_view(trainer.model))
    weight = trainer.model.state_dict()["1.weight"]
    with pytest.raises(CheckpointNameError, match="both map to checkpoint name '1.weight'"):
        sender.publisher.view_of_stream([("module.1.weight", weight), ("1.weight", weight)])


def test_each_step_is_one_version_and_a_retry_with_the_same_bits_is_a_no_op(bulletin, run, sender) -> None:
    trainer = ToyTrainer()
    assert sender.publish(_stream(trainer.model), 0).version == 0
    trainer.step()
    one = sender.publish(_stream(trainer.model), 1)
    assert (one.version, one.new) == (1, True) and one.encoded_bytes > 0
    again = sender.publish(_stream(trainer.model), 1)  # verl's manager retried the step
    assert (again.step, again.version, again.new) == (1, 1, False)
    client = bulletin.client()
    assert client.latest(run) == 1
    assert client.manifest(run, 1).metadata["step"] == 1


def test_a_restarted_sender_replaying_an_older_step_with_its_bits_is_a_no_op(bulletin, run, sender, tmp_path) -> None:
    trainer = ToyTrainer()
    sender.publish(_stream(trainer.model), 0)
    trainer.step()
    sender.publish(_stream(trainer.model), 1)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.step()
    sender.publish(_stream(trainer.model), 2)
    restarted = StepPublisher(VerlOptions(bulletin=bulletin.url, run=run, workdir=str(tmp_path / "again")), True)
    try:  # a new manager (a new publisher resuming the run) sends step 1's weights again
        replay = restarted.publish(iter(before.items()), 1)
    finally:
        restarted.close()
    assert (replay.version, replay.new) == (1, False)
    assert bulletin.client().latest(run) == 2


@pytest.mark.parametrize("step", [1, 0], ids=["latest-step", "older-step"])
def test_the_same_step_with_other_bits_is_refused_naming_step_and_version(bulletin, run, sender, step) -> None:
    trainer = ToyTrainer()
    sender.publish(_stream(trainer.model), 0)
    trainer.step()
    sender.publish(_stream(trainer.model), 1)
    trainer.step()  # other weights under an already published step
    with pytest.raises(StepConflictError, match=rf"step {step} is already version {step} with other bits") as refused:
        sender.publish(_stream(trainer.model), step)
    assert refused.value.details["step"] == step and refused.value.details["version"] == step
    assert refused.value.details["tensors"]
    assert bulletin.client().latest(run) == 1  # nothing published


def test_only_the_committer_publishes_and_every_rank_consumes_the_stream(bulletin, run) -> None:
    trainer = ToyTrainer()
    taken = []

    def stream():
        for name, tensor in trainer.model.state_dict().items():
            taken.append(name)
            yield name, tensor

    other = StepPublisher(VerlOptions(bulletin=bulletin.url, run=run), committer=False)
    assert other.publish(stream(), 0) is None
    assert taken == list(trainer.model.state_dict())
    assert bulletin.client().latest(run) is None


def test_options_come_from_the_client_environment_and_engine_kwargs_win(monkeypatch) -> None:
    monkeypatch.setenv("STITCH_CLIENT_BULLETIN", "http://bulletin:8700")
    monkeypatch.setenv("STITCH_CLIENT_RUN", "env-run")
    monkeypatch.setenv("STITCH_CLIENT_TOKEN", "env-token")
    assert VerlOptions().target() == ("http://bulletin:8700", "env-run")
    assert VerlOptions(run="kw-run", token="kw").model_dump()["token"] == "kw"
    assert VerlOptions(run="kw-run").target() == ("http://bulletin:8700", "kw-run")
    monkeypatch.delenv("STITCH_CLIENT_RUN")
    with pytest.raises(ValueError, match=r"no run: set engine_kwargs.stitchboard.run or STITCH_CLIENT_RUN"):
        VerlOptions().target()
    with pytest.raises(ValueError, match="min_repicas"):  # a typo is refused, not ignored
        VerlOptions(min_repicas=2)


def test_a_receiver_waiting_before_the_commit_returns_once_a_sidecar_applied_the_step(
    bulletin, run, sender, tmp_path
) -> None:
    """verl runs senders and receivers concurrently: the receiver starts before the run has any version."""
    trainer = ToyTrainer()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(wait_for_step, bulletin.client(), run, 3, min_replicas=1, timeout_s=120)
        sender.publish(_stream(trainer.model), 0)
        sidecar = start_sidecar(bulletin.url, run, "r1", FakeEngine(), tmp_path / "handoff")
        try:
            trainer.step()
            sender.publish(_stream(trainer.model), 3)
            count = waiting.result(timeout=180)
        finally:
            sidecar.stop(engine_too=True)
    assert (count.version, count.at_or_above) == (1, 1)


def test_a_receiver_times_out_naming_the_step_then_the_version_and_replicas(bulletin, run, sender, tmp_path) -> None:
    trainer = ToyTrainer()
    sender.publish(_stream(trainer.model), 0)
    client = bulletin.client()
    with pytest.raises(StepTimeoutError, match=r"no version of step 1 was published .* latest version is 0") as none:
        wait_for_step(client, run, 1, timeout_s=0.5)
    assert none.value.details == {"run": run, "step": 1, "latest_version": 0}
    engine = FakeEngine()
    engine.refuse_versions = {1}  # the replica cannot take the step's version
    sidecar = start_sidecar(bulletin.url, run, "r1", engine, tmp_path / "handoff")
    try:
        wait_for_step(client, run, 0, min_replicas=1, timeout_s=60)  # r1 serves version 0
        trainer.step()
        sender.publish(_stream(trainer.model), 1)
        with pytest.raises(FleetTimeoutError, match=r"step 1 \(version 1\).*r1 at version 0") as slow:
            wait_for_step(client, run, 1, min_replicas=1, timeout_s=3)
        assert slow.value.details["version"] == 1 and slow.value.details["laggards"] == ["r1"]
    finally:
        sidecar.stop(engine_too=True)
