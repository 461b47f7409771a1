"""One recorded SmolLM2 training trajectory, shared by the test modules that publish real AdamW steps.

Runs in the test processes (pytest and its xdist workers). :func:`recorded_trajectory` trains
:class:`~tests.support.training.CpuTrainer` (its defaults: batch 4 x 64 tokens, lr 3e-6, seed 0)
for :data:`STEPS` steps once and keeps every step's float32 master weights as a safetensors file;
the first process to ask trains, under a file lock, and every other process (xdist workers
included) waits for it and reads the files. :class:`ReplayTrainer` then offers CpuTrainer's
interface (``model``, ``input_ids``, ``step()``, ``served_view()``) over those files: each
``step()`` loads the next step's masters into a float32 SmolLM2, so the model, its
``state_dict``, ``save_pretrained`` and the bf16 served view are bit for bit those of the
trainer after that many real AdamW steps, without each module training its own copy.

Cost: the 4 steps train once per session (~11-13 s on the 2-core machine, from
:mod:`tests.support.training`'s figures); a replayed step reads 538 MB of float32 masters. The
files take 4 x 538 MB in the session's base temporary folder, which the next session removes
(pyproject.toml: ``tmp_path_retention_count = 1``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from stitchboard.trainer_client.served_view import checkpoint_state
from tests.support.training import CpuTrainer, bf16_view

#: Steps recorded (the most any module replays: test_smollm2_publish's four).
STEPS = 4
#: Seconds a process waits for another one's recording before failing.
LOCK_TIMEOUT_S = 900.0
_DONE = "trajectory.json"


@dataclass(frozen=True)
class Trajectory:
    """A recorded run of :data:`STEPS` CpuTrainer steps.

    Attributes:
        checkpoint_dir: the bf16 SmolLM2 checkpoint the run started from (step 0).
        folder: holds ``step-N.safetensors`` (N = 1..steps): every parameter under its checkpoint
            name (272 tensors; the tied head is the embedding), float32, after N steps.
        losses: the loss each step returned (nats per token), ``losses[N - 1]`` for step N.
        input_ids: the training batch, ``[4, 64]`` int64.
    """

    checkpoint_dir: Path
    folder: Path
    losses: tuple[float, ...]
    input_ids: torch.Tensor

    @property
    def steps(self) -> int:
        """Steps recorded."""
        return len(self.losses)

    def masters(self, step: int) -> dict[str, torch.Tensor]:
        """The float32 master weights after ``step`` steps (1..steps), checkpoint name -> tensor.

        Raises:
            ValueError: ``step`` is not in 1..steps.
        """
        if not 1 <= step <= self.steps:
            raise ValueError(f"step {step} not recorded: this trajectory holds steps 1..{self.steps}")
        return load_file(self.folder / f"step-{step}.safetensors")

    def replay(self) -> ReplayTrainer:
        """A fresh :class:`ReplayTrainer` at step 0."""
        return ReplayTrainer(self)


class ReplayTrainer:
    """CpuTrainer's interface over a :class:`Trajectory`: ``step()`` moves the model to the next recorded step.

    Attributes:
        model: a float32 ``LlamaForCausalLM`` (train mode, head tied) holding the masters of step ``steps``.
        input_ids: the trajectory's batch, ``[4, 64]`` int64.
        steps: steps replayed so far.
    """

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        self.model = AutoModelForCausalLM.from_pretrained(trajectory.checkpoint_dir, dtype=torch.float32)
        self.model.train()
        self.input_ids = trajectory.input_ids.clone()
        self.steps = 0

    def step(self) -> float:
        """Load the next step's masters into :attr:`model` and return the loss that step had.

        Raises:
            ValueError: every recorded step was replayed already.
        """
        masters = self.trajectory.masters(self.steps + 1)
        missing, unexpected = self.model.load_state_dict(masters, strict=False)
        if missing != ["lm_head.weight"] or unexpected:  # the head is tied to model.embed_tokens.weight
            raise RuntimeError(f"step file does not match the model: missing {missing}, unexpected {unexpected}")
        self.steps += 1
        return self.trajectory.losses[self.steps - 1]

    def served_view(self) -> dict[str, torch.Tensor]:
        """As :meth:`CpuTrainer.served_view`: each parameter cast to bf16, fresh copies."""
        return bf16_view(self.model)


def _load(checkpoint_dir: Path, folder: Path) -> Trajectory:
    done = json.loads((folder / _DONE).read_text())
    ids = torch.tensor(done["input_ids"], dtype=torch.int64)
    return Trajectory(Path(checkpoint_dir), folder, tuple(done["losses"]), ids)


def recorded_trajectory(checkpoint_dir: Path, folder: Path) -> Trajectory:
    """The trajectory recorded in ``folder``, training and writing it first if no process has.

    Safe across processes: the recording is made under ``folder``'s file lock and marked done
    (``trajectory.json``) last, so a process that died mid-recording leaves it to the next one.

    Args:
        checkpoint_dir: the SmolLM2 checkpoint (``build_smollm2_checkpoint``).
        folder: where the step files live; shared by every process of one pytest session.

    Raises:
        filelock.Timeout: another process held the lock for more than :data:`LOCK_TIMEOUT_S`.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock", timeout=LOCK_TIMEOUT_S):
        if (folder / _DONE).is_file():
            return _load(checkpoint_dir, folder)
        shutil.rmtree(folder, ignore_errors=True)  # a recording cut short
        folder.mkdir()
        trainer, losses = CpuTrainer(checkpoint_dir), []
        for step in range(1, STEPS + 1):
            losses.append(trainer.step())
            masters = {name: t.detach().contiguous() for name, t in checkpoint_state(trainer.model).items()}
            save_file(masters, str(folder / f"step-{step}.safetensors"))
        done = {"losses": losses, "input_ids": trainer.input_ids.tolist()}
        tmp = folder / f".{_DONE}.{os.getpid()}"
        tmp.write_text(json.dumps(done))
        tmp.replace(folder / _DONE)
        return _load(checkpoint_dir, folder)
