"""The demo on a mixture-of-experts model: the built-in presets, a reward with spread, the routing check.

``stitchboard demo --model tiny-qwen3-moe`` (or ``tiny-mixtral``) runs the main job on a tiny
randomly initialised MoE checkpoint (:mod:`.moe_models`, built on first use). Two things differ
from the SmolLM2 run:

* **The reward.** A random model writes random tokens: every sample scores 0 on the counting
  task, every group-relative advantage is 0 and no step changes a weight. The presets use
  :func:`parity_reward` instead: the share of even token ids in the completion, as the
  trainer's tokenizer encodes it (the ids the GRPO step trains on). It is deterministic, in
  [0, 1], and a group of random completions of 24 tokens almost always has spread (its standard
  deviation is ~0.1), so every step has non-zero advantages and changes weights, and the policy
  has something to learn (put mass on even ids).
* **Routing replay.** Every rollout of a MoE model asks the sidecar for the experts its tokens
  were routed to (``return_routed_experts``: one completion per request, so a group is sent as
  concurrent requests); the run fails the check :data:`ROUTING_CHECK` unless every answer
  came back with a full routing (:meth:`RoutingShape.problem`).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .moe_models import PRESETS, moe_preset_checkpoint

#: The demo's PASS-check line for routing replay.
ROUTING_CHECK = "routing returned for every response"
#: The body field a rollout sets to get its routing back (SGLang's name; the sidecar's too).
ROUTING_FIELD = "return_routed_experts"
#: Config keys holding the number of routed experts (Qwen3-MoE / DeepSeek, Mixtral).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class RoutingShape:
    """What a complete routing of a MoE model holds: per token row, ``layers`` x ``top_k`` expert
    ids in ``[0, experts)``."""

    layers: int
    top_k: int
    experts: int

    @classmethod
    def of(cls, model_dir: Path) -> RoutingShape | None:
        """The shape from ``model_dir/config.json``; None for a model without routed experts
        (or an unreadable config)."""
        try:
            config = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError):
            return None
        experts = next((config[k] for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int) and config[k] > 0), None)
        if experts is None:
            return None
        return cls(int(config["num_hidden_layers"]), int(config["num_experts_per_tok"]), experts)

    def problem(self, answer: dict) -> str | None:
        """Why ``answer`` (a sidecar's ``/v1/completions`` JSON answer asked with
        :data:`ROUTING_FIELD`) lacks a full routing, or None when it has one.

        A full routing is ``sglext.routed_experts``: base64 of int32 ids, ``[prompt_tokens +
        completion_tokens - 1, layers, top_k]`` (every position read by a forward pass), each
        id in ``[0, experts)``, with ``routed_experts_weight_versions`` spans over its rows.
        """
        encoded = (answer.get("sglext") or {}).get("routed_experts")
        if not encoded:
            return f"no routed_experts ({answer.get('routed_experts_error', 'no error given')})"
        usage = answer.get("usage") or {}
        rows = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0)) - 1
        ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        if ids.size != rows * self.layers * self.top_k:
            return f"routed_experts holds {ids.size} ids, not {rows} rows x {self.layers} layers x top-{self.top_k}"
        if ids.size and (ids.min() < 0 or ids.max() >= self.experts):
            return f"routed_experts holds ids outside 0..{self.experts - 1}"
        spans = answer.get("routed_experts_weight_versions") or []
        if sum(int(sp["end"]) - int(sp["start"]) for sp in spans) != rows:
            return f"routed_experts_weight_versions {spans} do not cover its {rows} rows"
        return None


def resolve_model(value: str | None) -> tuple[Path | None, str | None]:
    """``--model`` as given: a preset name (:data:`.moe_models.PRESETS`, built on first use) or a folder.

    Returns:
        (checkpoint folder, preset name); (None, None) when ``value`` is None (the SmolLM2 default).
        A folder is returned as given (checked when the run loads it).

    Raises:
        ModelBuildError: building the preset failed.
    """
    if value is None:
        return None, None
    if value in PRESETS and not Path(value).exists():  # a folder of that name in the cwd wins
        return moe_preset_checkpoint(value), value
    return Path(value), None


def parity_reward(token_ids: Sequence[int]) -> float:
    """The share of even ids in ``token_ids``, in [0, 1] (0 for an empty completion)."""
    return sum(1 for t in token_ids if t % 2 == 0) / len(token_ids) if token_ids else 0.0


def completion_reward(tokenizer, completion: str) -> float:
    """:func:`parity_reward` of ``completion`` encoded by ``tokenizer`` (no special tokens)."""
    return parity_reward(tokenizer(completion, add_special_tokens=False)["input_ids"])
