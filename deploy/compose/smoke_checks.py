"""Host side of the compose smoke (deploy/compose/compose-smoke.sh; runs in the repository's .venv), in two phases:

    python deploy/compose/smoke_checks.py across SIDECAR_URL BULLETIN_URL RUN WORKDIR
        a request through the sidecar with ``min_version`` = the run's latest version + 1, sent while the trainer
        service is still publishing: it waits for that publish and its answer is stamped at or after it;
    python deploy/compose/smoke_checks.py greedy SIDECAR_URL BULLETIN_URL RUN WORKDIR
        (trainer stopped) the sidecar applies the run's last version; greedy answers through it, pinned to that
        version, saved to WORKDIR/sidecar-greedy.json;
    python deploy/compose/smoke_checks.py oracle SIDECAR_URL BULLETIN_URL RUN WORKDIR
        (the stack's engine stopped: vLLM's CPU engine pins a core, and a second engine beside it barely runs) those
        answers equal bit for bit those of a fresh vLLM on the host started from that version pulled from the
        bulletin (the demo's oracle: demo.engines.greedy, same prompts, same vLLM arguments).

The read token is STITCH_CLIENT_TOKEN (the rollout token). Prints the demo's report (demo.example_checks): ``ok`` /
``FAIL`` lines and the verdict last; exit 0 iff PASS.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.engines import greedy, start_engine, wait_applied
from stitchboard.demo.example_checks import Checks, run_checks
from stitchboard.demo.processes import ProcessGroup
from stitchboard.proto.env import env_setting
from stitchboard.sidecar.client import SidecarClient, stamps
from stitchboard.trainer_client.resume import pull_version


def latest(bulletin: BulletinClient, run: str) -> int:
    version = bulletin.latest(run)
    if version is None:
        raise RuntimeError(f"run {run} has no version on {bulletin.url}")
    return version


def across(checks: Checks, sidecar_url: str, bulletin: BulletinClient, run: str) -> None:
    applied, _ = wait_applied(sidecar_url, 0, timeout_s=1200)
    checks[f"sidecar healthy in the stack, engine at version {applied}"] = None
    target = latest(bulletin, run) + 1
    body = {"model": "demo", "prompt": "The lighthouse keeper", "max_tokens": 8, "temperature": 1.0, "seed": 0}
    started = time.monotonic()
    with SidecarClient(sidecar_url) as sidecar:
        resp = sidecar.complete(body, min_version=target, wait_s=600)
    if resp.status_code != 200:
        checks[f"a request with min_version {target} is answered"] = f"{resp.status_code} {resp.text[:300]}"
        return
    start, end = stamps(resp.json())
    waited = time.monotonic() - started
    checks[f"a request with min_version {target} (the next publish) waited {waited:.0f} s for it"] = None
    ok = start is not None and end is not None and target <= start <= end
    checks[f"its answer is stamped {start}..{end}, at or after version {target}"] = None if ok else f"{start}..{end}"


def sidecar_greedy(checks: Checks, sidecar_url: str, bulletin: BulletinClient, run: str, workdir: Path) -> None:
    final = latest(bulletin, run)
    applied, _ = wait_applied(sidecar_url, final, timeout_s=900)
    checks[f"the sidecar applied the run's last version {final}"] = None if applied == final else f"{applied}"
    answers = greedy(sidecar_url, exact_version=final)
    (workdir / "sidecar-greedy.json").write_text(json.dumps({"version": final, "answers": answers}))
    checks[f"greedy answers through the sidecar pinned to version {final}"] = None


def oracle(checks: Checks, bulletin: BulletinClient, run: str, workdir: Path) -> None:
    saved = json.loads((workdir / "sidecar-greedy.json").read_text())
    final, through_sidecar = saved["version"], saved["answers"]
    pulled = workdir / f"pulled-v{final}"
    pull_version(bulletin, run, pulled, final)
    with ProcessGroup(workdir / "logs") as procs:
        fresh, url = start_engine(procs, "engine-fresh", pulled, extension=False)
        fresh.wait_healthy(timeout_s=900)
        reference = greedy(url)
    why = None
    if through_sidecar != reference:
        pairs = enumerate(zip(through_sidecar, reference, strict=True))
        why = next(f"prompt {i}: {a['tokens']} {a['token_logprobs']} != {b['tokens']} {b['token_logprobs']}"
                   for i, (a, b) in pairs if a != b)  # fmt: skip
    checks[f"greedy answers at version {final} == a fresh host vLLM on the pulled version (bitwise)"] = why


def main() -> int:
    phase, sidecar_url, bulletin_url, run, workdir = sys.argv[1:6]
    bulletin = BulletinClient(bulletin_url, token=env_setting("STITCH_CLIENT_TOKEN"))

    def body(checks: Checks) -> None:
        with bulletin:
            if phase == "across":
                across(checks, sidecar_url, bulletin, run)
            elif phase == "greedy":
                sidecar_greedy(checks, sidecar_url, bulletin, run, Path(workdir))
            else:
                oracle(checks, bulletin, run, Path(workdir))

    return run_checks(body)


if __name__ == "__main__":
    sys.exit(main())
