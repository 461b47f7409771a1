"""The answer-version check as a request feature (sidecar process, event loop): every answer of an
engine that names its own weight version is checked against what the sidecar held while the
request ran, before it is sent (:mod:`..answer_versions`)."""

from __future__ import annotations

from typing import Any

from ..answer_versions import AnswerVersionCheck, reported_versions
from ..stamps import SseStamper
from .base import ModelRequest, RequestFeature, RequestUse, Verdict


class VersionCheck(RequestFeature):
    """Checks the versions answers report (engines whose kind ``reports_versions``)."""

    def __init__(self, check: AnswerVersionCheck) -> None:
        self.check = check

    async def open(self, request: ModelRequest) -> RequestUse:
        return _Checked(self.check)


class _Checked(RequestUse):
    def __init__(self, check: AnswerVersionCheck) -> None:
        self.check = check
        self.start = self.claims = 0
        self.vouched = False  # a reported version was checked

    def admitted(self, request: ModelRequest, start: int, claims: int) -> None:
        self.start, self.claims = start, claims

    async def _verify(self, reported: list[Any] | None) -> None:
        await self.check.verify(reported, self.start, self.check.now(), self.claims)

    async def on_answer(self, answer: Any) -> None:
        await self._verify(reported_versions(answer))

    async def on_event(self, data: bytes, decoded: Any, stamper: SseStamper) -> Verdict:
        if data == b"[DONE]":
            if not self.vouched:
                await self._verify(None)
        elif (reported := reported_versions(decoded)) is not None:
            self.vouched = True
            await self._verify(reported)
        return "send"

    async def at_end(self, stamper: SseStamper) -> None:
        if not self.vouched and not stamper.stamped:  # ended without [DONE]: the engine vouches
            await self._verify(None)
