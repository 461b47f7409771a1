"""The options every bulletin client CLI takes (``stitchboard versions ...``, ``publish``, ``pull``), declared once.

``--bulletin`` and ``--token`` also come from the client's environment variables
``STITCH_CLIENT_BULLETIN`` and ``STITCH_CLIENT_TOKEN`` (a token kept out of argv). Their legacy
names ``STITCH_BULLETIN_URL`` and ``STITCH_TOKEN`` are still read when the new one is unset or
empty, with a :class:`~stitchboard.proto.env.LegacyEnvWarning` naming the new one; a value on
the command line wins over both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Annotated

import typer

from stitchboard.proto.env import RENAMED_ENV, warn_legacy_env

#: Environment variable of ``--bulletin``.
BULLETIN_ENV = "STITCH_CLIENT_BULLETIN"
#: Environment variable of ``--token``.
TOKEN_ENV = "STITCH_CLIENT_TOKEN"


def _warn_if_legacy(new: str) -> Callable[[typer.Context, typer.CallbackParam, str | None], str | None]:
    """An option callback passing the value on; it warns when the value came from ``new``'s legacy variable."""

    def callback(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if source is not None and source.name == "ENVIRONMENT" and not os.environ.get(new):
            warn_legacy_env(new)
        return value

    return callback


Bulletin = Annotated[
    str,
    typer.Option(
        "--bulletin",
        envvar=[BULLETIN_ENV, RENAMED_ENV[BULLETIN_ENV]],
        callback=_warn_if_legacy(BULLETIN_ENV),
        help="bulletin base URL, e.g. http://host:8700",
    ),
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar=[TOKEN_ENV, RENAMED_ENV[TOKEN_ENV]],
        callback=_warn_if_legacy(TOKEN_ENV),
        help="bearer token (read scope; publish scope to publish)",
    ),
]
Run = Annotated[str, typer.Option("--run", help="run id")]
