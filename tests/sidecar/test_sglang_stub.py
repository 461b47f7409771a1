"""The sgl_kernel stand-in (deploy/sglang_cpu/sgl_kernel): every attribute records its call and raises."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

STUB = Path(__file__).resolve().parents[2] / "deploy" / "sglang_cpu" / "sgl_kernel" / "__init__.py"


def test_every_stub_call_is_recorded_and_raises(tmp_path, monkeypatch):
    """Any name imports, no call passes silently: each raises NotImplementedError and leaves a line
    in the file named by STITCH_SGL_KERNEL_STUB_LOG (what the SGLang tests check is empty)."""
    spec = importlib.util.spec_from_file_location("sgl_kernel_stub_under_test", STUB)
    assert spec is not None and spec.loader is not None
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    log = tmp_path / "calls"
    monkeypatch.setenv(stub.LOG_ENV, str(log))
    from_import = stub.fused_experts_cpu  # what `from sgl_kernel import fused_experts_cpu` does
    for fn in (from_import, stub.convert_weight_packed):
        with pytest.raises(NotImplementedError, match="stand-in"):
            fn(1, 2, key=3)
    assert [line.split()[2] for line in log.read_text().splitlines()] == [
        "sgl_kernel.fused_experts_cpu",
        "sgl_kernel.convert_weight_packed",
    ]
    with pytest.raises(AttributeError):
        _ = stub.__wrapped__  # dunder look-ups (import machinery, hasattr) are not stubs
    assert stub.STITCHBOARD_STUB is True
