"""Change detection where the tensor lives (trainer_client/device_diff.py): the torch-ops diff gives exactly the C
kernel's positions and bits (every served dtype, NaN payloads, -0.0, empty tensors), the patch and target checksum
are byte-identical, and a tensor on a device other than the CPU is routed to it (``on_device`` is our seam; the
torch ops then run on CPU tensors, as no GPU is lent to CI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stitchboard.proto import _bitdiff
from stitchboard.proto.codec import checksum, encode_tensor
from stitchboard.proto.dtypes import DTYPE_SIZES
from stitchboard.trainer_client import publisher as publisher_module
from stitchboard.trainer_client import stream as stream_module
from stitchboard.trainer_client.device_diff import DeviceDiffer, on_device, varint_gaps
from stitchboard.trainer_client.encode_version import BaseTensor
from stitchboard.trainer_client.errors import TiedWeightsError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.recipes import get_recipe
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import TORCH_DTYPE_NAMES, to_raw
from stitchboard.trainer_client.stream import ViewStreamer
from stitchboard.trainer_client.version_parts import PublishedVersion
from tests.trainer_client.toy import assert_same_view

DTYPES = [d for d in TORCH_DTYPE_NAMES if d != torch.bool] + [torch.bool]
ENCODINGS = ["xor", "overwrite", "cond"]


def _random_pair(dtype: torch.dtype, numel: int, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors of ``dtype`` with random bits, the second differing at about ``density`` of the elements."""
    g = np.random.default_rng(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    old = g.integers(0, 256, numel * size, dtype=np.uint8)
    if dtype == torch.bool:
        old &= 1
    new = old.reshape(numel, size).copy()
    hit = g.random(numel) < density
    new[hit, 0] ^= 1  # the lowest bit of each changed element: valid for every dtype, bool included
    return torch.from_numpy(old).view(dtype), torch.from_numpy(new.reshape(-1)).view(dtype)


def _check_same_as_c(
    name: str, old: torch.Tensor, new: torch.Tensor, encoding: str, part_bytes: int | None = None
) -> None:
    """The device path's delta and change of ``old`` -> ``new`` equal the C kernel's, byte for byte."""
    kept = to_raw(old.contiguous())
    target = to_raw(new.contiguous())
    got = DeviceDiffer().diff(name, kept, checksum(kept), new.clone(), encoding, part_bytes)  # type: ignore[arg-type]
    want = encode_tensor(name, kept, target, encoding, part_bytes=part_bytes)  # type: ignore[arg-type]
    assert got.encoded == want
    count, gaps, values = _bitdiff.diff(kept.bits, target.bits, DTYPE_SIZES[kept.dtype], False)
    assert (got.count, got.gaps, got.new_bits) == (count, gaps, values)
    assert got.target_checksum == checksum(target)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_tensors_of_every_served_dtype_give_the_c_kernels_bits(dtype: torch.dtype) -> None:
    for encoding in ENCODINGS:
        for numel, density in ((1, 1.0), (4099, 0.01), (4099, 0.5)):
            old, new = _random_pair(dtype, numel, density, seed=numel)
            _check_same_as_c("w", old, new, encoding)
        old, new = _random_pair(dtype, 64 * 33, 0.05, seed=7)
        _check_same_as_c("rows", old.reshape(64, 33), new.reshape(64, 33), encoding, part_bytes=300)  # row parts


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_edge_cases_no_change_all_changed_nan_payloads_signed_zero_and_empty(encoding: str) -> None:
    old = torch.randn(64, 33).to(torch.bfloat16)
    _check_same_as_c("same", old, old.clone(), encoding)
    _check_same_as_c("all", old, (old.view(torch.int16) ^ 1).view(torch.bfloat16), encoding)
    nan = torch.tensor([0x7FC0, 0x7FC1, -0x0040, 0x0000, 0x7F80, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    other = torch.tensor([0x7FC1, 0x7FC1, 0x7FC0, -0x8000, 0x7F80, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    _check_same_as_c("nan", nan, other, encoding)  # NaN payloads differ; +0.0 -> -0.0 changes; inf stays
    assert DeviceDiffer().diff("nan", to_raw(nan), checksum(to_raw(nan)), other, encoding).count == 3  # type: ignore[arg-type]
    for shape in ((0,), (3, 0)):
        _check_same_as_c("empty", torch.empty(shape, dtype=torch.float32), torch.empty(shape), encoding)
    wide = torch.zeros(3 << 20, dtype=torch.uint8)
    moved = wide.clone()
    moved[[0, 200, 20_000, (3 << 20) - 1]] = 1  # gaps of 1, 2 and 3 varint bytes
    _check_same_as_c("gaps", wide, moved, encoding)
    _check_same_as_c("strided", old.t(), (old.view(torch.int16) + 1).view(torch.bfloat16).t(), encoding)


def test_varint_gaps_are_the_c_kernels_for_gaps_of_every_length() -> None:
    positions = np.array([0, 1, 129, 129 + 16_385, 2**35, 2**35 + 1, 2**62], dtype=np.int64)
    gaps = np.diff(positions, prepend=-1) - 1
    want = bytearray()
    for gap in gaps.tolist():
        while gap >= 0x80:
            want.append(gap & 0x7F | 0x80)
            gap >>= 7
        want.append(gap)
    assert varint_gaps(positions) == bytes(want)
    decoded = np.empty(3, dtype=np.int64)
    _bitdiff.positions(varint_gaps(positions[:3]), decoded, 200)
    assert decoded.tolist() == positions[:3].tolist()


def test_the_mirror_is_used_only_for_the_base_it_holds() -> None:
    differ = DeviceDiffer(keep_on_device=True)
    a, b = _random_pair(torch.bfloat16, 1000, 0.1, seed=1)
    ra, rb = to_raw(a), to_raw(b)
    first = differ.diff("w", ra, checksum(ra), b.clone(), "xor")
    assert differ.mirrored_bytes == 2000 and first.target_checksum == checksum(rb)
    c = (b.view(torch.int16) ^ 3).view(torch.bfloat16)
    again = differ.diff("w", rb, checksum(rb), c.clone(), "xor")  # the mirror holds b: used
    assert again.encoded == encode_tensor("w", rb, to_raw(c), "xor")
    stale = differ.diff("w", ra, checksum(ra), c.clone(), "xor")  # mirror holds c, base is a: the host copy is used
    assert stale.encoded == encode_tensor("w", ra, to_raw(c), "xor")
    differ.retain(set())
    assert differ.mirrored_bytes == 0


@pytest.mark.parametrize("served", ["fp8", "fp8-block"])
def test_fp8_recipes_on_a_torch_tensor_give_the_host_recipes_bits(served: str) -> None:
    recipe = get_recipe(served)
    w = torch.randn(300, 200).to(torch.bfloat16)
    w[5] = 0  # a zero row: eps scale
    name = "model.layers.0.mlp.up_proj.weight"
    got = recipe.apply_tensor(name, w, "BF16")
    want = recipe.apply({name: to_raw(w)})
    assert set(got) == set(want) and len(want) == 2
    assert_same_view({n: to_raw(t.contiguous()) for n, t in got.items()}, want)
    norm = torch.ones(200, dtype=torch.bfloat16)
    assert (
        recipe.apply_tensor("model.layers.0.input_layernorm.weight", norm, "BF16")[
            "model.layers.0.input_layernorm.weight"
        ]
        is norm
    )


def test_a_tensor_on_another_device_is_routed_to_the_device_path() -> None:
    assert on_device(torch.empty(2, device="meta")) and not on_device(torch.empty(2))


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(96, 32, generator=g),
        "model.layers.0.input_layernorm.weight": torch.ones(32),
        "model.layers.0.step": torch.tensor([seed], dtype=torch.int64),
    }


@pytest.mark.parametrize(
    ("served", "encoding", "part_bytes"), [("bf16", "cond", None), ("bf16", "xor", 1024), ("fp8", "cond", 1024)]
)
def test_a_publish_routed_to_the_device_path_writes_the_same_patch_and_pulls_bit_exact(
    bulletin, run, tmp_path, monkeypatch, served: str, encoding: str, part_bytes: int | None
) -> None:
    calls: list[str] = []
    device_diff = DeviceDiffer.diff

    def spy(self: DeviceDiffer, name: str, *args: object) -> object:
        calls.append(name)
        return device_diff(self, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DeviceDiffer, "diff", spy)
    state = _state(0)
    with Publisher(
        bulletin.url, run, encoding=encoding, served=served, device_kept_view=True, part_bytes=part_bytes
    ) as pub:  # type: ignore[arg-type]
        pub.publish(state, step=0)
        for step in (1, 2):
            state = {n: t + 1e-2 * torch.randn_like(t) if t.is_floating_point() else t + 1 for n, t in state.items()}
            host = pub._stream_of(state)
            assert host is not None and not calls
            for module in (publisher_module, stream_module):
                monkeypatch.setattr(module, "on_device", lambda t: True)  # as if the tensors were on a GPU
            routed = pub._stream_of(state)
            assert routed is not None and sorted(calls) == sorted(routed.layout)
            meta = {"run": run, "version": str(step), "base_version": str(step - 1)}
            assert routed.part(meta) == host.part(meta) and routed.changes == host.changes
            parted = [e.entry.name for e in routed.encoded if e.entry.parts is not None]
            assert bool(parted) == (part_bytes is not None)  # the 96 x 32 up_proj and 64 x 32 embedding in parts
            result = pub.publish(state, step=step)
            monkeypatch.undo()
            monkeypatch.setattr(DeviceDiffer, "diff", spy)
            calls.clear()
            assert result.changed_elements > 0 and pub._device_differ.mirrored_bytes > 0
            assert_same_view(rebuild_version(pub.client, run, step, workdir=tmp_path).view, dict(pub.kept_view()))


def test_device_tensors_new_to_the_view_are_kept_whole_and_a_tied_head_is_folded_or_refused(monkeypatch) -> None:
    monkeypatch.setattr(stream_module, "on_device", lambda t: True)
    emb = torch.randn(16, 8).to(torch.bfloat16)
    base = {"model.embed_tokens.weight": to_raw(emb)}
    tensors = {n: BaseTensor(t.dtype, tuple(t.shape), checksum(t)) for n, t in base.items()}
    published = PublishedVersion(0, base, tensors, 0)
    new_emb = (emb.view(torch.int16) ^ 1).view(torch.bfloat16)
    differ = DeviceDiffer(keep_on_device=True)
    streamer = ViewStreamer(published, "xor", tied=True, device=differ)
    streamer.add("model.embed_tokens.weight", new_emb.clone())
    streamer.add("model.norm.weight", torch.ones(8, dtype=torch.bfloat16))  # new to the view
    streamer.add("lm_head.weight", new_emb.clone())
    got = streamer.finish()
    assert set(got.layout) == {"model.embed_tokens.weight", "model.norm.weight"} and set(got.whole) == {
        "model.norm.weight"
    }
    assert got.changes["model.embed_tokens.weight"].count == emb.numel()
    assert differ.mirrored_bytes == (emb.numel() + 8) * 2
    refused = ViewStreamer(published, "xor", tied=True, device=differ)
    refused.add("model.embed_tokens.weight", new_emb.clone())
    refused.add("lm_head.weight", emb.clone())
    with pytest.raises(TiedWeightsError):
        refused.finish()
