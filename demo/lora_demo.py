"""``stitchboard demo --lora``: a LoRA RL run whose adapter versions are served beside the base model (demo process).

Sequence (:func:`run_lora_demo`):

1. the bf16 SmolLM2 checkpoint (or ``--model``); a bulletin on a local folder under the work dir;
2. the LoRA policy (:mod:`.lora_policy`: real PEFT LoRA over the float32 masters); version 0 of the
   adapter run :data:`LORA_RUN` published with the SDK's ``publish`` (adapter weights only);
3. one vLLM engine with LoRA on (:data:`SLOTS` adapter slots) and stitchboard's worker extension,
   behind a sidecar in adapter mode keeping the last :data:`RESIDENT` versions resident; the engine
   keeps serving the base model under ``demo``;
4. per step: a group of completions per prompt sampled through the sidecar from the run's newest
   resident version (``"model": "<run>"`` with ``min_version``), one GRPO step with AdamW on the
   adapter, publish, wait until ``<run>@<N>`` is resident; greedy answers of each version through
   the sidecar recorded right after it is loaded. During the last swap a base-model stream is in
   flight (:func:`.lora_checks.BaseStream`);
5. checks (:mod:`.lora_checks`), each an ``ok``/``FAIL`` line and a key of ``summary.json``'s ``checks``.
   The oracle is one fresh plain vLLM given every version pulled from the bulletin as a PEFT folder
   (``--lora-modules``): cold, from disk.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.adapter import adapter_name

from .engines import SERVED_NAME, greedy, start_bulletin
from .errors import DemoError
from .lora_checks import BaseStream, check_lora_demo, resident_adapters, wait_resident
from .lora_engine import LoraRollout, lora_engine, remove_handoff, start_lora_rollout
from .lora_policy import LORA_LR, lora_optimizer, lora_policy
from .processes import ProcessGroup
from .smollm2 import build_smollm2_checkpoint
from .task import prompts_for_step, reward

#: The adapter run the demo publishes (its versions are served as ``demo-lora@<N>``).
LORA_RUN = "demo-lora"
#: Versions the sidecar keeps resident, and the engine's adapter slots (one more: load before unload).
RESIDENT = 2
SLOTS = RESIDENT + 1


@dataclass
class LoraStepRow:
    """One LoRA step's figures (a line of the demo's output)."""

    step: int
    version: int
    changed_pct: float
    patch_bytes: int
    adapter_bytes: int
    publish_s: float
    servable_s: float
    mean_reward: float
    loss: float
    versions_seen: list[list[int]]


@dataclass
class LoraDemoResult:
    """What the LoRA demo measured and whether every check held (``summary.json``)."""

    rows: list[LoraStepRow] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    final_version: int | None = None
    seconds: float = 0.0
    swap: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when every check held."""
        return bool(self.checks) and all(self.checks.values())

    def write_summary(self, workdir: Path) -> Path:
        """``workdir/summary.json``: passed, checks, reasons, versions, the swap's base stream."""
        path = workdir / "summary.json"
        body = {"passed": self.passed, "engine": "vllm", "lora": True, "checks": self.checks, "reasons": self.reasons,
                "final_version": self.final_version, "seconds": round(self.seconds, 1), "swap": self.swap,
                "steps": [asdict(r) for r in self.rows]}  # fmt: skip
        path.write_text(json.dumps(body, indent=2) + "\n")
        return path


@dataclass
class LoraDemoConfig:
    """Options of ``stitchboard demo --lora`` (see its ``--help``)."""

    workdir: Path
    steps: int = 2
    model_dir: Path | None = None
    prompts_per_step: int = 4
    group_size: int = 4
    max_tokens: int = 24
    lr: float = LORA_LR
    seed: int = 0
    startup_timeout_s: float = 900.0


