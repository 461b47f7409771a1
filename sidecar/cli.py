"""``stitchboard sidecar run``: serve the sidecar in front of one engine on the same host.

Its options are the fields of :class:`~stitchboard.sidecar.settings.SidecarSettings`, made here from
the model: one ``--field-name`` per field (``--name/--no-name`` for a yes/no field; ``salt_cache``
keeps its published ``--salt-cache/--reset-cache``), its type, its default and its description, so
a new setting is an option without an edit here. An option given on the command line overrides the
``STITCH_SIDECAR_*`` environment variable; one left out leaves the variable, else the default.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import typer
import uvicorn
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from stitchboard.proto.logs import RequestContext, logging_config
from stitchboard.proto.sidecar_wire import START_HEADER

from .engines.registry import lookup
from .report import default_replica_id
from .settings import SidecarSettings

app = typer.Typer(no_args_is_help=True)

#: Yes/no fields whose off switch is not ``--no-<name>`` (kept as published).
OFF_SWITCHES = {"salt_cache": "--reset-cache"}


@app.callback()
def sidecar() -> None:
    """The sidecar: keeps one rollout engine at the run's latest weights and gates its requests by version."""


def _settings(**overrides: Any) -> SidecarSettings:
    try:
        settings = SidecarSettings(**overrides)
        lookup(
            settings.engine
        )  # an unknown kind (from STITCH_SIDECAR_ENGINE) is refused here, not at the first request
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        typer.echo(f"invalid sidecar settings: {problems} (options or STITCH_SIDECAR_* env vars)", err=True)
        raise typer.Exit(2) from None
    except ValueError as exc:
        typer.echo(f"invalid sidecar settings: engine: {exc} (options or STITCH_SIDECAR_* env vars)", err=True)
        raise typer.Exit(2) from None
    return settings


def _engine_kind(value: str | None) -> str | None:
    """``--engine``'s check: a kind built in or registered (:func:`~.engines.registry.lookup`), else a usage error."""
    if value is not None:
        try:
            lookup(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


#: Options checked as they are parsed, beyond their field's type.
OPTION_CHECKS = {"engine": _engine_kind}


def option_parameter(name: str, field: FieldInfo) -> inspect.Parameter:
    """The ``stitchboard sidecar run`` option of settings field ``name``, as a keyword parameter typer reads.

    Its type and default are the field's (no default for a required field: the environment may give it);
    its help is the field's description with the environment variable's name.
    """
    flag = "--" + name.replace("_", "-")
    off = OFF_SWITCHES.get(name, "--no-" + name.replace("_", "-"))
    decls = [f"{flag}/{off}"] if field.annotation is bool else [flag]
    env = SidecarSettings.model_config.get("env_prefix", "") + name.upper()
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    description = (field.description or "").removesuffix(".")
    option = typer.Option(default, *decls, help=f"{description} (env {env}).", callback=OPTION_CHECKS.get(name))
    annotation = field.annotation if default is not None else Optional[field.annotation]  # noqa: UP045
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def run_sidecar(ctx: typer.Context, **options: Any) -> None:
    """Follow RUN at the bulletin, apply its versions to the engine, and proxy its OpenAI API (every option is
    also a STITCH_SIDECAR_* env var, see stitchboard.sidecar.settings)."""
    given = {k: v for k, v in options.items() if getattr(ctx.get_parameter_source(k), "name", None) == "COMMANDLINE"}
    settings = _settings(**given)
    from .app import create_app

    replica = settings.replica_id or default_replica_id(settings.port)
    uvicorn.run(
        RequestContext(create_app(settings), version_header=START_HEADER),  # a request's id and stamped version
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=logging_config(settings.log_format, settings.log_level, {"run": settings.run, "replica": replica}),
        timeout_graceful_shutdown=5,
    )


# typer reads the options from the signature; typeshed's functions lack the __signature__ that inspect reads.
run_sidecar.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        *(option_parameter(name, field) for name, field in SidecarSettings.model_fields.items()),
    ]
)
app.command("run")(run_sidecar)
