"""``make example-verl``: verl 0.9.1's own CheckpointEngineManager syncs real AdamW steps of SmolLM2 into real vLLM
through the ``stitchboard`` checkpoint engine, a bulletin and a sidecar; then checks what stitchboard promises.

Runs (in .venv) a bulletin, one vLLM engine (CPU build) with its sidecar, and (in .venv-verl, a subprocess)
examples/verl/verl_driver.py: verl's manager on a local CPU Ray cluster, configured as a user configures it
(``backend=stitchboard``, ``custom_backend_module=stitchboard.trainer_client.verl``, ``engine_kwargs.stitchboard``).
The manager itself runs, not a replay of its call order. Prints one ``ok <check>`` line per check, or
``FAIL <check>: why``; the last line is ``PASS`` or ``FAIL ...``; exit status 0 if and only if it is ``PASS``.
Every process started is stopped at the end.

Checks:

* verl's CheckpointEngineManager ran (Ray, verl's workers) and synced step 0 (the loaded weights: version 0, a
  no-op), steps 1..N (one new version each) and step N again (a retried sync: a no-op);
* verl's rollout-side workers returned only once the sidecar served the last version;
* the bulletin's last version is the trainer's served view (bf16 cast) bit for bit, and the sidecar applied and
  verified it (its in-engine checksums);
* the demo's oracle: greedy completions with logprobs from the engine at the last version equal those of a fresh
  vLLM loaded from that version pulled from the bulletin, and differ from version 0's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.engines import greedy, start_engine, start_rollout, stitchboard_cli, wait_applied
from stitchboard.demo.example_checks import run_checks
from stitchboard.demo.processes import ProcessGroup, free_port
from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import pull_version

RUN = "example-verl"
ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("stitchboard-example-verl"))
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps synced by verl's manager (>= 1)")
    args = parser.parse_args(argv)
    return run_checks(lambda checks: run(args.workdir.resolve(), args.steps, checks))


def run_driver(model_dir: Path, bulletin_url: str, steps: int, log: Path) -> dict[str, Any]:
    """verl's side (examples/verl/verl_driver.py in .venv-verl); its JSON result. Its output goes to ``log``."""
    if not VERL_PYTHON.exists():
        raise FileNotFoundError(f"no verl environment at {VERL_PYTHON}: `make venv-verl` builds it")
    argv = [str(VERL_PYTHON), str(Path(__file__).with_name("verl_driver.py"))]
    argv += ["--model", str(model_dir), "--bulletin", bulletin_url, "--run", RUN, "--steps", str(steps)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    log.write_text(proc.stdout + proc.stderr)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VERL_DRIVER ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"verl's side exited {proc.returncode} (log: {log}): {proc.stderr[-1500:]}")
    return json.loads(line.removeprefix("VERL_DRIVER "))


def run(workdir: Path, steps: int, checks: dict[str, str | None]) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_smollm2_checkpoint()
    with ProcessGroup(workdir / "logs") as procs:
        port = free_port()
        bulletin_url = f"http://127.0.0.1:{port}"
        store = workdir / f"store-{int(time.time())}"
        argv = [*stitchboard_cli(), "bulletin", "serve", "--store", f"file://{store}", "--port", str(port)]
        procs.start("bulletin", argv, f"{bulletin_url}/healthz").wait_healthy(120)
        with Publisher(bulletin_url, RUN, assets=model_dir, workdir=workdir / "publisher") as publisher:
            publisher.publish_view(load_checkpoint(model_dir), step=0)  # version 0: what the engine boots from
        rollout = start_rollout(procs, 0, model_dir, bulletin_url, RUN, 0, workdir / "handoff-0")
        rollout.engine.wait_healthy(600)
        rollout.sidecar.wait_healthy(120)
        before = greedy(rollout.url, exact_version=0)

        out = run_driver(model_dir, bulletin_url, steps, workdir / "logs" / "verl.log")
        checks[
            "verl's CheckpointEngineManager ran on a local CPU Ray cluster (the manager itself, not its call order)"
        ] = None
        syncs = [(s["step"], s["version"], s["new"]) for s in out["syncs"]]
        want = [(0, 0, False), *[(k, k, True) for k in range(1, steps + 1)], (steps, steps, False)]
        checks[f"step 0 (version 0, a no-op), steps 1-{steps} (a new version each), step {steps} retried (a no-op)"] = (
            None if syncs == want else f"syncs {syncs}, want {want}"
        )
        seen = out["rollout_last"]
        checks[f"verl's rollout side returned once the sidecar served version {steps}"] = (
            None if seen == [{"step": steps, "version": steps, "replicas": 1}] else f"rollout side saw {seen}"
        )
        client = BulletinClient(bulletin_url)
        try:
            sums = client.manifest(RUN, steps).checksums()
            checks[f"the bulletin's version {steps} is the trainer's served view, bit for bit"] = (
                None if sums == out["sums"] else "the version's checksums differ from the trainer's served view"
            )
            applied, status = wait_applied(rollout.url, steps, 300)
            checks[f"the sidecar applied and verified version {steps}"] = (
                None if applied == steps and status.state == "idle" else f"applied {applied}, state {status.state}"
            )
            after = greedy(rollout.url, exact_version=steps)
            procs.stop(rollout.sidecar)  # free the cores for the fresh engine
            procs.stop(rollout.engine)
            pulled = workdir / f"pulled-v{steps}-{int(time.time())}"
            pull_version(client, RUN, pulled, steps)
        finally:
            client.close()
        fresh, fresh_url = start_engine(procs, "engine-fresh", pulled, extension=False)
        fresh.wait_healthy(600)
        reference = greedy(fresh_url)
        checks["engine == fresh vLLM from the pulled checkpoint (greedy tokens and logprobs, bitwise)"] = (
            None if after == reference else f"engine {after[0]['tokens']} != fresh {reference[0]['tokens']}"
        )
        checks["the last version's answers differ from version 0's"] = None if after != before else "no change"


if __name__ == "__main__":
    sys.exit(main())
