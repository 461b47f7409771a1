"""``stitchboard demo --lora``'s command-line side: what it refuses up front, its lines and exit status (demo process).

The run itself is :func:`.lora_demo.run_lora_demo`. The output ends with one line per check (``ok <check>`` or
``FAIL <check>``), the summary's path, and ``PASS`` or ``FAIL: <reasons>`` as the last line; the exit status is 0
if and only if that line starts with ``PASS``.
"""

from __future__ import annotations

from pathlib import Path

import typer

from stitchboard.proto.errors import StitchError

from .lora_demo import LoraDemoConfig, LoraStepRow, run_lora_demo
from .moe_models import PRESETS

#: Why the LoRA demo does not run with ``--served`` other than bf16.
SERVED_REASON = (
    "the LoRA demo serves a bf16 adapter over the bf16 base model; an FP8 base under a bf16 adapter is not part of it"
)
#: Why the LoRA demo does not run on a MoE preset.
MOE_REASON = (
    "the LoRA demo trains its adapter on the attention projections of a dense model (SmolLM2 or a --model folder); "
    "the MoE presets' routing-replay checks have no adapter counterpart"
)


def refuse_lora(engine: str, served: str, model: str | None, engines: int) -> None:
    """Refuse, before anything starts, what ``--lora`` does not run, naming the reason.

    Raises:
        typer.BadParameter: ``--engine`` other than vllm (SGLang: the reason its engine room gives), ``--served``
            other than bf16, a MoE preset as ``--model``, or ``--engines`` other than 1.
    """
    if engine != "vllm":
        from stitchboard.sidecar.engines.registry import lookup

        try:
            why = lookup(engine).adapters_unsupported or "its engine room serves no adapters"
        except ValueError as exc:  # no engine of that name
            why = str(exc)
        raise typer.BadParameter(f"--lora with --engine {engine}: {why}; use --engine vllm", param_hint="--engine")
    if served != "bf16":
        raise typer.BadParameter(f"--lora with --served {served}: {SERVED_REASON}", param_hint="--served")
    if model in PRESETS:
        raise typer.BadParameter(f"--lora with --model {model}: {MOE_REASON}", param_hint="--model")
    if engines != 1:
        raise typer.BadParameter(
            f"--lora with --engines {engines}: the LoRA demo runs one engine behind one sidecar", param_hint="--engines"
        )


def _row_line(r: LoraStepRow) -> str:
    return (
        f"step {r.step}: version {r.version}, {r.changed_pct:.1f} % of the adapter changed, patch "
        f"{r.patch_bytes / 1e3:.1f} kB / adapter {r.adapter_bytes / 1e6:.2f} MB, publish {r.publish_s:.2f} s, "
        f"resident after {r.servable_s:.2f} s, mean reward {r.mean_reward:+.3f}, stamps {r.versions_seen}"
    )


def run_lora_cli(cfg: LoraDemoConfig, keep: bool) -> None:
    """Run the LoRA demo, print its lines and exit: 0 iff every check held (the last line is then ``PASS``).

    Args:
        keep: keep every process running at the end until Enter is pressed.
    """
    try:
        result = run_lora_demo(
            cfg,
            on_event=lambda text: print(text, flush=True),
            on_row=lambda row: print(_row_line(row), flush=True),
            wait_for_user=(lambda: input("processes kept running; press Enter to stop them ")) if keep else None,
        )
    except (StitchError, OSError) as exc:
        print(f"FAIL: {exc}", flush=True)
        raise typer.Exit(1) from None
    summary = result.write_summary(Path(cfg.workdir).resolve())
    for name, held in result.checks.items():
        print(f"{'ok' if held else 'FAIL'} {name}")
    print(f"summary: {summary}; {result.seconds:.0f} s")
    if not result.passed:
        print(f"FAIL: {'; '.join(result.reasons)}", flush=True)
        raise typer.Exit(1)
    print("PASS (vLLM, LoRA adapter versions)", flush=True)
