"""Staging and committing patches (``stitchboard.sidecar.engines.vllm.update``) without vLLM.

The runtime layout is the seam: a small layout object places checkpoint tensors in torch
parameters the way :class:`~stitchboard.sidecar.engines.vllm.layout.RuntimeLayout` does for a live
model, including two checkpoint tensors fused in one parameter (``q``/``k`` rows of ``qkv``).
Patches are real codec output, ``cond`` (the publisher's default, decoded on the host copy's
bits) and ``xor``. The real engine path (vLLM CPU, packing, TP = 3) is covered by
``test_vllm_engine.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from stitchboard.proto.codec import PatchEncoding, build_patch, encode_tensor
from stitchboard.proto.container import RawTensor
from stitchboard.proto.diff import diff_views
from stitchboard.proto.errors import BaseMismatchError, PatchFormatError, TargetMismatchError
from stitchboard.proto.schema import XXH3_128
from stitchboard.sidecar.engines.vllm.experts import ExpertPlacement
from stitchboard.sidecar.engines.vllm.layout import Placement
from stitchboard.sidecar.engines.vllm.update import (
    commit_staged,
    stage_patches,
)
from stitchboard.sidecar.engines.vllm.weights import WeightIO
from stitchboard.sidecar.errors import ApplyFailedError

SHAPES = {"q": (8, 16), "k": (4, 16), "norm": (16,)}


def _view(seed: int, base: dict[str, RawTensor] | None = None, fraction: float = 0.1) -> dict[str, RawTensor]:
    """bf16 view; with ``base``, a copy whose bits differ at ~``fraction`` of the positions."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in SHAPES.items():
        if base is None:
            bits = (
                torch.randn(shape, generator=torch.Generator().manual_seed(seed + len(name)))
                .to(torch.bfloat16)
                .view(torch.int16)
                .numpy()
                .view(np.uint16)
                .reshape(-1)
            )
        else:
            bits = base[name].bits.copy()
            hit = rng.random(bits.size) < fraction
            bits[hit] ^= rng.integers(1, 8, hit.sum(), dtype=np.uint16)
        out[name] = RawTensor("BF16", shape, np.ascontiguousarray(bits))
    return out


