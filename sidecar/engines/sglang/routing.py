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

A request running across a commit is retracted in the pause (its KV freed) and on resume
computes its whole sequence again under the new weights; SGLang's capturer, indexed by KV slot,
would then answer the recompute's rows for the positions routed before the commit, not the
routing the request's tokens were sampled from. :func:`keep_first_routing` (installed when the
loader is first imported) keeps the first routing of every position, as the vLLM capture does:
at each release of a request that asked for its routing (SGLang's ``release_req``, which every
retraction goes through) the rows of its positions computed so far are copied out before its KV
is freed, merged with what an earlier retraction kept, and laid back over the answer's rows when
SGLang collects them at the end (``_maybe_collect_routed_experts``).
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
        from sglang.srt.state_capturer.routed_experts import (
            RoutedExpertsCapturer,
            get_global_experts_capturer,
            set_global_experts_capturer,
        )
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
    log.info(
        "routed-experts capturer installed: host rows %d, layers %d, top-k %d",
        capturer.host_cache.num_tokens,
        capturer.num_layers,
        capturer.topk_size,
    )
    return None


#: The ``Req`` attribute holding the first routing of the positions a retraction freed.
_FIRST_ROWS = "_stitch_first_routed_experts"


def _keep_rows(req: Any, req_to_token_pool: Any) -> None:
    # Before ``req``'s KV is freed: copy the rows that made its output tokens so far, keeping those
    # an earlier retraction kept (the first routing of each position). Output token o was sampled
    # from position prompt - 1 + o's pass, and the prompt's rows from the pass that made token 0,
    # so the rows are those of positions [0, prompt - 1 + outputs) that were computed: none while
    # no token was sampled yet (a prompt retracted mid-prefill is routed again, and its first
    # token sampled, under the new weights).
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    capturer = get_global_experts_capturer()
    kv = getattr(req, "kv", None)
    index, outputs = getattr(kv, "req_pool_idx", None), len(getattr(req, "output_ids", ()) or ())
    if capturer is None or index is None or outputs == 0 or not getattr(req, "return_routed_experts", False):
        return
    made = min(int(getattr(kv, "kv_committed_len", 0) or 0), len(req.origin_input_ids) - 1 + outputs)
    if made <= 0:
        return
    rows = capturer.get_topk(req_pool_idx=index, seqlen=made + 1, req_to_token_pool=req_to_token_pool).clone()
    kept = getattr(req, _FIRST_ROWS, None)
    if kept is not None and len(kept) >= len(rows):
        return
    setattr(req, _FIRST_ROWS, rows if kept is None else torch.cat([kept, rows[len(kept) :]]))


def _lay_back(req: Any) -> None:
    # After SGLang collected ``req.routed_experts`` (rows start_len .. seqlen - 2): the kept first
    # routings over the positions they cover.
    kept, rows = getattr(req, _FIRST_ROWS, None), getattr(req, "routed_experts", None)
    if kept is None:
        return
    setattr(req, _FIRST_ROWS, None)
    if not isinstance(rows, torch.Tensor) or rows.ndim != 3:
        return
    seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)
    start = min(max(int(getattr(req, "routed_experts_start_len", 0) or 0), 0), max(seqlen - 1, 0))
    end = min(len(kept), start + len(rows))
    if end > start:
        rows[: end - start] = kept[start:end]


def keep_first_routing() -> None:
    """Wrap SGLang's ``release_req`` and ``_maybe_collect_routed_experts`` so that a request
    retracted at a commit answers the first routing of every position (see the module docstring).
    No-op without SGLang or when already wrapped; never raises into SGLang (a failure costs only
    the kept rows: the answer then carries the recompute's, as SGLang's own would)."""
    try:
        from sglang.srt.managers import schedule_batch
        from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    except ImportError:
        return
    release, collect = schedule_batch.release_req, SchedulerBatchResultProcessor._maybe_collect_routed_experts
    if getattr(release, "_stitch_keeps_routing", False):
        return

    def release_req(*args: Any, **kwargs: Any) -> Any:
        try:
            _keep_rows(kwargs["req"], kwargs["req_to_token_pool"])
        except Exception as exc:  # noqa: BLE001 - never into SGLang's scheduler
            log.warning("first routing not kept at a release: %r", exc)
        return release(*args, **kwargs)

    def _maybe_collect_routed_experts(self: Any, req: Any) -> Any:
        result = collect(self, req)
        try:
            _lay_back(req)
        except Exception as exc:  # noqa: BLE001 - never into SGLang's scheduler
            log.warning("first routing not laid back: %r", exc)
        return result

    release_req._stitch_keeps_routing = True  # type: ignore[attr-defined]
    schedule_batch.release_req = release_req
    SchedulerBatchResultProcessor._maybe_collect_routed_experts = _maybe_collect_routed_experts
