"""Real training steps on the CPU, for tests and benchmarks that need genuine weight updates.

:class:`CpuTrainer` loads the SmolLM2-135M-Instruct checkpoint built by
:func:`stitchboard.demo.smollm2.build_smollm2_checkpoint` as float32 master weights,
trains it with AdamW on one fixed batch of real English text (:data:`TRAINING_TEXT`), and
exposes what a trainer would publish: the bf16 cast of every parameter under its checkpoint
name (:meth:`CpuTrainer.served_view`).

Measured on a 2-core shared CPU (torch 2.13 CPU, 2 threads), batch 4 x 64 tokens, lr 3e-6,
seed 0 (two runs gave bit-identical losses and change counts):

* set-up (load + tokenize): ~2 s; one :meth:`CpuTrainer.step` (forward, backward and AdamW
  over 134.5 M parameters): 1.7-2.6 s, the first one ~4.5 s; peak RSS ~3.8 GB.
* loss over 5 steps: 3.8922, 3.8385, 3.7890, 3.7413, 3.6949.
* served-view bf16 elements whose bits change from one step to the next, of 134,515,008:
  0.57 %, 0.97 %, 1.26 %, 0.96 %, 0.63 % for steps 1-5 (embedding alone: 1.0-1.9 %; the
  30 x 2 + 1 norm vectors: 43-68 elements in all). A bf16 value moves only when its
  float32 master crosses a rounding boundary: the first time after drifting half a bf16
  ulp from the grid point it was loaded at, then once per full ulp, so the per-step
  fraction rises and falls over the first steps rather than staying flat.
* the served view before any step is bit-identical to ``model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stitchboard.trainer_client.served_view import checkpoint_state

#: 482 tokens of plain English prose (SmolLM2 tokenizer); the batch is cut from its start.
TRAINING_TEXT = """\
The lighthouse stood at the end of a long spit of sand, and for most of the year the keeper \
saw no one but the man who brought oil and flour on the first Monday of each month. He kept \
a logbook in which he wrote the weather, the ships that passed, and the birds that rested on \
the gallery rail. In the spring there were terns and sandpipers; in the autumn, long ragged \
lines of geese that flew south so low over the water that he could hear their wings.

Keeping the light was simple work, but it had to be done every night without fail. At dusk he \
climbed the one hundred and twelve steps, trimmed the wick, polished the great glass lens, \
and wound the clockwork that turned it. Then he sat by the window with a mug of tea and \
watched the beam sweep across the waves, once every twelve seconds, until the sky grew pale \
again in the east.

A library is a quiet place, but it is never an idle one. Each morning the staff sort the \
returned books, repair torn covers, and answer questions about everything from tax forms to \
the names of distant stars. Children come in after school to read comics and finish their \
homework, and older visitors spend whole afternoons with newspapers from towns they left \
decades ago. A good librarian knows that the right book, handed over at the right moment, \
can change the course of a life.

To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven \
grams of dried yeast, and about three hundred and fifty millilitres of warm water. Knead the \
dough for ten minutes, until it is smooth and springs back when pressed. Leave it in a covered \
bowl until it has doubled in size, then shape it, let it rise once more, and bake it in a hot \
oven for thirty to thirty-five minutes. The loaf is done when it sounds hollow when tapped on \
the bottom.

Rivers shape the land they flow through. Over thousands of years they carve valleys, carry \
soil down from the hills, and lay it out again as wide, fertile plains near the sea. People \
have always settled along their banks, drawn by fresh water, good farmland, and an easy road \
for trade. Many of the great cities of the world grew up where a river could be crossed.
"""


class CpuTrainer:
    """SmolLM2 with float32 master weights and AdamW, stepping on one fixed text batch.

    Args:
        checkpoint_dir: a folder built by ``build_smollm2_checkpoint`` (bf16 safetensors).
        batch_size: rows of the batch.
        seq_len: tokens per row; the batch is the first ``batch_size * seq_len`` tokens of
            :data:`TRAINING_TEXT`, shape ``[batch_size, seq_len]``, int64.
        lr: AdamW learning rate (betas and eps are torch's defaults).
        weight_decay: AdamW decoupled weight decay.
        seed: passed to ``torch.manual_seed`` before loading, so runs are repeatable.

    Raises:
        ValueError: ``batch_size * seq_len`` exceeds the tokens of :data:`TRAINING_TEXT`.
        OSError: ``checkpoint_dir`` is not a loadable checkpoint (from transformers).

    Attributes:
        model: the ``LlamaForCausalLM`` in float32, train mode; ``lm_head`` is tied to
            ``model.embed_tokens``.
        optimizer: the ``torch.optim.AdamW`` over ``model.parameters()``.
        input_ids: the fixed batch, ``[batch_size, seq_len]`` int64.
        steps: optimizer steps taken so far.
    """

    def __init__(
        self,
        checkpoint_dir: Path,
        *,
        batch_size: int = 4,
        seq_len: int = 64,
        lr: float = 3e-6,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        tokens = tokenizer(TRAINING_TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        needed = batch_size * seq_len
        if tokens.numel() < needed:
            raise ValueError(
                f"batch {batch_size} x {seq_len} needs {needed} tokens; TRAINING_TEXT has {tokens.numel()}"
            )
        self.input_ids = tokens[:needed].reshape(batch_size, seq_len).clone()
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.steps = 0

    def step(self) -> float:
        """Take one AdamW step on the fixed batch and return its loss.

        Returns:
            The mean next-token cross-entropy (nats per token) of the batch, computed with
            the weights before the step.
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(input_ids=self.input_ids, labels=self.input_ids).loss
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return loss.item()

    def served_view(self) -> dict[str, torch.Tensor]:
        """The weights a rollout engine would serve now: each parameter cast to bf16.

        Returns:
            ``{checkpoint name: tensor}``, bf16, same shapes as the parameters, rounded to
            nearest even from the float32 masters; fresh copies, not views of the model. The
            names are exactly the keys of the checkpoint's ``model.safetensors`` (272 tensors):
            the tied output embedding appears once, as ``model.embed_tokens.weight``. For
            a MoE checkpoint (:mod:`stitchboard.demo.moe_models`), the per-expert checkpoint
            names, as the trainer SDK publishes them.
        """
        return bf16_view(self.model)


@torch.no_grad()
def bf16_view(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters under their checkpoint names, each cast to bf16 (fresh copies; see
    :meth:`CpuTrainer.served_view`)."""
    return {name: t.to(torch.bfloat16, copy=True) for name, t in checkpoint_state(model).items()}
