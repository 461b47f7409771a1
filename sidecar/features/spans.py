"""Per-token version spans as a request feature (sidecar process, event loop): see :mod:`..spans`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..spans import DROP, EDITED, SpanLedger, Spans, SpanStamper, wants_spans
from ..stamps import SseStamper
from .base import IsFinal, ModelRequest, OnSpans, RequestFeature, RequestUse, Verdict


class SpansFeature(RequestFeature):
    """Adds ``weight_versions`` to the answers of requests that ask for them (or whose other
    features need them: :attr:`~.base.ModelRequest.want_spans`).

    Args:
        ledger: the app's span ledger (shared with the reconciler).
        engine_reports: the engine reports its own spans (the kind's ``reports_versions``).
    """

    def __init__(self, ledger: SpanLedger, engine_reports: bool) -> None:
        self.ledger, self.engine_reports = ledger, engine_reports

    async def open(self, request: ModelRequest) -> RequestUse:
        return _Spanned(self, wants_spans(request.headers, request.payload))


class _Spanned(RequestUse):
    def __init__(self, feature: SpansFeature, asked: bool) -> None:
        self.feature, self.asked = feature, asked
        self.spans: Spans | None = None

    def admitted(self, request: ModelRequest, start: int, claims: int) -> None:
        if not (self.asked or request.want_spans):
            self.active = False
            return
        f = self.feature
        self.spans = Spans(f.ledger, f.engine_reports, start, request.path, request.payload, request.request_id)
        request.changed = request.changed or self.spans.changed_body
        if self.spans.request_id is not None:
            request.request_id = self.spans.request_id

    def stamper(
        self, start: int, end: Callable[[], int | None], final: IsFinal, on_spans: OnSpans
    ) -> SseStamper | None:
        spans = self.spans
        if spans is None:
            return None

        def streamed() -> tuple[list[dict[str, int]] | None, dict[int, list[dict[str, int]]] | None]:
            top, per_choice = spans.streamed(end())
            on_spans(top)
            return top, per_choice

        return SpanStamper(start, end, final, streamed)

    async def on_answer(self, answer: Any) -> None:
        if self.spans is not None:
            self.spans.attach(answer)

    async def on_event(self, data: bytes, decoded: Any, stamper: SseStamper) -> Verdict:
        if self.spans is None or data == b"[DONE]":
            return "send"
        seen = self.spans.see_event(decoded)
        return "drop" if seen == DROP else "edited" if seen == EDITED else "send"

    def on_release(self) -> None:
        if self.spans is not None:
            self.spans.forget()
