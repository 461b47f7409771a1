"""Format stability: a small fixed patch must encode to the committed bytes and decode the same.

If this fails after a deliberate format change, bump ``FORMAT_VERSION`` and regenerate with
``python tests/codec/test_golden.py --regenerate``; if it fails after a zstandard upgrade, encoded bytes
changed (retried publishes would no longer be byte-identical across versions): investigate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from stitchboard.proto.apply import apply_to_copy
from stitchboard.proto.codec import ENCODINGS, PatchEncoding
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views

GOLDEN = Path(__file__).parent / "golden"


def fixed_views() -> tuple[dict[str, RawTensor], dict[str, RawTensor]]:
    """Base/target: a bf16 matrix with a few +-1 ulp steps and a NaN, an f32 vector, an fp8 tensor."""
    w = (np.arange(64, dtype=np.uint32) * 2654435761 % 65521).astype(np.uint16)
    v = np.array([0x3F800000, 0x80000000, 0x7F800000, 0x00000001], dtype=np.uint32)
    q = np.arange(16, dtype=np.uint8)
    base = {
        "model.w": RawTensor("BF16", (8, 8), w),
        "model.v": RawTensor("F32", (4,), v),
        "model.q": RawTensor("F8_E4M3", (16,), q),
    }
    w2, v2, q2 = w.copy(), v.copy(), q.copy()
    w2[[0, 1, 17, 63]] += 1
    w2[40] = 0x7FC1
    v2[1] = 0x00000000
    q2[15] = 0x7F
    target = {
        "model.w": RawTensor("BF16", (8, 8), w2),
        "model.v": RawTensor("F32", (4,), v2),
        "model.q": RawTensor("F8_E4M3", (16,), q2),
    }
    return base, target


def encode(encoding: PatchEncoding) -> bytes:
    base, target = fixed_views()
    return diff_views(base, target, encoding, metadata={"run_id": "golden", "version": "1"}).patch


def test_encoding_matches_golden_bytes():
    for encoding in ENCODINGS:
        assert encode(encoding) == (GOLDEN / f"patch-v1-{encoding}.safetensors").read_bytes(), encoding


def test_golden_decodes_to_target():
    base, target = fixed_views()
    for encoding in ENCODINGS:
        patch = read_patch((GOLDEN / f"patch-v1-{encoding}.safetensors").read_bytes())
        assert patch.changed_elements == 7 and patch.metadata == {"run_id": "golden", "version": "1"}
        out = apply_to_copy(base, patch)
        assert all(np.array_equal(out[k].bits, target[k].bits) for k in target)


if __name__ == "__main__" and "--regenerate" in sys.argv:
    for enc in ENCODINGS:
        (GOLDEN / f"patch-v1-{enc}.safetensors").write_bytes(encode(enc))
