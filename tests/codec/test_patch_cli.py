"""The ``stitchboard patch`` commands on single-file and sharded HF checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stitchboard.proto.checkpoint import INDEX_NAME, load_checkpoint, save_checkpoint

from .helpers import copy_view, raw, same_bits

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

CLI = [sys.executable, "-c", "from stitchboard.proto.cli import main; main()"]


def run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], check=False, capture_output=True, text=True, timeout=120)


def views():
    rng = np.random.default_rng(1)
    base = {
        "model.embed_tokens.weight": raw("BF16", (64, 16), rng.integers(0, 2**16, 1024)),
        "model.layers.0.mlp.up_proj.weight": raw("BF16", (32, 16), rng.integers(0, 2**16, 512)),
        "model.norm.weight": raw("F32", (16,), rng.integers(0, 2**32, 16)),
    }
    target = copy_view(base)
    target["model.embed_tokens.weight"].bits[[3, 500, 1023]] += 1
    target["model.norm.weight"].bits[0] = 0x80000000  # -0.0
    return base, target


@pytest.mark.parametrize("encoding", ["cond", "xor", "overwrite", None])
def test_diff_apply_single_file(tmp_path: Path, encoding: str | None):
    base, target = views()
    save_checkpoint(tmp_path / "base", base)
    save_checkpoint(tmp_path / "target", target)
    chosen = ["--encoding", encoding] if encoding else []
    r = run(
        "patch",
        "diff",
        tmp_path / "base/model.safetensors",
        tmp_path / "target/model.safetensors",
        "-o",
        tmp_path / "p.safetensors",
        *chosen,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "4 of 1,552 elements changed" in r.stdout and "bytes per changed element" in r.stdout
    r = run(
        "patch",
        "apply",
        tmp_path / "base/model.safetensors",
        tmp_path / "p.safetensors",
        "-o",
        tmp_path / "out.safetensors",
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert same_bits(load_checkpoint(tmp_path / "out.safetensors"), target)
    r = run("patch", "inspect", tmp_path / "p.safetensors")
    assert (
        r.returncode == 0 and "model.embed_tokens.weight" in r.stdout and f"encoding {encoding or 'cond'}" in r.stdout
    )


def test_diff_apply_sharded_checkpoint(tmp_path: Path):
    base, target = views()
    save_checkpoint(tmp_path / "base", base, max_shard_bytes=2048)
    save_checkpoint(tmp_path / "target", target, max_shard_bytes=2048)
    index = json.loads((tmp_path / "base" / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (
        run("patch", "diff", tmp_path / "base", tmp_path / "target", "-o", tmp_path / "p.safetensors").returncode == 0
    )
    r = run("patch", "apply", tmp_path / "base", tmp_path / "p.safetensors", "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr + r.stdout
    assert json.loads((tmp_path / "out" / INDEX_NAME).read_text())["weight_map"] == index["weight_map"]
    assert same_bits(load_checkpoint(tmp_path / "out"), target)


def test_apply_to_wrong_base_fails_cleanly(tmp_path: Path):
    base, target = views()
    save_checkpoint(tmp_path / "base", base)
    save_checkpoint(tmp_path / "target", target)
    run("patch", "diff", tmp_path / "base", tmp_path / "target", "-o", tmp_path / "p.safetensors")
    r = run("patch", "apply", tmp_path / "target", tmp_path / "p.safetensors", "-o", tmp_path / "out.safetensors")
    assert r.returncode == 1 and "not the patch's base" in r.stderr
    assert not (tmp_path / "out.safetensors").exists()
    r = run("patch", "diff", tmp_path / "base", tmp_path / "missing", "-o", tmp_path / "q.safetensors")
    assert r.returncode == 1 and "no such checkpoint" in r.stderr


@pytest.mark.slow
def test_patch_cli_on_smollm2(tmp_path: Path, smollm2_dir: Path):
    """Perturb the real checkpoint (q/k/v, gate/up, tied embedding), diff, apply, compare."""
    base = load_checkpoint(smollm2_dir)
    target = copy_view(base)
    rng = np.random.default_rng(0)
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.3.mlp.gate_proj.weight",
        "model.layers.3.mlp.up_proj.weight",
        "model.embed_tokens.weight",
    ]:
        bits = target[name].bits
        idx = rng.choice(bits.size, size=bits.size // 100, replace=False)
        bits[idx] += 1
    save_checkpoint(tmp_path / "target", target)
    r = run("patch", "diff", smollm2_dir, tmp_path / "target", "-o", tmp_path / "p.safetensors")
    assert r.returncode == 0, r.stdout
    r = run("patch", "apply", smollm2_dir, tmp_path / "p.safetensors", "-o", tmp_path / "out.safetensors")
    assert r.returncode == 0, r.stdout
    assert same_bits(load_checkpoint(tmp_path / "out.safetensors"), target)


def test_a_command_loads_only_its_own_group() -> None:
    """``stitchboard patch ...`` imports neither the demo's torch nor the bulletin's web stack;
    a lone plain command (``publish``) stays a subcommand; ``--help`` lists every group."""
    import typer
    from typer.testing import CliRunner

    from stitchboard.proto.cli import build_app

    probe = (
        "import sys; from stitchboard.proto.cli import build_app; build_app('patch'); "
        "print(sorted(m for m in ('torch', 'fastapi', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
    alone = build_app("publish")
    assert sorted(typer.main.get_command(alone).commands) == ["publish"]  # type: ignore[attr-defined]
    shown = CliRunner().invoke(alone, ["publish", "--help"])
    assert shown.exit_code == 0 and "CHECKPOINT" in shown.output, shown.output
    every = typer.main.get_command(build_app("--help")).commands  # type: ignore[attr-defined]
    assert {"patch", "publish", "pull", "sidecar", "bulletin", "demo"} <= set(every)
