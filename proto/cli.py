"""The ``stitchboard`` command line: one typer app; each role adds its subcommands.

Subcommands come from the ``stitchboard.commands`` entry-point group (see pyproject.toml), so
a host with only some extras installed gets the commands it can run, and a missing extra is
reported with the install line instead of a traceback.

A command loads only its own group: ``stitchboard patch inspect`` or ``stitchboard sidecar run``
imports neither the demo's torch nor the bulletin's web stack. Loading every group costs ~6 s of
one core on the 2-core test host, the ``patch`` group alone ~0.7 s (``bulletin`` ~2.4 s, ``demo``
~3.5 s); ``stitchboard --help`` and an unknown name still load them all, to list them.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

import typer

HELP = "stitchboard: ship RL weight updates to rollout engines as small bit-exact patches."


def _missing(name: str, exc: ImportError) -> typer.Typer:
    sub = typer.Typer(help=f"(unavailable: {exc.name or exc} is not installed)")

    @sub.callback(invoke_without_command=True)
    def _explain() -> None:
        typer.echo(f"'stitchboard {name}' needs an optional extra: pip install 'stitchboard[{name}]' ({exc})", err=True)
        raise typer.Exit(2)

    return sub


def build_app(only: str | None = None) -> typer.Typer:
    """A new root app with the registered subcommand groups attached.

    Args:
        only: the subcommand about to run (``sys.argv[1]``): when it names a registered group,
            only that group is loaded; otherwise (``None``, an option such as ``--help``, a
            name no group has) every group is, so help and "no such command" list them all.
    """
    app = typer.Typer(help=HELP, no_args_is_help=True)

    @app.callback()
    def _root() -> None:
        # A callback keeps the root a group when only one plain command (e.g. `publish`) is attached.
        pass

    registered = sorted(entry_points(group="stitchboard.commands"), key=lambda e: e.name)
    for ep in [ep for ep in registered if ep.name == only] or registered:
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
    build_app(sys.argv[1] if len(sys.argv) > 1 else None)()
