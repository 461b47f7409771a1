"""``make example-trl``: TRL's GRPOTrainer trains SmolLM2-135M-Instruct on this CPU, its rollouts from real vLLM
through a stitchboard sidecar and bulletin; then checks what stitchboard promises.

Runs a bulletin, one vLLM engine (CPU build) with its sidecar, and TRL's ``GRPOTrainer`` with the three
lines a user adds (``use_vllm=False``, :class:`PublishCallback`, :class:`SidecarRollout`: see README.md).
The task is the demo's counting task with its graded reward (:mod:`stitchboard.demo.task`). Prints one
``ok <check>`` line per check, or ``FAIL <check>: why``; the last line is ``PASS`` or ``FAIL ...``; exit
status 0 if and only if it is ``PASS``. Every process started is stopped at the end.

Checks:

* every optimizer step was published as a version recording its step;
* every rollout of step k came from versions whose step is >= k - staleness, by the answers' stamps
  and by each token's version (the sidecar's spans);
* the bulletin's last version is the trainer's served view (bf16 cast) bit for bit, and the sidecar
  applied and verified it (its in-engine checksums);
* the demo's oracle: greedy completions with logprobs from the engine at the last version equal those
  of a fresh vLLM loaded from that version pulled from the bulletin, and differ from version 0's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.engines import greedy, start_engine, start_rollout, stitchboard_cli, wait_applied
from stitchboard.demo.example_checks import run_checks
from stitchboard.demo.processes import ProcessGroup, free_port
from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.demo.task import Prompt, prompts_for_step, reward
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import pull_version, rebuild_version
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.trl.callback import PublishCallback
from stitchboard.trainer_client.trl.rollout import SidecarRollout

RUN = "example-trl"


class CountingReward:
    """The demo's counting reward for TRL (dataset column ``n``); keeps what each call saw: the step,
    and the rollout's per-token versions and stamps (extra fields TRL passes to reward functions)."""

    __name__ = "counting"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, completions: list[Any], n: list[int], trainer_state: Any, **kwargs: Any) -> list[float]:
        self.calls.append(
            {
                "step": trainer_state.global_step,
                "weight_versions": kwargs["weight_versions"],
                "starts": kwargs["weight_version_start"],
                "ends": kwargs["weight_version_end"],
            }
        )
        return [reward(Prompt(k), c[0]["content"]) for c, k in zip(completions, n, strict=True)]


