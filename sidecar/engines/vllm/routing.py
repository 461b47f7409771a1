"""Routed experts captured during generation, per request and token (vLLM worker processes).

The sidecar tags a request that asks for its routing (``return_routed_experts``) with an
``X-Request-Id`` holding a mark ``stitch-routing-`` + 32 hex digits (:data:`ROUTE_MARK`); vLLM
builds its engine request id from it. Importing this module (the worker extension does)
wraps ``GPUModelRunner.execute_model`` (the CPU runner inherits it): on its first call the
router of every MoE layer gets a capture function (``BaseRouter.set_capture_fn``; one vLLM
already set is still called), which vLLM calls inside the forward pass with the layer's
logical expert ids, int32 ``[tokens, top_k]``, before any expert-parallel mapping.

Within one forward pass the token rows are the scheduled requests in the input batch's order
(``input_batch.req_ids``), ``num_scheduled_tokens[req_id]`` rows each, at positions
``num_computed_tokens .. + n``. The rows of marked requests are copied out, per request, as
chunks ``(first position, weight version, int32 [n, num_layers, top_k])``; the version is the one
the worker records when the forward pass runs (:func:`note_version`: the worker extension calls
it with every answer; versions change only inside its calls, between forward passes). Nothing
is recomputed afterwards. A position computed twice (a request preempted and recomputed, e.g.
by the prefix-cache reset of a commit) keeps its first routing: the one the token sampled from
it was made with. Layers without experts (dense layers of a mixed model) stay -1.

:func:`take` hands the sidecar a request's routing once its answer is complete, and forgets
it; the last :data:`KEPT` marked requests nobody collected are kept, older ones dropped.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from ..contract import ROUTE_MARK

#: How many marked requests' routings are kept until collected.
KEPT = 1024

_version: int | None = None


def note_version(version: int | None) -> None:
    """Record the weight version the worker holds now (tags the forward passes that follow)."""
    global _version
    _version = version


@dataclass
class _Routing:
    prompt_tokens: int
    chunks: list[tuple[int, int | None, np.ndarray]] = field(default_factory=list)
    error: str | None = None  # why a forward pass's rows could not be split (then no rows are answered)


@dataclass
class _Capture:
    """The capture state of one model runner."""

    layer_ids: list[int]
    num_layers: int
    top_k: int
    model: str
    requests: OrderedDict[str, _Routing] = field(default_factory=OrderedDict)
    step: Any = None  # the scheduler output of the forward pass running now
    rows: list[tuple[int, int, np.ndarray, _Routing]] = field(
        default_factory=list
    )  # (row offset, n, buffer, request) this step
    total: int = 0  # token rows of this step's scheduled requests

    def begin(self, runner: Any) -> None:
        """Lay out this step's rows (called at the first MoE layer of each forward pass)."""
        self.rows, offset = [], 0
        batch = runner.input_batch
        for index, req_id in enumerate(batch.req_ids):
            n = int(self.step.num_scheduled_tokens.get(req_id, 0))
            match = ROUTE_MARK.search(req_id)
            if match is not None and n > 0:
                mark = match.group(0)
                entry = self.requests.get(mark)
                if entry is None:
                    state = runner.requests.get(req_id)
                    entry = self.requests[mark] = _Routing(int(getattr(state, "num_prompt_tokens", 0)))
                    while len(self.requests) > KEPT:
                        self.requests.popitem(last=False)
                buffer = np.full((n, self.num_layers, self.top_k), -1, dtype=np.int32)
                entry.chunks.append((int(batch.num_computed_tokens_cpu[index]), _version, buffer))
                self.rows.append((offset, n, buffer, entry))
            offset += n
        self.total = offset

    def capture(self, runner: Any, layer_id: int, topk_ids: Any) -> None:
        """The capture function of layer ``layer_id``: ``topk_ids`` int [tokens, top_k]."""
        if self.step is None:  # a dummy or profiling run
            return
        if layer_id == self.layer_ids[0]:
            self.begin(runner)
        if not self.rows:
            return
        ids = topk_ids.cpu().numpy()
        if ids.ndim != 2 or ids.shape[0] < self.total or ids.shape[1] != self.top_k:
            # e.g. sequence- or data-parallel MoE layers see other rows: never guess, never fail the forward pass
            for _, _, _, entry in self.rows:
                entry.error = (
                    f"layer {layer_id} routed {tuple(ids.shape)} ids for a step of {self.total} token "
                    f"rows, top-{self.top_k}"
                )
            self.rows = []
            return
        for offset, n, buffer, _ in self.rows:
            buffer[:, layer_id, :] = ids[offset : offset + n]

    def take(self, mark: str) -> dict[str, Any] | None:
        """The routing of the request ``mark`` (see :func:`take`), forgotten here; None if unknown."""
        entry = self.requests.pop(mark, None)
        if entry is None or not entry.chunks:
            return None
        if entry.error is not None:
            return {"error": entry.error}
        first = entry.chunks[0][0]
        end = first
        parts: list[np.ndarray] = []
        versions: list[list[Any]] = []
        for position, version, buffer in entry.chunks:
            if position > end:
                return {"error": f"the routing of positions {end}..{position - 1} was not captured"}
            fresh = buffer[end - position :]
            if len(fresh) == 0:
                continue
            parts.append(fresh)
            if versions and versions[-1][0] == version:
                versions[-1][2] = end + len(fresh)
            else:
                versions.append([version, end, end + len(fresh)])
            end += len(fresh)
        rows = np.concatenate(parts) if parts else np.zeros((0, self.num_layers, self.top_k), np.int32)
        return {
            "prompt_tokens": entry.prompt_tokens,
            "start": first,
            "rows": base64.b64encode(rows.tobytes()).decode(),
            "versions": versions,
        }


