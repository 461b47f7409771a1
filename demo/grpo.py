"""One GRPO-style policy-gradient step on the CPU, with fp32 master weights.

For each prompt, the group of sampled completions gets group-relative advantages
``A_i = (r_i - mean(r)) / (std(r) + 1e-4)`` (GRPO, arXiv:2402.03300, without the KL term and
clipping: every step is on-policy, one optimizer step per batch). The loss is
``-sum_i A_i * sum_t log p(token_t | prefix) / (number of completion tokens)``, and AdamW takes
one step. Completions are re-tokenized with the model's tokenizer after the chat-templated
prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sample:
    """One sampled completion: its prompt text (chat-templated), completion text and reward."""

    prompt_text: str
    completion: str
    reward: float
    group: int


def group_advantages(samples: list[Sample]) -> list[float]:
    """Group-relative advantages, one per sample (0 for a group whose rewards are all equal)."""
    out = []
    for s in samples:
        rewards = torch.tensor([o.reward for o in samples if o.group == s.group], dtype=torch.float64)
        std = rewards.std(unbiased=False) if len(rewards) > 1 else torch.tensor(0.0, dtype=torch.float64)
        out.append(float((s.reward - rewards.mean()) / (std + 1e-4)) if std > 0 else 0.0)
    return out


def policy_gradient_step(
    model: torch.nn.Module, tokenizer, optimizer: torch.optim.Optimizer, samples: list[Sample]
) -> float:
    """Take one optimizer step on ``samples``; returns the loss (0.0 and no step if all advantages are 0).

    Args:
        model: a causal LM with fp32 parameters (the master weights).
        tokenizer: its tokenizer.
        optimizer: e.g. AdamW(lr=3e-6).
        samples: completions with rewards and group ids.
    """
    advantages = group_advantages(samples)
    if not any(advantages):
        return 0.0
    prompts = [tokenizer(s.prompt_text, add_special_tokens=False)["input_ids"] for s in samples]
    fulls = [tokenizer(s.prompt_text + s.completion, add_special_tokens=False)["input_ids"] for s in samples]
    width = max(len(f) for f in fulls)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    weight = torch.zeros((len(samples), width - 1), dtype=torch.float32)
    for i, (p, f) in enumerate(zip(prompts, fulls, strict=True)):
        ids[i, : len(f)] = torch.tensor(f)
        mask[i, : len(f)] = 1
        weight[i, len(p) - 1 : len(f) - 1] = advantages[i]  # predicts completion tokens only
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    tokens = (weight != 0).sum().clamp(min=1)
    loss = -(logp * weight).sum() / tokens
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())
