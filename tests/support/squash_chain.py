"""A chain of views shaped like RL steps, for the squash tests."""

from __future__ import annotations

import numpy as np

from stitchboard.proto.container import RawTensor
from tests.sidecar.fake_engine import copy_view
from tests.sidecar.sidecar_helpers import make_view


def rl_steps(seed: int, steps: int, tensors: int = 4, numel: int = 8192) -> list[dict[str, RawTensor]]:
    """A view and ``steps`` successors that, like Adam steps near the bf16 grid, keep moving the
    same ~2 % of elements by one ulp up or down (so k steps touch far fewer than k x 2 %)."""
    rng = np.random.default_rng(seed)
    views = [make_view(seed, tensors, numel)]
    hot = {n: rng.choice(numel, numel // 50, replace=False) for n in views[0]}
    for _ in range(steps):
        view = copy_view(views[-1])
        for name, t in view.items():
            at = hot[name][rng.random(hot[name].size) < 0.5]
            t.bits[at] = (t.bits[at].astype(np.int32) + rng.choice([-1, 1], at.size)).astype(np.uint16)
        views.append(view)
    return views
