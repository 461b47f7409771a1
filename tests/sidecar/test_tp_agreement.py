"""TP ranks agree on a rank-local failure before their next collective (``WeightIO.agreed``).

Three processes on a gloo group stand in for an engine's TP ranks (no vLLM): one cannot read its
hand-off file. Without the agreement the other two would wait in the next gather until the
group's timeout (10 min in the worker extension); here all three fail the step at once, the
failing rank with its own error and the others with ``TpRankFailed`` naming it, and the group
still works for the next step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("tp_agree_worker.py")


def test_a_rank_that_cannot_read_its_file_fails_every_rank_at_once(tmp_path):
    world, failing = 3, 1
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path), str(failing)],
            env={**env, "RANK": str(r)},
            stderr=subprocess.PIPE,
        )
        for r in range(world)
    ]
    errors = [p.communicate(timeout=180)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0] * world, errors
    read, write = zip(*(json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)), strict=False)
    assert read[failing]["type"] == "FileNotFoundError" and "missing.safetensors" in read[failing]["message"]
    for rank in set(range(world)) - {failing}:
        assert read[rank]["type"] == "TpRankFailed", read[rank]
        assert (
            list(read[rank]["failed"]) == [str(failing)] and "FileNotFoundError" in read[rank]["failed"][str(failing)]
        )
        assert f"TP rank {failing} failed" in read[rank]["message"]
    assert [w.get("result") for w in write] == list(range(world)), "the group is usable after a failed step"
