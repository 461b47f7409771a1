"""``make compose-smoke`` as a test (heavy tier): the whole compose stack on a real Docker engine must print PASS.

The script (``deploy/compose/compose-smoke.sh``, docs/deploy.md) builds the images, starts radosgw, the bulletin,
the example trainer, the CPU vLLM engine and the sidecar, checks ``min_version`` gating, the stamps, the bit-exact
oracle against a fresh host vLLM and the JSON log lines, and tears everything down. It needs root (it starts its
own ``dockerd`` when none runs) and ~10 min from a cold image cache on 2 cores, so ``.ci/run`` leaves it out
with the rest of the heavy tier (CI's 55-minute budget) and it runs by ``make test-left-out`` before each stop, as
docs/testing.md says.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.vllm_server import require_vllm

REPO = Path(__file__).resolve().parents[2]

#: The ``ok`` line the smoke prints when the oracle holds (deploy/compose/smoke_checks.py), around its version.
ORACLE_OK = ("ok greedy answers at version ", " == a fresh host vLLM on the pulled version (bitwise)")


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.heavy
def test_compose_smoke_passes(smollm2_dir: Path) -> None:
    require_vllm()
    if os.geteuid() != 0:
        pytest.skip("make compose-smoke starts dockerd: it needs root")
    proc = subprocess.run(
        ["make", "--no-print-directory", "compose-smoke"],
        cwd=REPO, check=False, capture_output=True, text=True, timeout=2400,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS"), (proc.stdout + proc.stderr)[-6000:]
    assert not any(line.startswith("FAIL") for line in lines), lines
    assert any(line.startswith(ORACLE_OK[0]) and line.endswith(ORACLE_OK[1]) for line in lines), lines
