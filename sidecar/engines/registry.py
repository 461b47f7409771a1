"""Engine kinds: one :class:`EngineKind` descriptor per kind, looked up by the ``engine`` setting (sidecar process).

Each ``sidecar/engines/<kind>/__init__.py`` exports its descriptor as ``ENGINE`` (cheap to
import: the engine processes import from those packages too); the built-in kinds (``vllm``,
``sglang``) are found there on first lookup. Another kind registers itself with
:func:`register`, or is found through the entry-point group :data:`ENTRY_POINT_GROUP` (an entry
point named for the kind whose object is its :class:`EngineKind`). Nothing outside ``engines/``
branches on the engine's kind: the service reads what the descriptor says.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from ..routes import RouteTable
    from ..settings import SidecarSettings
    from .base import EngineAdapter

#: The entry-point group an installed package names its engine kinds in.
ENTRY_POINT_GROUP = "stitchboard.engines"
_BUILT_IN = {"vllm": "stitchboard.sidecar.engines.vllm", "sglang": "stitchboard.sidecar.engines.sglang"}
_KINDS: dict[str, EngineKind] = {}


class EngineRows(Protocol):
    """Routing replay of one admitted request from the engine's own rows (proxy side; event-loop only)."""

    def see_event(self, event: Any) -> None:
        """Read one decoded stream event."""

    def fields(self, spans: list[dict[str, int]] | None) -> dict[str, Any]:
        """The top-level routing fields for the output tokens' ``spans`` (a stream's stamp event)."""

    def attach(self, answer: Any) -> None:
        """Add the routing fields to a decoded JSON answer (in place)."""


@dataclass(frozen=True)
class EngineKind:
    """What the sidecar needs to know about one engine kind.

    Attributes:
        name: the kind, as the ``engine`` setting names it.
        routes: the routes forwarded (model and read routes; everything else is refused).
        adapter: builds the sidecar's adapter for ``settings`` (its URL and timeouts).
        salted_paths: model paths whose body takes the cache salt (:mod:`..salt`); empty: never salted.
        salt_field: the body field the salt goes into.
        reports_versions: whether the engine's answers carry its own weight version (each is
            checked, :mod:`..answer_versions`).
        routing: routing replay: ``worker`` (rows captured in the engine's workers and collected by
            the adapter, :mod:`..routed_experts`), ``engine`` (the engine answers its own rows,
            :attr:`engine_rows` tags them) or ``none``.
        engine_rows: with ``routing="engine"``: ``(routed_experts_start_len, payload) ->``
            :class:`EngineRows` (changes the decoded request body in place).
        final_in_place: model paths whose streams mark each output's final chunk: the stamps go
            into that chunk (:mod:`..stamps`) instead of an event of their own.
        adapters_unsupported: why the kind's adapter does not implement
            :class:`~.base.ServesAdapters` (LoRA adapter runs), as the sidecar's refusal says it;
            None when it does, or nothing is known.

    Raises:
        ValueError: ``routing="engine"`` without an ``engine_rows`` factory, or one given with another mode.
    """

    name: str
    routes: RouteTable
    adapter: Callable[[SidecarSettings], EngineAdapter]
    salted_paths: frozenset[str] = frozenset()
    salt_field: str = "cache_salt"
    reports_versions: bool = False
    routing: Literal["worker", "engine", "none"] = "none"
    engine_rows: Callable[[int, dict[str, Any]], EngineRows] | None = None
    final_in_place: frozenset[str] = frozenset()
    adapters_unsupported: str | None = None

    def __post_init__(self) -> None:
        if (self.routing == "engine") != (self.engine_rows is not None):
            raise ValueError(
                f"engine kind {self.name!r}: routing='engine' needs an engine_rows factory, and only it takes one"
            )


def register(kind: EngineKind) -> None:
    """Make ``kind`` available to the ``engine`` setting under ``kind.name`` (a later registration
    of the same name replaces it)."""
    _KINDS[kind.name] = kind


def _entry_point(name: str) -> EngineKind | None:
    for point in entry_points(group=ENTRY_POINT_GROUP, name=name):
        kind = point.load()
        if isinstance(kind, EngineKind):
            return kind
    return None


def lookup(name: str) -> EngineKind:
    """The descriptor of engine kind ``name``.

    Raises:
        ValueError: no kind of that name is built in, registered or named in :data:`ENTRY_POINT_GROUP`.
    """
    kind = _KINDS.get(name)
    if kind is None and name in _BUILT_IN:
        kind = importlib.import_module(_BUILT_IN[name]).ENGINE
    if kind is None:
        kind = _entry_point(name)
    if kind is None:
        raise ValueError(
            f"no engine kind {name!r}: use one of {known()}, or register it "
            f"(stitchboard.sidecar.engines.registry.register or the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    _KINDS.setdefault(name, kind)
    return kind


def known() -> list[str]:
    """The kinds built in or registered so far (sorted)."""
    return sorted(set(_BUILT_IN) | set(_KINDS))
