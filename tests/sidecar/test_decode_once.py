"""Decoded once, where it is written (DESIGN.md, "The patch format"): the sidecar's fetch-time
check reads a patch's container and index only, so a payload that does not decode passes it; the
engine that writes the patch decodes it in full and refuses it before its first write (vLLM's
staging, SGLang's stage, and the codec's apply that the tests' fake engine uses)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from stitchboard.proto.apply import apply_patch
from stitchboard.proto.codec import PAYLOAD_KEY
from stitchboard.proto.container import RawTensor, parse_safetensors, serialize_safetensors
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from stitchboard.proto.errors import PatchFormatError
from stitchboard.sidecar.engines.sglang.inplace import Ranks, stage
from stitchboard.sidecar.engines.sglang.slot import Slot
from stitchboard.sidecar.engines.vllm.layout import Placement
from stitchboard.sidecar.engines.vllm.update import stage_patches
from stitchboard.sidecar.engines.vllm.weights import WeightIO
from stitchboard.sidecar.fetch import patch_index

SHAPE = (8, 16)


def _views() -> tuple[dict[str, RawTensor], dict[str, RawTensor]]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 14, SHAPE[0] * SHAPE[1], dtype=np.uint16)
    target = base.copy()
    target[::5] ^= 3
    return {"w": RawTensor("BF16", SHAPE, base)}, {"w": RawTensor("BF16", SHAPE, target)}


def _undecodable(tmp_path: Path, encoding: str) -> Path:
    """A patch whose container and index are the codec's but whose payload (a well-formed zstd
    frame of the size the index implies) holds unterminated varints: it parses, it does not decode."""
    base, target = _views()
    meta, tensors = parse_safetensors(diff_views(base, target, encoding).patch)  # type: ignore[arg-type]
    size = len(zstandard.ZstdDecompressor().decompress(tensors[PAYLOAD_KEY].bits.tobytes()))
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"\xff" * size)
    tensors = {**tensors, PAYLOAD_KEY: RawTensor("U8", (len(frame),), np.frombuffer(frame, np.uint8).copy())}
    path = tmp_path / f"{encoding}.patch"
    path.write_bytes(serialize_safetensors(tensors, meta))
    return path


def _param(view: dict[str, RawTensor]) -> torch.nn.Parameter:
    bits = view["w"].bits.view(np.int16).reshape(SHAPE).copy()
    return torch.nn.Parameter(torch.from_numpy(bits).view(torch.bfloat16), requires_grad=False)


class _Layout:
    def __init__(self, slot: object) -> None:
        self.slot, self.tp_size = slot, 1

    def place(self, name: str) -> object:
        return self.slot

    def runtime_params(self) -> list[str]:
        return ["w"]


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_the_sidecar_passes_an_undecodable_payload_and_every_engine_refuses_it_unwritten(tmp_path, encoding):
    path = _undecodable(tmp_path, encoding)
    base, _ = _views()
    assert set(patch_index(path).entries) == {"w"}, "the sidecar reads the index only"
    with pytest.raises(PatchFormatError):
        read_patch(path.read_bytes()).deltas()

    held = {"w": RawTensor("BF16", SHAPE, base["w"].bits.copy())}
    with pytest.raises(PatchFormatError):
        apply_patch(held, read_patch(path.read_bytes()))  # the fake engine's write
    assert np.array_equal(held["w"].bits, base["w"].bits)

    param = _param(base)
    placement = Placement("w", "w", "BF16", SHAPE, 0, ((0, SHAPE[0]),), 0, 0, param, ())
    with pytest.raises(PatchFormatError):
        stage_patches(WeightIO(_Layout(placement), None, repack=False), [([str(path)], 0, 1)])  # type: ignore[arg-type]
    assert np.array_equal(param.data.view(torch.int16).numpy().view(np.uint16).reshape(-1), base["w"].bits)

    param = _param(base)
    slot = Slot("w", "w", "BF16", SHAPE, 0, ((0, SHAPE[0]),), 0, 0, 0, param)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(PatchFormatError):
        stage(Ranks(_Layout(slot), None), [([str(path)], [digest])])  # type: ignore[arg-type]
    assert np.array_equal(param.data.view(torch.int16).numpy().view(np.uint16).reshape(-1), base["w"].bits)
