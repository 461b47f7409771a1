"""Engine adapters (run in the sidecar) and the code each engine runs inside its own processes.

One folder per engine kind, each exporting its descriptor (:class:`.registry.EngineKind`); a
kind of one's own is added with :func:`register`. Which process runs each module is in
DESIGN.md's map ("Packages and modules"), the one list of them. Only the (light) registry is
imported at package import: the worker processes import only what they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import EngineKind, lookup, register

if TYPE_CHECKING:
    from ..settings import SidecarSettings
    from .base import EngineAdapter

__all__ = ["EngineKind", "create_adapter", "lookup", "register"]


def create_adapter(settings: SidecarSettings) -> EngineAdapter:
    """The adapter of the kind ``settings.engine`` names, at ``settings.engine_url``, with the settings' timeouts.

    Raises:
        ValueError: an engine kind that is neither built in nor registered.
    """
    return lookup(settings.engine).adapter(settings)