_captures: dict[int, _Capture | None] = {}


def _install(runner: Any) -> _Capture | None:
    """Set the capture function of every MoE router of ``runner``'s model; None: no MoE layer."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    routers = [
        (m.layer_id, m.router)
        for m in runner.get_model().modules()
        if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)
    ]
    if not routers:
        return None
    config = runner.model_config
    capture = _Capture(
        sorted(i for i, _ in routers),
        config.get_total_num_hidden_layers(),
        config.get_num_experts_per_tok(),
        str(config.served_model_name),
    )
    for layer_id, router in routers:
        router.set_capture_fn(_chained(router.capture_fn, partial(capture.capture, runner, layer_id)))
    return capture


def _chained(first: Any, ours: Any) -> Any:
    if first is None:
        return ours

    def both(topk_ids: Any) -> None:
        first(topk_ids)
        ours(topk_ids)

    return both


def capture_of(runner: Any) -> _Capture | None:
    """The capture of ``runner`` (installed on first use); None when its model has no MoE layer."""
    key = id(runner)
    if key not in _captures:
        _captures[key] = _install(runner)
    return _captures[key]


def track_routing() -> None:
    """Wrap vLLM's ``GPUModelRunner.execute_model`` so that each forward pass's routing of marked
    requests is captured. No-op without vLLM or when already wrapped."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return
    original = GPUModelRunner.execute_model
    if getattr(original, "_stitch_tracks_routing", False):
        return

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        capture = capture_of(self)
        if capture is None:
            return original(self, scheduler_output, *args, **kwargs)
        capture.step = scheduler_output
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            capture.step, capture.rows = None, []

    execute_model._stitch_tracks_routing = True  # type: ignore[attr-defined]
    GPUModelRunner.execute_model = execute_model  # type: ignore[method-assign]


def take(runner: Any, marks: list[str]) -> dict[str, Any]:
    """What the engine routed the marked requests ``marks`` to, forgotten afterwards.

    Returns ``{"moe": bool, "model", "num_layers", "top_k", "requests": {mark: {...} | None}}``;
    per request (None: nothing captured, e.g. unknown or dropped): ``prompt_tokens``, ``start``
    (the first captured position), ``rows`` (base64 of int32 ``[n, num_layers, top_k]``, C
    order: positions ``start .. start + n - 1``), ``versions`` (``[version, start, end]``
    position spans, half-open, in order), or ``error`` (a gap in the capture).

    Args:
        runner: the worker's model runner (``worker.model_runner``).
        marks: the requests' marks (:data:`ROUTE_MARK`).
    """
    capture = capture_of(runner)
    if capture is None:
        return {"moe": False, "model": str(runner.model_config.served_model_name), "requests": {}}
    return {
        "moe": True,
        "model": capture.model,
        "num_layers": capture.num_layers,
        "top_k": capture.top_k,
        "requests": {m: capture.take(m) for m in marks},
    }
