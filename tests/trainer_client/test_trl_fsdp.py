"""PublishCallback under FSDP2: two CPU gloo ranks (``trl_fsdp_worker.py``). By default every rank joins the gather
of the full state dict and rank 0 alone publishes; with ``shard_local=True`` every rank publishes its own blocks
(no gather) and a refused commit is retried on both ranks alike. Either way the versions are the gathered
weights bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fault_proxy import FaultProxy, Rule
from tests.support.pythonpath import repo_on_pythonpath

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("trl_fsdp_worker.py")


def _run_ranks(tmp_path: Path, url: str, run: str, mode: str) -> None:
    pytest.importorskip("trl")
    env = {**repo_on_pythonpath(), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    for r in range(2):
        with logs[r].open("wb") as log:  # the rank writes to its own copy of the descriptor: ours closes at once
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(tmp_path / "rendezvous"), url, run, mode],
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


def test_rank0_publishes_the_gathered_full_weights(bulletin, run, tmp_path: Path) -> None:
    _run_ranks(tmp_path, bulletin.url, run, "gather")


def test_shard_local_every_rank_publishes_its_blocks_and_retries_alike(bulletin, run, tmp_path: Path) -> None:
    proxy = FaultProxy(bulletin.url, [Rule("status", path=r"/versions$", method="POST", times=1)])
    try:
        _run_ranks(tmp_path, proxy.url, run, "shard_local")
    finally:
        proxy.stop()
    assert proxy.actions("status") == 1, "the first commit was refused once, then retried"
