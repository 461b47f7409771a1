"""PublishCallback under FSDP2: two CPU gloo ranks (``trl_fsdp_worker.py``), every rank joins the gather of the
full state dict, rank 0 alone publishes, and the versions are the gathered weights bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.pythonpath import repo_on_pythonpath

WORKER = Path(__file__).with_name("trl_fsdp_worker.py")


def test_rank0_publishes_the_gathered_full_weights(bulletin, run, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    env = {**repo_on_pythonpath(), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        with logs[r].open("wb") as log:  # the rank writes to its own copy of the descriptor: ours closes at once
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(tmp_path / "rendezvous"), bulletin.url, run],
                    env={**env, "RANK": str(r)},
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    tails = "\n".join(f"rank {r}:\n{log.read_text(errors='replace')[-3000:]}" for r, log in enumerate(logs))
    assert codes == [0, 0], tails
