"""``stitchboard watch DIR``: publish every complete checkpoint a training framework writes to DIR
(the command's process; the work is :class:`~.watch.Watcher`'s). Registered through the
``stitchboard.commands`` entry-point group; docs/integrations/watch.md has a command per framework.
"""

from __future__ import annotations

import logging
import signal
import threading
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from stitchboard.bulletin.cli_options import Bulletin, Run, Token
from stitchboard.proto.codec import ENCODINGS
from stitchboard.proto.logs import LogFormat, LogFormatOption, configure_logging


class LayoutName(StrEnum):
    """The ``--layout`` choices."""

    auto = "auto"
    prime_rl = "prime-rl"
    nemo_rl = "nemo-rl"
    hf_trainer = "hf-trainer"
    miles = "miles"


def watch(
    folder: Annotated[Path, typer.Argument(help="the folder the framework writes its checkpoint folders into")],
    bulletin: Bulletin,
    run: Run,
    token: Token = None,
    layout: Annotated[
        LayoutName,
        typer.Option(
            help="prime-rl (step_N/ + STABLE), nemo-rl (version_N/), hf-trainer (checkpoint-N/), "
            "miles (weight_vNNNNNN/ disk-delta versions; needs --base)"
        ),
    ] = LayoutName.auto,
    pattern: Annotated[
        str | None, typer.Option(help="custom layout: folders matching this glob (the step is the last number)")
    ] = None,
    complete_marker: Annotated[
        str | None, typer.Option(help="with --pattern: a checkpoint is complete once this file is in it")
    ] = None,
    settle_s: Annotated[
        float, typer.Option(min=0, help="a checkpoint is complete once its files stayed unchanged this long, seconds")
    ] = 0.0,
    base: Annotated[
        Path | None,
        typer.Option(help="with --layout miles: Miles' --hf-checkpoint, the version its first delta is based on"),
    ] = None,
    served: Annotated[str, typer.Option(help="the run's served view: bf16, fp8, fp8-block, nvfp4")] = "bf16",
    assets: Annotated[
        Path | None, typer.Option(help="config/tokenizer folder for a new run (default: the first checkpoint's)")
    ] = None,
    poll_s: Annotated[float, typer.Option(min=0.05, help="seconds between passes over the folder")] = 2.0,
    metrics_port: Annotated[int | None, typer.Option(help="serve Prometheus /metrics on this port")] = None,
    encoding: Annotated[str, typer.Option(help=f"patch encoding: {', '.join(ENCODINGS)}")] = "cond",
    snapshot_every: Annotated[int, typer.Option(min=1, help="an anchor every this many versions")] = 10,
    log_format: LogFormatOption = LogFormat.text,
) -> None:
    """Publish every complete checkpoint written to FOLDER as the run's next version; runs until stopped.

    Exit status 1 when the folder holds another layout's checkpoints or the run cannot be published to.
    """
    from stitchboard.bulletin.client import BulletinClient
    from stitchboard.proto.errors import StitchError

    from .publisher_core import PublisherOptions
    from .watch import Watcher, WatchMetrics
    from .watch_layouts import LAYOUTS, Layout, miles_layout, pattern_layout

    if pattern is not None and layout is not LayoutName.auto:
        raise typer.BadParameter("give --layout or --pattern, not both", param_hint="--pattern")
    if pattern is not None and complete_marker is None and settle_s <= 0:
        raise typer.BadParameter("--pattern needs --complete-marker FILE or --settle-s S", param_hint="--pattern")
    if pattern is None and complete_marker is not None:
        raise typer.BadParameter("--complete-marker goes with --pattern", param_hint="--complete-marker")
    if encoding not in ENCODINGS:
        raise typer.BadParameter(f"use one of {', '.join(ENCODINGS)}", param_hint="--encoding")
    if (layout is LayoutName.miles) != (base is not None):
        raise typer.BadParameter(
            "--layout miles needs --base (Miles' --hf-checkpoint), and only it", param_hint="--base"
        )
    chosen: Layout | None
    if base is not None:
        chosen = miles_layout(base)
        assets = base if assets is None else assets
    else:
        chosen = pattern_layout(pattern, complete_marker) if pattern else LAYOUTS.get(layout.value)
    configure_logging(log_format, logging.WARNING, {"run": run}, text_format="%(message)s")
    metrics = WatchMetrics()
    stop_serving = metrics.serve(metrics_port) if metrics_port is not None else None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    options: PublisherOptions = {
        "served": served,
        "encoding": encoding,
        "snapshot_every": snapshot_every,
    }
    try:
        with BulletinClient(bulletin, token, retries=5, backoff_s=0.5) as client:
            watcher = Watcher(
                folder,
                run,
                client,
                layout=chosen,
                poll_s=poll_s,
                settle_s=settle_s,
                assets=assets,
                options=options,
                metrics=metrics,
                say=typer.echo,
            )
            try:
                watcher.run_until(stop)
            finally:
                watcher.close()
    except (StitchError, OSError, ValueError) as exc:
        typer.echo(f"error ({getattr(exc, 'type', type(exc).__name__)}): {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(1) from exc
    finally:
        if stop_serving is not None:
            stop_serving()
