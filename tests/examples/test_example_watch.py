"""``make example-watch`` end to end (heavy tier): prime-rl's broadcast folders through ``stitchboard watch`` and a
sidecar with prime-rl's admin API into real vLLM must print PASS.

Runs ``examples/prime-rl-watch/run_watch.py`` as the make target does (~1.5 min on 2 cores: 3 AdamW steps on
SmolLM2, one vLLM engine behind a sidecar, then a fresh vLLM for the oracle).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.vllm_server import require_vllm

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "prime-rl-watch" / "run_watch.py"


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.heavy
def test_example_watch_passes(tmp_path: Path, smollm2_dir: Path) -> None:
    require_vllm()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path / "example")],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1] == "PASS", (proc.stdout + proc.stderr)[-6000:]
    oks = [line for line in lines if line.startswith("ok ")]
    assert len(oks) == 8 and not any(line.startswith("FAIL") for line in lines), lines
    assert "ok the watcher published steps 1-3 as versions 1-3, each recording its step" in oks
