"""How the sidecar reads request paths, and the shape of an engine kind's route table.

Every engine kind's descriptor (:mod:`.engines.registry`) holds a :class:`RouteTable` (an
allow-list; vLLM's and SGLang's are in ``engines/vllm/__init__.py`` and ``engines/sglang/__init__.py``):

* model routes (answers depend on the weights) pass the gate and are stamped;
* read routes (models, tokenizer, model info) are forwarded as they are;
* every other ``(method, path)`` is refused with 403 :class:`~.errors.RouteForbiddenError`:
  engine control and admin routes (pause, weight updates, cache flushes, profiling, LoRA,
  sessions, request aborts...) are the sidecar's alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

from .errors import InvalidPathError

RouteKind = Literal["model", "read"]


@dataclass(frozen=True)
class RouteTable:
    """The routes of one engine kind the sidecar forwards.

    Attributes:
        model: ``(method, path)`` gated and stamped.
        read: ``(method, path)`` forwarded as they are.
        read_prefixes: ``(method, path prefix)`` forwarded as they are (e.g. ``/v1/models/<id>``).
    """

    model: frozenset[tuple[str, str]]
    read: frozenset[tuple[str, str]]
    read_prefixes: tuple[tuple[str, str], ...] = (("GET", "/v1/models/"),)

    def kind(self, method: str, path: str) -> RouteKind | None:
        """``model``, ``read``, or None (refused) for ``method path`` (a :func:`normalise_path` route)."""
        if (method, path) in self.model:
            return "model"
        if (method, path) in self.read or any(method == m and path.startswith(p) for m, p in self.read_prefixes):
            return "read"
        return None


def post_routes(*paths: str) -> frozenset[tuple[str, str]]:
    """``("POST", path)`` for each of ``paths``."""
    return frozenset(("POST", p) for p in paths)


def normalise_path(path: str) -> str:
    """The route a request path names: percent-decoded (again, for double encoding) segment by
    segment, repeated slashes collapsed, a trailing slash kept.

    Raises:
        InvalidPathError: a segment is ``.`` or ``..`` (percent-encoded or not): the request is
            refused rather than resolved, so no path reaches a route the allow-list does not name.
    """
    segments = unquote(path).split("/")
    if any(unquote(seg) in (".", "..") for seg in segments):
        raise InvalidPathError(f"path {path!r} has a dot segment ('.' or '..'): name the route itself", path=path)
    kept = [seg for seg in segments if seg]
    return "/" + "/".join(kept) + ("/" if kept and path.endswith("/") else "")
