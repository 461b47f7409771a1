"""SGLang's own routed-experts capture on the CPU: a capturer with a plain host buffer (SGLang scheduler processes).

SGLang 0.5.23 returns a request's routing (``return_routed_experts``; ``meta_info.routed_experts``
in native answers, ``sglext.routed_experts`` in OpenAI ones) through one process-global capturer:
``select_experts`` calls its ``capture(layer_id, topk_ids)`` in every MoE layer, the model runner
calls ``on_forward_end(forward_batch=...)`` after each forward pass (the rows go to a host buffer
indexed by KV-cache slot), and a finishing request that asked reads ``get_topk(...)`` over its
slots. The server flag ``--enable-return-routed-experts`` only decides whether the scheduler
creates that capturer, and SGLang's one cannot be made on the CPU: its host buffer is allocated
with ``pin_memory=True``, registered through ``torch.cuda.cudart()`` (``state_capturer/base.py``
``BaseHostCache``), which kills the scheduler without an NVIDIA driver.

:func:`install_capturer` (called by the loader on every call; the sidecar's first call comes at
its start) sets a :class:`PlainRoutedExpertsCapturer` as that global in the process: SGLang's own
class with the host buffer replaced by an ordinary CPU tensor of the same shape, sized as SGLang
sizes it (``ModelRunner.init_routed_experts_capturer``). Everything else is SGLang's code, so
the rows are captured during generation and never recomputed. Each TP rank captures its own
copy (the routers are replicated, so every rank routes the same); only rank 0's reaches the answer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .token_counts import find_scheduler

log = logging.getLogger("stitchboard.sidecar.engines.sglang.routing")


def _model_runner() -> Any:
    scheduler = find_scheduler()
    return None if scheduler is None else scheduler.tp_worker.model_runner


def install_capturer() -> str | None:
    """Set the routed-experts capturer of this process when it has none and the model has MoE
    layers; returns None when one is (or now is) installed, else why not (never raises: the
    loader must not kill the server)."""
    try:
        from sglang.srt.state_capturer import base
        from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, get_global_experts_capturer, set_global_experts_capturer
    except ImportError as exc:
        return f"SGLang has no routed-experts capturer: {exc}"
    if get_global_experts_capturer() is not None:
        return None
    runner = _model_runner()
    if runner is None:
        return "no SGLang Scheduler on the loader's call stack"
    config = runner.model_config.hf_text_config
    if not getattr(config, "num_experts_per_tok", None):
        return f"the model {type(runner.model).__name__} has no mixture-of-experts layers"

    class PlainHostCache(base.BaseHostCache):
        """SGLang's host cache with an ordinary (unpinned) CPU buffer: int32 [num_tokens, layers, top_k]."""

        def __init__(self, num_tokens: int, num_layers: int, topk_size: int, name: str, device: str) -> None:
            del device
            self.buffer = torch.zeros((num_tokens, num_layers, topk_size), dtype=torch.int32)
            self.num_tokens, self.num_layers, self.topk_size, self.name = num_tokens, num_layers, topk_size, name

    previous = base.BaseHostCache
    base.BaseHostCache = PlainHostCache
    try:
        capturer = RoutedExpertsCapturer(
            runner.model_config,
            num_tokens=runner.kv_index_translator.capture_token_capacity(runner.max_token_pool_size),
            max_running_requests=runner.max_running_requests,
            num_fused_shared_experts=runner.model.shared_experts_config.num_fused_shared_experts,
            device=runner.device,
        )
    except Exception as exc:  # noqa: BLE001 - reported, never raised into SGLang
        log.warning("routed-experts capturer not installed: %r", exc)
        return f"the routed-experts capturer could not be made: {exc!r}"
    finally:
        base.BaseHostCache = previous
    set_global_experts_capturer(capturer)
    log.info("routed-experts capturer installed: host rows %d, layers %d, top-k %d", capturer.host_cache.num_tokens, capturer.num_layers, capturer.topk_size)
    return None
