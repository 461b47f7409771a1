"""The SGLang engine: the sidecar's adapter and the loader that runs inside SGLang's processes
(their modules and processes: DESIGN.md's map).

:data:`ENGINE` is the kind's descriptor (:mod:`..registry`): cheap to import, the adapter and
the routing replay are imported when used. Its route table follows SGLang 0.5.23
(``sglang/srt/entrypoints/http_server.py``): native ``/generate`` (POST and PUT) and its OpenAI,
embedding, classification, scoring and Anthropic routes are model routes; its control routes
(``/update_weights_from_*``, ``/begin_weight_update``, ``/end_weight_update``,
``/pause_generation``, ``/continue_generation``, ``/flush_cache``, ``/update_weight_version``,
``/release_memory_occupation``, ``/resume_memory_occupation``, ``/init_weights_update_group``,
``/abort_request``, ``/get_weights_by_name``, ``/server_info``, ...) are on no list.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...routes import RouteTable, post_routes
from ..registry import EngineKind

if TYPE_CHECKING:
    from ...settings import SidecarSettings
    from .adapter import SglangEngine
    from .routing_replay import SglangRoutedExperts

#: SGLang's model routes (gated and stamped).
MODEL_PATHS = (
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/encode", "/classify", "/v1/classify",
    "/v1/score", "/v1/rerank",
    "/v1/responses", "/invocations", "/v1/messages",
)  # fmt: skip
ROUTES = RouteTable(
    model=post_routes(*MODEL_PATHS)
    | {("PUT", "/generate"), ("PUT", "/encode"), ("PUT", "/classify"), ("PUT", "/v1/rerank")},
    read=frozenset({("GET", "/v1/models"), ("GET", "/model_info"), ("GET", "/get_model_info"), ("GET", "/ping")})
    | post_routes("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/v1/messages/count_tokens"),
)


def adapter(settings: SidecarSettings) -> SglangEngine:
    """The :class:`~.adapter.SglangEngine` at ``settings.engine_url`` with the settings' timeouts,
    its per-rank records under the sidecar's handoff folder."""
    from .adapter import SglangEngine

    records = Path(settings.handoff_dir) / f"sidecar-{settings.port}" / "sglang-records"
    return SglangEngine(
        settings.engine_url,
        records,
        timeout_s=settings.engine_call_timeout_s,
        apply_timeout_s=settings.engine_apply_timeout_s,
    )


def engine_rows(start_len: int, payload: dict[str, Any]) -> SglangRoutedExperts:
    """The routing replay of one admitted request from SGLang's own rows (:mod:`.routing_replay`)."""
    from .routing_replay import SglangRoutedExperts

    return SglangRoutedExperts(start_len, payload)


#: Why SGLang's room serves no LoRA adapter runs (verified with SGLang 0.5.23 on a CPU host, no GPU).
ADAPTERS_UNSUPPORTED = (
    "SGLang 0.5.23 cannot serve LoRA adapters on a CPU host: its LoRA layers allocate pinned host memory "
    "unconditionally (sglang/srt/lora/layers.py:475, ColumnParallelLinearWithLoRA.__init__: "
    "torch.tensor(..., device='cpu', pin_memory=True)), which raises 'RuntimeError: Found no NVIDIA driver on "
    "your system' without CUDA, whichever LoRA backend is chosen (torch_native, the CPU one, included)"
)

#: SGLang: salted on ``/generate`` and its OpenAI generation routes (its radix cache keys on
#: ``cache_salt``); answers name its weight version; routing rows are its own; ``/generate``
#: streams mark each output's final chunk.
ENGINE = EngineKind(
    name="sglang",
    routes=ROUTES,
    adapter=adapter,
    salted_paths=frozenset({"/generate", "/v1/completions", "/v1/chat/completions"}),
    reports_versions=True,
    routing="engine",
    engine_rows=engine_rows,
    final_in_place=frozenset({"/generate"}),
    adapters_unsupported=ADAPTERS_UNSUPPORTED,
)
