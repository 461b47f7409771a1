"""The engine's own weight version in its answers (SGLang), checked against what the sidecar held.

SGLang writes the version its weights are recorded as (its ``weight_version``, which the
sidecar's adapter sets to the decimal version it commits, e.g. ``"3"``) into its answers:

* native ``/generate``: ``meta_info.weight_version`` in every output (each item of a batched
  answer, every event of a stream); a finished output that crossed an update also carries
  ``meta_info.weight_versions``, spans ``[{"version", "start", "end"}]`` over its output tokens;
* OpenAI routes: a top-level ``metadata`` with the same two fields (non-streamed answers only:
  SGLang 0.5.23's OpenAI stream chunks carry none).

The rule (:meth:`AnswerVersionCheck.verify`): every version an answer reports must be one the
sidecar held while the request ran: a decimal integer ``v`` with ``start <= v <= applied``
(``applied`` now; an answer that ends while the sidecar holds no verified version fails).
A ``v`` ahead of the sidecar is a commit or flip the engine records before the sidecar marks it
applied: the check waits for the gate to reach it (at most ``wait_s``). Anything else (below
``start``, still ahead, or not a version at all, like a restarted SGLang's ``"default"``) is a
mismatch: :class:`~.errors.AnswerVersionMismatchError` (503) instead of the answer (a stream
ends with an error event, the mismatching event unsent), and the engine check of the claim
runs at once, so a restarted or changed engine loses the claim. An answer that reports no
version (an OpenAI stream, an embedding) is vouched for by one engine check (instance and
record, the claim watch's) made after it completed, shared by answers that complete together,
and only if the sidecar's claim held from its admission to then (no drop in between).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import AnswerVersionMismatchError
from .gate import Gate

_DECIMAL = re.compile(r"[0-9]+")


def reported_versions(answer: Any) -> list[Any] | None:
    """The weight versions a decoded SGLang answer (or stream event) reports, in token order:
    the span versions where spans are given, else ``weight_version``, per output; None when it
    reports none."""
    found, out = False, []
    for item in answer if isinstance(answer, list) else [answer]:
        if not isinstance(item, dict):
            continue
        info = item.get("meta_info") if isinstance(item.get("meta_info"), dict) else item.get("metadata")
        if not isinstance(info, dict) or "weight_version" not in info:
            continue
        found = True
        spans = info.get("weight_versions")
        if isinstance(spans, list) and spans:
            out += [s.get("version") if isinstance(s, dict) else s for s in spans]
        else:
            out.append(info["weight_version"])
    return out if found else None


def parse_version(label: Any) -> int | None:
    """The version an engine label names (a decimal string), or None for anything else."""
    return int(label) if isinstance(label, str) and _DECIMAL.fullmatch(label) else None


class _SharedCheck:
    # One engine check at a time; a caller waits for a check that began after its answer completed.
    def __init__(self, check: Callable[[], Awaitable[str | None]]) -> None:
        self.check = check
        self.task: asyncio.Future[str | None] | None = None
        self.started = 0.0

    async def _run(self) -> str | None:
        try:
            return await self.check()
        except Exception as exc:  # noqa: BLE001 - a check that fails vouches for nothing
            return f"the engine check failed: {type(exc).__name__}: {exc}"

    async def after(self, t: float) -> str | None:
        loop = asyncio.get_running_loop()
        while True:
            task = self.task
            if task is not None and self.started >= t:
                return await asyncio.shield(task)
            if task is not None and not task.done():
                await asyncio.wait({task})
                continue
            self.started, self.task = loop.time(), asyncio.ensure_future(self._run())


class AnswerVersionCheck:
    """Checks answers against the gate (one per proxy; event-loop only).

    Args:
        gate: the app's gate.
        check_engine: the claim's engine check (returns why the claim was dropped, or None).
        wait_s: longest wait for the gate to reach a version the engine reports ahead of it, seconds.
    """

    def __init__(self, gate: Gate, check_engine: Callable[[], Awaitable[str | None]], wait_s: float) -> None:
        self.gate = gate
        self.wait_s = wait_s
        self._engine = _SharedCheck(check_engine)

    @staticmethod
    def now() -> float:
        """The loop clock, for :meth:`verify`'s ``completed_at``."""
        return asyncio.get_running_loop().time()

    async def verify(self, reported: list[Any] | None, start: int, completed_at: float, claims: int) -> None:
        """Check the versions an answer reports (:func:`reported_versions`) for a request admitted at ``start``.

        Args:
            reported: the versions, or None (the answer reports none: the engine is checked).
            start: the request's start stamp.
            completed_at: when the answer (or event) arrived, :meth:`now`.
            claims: the gate's ``claims`` when the request was admitted.

        Raises:
            AnswerVersionMismatchError: a version the sidecar did not hold, or the engine check failed.
        """
        if reported is None:
            reason = await self._engine.after(completed_at)
            if reason is None and self.gate.claims != claims:
                reason = "the sidecar dropped its claim on the engine while the request ran"
            if reason is not None:
                raise AnswerVersionMismatchError(
                    f"the engine answered, but is no longer what the sidecar verified: {reason}; retry the request",
                    start_version=start,
                )
            return
        for label in reported:
            version = parse_version(label)
            if version is not None and self.gate.applied is not None and version > self.gate.applied:
                await self.gate.wait_applied(version, self.wait_s)
            applied = self.gate.applied
            if version is None or version < start or applied is None or version > applied:
                reason = await self._engine.after(self.now())
                raise AnswerVersionMismatchError(
                    f"the engine answered under weight version {label!r}, but the sidecar held versions "
                    f"{start}..{applied} while the request ran"
                    + (f"; {reason}" if reason else "")
                    + ": the answer is withheld; retry the request",
                    reported_version=str(label),
                    start_version=start,
                    applied_version=applied,
                )
