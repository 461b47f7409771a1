"""Which engine routes the sidecar forwards, per engine kind, and how it reads request paths.

Every engine kind has a :class:`RouteTable` (an allow-list):

* model routes (answers depend on the weights) pass the gate and are stamped;
* read routes (models, tokenizer, model info) are forwarded as they are;
* every other ``(method, path)`` is refused with 403 :class:`~.errors.RouteForbiddenError`:
  engine control and admin routes (pause, weight updates, cache flushes, profiling, LoRA,
  sessions, request aborts...) are the sidecar's alone.

vLLM's table is :data:`VLLM_ROUTES`. :data:`SGLANG_ROUTES` is SGLang's (0.5.23
``sglang/srt/entrypoints/http_server.py``): native ``/generate`` (POST and PUT) and its
OpenAI, embedding, classification, scoring and Anthropic routes are model routes; its control
routes (``/update_weights_from_*``, ``/begin_weight_update``, ``/end_weight_update``,
``/pause_generation``, ``/continue_generation``, ``/flush_cache``, ``/update_weight_version``,
``/release_memory_occupation``, ``/resume_memory_occupation``, ``/init_weights_update_group``,
``/abort_request``, ``/get_weights_by_name``, ``/server_info``, ...) are on no list.
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
        engine: the engine kind (the ``engine`` setting).
        model: ``(method, path)`` gated and stamped.
        read: ``(method, path)`` forwarded as they are.
        read_prefixes: ``(method, path prefix)`` forwarded as they are (e.g. ``/v1/models/<id>``).
        reports_versions: whether the engine's answers carry its own weight version
            (checked by :class:`~.answer_versions.AnswerVersionCheck`).
        final_in_place: model paths whose streams mark each output's final chunk
            (``meta_info.finish_reason``): the stamps go into that chunk (:mod:`.stamps`).
    """

    engine: str
    model: frozenset[tuple[str, str]]
    read: frozenset[tuple[str, str]]
    read_prefixes: tuple[tuple[str, str], ...] = (("GET", "/v1/models/"),)
    reports_versions: bool = False
    final_in_place: frozenset[str] = frozenset()

    def kind(self, method: str, path: str) -> RouteKind | None:
        """``model``, ``read``, or None (refused) for ``method path`` (a :func:`normalise_path` route)."""
        if (method, path) in self.model:
            return "model"
        if (method, path) in self.read or any(method == m and path.startswith(p) for m, p in self.read_prefixes):
            return "read"
        return None


def _post(*paths: str) -> frozenset[tuple[str, str]]:
    return frozenset(("POST", p) for p in paths)


_VLLM_MODEL = (
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/invocations", "/pooling", "/classify", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/v2/rerank", "/v1/audio/transcriptions", "/v1/audio/translations",
)  # fmt: skip
_SGLANG_MODEL = (
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/encode", "/classify", "/v1/classify", "/v1/score", "/v1/rerank",
    "/v1/responses", "/invocations", "/v1/messages",
)  # fmt: skip

VLLM_ROUTES = RouteTable(
    engine="vllm",
    model=_post(*_VLLM_MODEL),
    read=frozenset(
        {
            ("GET", "/v1/models"),
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("GET", "/version"),
            ("GET", "/ping"),
            ("GET", "/load"),
        }
    ),
)

SGLANG_ROUTES = RouteTable(
    engine="sglang",
    model=_post(*_SGLANG_MODEL)
    | {("PUT", "/generate"), ("PUT", "/encode"), ("PUT", "/classify"), ("PUT", "/v1/rerank")},
    read=frozenset({("GET", "/v1/models"), ("GET", "/model_info"), ("GET", "/get_model_info"), ("GET", "/ping")})
    | _post("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/v1/messages/count_tokens"),
    reports_versions=True,
    final_in_place=frozenset({"/generate"}),
)

_TABLES = {t.engine: t for t in (VLLM_ROUTES, SGLANG_ROUTES)}


def route_table(engine: str) -> RouteTable:
    """The route table of engine kind ``engine``.

    Raises:
        ValueError: an engine kind with no table.
    """
    try:
        return _TABLES[engine]
    except KeyError:
        raise ValueError(f"no route table for engine {engine!r}: use one of {sorted(_TABLES)}") from None


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
