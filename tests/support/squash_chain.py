"""A chain of views shaped like RL steps, for the squash tests."""

from __future__ import annotations

import numpy as np

from stitchboard.proto.codec import build_patch, checksum, encode_tensor
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


def wrong_bits_squash(views: list[dict[str, RawTensor]], base: int, target: int, encoding: str = "cond") -> bytes:
    """A squash patch ``base -> target`` whose index is right (version ``base``'s checksums as its
    bases, ``target``'s as its targets) but whose bits are not: decoded on ``base`` it gives
    ``target``'s view with one element of one tensor off by its lowest bit. Every index check
    passes it (the bulletin's put, the sidecar's fetch); only a decode on the base finds it."""
    wrong = copy_view(views[target])
    moved = sorted(n for n in wrong if not np.array_equal(views[base][n].bits, wrong[n].bits))
    wrong[moved[0]].bits[0] ^= 1
    encoded = [
        encode_tensor(
            n,
            views[base][n],
            wrong[n],
            encoding,
            base_checksum=checksum(views[base][n]),
            target_checksum=checksum(views[target][n]),
        )
        for n in moved
    ]
    meta = {"version": str(target), "base_version": str(base), "squash": "true"}
    return build_patch([e for e in encoded if e is not None], encoding, meta)
