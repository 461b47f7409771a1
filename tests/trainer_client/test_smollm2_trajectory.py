"""The recorded SmolLM2 trajectory the publishing tests replay (tests/support/trajectory.py) is the training itself:
a replayed step holds, bit for bit, the float32 masters and the loss of a live CpuTrainer's step."""

from __future__ import annotations

import itertools

import pytest
import torch

from stitchboard.trainer_client.served_view import checkpoint_state
from tests.support.training import CpuTrainer
from tests.support.trajectory import STEPS

pytestmark = pytest.mark.slow


def test_a_replayed_step_is_a_live_step_bit_for_bit(smollm2_dir, smollm2_trajectory):
    live = CpuTrainer(smollm2_dir)
    loss = live.step()
    replay = smollm2_trajectory.replay()
    assert replay.step() == loss and replay.steps == 1
    assert torch.equal(replay.input_ids, live.input_ids)
    want, got = checkpoint_state(live.model), checkpoint_state(replay.model)
    assert list(got) == list(want) and len(want) == 272
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name].detach().view(torch.int32), tensor.detach().view(torch.int32)), name
    assert replay.model.lm_head.weight is replay.model.model.embed_tokens.weight  # still tied
    assert replay.served_view().keys() == live.served_view().keys()


def test_the_trajectory_holds_its_steps_only(smollm2_trajectory):
    assert smollm2_trajectory.steps == STEPS
    losses = smollm2_trajectory.losses
    assert all(a > b for a, b in itertools.pairwise(losses))  # training on one batch: the loss falls
    with pytest.raises(ValueError, match=f"step {STEPS + 1} not recorded"):
        smollm2_trajectory.masters(STEPS + 1)
    replay = smollm2_trajectory.replay()
    for _ in range(STEPS):
        replay.step()
    with pytest.raises(ValueError, match="not recorded"):
        replay.step()
