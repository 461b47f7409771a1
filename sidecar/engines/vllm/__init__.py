"""vLLM: the adapter the sidecar drives and the worker extension that runs inside vLLM's worker
processes (their modules and processes: DESIGN.md's map).

:data:`ENGINE` is the kind's descriptor (:mod:`..registry`): cheap to import, the adapter is
imported when one is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...routes import RouteTable, post_routes
from ..registry import EngineKind

if TYPE_CHECKING:
    from ...settings import SidecarSettings
    from .adapter import VllmEngine

#: vLLM's model routes (gated and stamped).
MODEL_PATHS = (
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/invocations", "/pooling",
    "/classify", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/v2/rerank", "/v1/audio/transcriptions", "/v1/audio/translations",
)  # fmt: skip
ROUTES = RouteTable(
    model=post_routes(*MODEL_PATHS),
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


def adapter(settings: SidecarSettings) -> VllmEngine:
    """The :class:`~.adapter.VllmEngine` at ``settings.engine_url`` with the settings' timeouts."""
    from .adapter import VllmEngine

    return VllmEngine(
        settings.engine_url, timeout_s=settings.engine_call_timeout_s, apply_timeout_s=settings.engine_apply_timeout_s
    )


#: vLLM: salted on its two OpenAI generation routes (vLLM mixes ``cache_salt`` into the first
#: cached block's hash); routing captured in its workers; no version in its answers.
ENGINE = EngineKind(
    name="vllm",
    routes=ROUTES,
    adapter=adapter,
    salted_paths=frozenset({"/v1/completions", "/v1/chat/completions"}),
    routing="worker",
)
