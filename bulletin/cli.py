"""``stitchboard bulletin serve|gc``: run the bulletin service, apply the retention policy."""

from __future__ import annotations

import json
import os
import re
from enum import StrEnum
from typing import Annotated, Any

import typer
import uvicorn
from rich.console import Console
from rich.table import Table

from stitchboard.proto.logs import RequestContext, logging_config

from .app import create_app
from .gc_hold import freeze_startup_heap
from .ledger import Ledger
from .retention import collect_garbage
from .settings import BulletinSettings
from .stores import open_store

app = typer.Typer(
    help="The bulletin: where trainers publish versions and rollout engines find them.", no_args_is_help=True
)

StoreOpt = Annotated[
    str | None, typer.Option("--store", help="file:///path or s3://bucket/prefix [env STITCH_BULLETIN_STORE]")
]


def _settings(**overrides: Any) -> BulletinSettings:
    return BulletinSettings(**{k: v for k, v in overrides.items() if v is not None})


class HttpProtocol(StrEnum):
    """``serve --http``: uvicorn's HTTP protocol; :data:`HTTP_PROTOCOLS` has the import string uvicorn loads."""

    bulletin = "bulletin"  # an answer's head and body in one write (http_protocol.py)
    httptools = "httptools"  # uvicorn's own


#: The run, version and replica a request's path names, for its log lines
#: (``/v1/runs/<run>[/versions/<n> | /replicas/<replica id>]...``).
RUN_PATH = re.compile(r"/v1/runs/(?P<run>[^/]+)(?:/versions/(?P<version>[0-9]+)(?:/|$)|/replicas/(?P<replica>[^/]+)$)?")

HTTP_PROTOCOLS = {
    HttpProtocol.bulletin: "stitchboard.bulletin.http_protocol:CoalescingHttpToolsProtocol",
    HttpProtocol.httptools: "httptools",
}


def served_app() -> Any:
    """The app ``bulletin serve`` runs in each of its processes (uvicorn's app factory): settings from the
    ``STITCH_BULLETIN_*`` environment, the startup heap frozen once the app is built (``gc_hold.py``)."""
    served = RequestContext(create_app(BulletinSettings()), path=RUN_PATH)  # a request's id, run and version
    freeze_startup_heap()  # full collections then walk only what serving creates
    return served


@app.command()
def serve(
    store: StoreOpt = None,
    host: Annotated[
        str | None, typer.Option(help="address to listen on [env STITCH_BULLETIN_HOST, default 127.0.0.1]")
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port [env STITCH_BULLETIN_PORT, default 8700]")] = None,
    log_level: Annotated[str | None, typer.Option(help="uvicorn log level [env STITCH_BULLETIN_LOG_LEVEL]")] = None,
    workers: Annotated[
        int | None,
        typer.Option(min=1, help="bulletin processes sharing the port [env STITCH_BULLETIN_WORKERS, default 1]"),
    ] = None,
    http: Annotated[HttpProtocol, typer.Option(help="uvicorn's HTTP protocol")] = HttpProtocol.bulletin,
) -> None:
    """Serve the REST API (all other settings: STITCH_BULLETIN_* env vars, see stitchboard.bulletin.settings)."""
    overrides = {"store": store, "host": host, "port": port, "log_level": log_level, "workers": workers}
    settings = _settings(**overrides)
    prefix = BulletinSettings.model_config["env_prefix"]
    for name, value in overrides.items():  # each worker process reads its settings from the environment
        if value is not None:
            os.environ[f"{prefix}{name.upper()}"] = str(value)
    open_store(settings.store, settings)  # a store URL not understood stops here, once, not in every worker
    access_log = settings.log_level.lower() in (
        "trace",
        "debug",
        "info",
    )  # above info uvicorn drops its lines, but still formats them per answer
    uvicorn.run(
        f"{__name__}:served_app", factory=True, workers=settings.workers, http=HTTP_PROTOCOLS[http],
        host=settings.host, port=settings.port, log_level=settings.log_level, access_log=access_log,
        log_config=logging_config(settings.log_format, settings.log_level),
        timeout_graceful_shutdown=5,
    )  # fmt: skip


@app.command()
def gc(
    store: StoreOpt = None,
    keep_snapshots: Annotated[
        int | None, typer.Option(help="keep the last K snapshots [env STITCH_BULLETIN_KEEP_SNAPSHOTS, default 2]")
    ] = None,
    grace_s: Annotated[
        float | None,
        typer.Option(help="seconds before dropped data is removed [env STITCH_BULLETIN_GC_GRACE_S, default 3600]"),
    ] = None,
    run: Annotated[
        list[str] | None, typer.Option("--run", help="only this run (repeatable); default: every run")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="report, remove nothing")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Remove versions outside the retention policy and blobs no kept version references (after the grace period)."""
    settings = _settings(store=store, keep_snapshots=keep_snapshots, gc_grace_s=grace_s)
    ledger = Ledger(open_store(settings.store, settings), cache_entries=0)
    report = collect_garbage(ledger, settings.keep_snapshots, settings.gc_grace_s, runs=run or None, dry_run=dry_run)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "versions_removed": report.versions_removed,
                    "blobs_removed": report.blobs_removed,
                    "bytes_freed": report.bytes_freed,
                    "dry_run": dry_run,
                }
            )
        )
        return
    table = Table(title=f"gc of {ledger.store.url}" + (" (dry run)" if dry_run else ""))
    for col in ("run", "versions removed", "blobs removed"):
        table.add_column(col)
    for r in sorted(set(report.versions_removed) | set(report.blobs_removed)):
        versions = report.versions_removed.get(r, [])
        table.add_row(
            r,
            f"{len(versions)} ({versions[0]}..{versions[-1]})" if versions else "0",
            str(len(report.blobs_removed.get(r, []))),
        )
    Console().print(table)
    typer.echo(f"{report.bytes_freed} bytes freed")
