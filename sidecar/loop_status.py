"""What the sidecar's loop reports about itself: its state, its last error, why it is unhealthy (sidecar process).

One :class:`LoopStatus` is shared by the :class:`~.reconciler.Reconciler` and its
:class:`~.claim.Claim`; the status route, ``/health`` and the fleet report read it. The state
changes in one place, :meth:`LoopStatus.set_state`, which logs the change and exports it
(``stitch_sidecar_state``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from stitchboard.proto.errors import StitchError
from stitchboard.proto.sidecar_wire import SidecarState

from .gate import Gate
from .metrics import SidecarMetrics

log = logging.getLogger("stitchboard.sidecar")


@dataclass(frozen=True)
class ErrorRecord:
    """The sidecar's last failure (the status's ``last_error``, the fleet report's).

    Attributes:
        type: the error's wire type (``StagingError``, ``EngineChanged``...; else its class name).
        message: what was being done, and what the error said.
        at: when, Unix seconds.
    """

    type: str
    message: str
    at: float

    def body(self) -> dict[str, Any]:
        """As the status's JSON object: ``{"type", "message", "at"}``."""
        return asdict(self)


class LoopStatus:
    """The loop's state, last error and unhealthy reason, and the version gauges they go with.

    Args:
        gate: the request gate (its applied and target versions are exported).
        metrics: where the state, the versions and health go.
    """

    def __init__(self, gate: Gate, metrics: SidecarMetrics) -> None:
        self.gate = gate
        self.metrics = metrics
        self._state: SidecarState = "starting"
        self.last_error: ErrorRecord | None = None
        self.unhealthy_reason: str | None = None  # why the last recovery left the sidecar unhealthy

    @property
    def state(self) -> SidecarState:
        """What the sidecar is doing (``/health``, status, ``stitch_sidecar_state``); see :meth:`set_state`."""
        return self._state

    def set_state(self, state: SidecarState, why: str) -> None:
        """The one place the state changes: logged (debug) with ``why`` and exported."""
        if state != self._state:
            log.debug("state %s -> %s: %s", self._state, state, why)
            self.metrics.state.state(state)
        self._state = state

    def error(self, exc: BaseException, during: str) -> ErrorRecord:
        """Record ``exc`` (raised while ``during``) as the last error, and log it."""
        kind = exc.type if isinstance(exc, StitchError) else type(exc).__name__
        self.last_error = ErrorRecord(kind, f"{during}: {exc}", time.time())
        log.warning("%s failed: %s: %s", during, kind, exc)
        return self.last_error

    def note(self, kind: str, message: str) -> None:
        """Record a failure found rather than raised (a dropped claim) as the last error."""
        self.last_error = ErrorRecord(kind, message, time.time())

    def publish(self) -> None:
        """Export the gate's versions and whether the sidecar is healthy."""
        self.metrics.versions(self.gate.applied, self.gate.target)
        self.metrics.healthy.set(0 if self.unhealthy_reason else 1)
