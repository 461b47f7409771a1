"""``stitchboard publish`` and ``stitchboard pull``: checkpoints on disk to versions and back.

For trainers that only write checkpoints (any framework): ``publish`` takes a safetensors
checkpoint (one file, or an HF index + shards; any tensor set and dtypes, taken as the served
view as is) and publishes it as the run's next version, diffing against the run's latest
version rebuilt from the bulletin. ``pull`` materializes any version as a plain folder
(safetensors checkpoint + run assets) that transformers or vLLM load, verified against the
manifest checksums; a version of an adapter run is written as a PEFT adapter folder
(:mod:`.adapter_pull`). Both are top-level commands registered through the
``stitchboard.commands`` entry-point group.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from stitchboard.bulletin.cli_options import Bulletin, Run, Token
from stitchboard.proto.logs import LogFormat, LogFormatOption, configure_logging


def _fail(exc: Exception) -> typer.Exit:
    kind = getattr(exc, "type", type(exc).__name__)
    typer.echo(f"error ({kind}): {getattr(exc, 'message', exc)}", err=True)
    return typer.Exit(1)


def publish(
    checkpoint: Annotated[Path, typer.Argument(help="a .safetensors file, an index json, or a folder holding either")],
    bulletin: Bulletin,
    run: Run,
    token: Token = None,
    anchor: Annotated[
        bool, typer.Option("--anchor", help="make this version an anchor (carry a full snapshot)")
    ] = False,
    skip_rebuild: Annotated[
        bool,
        typer.Option(
            "--skip-rebuild", help="do not download the latest version; send changed tensors whole, as an anchor"
        ),
    ] = False,
    step: Annotated[int | None, typer.Option(help="training step, stored in the manifest metadata")] = None,
    assets: Annotated[
        Path | None,
        typer.Option(help="folder of config/tokenizer files for a new run (default: the checkpoint's folder)"),
    ] = None,
    log_format: LogFormatOption = LogFormat.text,
) -> None:
    """Publish CHECKPOINT as the run's next version (version 0 with its assets on a new run); print the version."""
    from stitchboard.bulletin.client import BulletinClient
    from stitchboard.proto.checkpoint import checkpoint_files, load_checkpoint
    from stitchboard.proto.errors import StitchError

    from .assets import ASSET_NAMES
    from .publisher import Publisher

    configure_logging(log_format, logging.INFO, {"run": run}, text_format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        view = load_checkpoint(checkpoint)
        folder = assets or checkpoint_files(checkpoint)[1]
        folder = folder if folder.is_dir() else folder.parent
        with BulletinClient(bulletin, token, retries=5, backoff_s=0.5) as client:
            new_run = client.latest(run) is None
            run_assets = folder if new_run and any((folder / n).is_file() for n in ASSET_NAMES) else None
            with Publisher(
                bulletin, run, token, assets=run_assets, resume="anchor" if skip_rebuild else "rebuild", client=client
            ) as publisher:
                result = publisher.publish_view(view, step=step, anchor=anchor)
    except (StitchError, OSError, ValueError) as exc:
        raise _fail(exc) from exc
    typer.echo(result.version)


def pull(
    bulletin: Bulletin,
    run: Run,
    output: Annotated[Path, typer.Option("-o", "--output", help="folder to create (must not exist or be empty)")],
    token: Token = None,
    version: Annotated[int | None, typer.Option(help="version to pull (default: the latest)")] = None,
    adapter: Annotated[
        bool, typer.Option("--adapter", help="require an adapter run's version (refuse a full run's)")
    ] = False,
) -> None:
    """Write a version into OUTPUT, verified against its manifest: a plain safetensors checkpoint + run assets, or
    for an adapter run a PEFT adapter folder (adapter_model.safetensors + adapter_config.json)."""
    from stitchboard.bulletin.client import BulletinClient
    from stitchboard.proto.errors import StitchError

    from .adapter_pull import pull_folder

    try:
        with BulletinClient(bulletin, token) as client:
            rebuilt = pull_folder(client, run, output, version, require_adapter=adapter)
    except (StitchError, OSError, ValueError) as exc:
        raise _fail(exc) from exc
    m = rebuilt.manifest
    kind = "" if m.adapter is None else f" (LoRA adapter r={m.adapter.r} over {m.adapter.base_model}, PEFT folder)"
    typer.echo(
        f"version {m.version} of run {run}: {len(m.tensors)} tensors{kind}, {len(rebuilt.assets)} asset files, "
        f"verified -> {output}"
    )