def dataset(steps: int, per_step: int) -> Any:
    """Conversational counting prompts, ``per_step`` distinct ones for each step."""
    from datasets import Dataset

    prompts = [p for s in range(1, steps + 1) for p in prompts_for_step(s, per_step)]
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": p.message}] for p in prompts], "n": [p.n for p in prompts]}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("stitchboard-example-trl"))
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (>= 3 for the example's checks)")
    parser.add_argument("--staleness", type=int, default=0, help="steps the rollouts' weights may lag")
    args = parser.parse_args(argv)
    return run_checks(lambda checks: run(args.workdir.resolve(), args.steps, args.staleness, checks))


def run(workdir: Path, steps: int, staleness: int, checks: dict[str, str | None]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(0)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_smollm2_checkpoint()
    with ProcessGroup(workdir / "logs") as procs:
        port = free_port()
        bulletin_url = f"http://127.0.0.1:{port}"
        store = workdir / f"store-{int(time.time())}"
        argv = [*stitchboard_cli(), "bulletin", "serve", "--store", f"file://{store}", "--port", str(port)]
        procs.start("bulletin", argv, f"{bulletin_url}/healthz").wait_healthy(120)

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        publisher = Publisher(bulletin_url, RUN, assets=model_dir, workdir=workdir / "publisher", encoding="xor")
        publisher.publish(
            model, step=0
        )  # version 0: the checkpoint the engine boots from (the callback resumes after it)
        rollout_proc = start_rollout(procs, 0, model_dir, bulletin_url, RUN, 0, workdir / "handoff-0")
        rollout_proc.engine.wait_healthy(600)
        rollout_proc.sidecar.wait_healthy(120)
        before = greedy(rollout_proc.url, exact_version=0)

        # --- the lines a user adds: use_vllm=False, the callback, the rollout_func ---------------------
        callback = PublishCallback(publisher)
        rollout = SidecarRollout([rollout_proc.url], callback=callback, staleness_steps=staleness, wait_s=300)
        config = GRPOConfig(
            output_dir=str(workdir / "trainer"),
            use_vllm=False,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=24,
            max_steps=steps,
            learning_rate=3e-6,
            beta=0.0,
            temperature=1.0,
            use_cpu=True,
            bf16=False,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=0,
            disable_tqdm=True,
        )
        counting = CountingReward()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=counting,
            args=config,
            train_dataset=dataset(steps, 2),
            processing_class=tokenizer,
            callbacks=[callback],
            rollout_func=rollout,
        )
        trainer.train()
        rollout.close()
        publisher.flush()

        client = BulletinClient(bulletin_url)
        step_of = {v.version: client.manifest(RUN, v.version).metadata.get("step") for v in client.versions(RUN)}
        last = max(step_of)
        published = [p.step for p in callback.published if not p.failed]
        checks[f"{steps} optimizer steps, each published as a version recording its step"] = (
            None
            if published == list(range(1, steps + 1)) and sorted(step_of.values()) == list(range(steps + 1))
            else f"published steps {published}, bulletin steps {step_of}, skipped {callback.skipped_steps}"
        )
        checks[f"every rollout of step k came from a version of step >= k - {staleness} (stamps and spans)"] = (
            _rollout_versions(counting.calls, step_of, staleness, steps)
        )
        view, rebuilt = served_view(trainer.model), rebuild_version(client, RUN).view
        same = set(view) == set(rebuilt) and all(view[k].bits.tobytes() == rebuilt[k].bits.tobytes() for k in view)
        checks[f"the bulletin's version {last} is the trainer's served view, bit for bit"] = (
            None if same else "the rebuilt version differs from served_view(trainer.model)"
        )
        applied, status = wait_applied(rollout_proc.url, last, 300)
        checks[f"the sidecar applied and verified version {last}"] = (
            None if applied == last and status.state == "idle" else f"applied {applied}, state {status.state}"
        )
        after = greedy(rollout_proc.url, exact_version=last)
        procs.stop(rollout_proc.sidecar)  # free the cores for the fresh engine
        procs.stop(rollout_proc.engine)
        pulled = workdir / f"pulled-v{last}-{int(time.time())}"
        pull_version(client, RUN, pulled, last)
        fresh, fresh_url = start_engine(procs, "engine-fresh", pulled, extension=False)
        fresh.wait_healthy(600)
        reference = greedy(fresh_url)
        checks["engine == fresh vLLM from the pulled checkpoint (greedy tokens and logprobs, bitwise)"] = (
            None if after == reference else f"engine {after[0]['tokens']} != fresh {reference[0]['tokens']}"
        )
        checks["the last version's answers differ from version 0's"] = None if after != before else "no change"
        client.close()
        publisher.close()


def _rollout_versions(calls: list[dict[str, Any]], step_of: dict[int, Any], staleness: int, steps: int) -> str | None:
    """None when every token and stamp of every rollout is from a version of step >= k - staleness."""
    if len(calls) < steps:
        return f"{len(calls)} rollouts for {steps} steps"
    for call in calls:
        low = call["step"] - staleness
        versions = {v for per_token in call["weight_versions"] for v in per_token} | set(call["starts"])
        if -1 in versions:
            return f"step {call['step']}: a token the sidecar could not attribute to a version"
        bad = sorted(v for v in versions if step_of.get(v) is None or step_of[v] < low)
        if bad:
            return (
                f"step {call['step']}: versions {bad} (steps {[step_of.get(v) for v in bad]}) are older than step {low}"
            )
    return None


if __name__ == "__main__":
    sys.exit(main())
