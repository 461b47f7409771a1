"""Routing replay as request features (sidecar process, event loop): rows captured in the engine's
workers and collected by the adapter (:mod:`..routed_experts`, vLLM), or the engine's own rows
tagged with versions from the answer's spans (the kind's ``engine_rows``, SGLang)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engines.registry import EngineRows
from ..routed_experts import RoutedExperts, RoutingSource, wants_routing
from ..stamps import SseStamper
from .base import ModelRequest, RequestFeature, RequestUse, Verdict


class WorkerRouting(RequestFeature):
    """Routing replay from the rows the engine's workers captured (an adapter that ``ReplaysRouting``)."""

    def __init__(self, source: RoutingSource) -> None:
        self.source = source

    async def open(self, request: ModelRequest) -> RequestUse | None:
        start_len = wants_routing(request.headers, request.payload, request.path)
        if start_len is None:
            return None
        await self.source.require_moe()
        routed = RoutedExperts(self.source, start_len, request.payload, request.request_id)
        request.request_id, request.changed = routed.request_id, True
        return _Routed(routed)


class _Routed(RequestUse):
    def __init__(self, routed: RoutedExperts) -> None:
        self.routed = routed

    async def on_answer(self, answer: Any) -> None:
        await self.routed.attach(answer)

    async def on_event(self, data: bytes, decoded: Any, stamper: SseStamper) -> Verdict:
        if data == b"[DONE]":
            if not stamper.stamped:
                stamper.extra = await self.routed.fields()
            return "send"
        return "send" if self.routed.see_event(decoded) else "drop"  # drop: the usage chunk only we asked for

    async def at_end(self, stamper: SseStamper) -> None:
        if not stamper.stamped:
            stamper.extra = await self.routed.fields()


class EngineRowsRouting(RequestFeature):
    """Routing replay from the engine's own rows, tagged from the output tokens' spans (asked for
    on the client's behalf).

    Args:
        make: the kind's ``engine_rows`` factory.
    """

    def __init__(self, make: Callable[[int, dict[str, Any]], EngineRows]) -> None:
        self.make = make

    async def open(self, request: ModelRequest) -> RequestUse | None:
        start_len = wants_routing(request.headers, request.payload, request.path)
        if start_len is None:
            return None
        rows = self.make(start_len, request.payload)
        request.want_spans, request.changed = True, True
        return _Rows(rows)


class _Rows(RequestUse):
    def __init__(self, rows: EngineRows) -> None:
        self.rows = rows

    async def on_answer(self, answer: Any) -> None:
        self.rows.attach(answer)  # after the spans feature's: reads the answer's weight_versions

    async def on_event(self, data: bytes, decoded: Any, stamper: SseStamper) -> Verdict:
        if data != b"[DONE]":
            self.rows.see_event(decoded)
        return "send"

    def on_spans(self, spans: list[dict[str, int]] | None, stamper: SseStamper) -> None:
        stamper.extra = self.rows.fields(spans)
