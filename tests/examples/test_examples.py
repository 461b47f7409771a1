"""The examples end to end (heavy tier), each run as its make target runs it; each must print PASS.

* ``make example-trl`` (``examples/trl/train_grpo.py``, ~2 min on 2 cores): TRL's GRPOTrainer on SmolLM2,
  3 optimizer steps, rollouts from one vLLM engine behind a sidecar, then a fresh vLLM for the oracle.
* ``make example-watch`` (``examples/prime-rl-watch/run_watch.py``, ~1.5 min): prime-rl's broadcast folders
  (3 AdamW steps on SmolLM2) through ``stitchboard watch`` and a sidecar with prime-rl's admin API into real
  vLLM, then a fresh vLLM for the oracle.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.vllm_server import require_vllm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

#: example -> (its script, how many ``ok`` lines it prints, one of them).
CASES = {
    "trl": ("trl/train_grpo.py", 6, "ok 3 optimizer steps, each published as a version recording its step"),
    "watch": (
        "prime-rl-watch/run_watch.py",
        8,
        "ok the watcher published steps 1-3 as versions 1-3, each recording its step",
    ),
}


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.heavy
@pytest.mark.parametrize("example", sorted(CASES))
def test_example_passes(example: str, tmp_path: Path, smollm2_dir: Path) -> None:
    script, oks_expected, one_ok = CASES[example]
    require_vllm()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--workdir", str(tmp_path / "example")],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1] == "PASS", (proc.stdout + proc.stderr)[-6000:]
    oks = [line for line in lines if line.startswith("ok ")]
    assert len(oks) == oks_expected and not any(line.startswith("FAIL") for line in lines), lines
    assert one_ok in oks