def run_lora_demo(
    cfg: LoraDemoConfig, on_event=lambda text: None, on_row=lambda row: None, wait_for_user=None
) -> LoraDemoResult:
    """Run the LoRA demo; every process it starts is stopped when it returns or raises.

    Args:
        cfg: options.
        on_event: called with progress messages; ``on_row``: with each step's :class:`LoraStepRow`.
        wait_for_user: called, when given, after the checks and before every process is stopped.

    Raises:
        DemoError: a process failed to start or a request failed (with the log's path).
    """
    from transformers import AutoTokenizer

    from stitchboard.trainer_client.publisher import Publisher

    t_start = time.monotonic()
    workdir = cfg.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = (cfg.model_dir or build_smollm2_checkpoint()).resolve()
    result = LoraDemoResult()
    rollout: LoraRollout | None = None
    try:
        with ProcessGroup(workdir / "logs") as procs:
            bulletin_url = start_bulletin(procs, workdir, on_event)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            policy = lora_policy(model_dir, seed=cfg.seed)
            optimizer = lora_optimizer(policy, cfg.lr)
            answers: dict[int, list[dict]] = {}
            with Publisher(bulletin_url, LORA_RUN, workdir=workdir / "publisher") as publisher:
                v0 = publisher.publish(policy, step=0)
                on_event(f"adapter version 0 published ({v0.view_bytes / 1e6:.2f} MB)")
                rollout = start_lora_rollout(
                    procs, model_dir, bulletin_url, LORA_RUN, slots=SLOTS, resident=RESIDENT,
                    name=f"stitch-demo-handoff-{bulletin_url.rsplit(':', 1)[1]}",
                )  # fmt: skip
                rollout.engine.wait_healthy(cfg.startup_timeout_s)
                rollout.sidecar.wait_healthy(120)
                wait_resident(rollout.url, adapter_name(LORA_RUN, 0), 300)
                answers[0] = greedy(rollout.url, model=adapter_name(LORA_RUN, 0))
                on_event(f"engine with {SLOTS} adapter slots ready behind sidecar {rollout.url}; version 0 resident")
                version = 0
                for step in range(1, cfg.steps + 1):
                    row, stream = _train_step(
                        cfg, step, version, rollout.url, policy, tokenizer, optimizer, publisher, step == cfg.steps
                    )
                    if stream is not None:
                        result.swap = stream.finish()
                    version = row.version
                    answers[version] = greedy(rollout.url, model=adapter_name(LORA_RUN, version))
                    result.rows.append(row)
                    on_row(row)
                result.final_version = version
                older = greedy(rollout.url, model=adapter_name(LORA_RUN, version - 1))
                resident = resident_adapters(rollout.url)
                status = rollout.status()
            procs.stop(rollout.sidecar)  # free the cores for the fresh engine
            procs.stop(rollout.engine)
            folders = _pull_all(bulletin_url, workdir, version)
            on_event(f"versions 0..{version} pulled as PEFT folders; starting a fresh engine on them")
            modules = {adapter_name(LORA_RUN, v): folder for v, folder in folders.items()}
            fresh, fresh_url = lora_engine(procs, "engine-fresh", model_dir, slots=len(modules), modules=modules)
            fresh.wait_healthy(cfg.startup_timeout_s)
            reference = {v: greedy(fresh_url, model=adapter_name(LORA_RUN, v)) for v in folders}
            result.checks, result.reasons = check_lora_demo(
                LORA_RUN, version, result.rows, result.swap, answers, reference, older, resident, status
            )
            if wait_for_user is not None:
                wait_for_user()
    finally:  # the sidecar stopped: its memory-backed hand-off folder goes too
        if rollout is not None:
            remove_handoff(rollout)
    result.seconds = time.monotonic() - t_start
    return result


def _pull_all(bulletin_url: str, workdir: Path, last: int) -> dict[int, Path]:
    """Every version 0..``last`` of the run pulled from the bulletin as a PEFT folder (the SDK's adapter pull)."""
    from stitchboard.trainer_client.adapter_pull import pull_adapter

    root = workdir / f"pulled-{int(time.time())}"
    client = BulletinClient(bulletin_url)
    for v in range(last + 1):
        pull_adapter(client, LORA_RUN, root / f"v{v}", v)
    return {v: root / f"v{v}" for v in range(last + 1)}


def _train_step(
    cfg, step, version, url, policy, tokenizer, optimizer, publisher, swap_stream
) -> tuple[LoraStepRow, BaseStream | None]:
    """One step: rollouts from the newest resident version, a GRPO step on the adapter, publish, wait until resident.
    With ``swap_stream``, a base-model stream is started after the optimizer step and kept across the swap."""
    from .engines import sample
    from .grpo import Sample, policy_gradient_step

    samples, seen = [], set()
    for i, prompt in enumerate(prompts_for_step(step, cfg.prompts_per_step)):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.message}], tokenize=False, add_generation_prompt=True
        )
        completions, stamps, _ = sample(
            url, text, cfg.group_size, min_version=version, max_tokens=cfg.max_tokens,
            seed=cfg.seed * 100_000 + step * 100 + i, model=LORA_RUN,
        )  # fmt: skip
        seen.add(stamps)
        samples += [Sample(text, c, reward(prompt, c), group=i) for c in completions]
    loss = policy_gradient_step(policy, tokenizer, optimizer, samples)
    stream = BaseStream(url, SERVED_NAME) if swap_stream else None
    if stream is not None:
        stream.wait_started()
    t0 = time.monotonic()
    res = publisher.publish(policy, step=step)
    publish_s = time.monotonic() - t0
    if stream is not None:
        stream.mark("publish_done")
    wait_resident(url, adapter_name(LORA_RUN, res.version), 300)
    servable_s = time.monotonic() - t0
    if stream is not None:
        stream.mark("resident")
    if res.version != version + 1:
        raise DemoError(f"step {step} published version {res.version}, expected {version + 1}")
    return LoraStepRow(
        step=step,
        version=res.version,
        changed_pct=100 * res.changed_fraction,
        patch_bytes=res.encoded_bytes,
        adapter_bytes=res.view_bytes,
        publish_s=publish_s,
        servable_s=servable_s,
        mean_reward=statistics.fmean(s.reward for s in samples),
        loss=loss,
        versions_seen=sorted([list(s) for s in seen]),
    ), stream
