"""The engine seam: what the sidecar needs from an inference engine (engine-neutral).

Runs in the sidecar process. :class:`EngineAdapter` is the whole contract (blocking calls; the
reconciler runs them in a thread pool); :class:`EngineState` is what an engine records about
its weights. Each engine kind has its adapter in a subpackage (:mod:`.vllm`) next to the code
that runs inside that engine; :func:`stitchboard.sidecar.engines.create_adapter` picks one by
the ``engine`` setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

#: What an engine records about its weights: ``idle`` (holds ``version``, or no known version),
#: ``paused`` (idle, and scheduling paused), ``applying`` / ``loading`` (a write died half-way:
#: no known version), ``failed`` (a write could not be undone: only a snapshot load clears it).
Phase = Literal["idle", "paused", "applying", "loading", "failed"]


@dataclass(frozen=True)
class EngineState:
    """What the engine records (DESIGN.md invariant 7).

    Attributes:
        version: the version it holds, or None (none known: fresh, or a write failed).
        phase: see :data:`Phase`.
        instance: an id of the engine's processes, new at every engine start: a changed id means
            the weights the sidecar verified are gone (the engine restarted), whatever
            ``version`` says.
    """

    version: int | None
    phase: Phase
    instance: str


class EngineAdapter(Protocol):
    """What the sidecar calls on an engine. Every method blocks; errors are ``SidecarError``s."""

    def health(self) -> bool:
        """Whether the engine answers its health check."""

    def state(self, timeout_s: float | None = None) -> EngineState:
        """What the engine records (phase ``paused`` while paused and idle); ``timeout_s``: how
        long each call may wait for the engine's answer (None: the adapter's control-call timeout)."""

    def pause(self) -> None:
        """Stop scheduling; in-flight requests are kept and continue after :meth:`resume`."""

    def resume(self) -> None:
        """Resume scheduling."""

    def apply_patch(self, handoff_path: str | Sequence[str], from_version: int, to_version: int) -> dict[str, Any]:
        """Apply the hand-off patch file(s) of one version in place; returns the apply report."""

    def stage_patches(self, steps: Sequence[tuple[Sequence[str], int, int]]) -> dict[str, Any]:
        """Validate and prepare ``(paths, from_version, to_version)`` steps while the engine serves
        (nothing written); returns the staging report. :meth:`commit_staged` writes them."""

    def commit_staged(self, to_version: int) -> dict[str, Any]:
        """Write the staged update (engine paused), verified; returns the commit report."""

    def load_snapshot(
        self, paths: Sequence[str], version: int, checksums: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Load a full snapshot (anchor shards) in place, verified; returns the load report."""

    def set_version(self, version: int, base: int | None = None) -> None:
        """Record ``version`` as the one the engine holds (boot checkpoint, empty delta), only if
        it records ``base`` now (None: no version); else EngineStateError, nothing recorded."""

    def reset_prefix_cache(self) -> None:
        """Drop KV blocks computed with older weights."""

    def checksums(self, names: Sequence[str]) -> dict[str, str]:
        """xxh3-128 (hex) of the named checkpoint tensors as the engine holds them; raises
        ApplyRefusedError for a name the engine has no place for."""
