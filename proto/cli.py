"""The ``stitchboard`` command line: one typer app; each role adds its subcommands.

Subcommands come from the ``stitchboard.commands`` entry-point group (see pyproject.toml), so
a host with only some extras installed gets the commands it can run, and a missing extra is
reported with the install line instead of a traceback.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import typer

app = typer.Typer(help="stitchboard: ship RL weight updates to rollout engines as small bit-exact patches.", no_args_is_help=True)


def _missing(name: str, exc: ImportError) -> typer.Typer:
    sub = typer.Typer(help=f"(unavailable: {exc.name or exc} is not installed)")

    @sub.callback(invoke_without_command=True)
    def _explain() -> None:
        typer.echo(f"'stitchboard {name}' needs an optional extra: pip install 'stitchboard[{name}]' ({exc})", err=True)
        raise typer.Exit(2)

    return sub


def build_app() -> typer.Typer:
    """Attach every registered subcommand group to the root app and return it."""
    for ep in sorted(entry_points(group="stitchboard.commands"), key=lambda e: e.name):
        try:
            sub = ep.load()
        except ImportError as exc:
            sub = _missing(ep.name, exc)
        if isinstance(sub, typer.Typer):
            app.add_typer(sub, name=ep.name)
        else:
            app.command(ep.name)(sub)
    return app


def main() -> None:
    """Console-script entry point."""
    build_app()()
