"""The ``stitchboard`` command line: one typer app; each role adds its subcommands.

Subcommands come from the ``stitchboard.commands`` entry-point group (see pyproject.toml), so
a host with only some extras installed gets the commands it can run, and a missing extra is
reported with the install line instead of a traceback, whether the command's module (at load)
or the command itself (at run) misses the module: the extra is the one its module is named for
(:func:`extra_of`).

A command loads only its own group: ``stitchboard patch inspect`` or ``stitchboard sidecar run``
imports neither the demo's torch nor the bulletin's web stack. Loading every group costs ~6 s of
one core on the 2-core test host, the ``patch`` group alone ~0.7 s (``bulletin`` ~2.4 s, ``demo``
~3.5 s); ``stitchboard --help`` and an unknown name still load them all, to list them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

import typer

HELP = "stitchboard: ship RL weight updates to rollout engines as small bit-exact patches."
GROUP = "stitchboard.commands"


def extra_of(command: EntryPoint) -> str | None:
    """The optional extra a command needs: the deepest part of its module's dotted path whose first word
    (up to ``_``) is an extra of the distribution that registers it.

    ``stitchboard.trainer_client.cli`` -> ``trainer``, ``stitchboard.demo.model_cli`` -> ``model``,
    ``stitchboard.bulletin.versions_cli`` -> ``bulletin``; None for a command of the core install
    (``stitchboard.proto.patch_cli``).
    """
    extras = set(command.dist.metadata.get_all("Provides-Extra") or []) if command.dist is not None else set()
    for part in reversed(command.module.split(".")[1:]):
        if (word := part.split("_")[0]) in extras:
            return word
    return None


def install_hint(command: EntryPoint, exc: ImportError) -> str:
    """The one line that says what to install for ``command``, which failed to import ``exc.name``."""
    extra = extra_of(command)
    if extra is None:
        return (
            f"'stitchboard {command.name}' cannot import {exc.name or exc}, a dependency of stitchboard itself: "
            f"reinstall it ({exc})"
        )
    return (
        f"'stitchboard {command.name}' needs the optional extra [{extra}]: pip install 'stitchboard[{extra}]' ({exc})"
    )


#: The stand-in of a command that cannot load takes any arguments and options, --help included, and explains.
_ANY_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _missing(command: EntryPoint, exc: ImportError) -> Callable[[], None]:
    def explain() -> None:
        typer.echo(install_hint(command, exc), err=True)
        raise typer.Exit(2)

    return explain


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

    registered = sorted(entry_points(group=GROUP), key=lambda e: e.name)
    for ep in [ep for ep in registered if ep.name == only] or registered:
        try:
            sub = ep.load()
        except ImportError as exc:
            help_text = f"(unavailable: {exc.name or exc} is not installed)"
            app.command(ep.name, help=help_text, context_settings=_ANY_ARGS)(_missing(ep, exc))
            continue
        if isinstance(sub, typer.Typer):
            app.add_typer(sub, name=ep.name)
        else:
            app.command(ep.name)(sub)
    return app


def main() -> None:
    """Console-script entry point.

    A command that fails to import a third-party module while it runs (commands import their heavy
    parts late) exits 2 with :func:`install_hint`'s line instead of a traceback.
    """
    only = sys.argv[1] if len(sys.argv) > 1 else None
    try:
        build_app(only)()
    except ImportError as exc:
        command = next(iter(entry_points(group=GROUP, name=only or "")), None)
        if command is None or exc.name is None or exc.name.partition(".")[0] == "stitchboard":
            raise
        typer.echo(install_hint(command, exc), err=True)
        raise SystemExit(2) from None
