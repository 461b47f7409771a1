"""The demo's verifiable task: counting, with graded credit.

A 135M instruct model fails most exact-answer tasks, which makes every reward in a group
equal, every group-relative advantage 0 and every step a no-op. Counting gives graded credit
that varies between samples of one prompt: the reward is the length of the correct prefix of
``1, 2, ..., n`` in the answer divided by ``n`` (in [0, 1]), minus 0.2 when the answer goes on
past ``n`` or contains anything but the numbers, so a group of samples almost always has
spread (measured with SmolLM2-135M-Instruct at temperature 1: most groups of 4 have distinct
rewards).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: How far each prompt asks to count; the demo cycles through these.
COUNT_TARGETS = (5, 6, 7, 8, 9, 10, 11, 12)


@dataclass(frozen=True)
class Prompt:
    """One task instance: the user message and how far it asks to count."""

    n: int

    @property
    def message(self) -> str:
        """The user turn sent to the model."""
        return f"Count from 1 to {self.n}. Write only the numbers, separated by commas."


def prompts_for_step(step: int, count: int) -> list[Prompt]:
    """The ``count`` prompts of training step ``step`` (deterministic, cycling the targets)."""
    return [Prompt(COUNT_TARGETS[(step * count + i) % len(COUNT_TARGETS)]) for i in range(count)]


def reward(prompt: Prompt, completion: str) -> float:
    """Graded credit in [-0.2, 1]: correct prefix of 1..n over n, minus 0.2 for anything extra."""
    numbers = re.findall(r"-?\d+", completion)
    prefix = 0
    for got, want in zip(numbers, range(1, prompt.n + 1), strict=False):
        if got != str(want):
            break
        prefix += 1
    extra = len(numbers) > prompt.n or bool(re.sub(r"[\d,\s.]", "", completion))
    return prefix / prompt.n - (0.2 if extra else 0.0)
