"""A ``stitchboard`` command whose optional extra is missing says which extra to install, not a traceback.

The missing module is made to fail the way an absent package does (``sys.modules[name] = None`` makes
``import name`` raise ModuleNotFoundError with ``exc.name == name``) in a fresh interpreter running the
console script's ``main()``.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from stitchboard.proto.cli import GROUP, extra_of

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow


def run_without(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``stitchboard ARGV`` in a new interpreter where importing ``module`` fails as if it were not installed."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; sys.argv = ['stitchboard', *{list(argv)!r}]\n"
        "from stitchboard.proto.cli import main; main()"
    )
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)


def test_each_command_names_the_extra_its_module_is_named_for():
    extras = {ep.name: extra_of(ep) for ep in entry_points(group=GROUP)}
    assert extras == {
        "patch": None,
        "bulletin": "bulletin",
        "versions": "bulletin",
        "model": "model",
        "publish": "trainer",
        "pull": "trainer",
        "squash": "trainer",
        "watch": "trainer",
        "demo": "demo",
        "sidecar": "sidecar",
        "simulate": "simulate",
    }


def test_publish_without_torch_names_the_trainer_extra():
    """``publish`` imports torch only when it runs: the import error there gets the hint too."""
    out = run_without("torch", "publish", "missing.safetensors", "--bulletin", "http://127.0.0.1:9", "--run", "r1")
    assert out.returncode == 2, out.stderr
    assert "'stitchboard publish' needs the optional extra [trainer]: pip install 'stitchboard[trainer]'" in out.stderr
    assert "torch" in out.stderr and "Traceback" not in out.stderr


def test_a_command_whose_module_cannot_load_names_its_extra():
    out = run_without("uvicorn", "sidecar", "run")
    assert out.returncode == 2, out.stderr
    assert "pip install 'stitchboard[sidecar]'" in out.stderr and "uvicorn" in out.stderr


def test_an_error_of_a_core_dependency_says_to_reinstall():
    out = run_without("zstandard", "patch", "inspect", "missing.safetensors")
    assert out.returncode == 2, out.stderr
    assert "'stitchboard patch' cannot import zstandard, a dependency of stitchboard itself: reinstall it" in out.stderr
