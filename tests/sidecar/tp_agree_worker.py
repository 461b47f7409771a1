"""One TP rank of the agreement test (run by test_tp_agreement.py, not collected by pytest).

Usage: ``python tp_agree_worker.py OUT_DIR FAILING_RANK`` with RANK and WORLD_SIZE set; the
ranks meet through a file store, ``OUT_DIR/rendezvous``. Each rank runs two steps through
:meth:`WeightIO.agreed` on a gloo group, as the worker extension's staging does: the first reads
a hand-off file, which is missing on FAILING_RANK; the second succeeds everywhere. Writes what
each step gave (``{"type", "message", "failed"}`` or ``{"result"}``) to ``OUT_DIR/rank-<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from stitchboard.proto.errors import StitchError
from stitchboard.sidecar.engines.vllm.weights import WeightIO


def outcome(step, what: str) -> dict:
    t0 = time.monotonic()
    try:
        return {"result": io.agreed(step, what), "seconds": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        details = exc.details if isinstance(exc, StitchError) else {}
        return {
            "type": exc.type if isinstance(exc, StitchError) else type(exc).__name__,
            "message": str(exc),
            "failed": details.get("failed"),
            "seconds": time.monotonic() - t0,
        }


if __name__ == "__main__":
    out, failing = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=int(os.environ["WORLD_SIZE"])
    )
    io = WeightIO(layout=None, tp_group=dist.group.WORLD, repack=False)  # agreed() needs only the group
    (out / "patch.safetensors").touch()
    path = out / ("missing.safetensors" if rank == failing else "patch.safetensors")
    results = [
        outcome(lambda: path.read_bytes(), "reading the patch files"),
        outcome(lambda: rank, "writing the update"),
    ]
    (out / f"rank-{rank}.json").write_text(json.dumps(results, default=str))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    # Interpreter shutdown after gloo collectives sometimes aborts in a C++ destructor ("terminate
    # called without an active exception", 2 in 30 runs under load): the work is done, skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
