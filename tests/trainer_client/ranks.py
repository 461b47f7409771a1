"""Running ``sharded_worker.py`` as the ranks of a CPU gloo job, for the sharded publisher tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

from tests.support.pythonpath import repo_on_pythonpath

WORKER = Path(__file__).with_name("sharded_worker.py")


def run_ranks(
    args: list[str], out: Path, world: int = 2, timeout_s: float = 180.0, worker: Path = WORKER, expect: int = 0
) -> list[int]:
    """Run ``worker *args`` (default ``sharded_worker.py``) as ``world`` ranks meeting in ``out``; assert every
    rank exits ``expect`` (a rank may exit 17 on purpose: ``shard_local_worker.py dies``).

    Once a rank fails, the others get 10 s to finish (one blocked in a collective with it never
    would), then every rank still running is killed; the assertion shows each rank's exit code
    and the tail of its stderr (kept in ``out/rank{r}.stderr``). Returns the exit codes.
    """
    env = {
        **repo_on_pythonpath(),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }  # the worker imports tests.trainer_client.*
    logs = [out / f"rank{r}.stderr" for r in range(world)]
    with contextlib.ExitStack() as stack:
        procs = [
            subprocess.Popen(
                [sys.executable, str(worker), *args],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.DEVNULL,
                stderr=stack.enter_context(open(logs[r], "wb")),
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.returncode not in (None, 0, expect) for p in procs):
                    deadline = min(deadline, time.monotonic() + 10)
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    tails = [
        f"rank {r} (exit {p.returncode}):\n{logs[r].read_text(errors='replace')[-3000:]}" for r, p in enumerate(procs)
    ]
    assert all(p.returncode in (0, expect) for p in procs), "\n".join(tails)
    return [p.returncode for p in procs]
