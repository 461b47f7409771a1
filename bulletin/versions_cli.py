"""``stitchboard versions latest|list|at-step|show|plan``: query a bulletin over REST (httpx only, no FastAPI)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from stitchboard.proto.schema import VersionInfo, canonical_json

from .cli_options import Bulletin, Run, Token
from .client import BulletinClient
from .errors import BulletinError

app = typer.Typer(help="Query versions of runs on a bulletin.", no_args_is_help=True)

AsJson = Annotated[bool, typer.Option("--json", help="machine-readable JSON output")]


def _client(bulletin: str, token: str | None) -> BulletinClient:
    return BulletinClient(bulletin, token, retries=2)


def _fail(exc: BulletinError) -> typer.Exit:
    typer.echo(f"error ({exc.type}): {exc.message}", err=True)
    return typer.Exit(1)


def _table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    Console().print(table)


@app.command()
def latest(
    bulletin: Bulletin,
    run: Run,
    token: Token = None,
    after: Annotated[int, typer.Option(help="only a version greater than this")] = -1,
    wait_s: Annotated[float, typer.Option(help="long-poll up to this many seconds")] = 0.0,
    as_json: AsJson = False,
) -> None:
    """The latest version of a run (exit 3 when there is none newer than --after)."""
    try:
        with _client(bulletin, token) as c:
            info = c.latest_info(run, after, wait_s)
    except BulletinError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps(info.model_dump() if info else None))
    elif info is None:
        typer.echo(f"run {run!r}: no version after {after}")
    else:
        _versions_table(run, [info])
    if info is None:
        raise typer.Exit(3)


def _versions_table(run: str, infos: list[VersionInfo]) -> None:
    """One row per version: number, snapshot, delta and snapshot bytes, commit time."""
    _table(
        f"run {run}",
        ["version", "snapshot", "delta bytes", "snapshot bytes", "committed at"],
        [[i.version, i.snapshot, i.size_bytes, i.snapshot_bytes, i.committed_at] for i in infos],
    )


@app.command("list")
def list_versions(
    bulletin: Bulletin,
    run: Run,
    token: Token = None,
    after: Annotated[int, typer.Option(help="list versions greater than this")] = -1,
    limit: Annotated[int | None, typer.Option(help="at most this many")] = None,
    as_json: AsJson = False,
) -> None:
    """Committed versions of a run, ascending."""
    try:
        with _client(bulletin, token) as c:
            infos = c.versions(run, after, limit)
    except BulletinError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps([i.model_dump() for i in infos]))
        return
    _versions_table(run, infos)


@app.command("at-step")
def at_step(
    bulletin: Bulletin,
    run: Run,
    step: Annotated[int, typer.Option(min=0, help="training step")],
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """The first version of a run whose training step is --step or later (exit 3 when none is)."""
    try:
        with _client(bulletin, token) as c:
            info = c.version_for_step(run, step)
    except BulletinError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps(info.model_dump() if info else None))
    elif info is None:
        typer.echo(f"run {run!r}: no version at step {step} or later")
    else:
        _versions_table(run, [info])
    if info is None:
        raise typer.Exit(3)


@app.command()
def show(
    bulletin: Bulletin,
    run: Run,
    version: Annotated[int, typer.Option(help="version number")],
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """One version's manifest (files; --json prints the canonical manifest)."""
    try:
        with _client(bulletin, token) as c:
            m = c.manifest(run, version)
    except BulletinError as exc:
        raise _fail(exc) from None
    if as_json:
        sys.stdout.write(canonical_json(m).decode() + "\n")
        return
    typer.echo(
        f"run {m.run_id} version {m.version} base {m.base_version} snapshot={m.snapshot} encoding={m.encoding} "
        f"tensors={len(m.tensors)} changed={m.stats.changed_elements}/{m.stats.total_elements}"
    )
    _table("files", ["path", "role", "bytes", "sha256"], [[f.path, f.role, f.size_bytes, f.sha256] for f in m.files])


@app.command()
def plan(
    bulletin: Bulletin,
    run: Run,
    token: Token = None,
    from_version: Annotated[int | None, typer.Option("--from", help="version held (absent: nothing)")] = None,
    to_version: Annotated[int | None, typer.Option("--to", help="target (absent: latest)")] = None,
    as_json: AsJson = False,
) -> None:
    """The ordered files to fetch to go from --from to --to."""
    try:
        with _client(bulletin, token) as c:
            p = c.plan(run, from_version, to_version)
    except BulletinError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(p.model_dump_json())
        return
    _table(
        f"run {run}: {p.from_version} -> {p.to_version}, {p.total_bytes} bytes",
        ["version", "kind", "files", "bytes"],
        [[s.version, s.kind, len(s.files), s.size_bytes] for s in p.steps],
    )
