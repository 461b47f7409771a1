"""A small model and a real optimizer step, for the fast trainer SDK tests."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from stitchboard.proto.container import RawTensor
from stitchboard.trainer_client.served_view import served_view


def toy_model(seed: int = 0) -> torch.nn.Module:
    """Embedding + two Linear + LayerNorm, float32 (~6 k parameters)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Linear(32, 48), torch.nn.Linear(48, 32), torch.nn.LayerNorm(32)
    )


class ToyTrainer:
    """AdamW steps of :func:`toy_model` on a fixed batch; ``wrap`` shards the model in place
    (e.g. FSDP2's ``fully_shard``) before the optimizer takes its parameters."""

    def __init__(self, seed: int = 0, lr: float = 1e-3, wrap: Callable[[torch.nn.Module], None] | None = None) -> None:
        self.model = toy_model(seed)
        if wrap is not None:
            wrap(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(seed))

    def step(self) -> None:
        self.opt.zero_grad()
        self.model(self.tokens).pow(2).mean().backward()
        self.opt.step()


def assert_same_view(got: dict[str, RawTensor], want: dict[str, RawTensor]) -> None:
    """Bitwise equality of two views, tensor by tensor."""
    assert set(got) == set(want)
    for name, w in want.items():
        assert (got[name].dtype, tuple(got[name].shape)) == (w.dtype, tuple(w.shape)), name
        assert np.array_equal(got[name].bits, w.bits), name


def view_of(model: torch.nn.Module) -> dict[str, RawTensor]:
    """The default (bf16) served view of ``model``."""
    return served_view(model)
