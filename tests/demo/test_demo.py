"""The main job end to end: ``stitchboard demo`` with real vLLM (CPU build) must print PASS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.vllm_server import require_vllm


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.heavy
def test_demo_two_steps_pass(tmp_path: Path, smollm2_dir: Path):
    require_vllm()
    exe = Path(sys.executable).with_name("stitchboard")
    proc = subprocess.run(
        [str(exe), "demo", "--steps", "2", "--workdir", str(tmp_path / "demo"), "--model", str(smollm2_dir)],
        check=False, capture_output=True, text=True, timeout=1800, env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PASS" in proc.stdout, out[-6000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["passed"] and summary["final_version"] == 2 and all(summary["checks"].values())
    assert [s["version"] for s in summary["steps"]] == [1, 2]
    assert all(0 < s["changed_pct"] < 10 and s["patch_bytes"] < s["full_bytes"] / 20 for s in summary["steps"])
    assert (tmp_path / "demo" / "sync.png").stat().st_size > 1000
    assert summary["checks"]["the bulletin's fleet view shows every engine at the last version"]
    assert (tmp_path / "demo" / "status.png").stat().st_size > 10_000  # the status page, screenshot in Chromium