class _Layout:
    """``q`` and ``k`` fused in one parameter (rows 0-7 and 8-11), ``norm`` alone; one rank."""

    def __init__(self, view: dict[str, RawTensor]) -> None:
        qk = np.concatenate([view["q"].bits, view["k"].bits]).view(np.int16).reshape(12, 16)
        self.qkv = torch.nn.Parameter(torch.from_numpy(qk.copy()).view(torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(
            torch.from_numpy(view["norm"].bits.view(np.int16).copy()).view(torch.bfloat16), requires_grad=False
        )
        self.places = {
            "q": Placement("q", "qkv", "BF16", (8, 16), 0, ((0, 8),), 0, 0, self.qkv, ()),
            "k": Placement("k", "qkv", "BF16", (4, 16), 0, ((0, 4),), 0, 8, self.qkv, ()),
            "norm": Placement("norm", "norm", "BF16", (16,), 0, ((0, 16),), 0, 0, self.norm, ()),
        }

    def place(self, name: str) -> Placement:
        return self.places[name]

    def held(self) -> dict[str, np.ndarray]:
        return {
            n: p.block().contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()
            for n, p in self.places.items()
        }


def _files(
    tmp_path, views: list[dict[str, RawTensor]], encoding: PatchEncoding = "cond"
) -> list[tuple[list[str], int, int]]:
    steps = []
    for v in range(1, len(views)):
        path = tmp_path / f"v{v}.patch"
        path.write_bytes(diff_views(views[v - 1], views[v], encoding).patch)
        steps.append(([str(path)], v - 1, v))
    return steps


def _assert_holds(layout: _Layout, view: dict[str, RawTensor]) -> None:
    held = layout.held()
    for name, t in view.items():
        assert np.array_equal(held[name], t.bits), f"{name} differs"


@pytest.mark.parametrize("encoding", ["cond", "xor"])
def test_a_chain_of_steps_is_staged_without_writing_then_committed_bit_exact(tmp_path, encoding):
    """Each step decodes on the host copy as the previous step left it (``cond`` needs that base)."""
    views = [_view(0)]
    views += [_view(v, views[-1]) for v in (1, 2, 3)]
    layout = _Layout(views[0])
    io = WeightIO(layout, None, repack=False)
    staged = stage_patches(io, _files(tmp_path, views, encoding))
    _assert_holds(layout, views[0])  # staging writes nothing
    assert (staged.from_version, staged.to_version, staged.report["tensors"]) == (0, 3, 3)
    changed = sum(int((views[0][n].bits != views[3][n].bits).sum()) for n in SHAPES)
    assert staged.report["rank_elements"] >= changed  # union of the steps' positions
    report = commit_staged(io, staged, lambda phase: None)
    _assert_holds(layout, views[3])
    assert report["write_s"] >= 0 and report["verify_s"] >= 0


@pytest.mark.parametrize("encoding", ["cond", "xor", "overwrite"])
@pytest.mark.parametrize("part_bytes", [None, 64])
def test_one_step_is_staged_on_the_live_parameters_then_committed_bit_exact(
    tmp_path, monkeypatch, encoding, part_bytes
):
    """One step at TP = 1 with no GEMM copy stages every tensor on the live bits (no host copy of a parameter):
    the target checksum, ``xxh3_128`` or over row parts of 64 bytes, is that of the bits the delta makes. The base
    checksum is taken only for ``overwrite`` (is a tensor already at the target?) and to name a refusal."""
    from stitchboard.sidecar.engines.vllm import staged_tensor, update

    live, original = [], update.stage_live
    base_checks, at_base = [], staged_tensor.at_base

    def counted(io, p, *rest):
        live.append(p.name)
        return original(io, p, *rest)

    def counted_base(step_delta, *rest):
        base_checks.append(step_delta.entry.name)
        return at_base(step_delta, *rest)

    monkeypatch.setattr(update, "stage_live", counted)
    monkeypatch.setattr(staged_tensor, "at_base", counted_base)
    views = [_view(0)]
    views.append(_view(1, views[0]))
    encoded = [encode_tensor(n, views[0][n], views[1][n], encoding, part_bytes=part_bytes) for n in SHAPES]
    path = tmp_path / "v1.patch"
    path.write_bytes(build_patch([e for e in encoded if e is not None], encoding))
    layout = _Layout(views[0])
    io = WeightIO(layout, None, repack=False)
    staged = stage_patches(io, [([str(path)], 0, 1)])
    _assert_holds(layout, views[0])  # staging writes nothing
    assert sorted(live) == sorted(SHAPES)
    assert sorted(base_checks) == (sorted(SHAPES) if encoding == "overwrite" else [])
    assert staged.report["rank_elements"] == sum(int((views[0][n].bits != views[1][n].bits).sum()) for n in SHAPES)
    commit_staged(io, staged, lambda phase: None)
    _assert_holds(layout, views[1])
    if encoding == "overwrite":  # staged again on its target: every tensor already current, nothing to write
        again = stage_patches(io, [([str(path)], 0, 1)])
        assert again.report["tensors_already_current"] == len(SHAPES) and not again.writes
    else:
        with pytest.raises(BaseMismatchError, match="step 0->1"):
            stage_patches(io, [([str(path)], 0, 1)])


def test_a_step_from_another_base_is_refused_at_staging(tmp_path):
    views = [_view(0)]
    views.append(_view(1, views[0]))
    steps = _files(tmp_path, views)
    stray = tmp_path / "v0-v2.patch"  # takes version 0, not 1, to some version 2
    stray.write_bytes(diff_views(views[0], _view(2, views[0]), "cond").patch)
    steps.append(([str(stray)], 1, 2))
    layout = _Layout(views[0])
    with pytest.raises(BaseMismatchError, match="step 1->2"):
        stage_patches(WeightIO(layout, None, repack=False), steps)
    _assert_holds(layout, views[0])


@pytest.mark.parametrize("encoding", ["cond", "xor"])
def test_a_wrong_target_checksum_is_refused_at_staging(tmp_path, encoding):
    base = _view(0)
    target = _view(1, base)
    enc = encode_tensor("k", base["k"], target["k"], encoding)
    enc = dataclasses.replace(enc, entry=dataclasses.replace(enc.entry, target={XXH3_128: "0" * 32}))
    path = tmp_path / "bad.patch"
    path.write_bytes(build_patch([enc], encoding))
    layout = _Layout(base)
    with pytest.raises(TargetMismatchError, match="'k'"):
        stage_patches(WeightIO(layout, None, repack=False), [([str(path)], 0, 1)])
    _assert_holds(layout, base)


def test_a_corrupt_cond_stream_is_refused_at_staging_after_a_good_step(tmp_path):
    """Step 2's stream decodes on step 1's result and fails there: nothing of either step is written."""
    views = [_view(0)]
    views += [_view(v, views[-1]) for v in (1, 2)]
    steps = _files(tmp_path, views)
    path = Path(steps[1][0][0])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x5A  # inside the last tensor's range-coded stream
    path.write_bytes(bytes(data))
    layout = _Layout(views[0])
    with pytest.raises((PatchFormatError, TargetMismatchError)):
        stage_patches(WeightIO(layout, None, repack=False), steps)
    _assert_holds(layout, views[0])


class _Linear(torch.nn.Module):
    """A module whose GEMM copy is an attribute, as vLLM's CPU linears hold ``cpu_linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_linear = "packed from the base"


def test_a_write_that_does_not_read_back_restores_bits_and_gemm_copies(tmp_path, monkeypatch):
    """The commit writes (each chunk read back), swaps GEMM copies; a lost write puts the old bits and copies back."""
    views = [_view(0)]
    views.append(_view(1, views[0]))
    layout = _Layout(views[0])
    io = WeightIO(layout, None, repack=False)
    staged = stage_patches(io, _files(tmp_path, views))
    linear = _Linear()
    staged = dataclasses.replace(staged, packs=[(linear, "packed from the target")])
    last = staged.writes[-1].placement.name
    real = Placement.accessors

    def losing(self: Placement) -> tuple:
        # the last tensor's write loses its first element (as if another writer raced it)
        scatter, gather = real(self)
        if self.name != last:
            return scatter, gather
        return (lambda index, values: scatter(index[1:], values[1:])), gather

    monkeypatch.setattr(Placement, "accessors", losing)
    phases = []
    with pytest.raises(ApplyFailedError) as failed:
        commit_staged(io, staged, phases.append)
    assert failed.value.details["cause"] == TargetMismatchError.type and failed.value.details["restored"] is True
    assert failed.value.details["name"] == last and "do not read back" in str(failed.value)
    assert phases == ["staged", "half-written"]
    _assert_holds(layout, views[0])
    assert linear.cpu_linear == "packed from the base"


def test_accessors_refuse_a_block_that_is_a_copy():
    """A placement whose block_bits gathers a copy must say how it writes: writes into the copy would be lost."""

    class Gathered(Placement):
        def block_bits(self, data=None):
            return super().block_bits(data).clone()

    param = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(TypeError, match="is a copy"):
        Gathered("w", "w", "BF16", (4, 4), 0, ((0, 4),), 0, 0, param, ()).accessors()


def test_expert_accessors_write_and_read_through_the_map():
    """An expert block is gathered through its map; its accessors write and read the packed parameter there."""
    param = torch.nn.Parameter(torch.zeros(2, 6, dtype=torch.bfloat16), requires_grad=False)
    flat = torch.tensor([7, 1, 10, 4, 0, 9], dtype=torch.int64)  # the block's element i lives at flat[i]
    p = ExpertPlacement("e", "w13", "BF16", (2, 3), 0, ((0, 2),), 0, 0, param, (), flat=flat)
    scatter, gather = p.accessors()
    index, bits = np.array([0, 2, 5]), np.array([11, 22, 33], dtype=np.int16)
    scatter(index, bits)
    assert gather(index).tolist() == [11, 22, 33]
    assert p.block_bits()[torch.from_numpy(index)].tolist() == [11, 22, 33]
    live = param.data.view(torch.int16).reshape(-1)
    assert live[flat[torch.from_numpy(index)]].tolist() == [11, 22, 33] and int(live.count_nonzero()) == 3
