"""Renamed environment variables: read the new name, fall back to the legacy one with a warning.

Every role reads its environment variables under one prefix (the table in docs/reference/settings.md):
``STITCH_BULLETIN_*`` (bulletin server), ``STITCH_CLIENT_*`` (the client CLIs and the trainer
example), ``STITCH_SIDECAR_*``, ``STITCH_BOOT_*`` (deploy boot step), ``STITCH_ENGINE_*`` (the
vLLM worker) and ``STITCH_DEMO_*``. :data:`RENAMED_ENV` lists the variables that had another
name before; the legacy names keep working for now, each use warning with the new name.

Standard library only: every process (trainer, bulletin, sidecar, vLLM worker) may import it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

#: New name -> legacy name of every renamed variable that is still read under its legacy name.
RENAMED_ENV: dict[str, str] = {
    "STITCH_CLIENT_BULLETIN": "STITCH_BULLETIN_URL",
    "STITCH_CLIENT_TOKEN": "STITCH_TOKEN",
    "STITCH_DEMO_CACHE": "STITCHBOARD_CACHE",
    "STITCH_ENGINE_FAULT_PHASE": "STITCH_FAULT_PHASE",
    "STITCH_ENGINE_FAULT_VERSION": "STITCH_FAULT_VERSION",
}


class LegacyEnvWarning(FutureWarning):
    """A variable was read under its legacy name (shown by default: it is meant for the user)."""


def warn_legacy_env(name: str, stacklevel: int = 1) -> None:
    """Warn that the legacy name of ``name`` is in use (call when its value came from there).

    Args:
        name: the new name, a key of :data:`RENAMED_ENV`.
        stacklevel: as for :func:`warnings.warn`, counted from the caller (1: the calling line).

    Raises:
        KeyError: ``name`` is not a renamed variable.
    """
    legacy = RENAMED_ENV[name]
    warnings.warn(
        f"{legacy} is a legacy name, read for now: set {name} instead", LegacyEnvWarning, stacklevel=stacklevel + 1
    )


def env_setting(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Value of the environment variable ``name``, else of its legacy name, else None.

    An empty value counts as unset (as for click's ``envvar``), so the new name wins whenever it
    holds a value. Reading the legacy name issues a :class:`LegacyEnvWarning`.

    Args:
        name: the variable's new name; one without a legacy name is read plainly.
        environ: the environment to read (default :data:`os.environ`).
    """
    env = os.environ if environ is None else environ
    value = env.get(name)
    if value:
        return value
    legacy = RENAMED_ENV.get(name)
    value = env.get(legacy) if legacy else None
    if not value:
        return None
    warn_legacy_env(name, stacklevel=2)
    return value
