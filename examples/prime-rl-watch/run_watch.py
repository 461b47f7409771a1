"""``make example-watch``: prime-rl's filesystem weight broadcast, published by ``stitchboard watch``, into real vLLM
through a sidecar that answers prime-rl's admin API; then checks what stitchboard promises.

Runs a bulletin, one vLLM engine (CPU build) with its sidecar (``STITCH_SIDECAR_ADMIN_API=prime-rl``) and the
watcher (``stitchboard watch --layout prime-rl``). This process plays prime-rl's two sides: its trainer (real
AdamW steps on the demo's SmolLM2, each step's bf16 state written to ``broadcasts/step_N/model.safetensors``, then
``STABLE`` touched, as prime-rl's filesystem broadcast does) and its orchestrator (for each step
``POST /pause?mode=keep&clear_cache=false``, ``POST /update_weights {"weight_dir": ".../step_N"}``,
``POST /resume``, then completions with the model id ``/v1/models`` lists). Prints one ``ok <check>`` line per
check, or ``FAIL <check>: why``; the last line is ``PASS`` or ``FAIL ...``; exit status 0 if and only if it is
``PASS``. Every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.engines import greedy, start_engine, stitchboard_cli, wait_applied
from stitchboard.demo.example_checks import run_checks
from stitchboard.demo.processes import ProcessGroup, free_port
from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.demo.task import prompts_for_step
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import pull_version, rebuild_version
from stitchboard.trainer_client.served_view import served_view

RUN = "example-watch"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("stitchboard-example-watch"))
    parser.add_argument("--steps", type=int, default=3, help="trainer steps, each a step_N/ folder")
    args = parser.parse_args(argv)
    return run_checks(lambda checks: run(args.workdir.resolve(), args.steps, checks))


def write_step(broadcasts: Path, step: int, model: torch.nn.Module) -> Path:
    """``broadcasts/step_N/model.safetensors`` (every tensor cast to bf16, a tied ``lm_head.weight`` kept as a
    tensor of its own, as prime-rl's gathered state holds it; ``{"format": "pt"}`` metadata), then ``STABLE``."""
    folder = broadcasts / f"step_{step}"
    folder.mkdir(parents=True)
    state = {n: t.detach().to(torch.bfloat16, copy=True).contiguous() for n, t in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "STABLE").touch()
    return folder


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokenizer: Any, step: int) -> float:
    """One AdamW step of next-token loss on the demo's counting prompts for ``step`` with their answers."""
    texts = [f"{p.message} {' '.join(str(i) for i in range(1, p.n + 1))}" for p in prompts_for_step(step, 4)]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    loss = model(**batch, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def orchestrate(http: httpx.Client, model_id: str, step_dir: Path) -> dict[str, Any]:
    """prime-rl's orchestrator around one policy update, then one completion; returns what it saw."""
    seen: dict[str, Any] = {}
    seen["pause"] = http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code
    update = http.post("/update_weights", json={"weight_dir": str(step_dir)}, timeout=720)
    seen["update"] = (update.status_code, update.json())
    seen["resume"] = http.post("/resume").status_code
    body = {"model": model_id, "prompt": "Count from 1 to 5:", "max_tokens": 8, "temperature": 1.0, "seed": 0}
    done = http.post("/v1/completions", json=body, timeout=600)
    seen["completion"] = (done.status_code, done.json())
    return seen


def run(workdir: Path, steps: int, checks: dict[str, str | None]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_smollm2_checkpoint()
    stamp = int(time.time())
    broadcasts = workdir / f"broadcasts-{stamp}"
    broadcasts.mkdir()
    with ProcessGroup(workdir / "logs") as procs:
        port = free_port()
        bulletin_url = f"http://127.0.0.1:{port}"
        argv = [*stitchboard_cli(), "bulletin", "serve", "--store", f"file://{workdir / f'store-{stamp}'}"]
        procs.start("bulletin", [*argv, "--port", str(port)], f"{bulletin_url}/healthz").wait_healthy(120)

        # version 0: the checkpoint the engine boots from, at step 0 (the watcher resumes after it)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with Publisher(bulletin_url, RUN, assets=model_dir, workdir=workdir / "publisher", encoding="xor") as pub:
            pub.publish(model, step=0)

        engine, engine_url = start_engine(procs, "engine-0", model_dir)
        sidecar_port = free_port()
        sidecar_url = f"http://127.0.0.1:{sidecar_port}"
        argv = [
            *stitchboard_cli(), "sidecar", "run", "--bulletin", bulletin_url, "--run", RUN, "--engine", "vllm",
            "--engine-url", engine_url,
            "--port", str(sidecar_port), "--boot-version", "0", "--handoff-dir", str(workdir / f"handoff-{stamp}"),
        ]  # fmt: skip
        env = {"STITCH_SIDECAR_ADMIN_API": "prime-rl", "STITCH_SIDECAR_REQUEST_WAIT_S": "600"}
        sidecar = procs.start("sidecar-0", argv, f"{sidecar_url}/health", env=env)
        metrics_port = free_port()
        argv = [
            *stitchboard_cli(), "watch", str(broadcasts), "--layout", "prime-rl", "--bulletin", bulletin_url,
            "--run", RUN, "--assets", str(model_dir), "--encoding", "xor", "--poll-s", "0.5",
            "--metrics-port", str(metrics_port),
        ]  # fmt: skip
        procs.start("watch", argv, f"http://127.0.0.1:{metrics_port}/metrics").wait_healthy(120)
        engine.wait_healthy(600)
        sidecar.wait_healthy(120)

        http = httpx.Client(base_url=sidecar_url, timeout=60)
        models = http.get("/v1/models").json()
        model_id = models["data"][0]["id"]
        checks["the sidecar answers /health and lists the engine's model id in /v1/models"] = (
            None if http.get("/health").status_code == 200 and model_id else f"/v1/models answered {models}"
        )

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        seen = []
        for step in range(1, steps + 1):
            train_step(model, optimizer, tokenizer, step)
            seen.append(orchestrate(http, model_id, write_step(broadcasts, step, model)))

        client = BulletinClient(bulletin_url)
        step_of = {v.version: client.manifest(RUN, v.version).metadata.get("step") for v in client.versions(RUN)}
        checks[f"the watcher published steps 1-{steps} as versions 1-{steps}, each recording its step"] = (
            None if step_of == {v: v for v in range(steps + 1)} else f"bulletin versions -> steps {step_of}"
        )
        checks["/pause, /update_weights and /resume answered 200 at every step, with the step's version"] = (
            _admin_answers(seen)
        )
        checks["every completion after an update came from that step's version (stamps)"] = _stamps(seen)

        last = max(step_of)
        first, final = ({t.name: t.checksums["xxh3_128"] for t in client.manifest(RUN, v).tensors} for v in (0, last))
        checks[f"the AdamW steps changed the served weights (version {last} vs 0)"] = (
            None if first != final else "every tensor of the last version equals version 0's"
        )
        view, rebuilt = served_view(model), rebuild_version(client, RUN).view
        same = set(view) == set(rebuilt) and all(view[k].bits.tobytes() == rebuilt[k].bits.tobytes() for k in view)
        checks[f"the bulletin's version {last} is the last step's served view, bit for bit"] = (
            None if same else "the rebuilt version differs from served_view(model) of the last step"
        )
        applied, status = wait_applied(sidecar_url, last, 300)
        checks[f"the sidecar applied and verified version {last}"] = (
            None if applied == last and status.state == "idle" else f"applied {applied}, state {status.state}"
        )
        after = greedy(sidecar_url, exact_version=last)
        http.close()
        procs.stop(sidecar)  # free the cores for the fresh engine
        procs.stop(engine)
        pulled = workdir / f"pulled-v{last}-{stamp}"
        pull_version(client, RUN, pulled, last)
        client.close()
        fresh, fresh_url = start_engine(procs, "engine-fresh", pulled, extension=False)
        fresh.wait_healthy(600)
        reference = greedy(fresh_url)
        checks["engine == fresh vLLM from the pulled checkpoint (greedy tokens and logprobs, bitwise)"] = (
            None if after == reference else f"engine {after[0]['tokens']} != fresh {reference[0]['tokens']}"
        )


def _admin_answers(seen: list[dict[str, Any]]) -> str | None:
    for step, s in enumerate(seen, start=1):
        code, body = s["update"]
        if (s["pause"], code, s["resume"]) != (200, 200, 200) or body.get("version") != step:
            return f"step {step}: pause {s['pause']}, update_weights {code} {body}, resume {s['resume']}"
    return None


def _stamps(seen: list[dict[str, Any]]) -> str | None:
    for step, s in enumerate(seen, start=1):
        code, body = s["completion"]
        versions = (body.get("weight_version_start"), body.get("weight_version_end"))
        if code != 200 or versions != (step, step):
            return f"step {step}: completion {code}, stamped {versions}"
    return None


if __name__ == "__main__":
    sys.exit(main())
