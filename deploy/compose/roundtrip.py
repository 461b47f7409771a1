"""Host side of the compose check (deploy/compose/compose-check.sh; runs in the repository's .venv): two
versions of a small bf16 checkpoint published to the bulletin in the stack, the latest listed, and the
second pulled back and compared bit for bit with what was published.

    python deploy/compose/roundtrip.py URL RUN FOLDER    (the trainer token in STITCH_CLIENT_TOKEN)

Prints one ``ok`` line per check; exits non-zero naming the check that failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def checkpoint(folder: Path, step: int) -> dict[str, torch.Tensor]:
    """A 2-tensor bf16 checkpoint (+ config.json, the run's asset); step N changes ~1 % of the elements."""
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(256, 256, generator=g).bfloat16(), "b": torch.randn(1000, generator=g).bfloat16()}
    for t in tensors.values():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(step))[: flat.numel() // 100]
        flat[idx] += step * 0.125
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "compose-check"}))
    return tensors


def cli(*args: str) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "stitchboard"), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"stitchboard {' '.join(args)} failed ({done.returncode}): {done.stderr[-1500:]}")
    return done.stdout


def main() -> None:
    url, run, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    for step in (0, 1):
        checkpoint(folder / f"step{step}", step)
        cli("publish", str(folder / f"step{step}"), "--bulletin", url, "--run", run, "--step", str(step))
    print(f"ok published versions 0 and 1 of run {run} through the bulletin (S3: radosgw)")
    latest = json.loads(cli("versions", "latest", "--bulletin", url, "--run", run, "--json"))
    if latest["version"] != 1:
        sys.exit(f"versions latest says {latest['version']}, not 1")
    print("ok versions latest: 1")
    cli("pull", "--bulletin", url, "--run", run, "--version", "1", "--output", str(folder / "pulled"))
    want, got = load_file(str(folder / "step1" / "model.safetensors")), {}
    for path in (folder / "pulled").glob("*.safetensors"):
        got.update(load_file(str(path)))
    if set(got) != set(want) or any(not torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want):
        sys.exit("the pulled version 1 differs from the published checkpoint")
    print("ok version 1 pulled back bit-exact")


if __name__ == "__main__":
    main()
