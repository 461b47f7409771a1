"""``make example-trl`` end to end (heavy tier): TRL's GRPOTrainer on SmolLM2 with real vLLM must print PASS.

Runs ``examples/trl/train_grpo.py`` as the make target does (~2 min on 2 cores: 3 optimizer steps,
one vLLM engine behind a sidecar, then a fresh vLLM for the oracle).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.vllm_server import require_vllm

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "trl" / "train_grpo.py"


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.heavy
def test_example_trl_passes(tmp_path: Path, smollm2_dir: Path) -> None:
    require_vllm()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(tmp_path / "example")],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1] == "PASS", (proc.stdout + proc.stderr)[-6000:]
    oks = [line for line in lines if line.startswith("ok ")]
    assert len(oks) == 6 and not any(line.startswith("FAIL") for line in lines), lines
    assert "ok 3 optimizer steps, each published as a version recording its step" in oks
