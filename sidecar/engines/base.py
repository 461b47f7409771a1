"""The engine seam: what the sidecar needs from an inference engine (engine-neutral).

Runs in the sidecar process. :class:`EngineAdapter` is the whole contract (blocking calls; the
reconciler runs them in a thread pool); :class:`EngineState` is what an engine records about
its weights; :class:`LeaseGrant` what a take of the engine's lease gives. Each engine kind has
its adapter in a subpackage (:mod:`.vllm`, :mod:`.sglang`) next to the code that runs inside that
engine; :func:`stitchboard.sidecar.engines.create_adapter` picks one by the ``engine`` setting.

The lease (``docs/reference/engine-lease.md``): an engine has one owner. The engine's own code
(:mod:`.lease`, held per TP rank) keeps it; :meth:`EngineAdapter.take_lease` takes or renews it,
and from then on every state-changing call of the adapter acts for that owner: the adapter calls
none of them, its engine's state-changing routes included (vLLM's ``/pause``, SGLang's
``/pause_generation``...), unless its lease is live, renewing it first when less than half its
TTL is left, and the engine refuses its own state-changing calls without it. Read-only calls
(:meth:`~EngineAdapter.health`, :meth:`~EngineAdapter.state`, :meth:`~EngineAdapter.checksums`,
output counts) need none.

Optional engine powers are the runtime-checkable Protocols at the end (:class:`CountsOutputs`,
:class:`PausesKeepingCache`, :class:`ReplaysRouting`, :class:`ServesAdapters`): the sidecar asks
``isinstance(engine, P)`` before it uses one, and an engine kind offers a power by defining its method.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from stitchboard.proto.parts import Layout

from ..errors import LeaseNotHeldError

#: What an engine records about its weights: ``idle`` (holds ``version``, or no known version),
#: ``paused`` (idle, and scheduling paused), ``applying`` / ``loading`` (a write died half-way:
#: no known version), ``failed`` (a write could not be undone: only a snapshot load clears it).
Phase = Literal["idle", "paused", "applying", "loading", "failed"]


@dataclass(frozen=True)
class LeaseGrant:
    """The engine's lease, held by ``owner`` until at least ``expires_at``.

    Attributes:
        owner: the owner id the lease was taken for.
        expires_at: ``time.monotonic()`` of this process before which the lease is live on every
            TP rank for sure: the time the take was sent plus the least time left any rank
            answered (the engine's own expiry is never earlier).
    """

    owner: str
    expires_at: float


class LeaseGuard:
    """What an adapter keeps of its lease (sidecar process): the owner and TTL of its last take
    and the latest :class:`LeaseGrant`; :meth:`ensure` before every state-changing call."""

    def __init__(self) -> None:
        self.owner: str | None = None
        self.ttl_s = 0.0
        self.grant: LeaseGrant | None = None

    def taken(self, grant: LeaseGrant, ttl_s: float) -> None:
        """A take for ``grant.owner`` (TTL ``ttl_s`` seconds) succeeded: act for that owner."""
        self.owner, self.ttl_s, self.grant = grant.owner, ttl_s, grant

    def note(self, grant: LeaseGrant | None) -> None:
        """What a call's answer says of the lease: a later expiry for this adapter's owner is kept."""
        if (
            grant is not None
            and grant.owner == self.owner
            and (self.grant is None or grant.expires_at > self.grant.expires_at)
        ):
            self.grant = grant

    def live(self) -> bool:
        """Whether this adapter's lease is live for sure now."""
        return self.grant is not None and time.monotonic() < self.grant.expires_at

    def refused(self, owner: str) -> None:
        """A take for ``owner`` was refused: nothing is known to be held (state-changing calls renew first)."""
        if self.owner == owner:
            self.grant = None

    def released(self, owner: str) -> None:
        """``owner``'s lease was ended: nothing is held, and nothing is renewed, any more."""
        if self.owner == owner:
            self.owner, self.grant = None, None

    def ensure(self, what: str, take: Callable[[str, float], LeaseGrant]) -> str:
        """The owner to act for in the state-changing call ``what``; when less than half the TTL
        is left of the lease (or none is known), it is renewed first with ``take``.

        Raises:
            LeaseNotHeldError: no lease was ever taken, or the renewal was refused (nothing called).
        """
        owner = self.owner
        if owner is None:
            raise LeaseNotHeldError(
                f"{what}: this adapter holds no lease on the engine (take_lease first); not called",
                holder=None,
                expires_in_s=None,
                owner=None,
            )
        if self.grant is None or time.monotonic() > self.grant.expires_at - self.ttl_s / 2:
            take(owner, self.ttl_s)
        return owner


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


class StageStep(NamedTuple):
    """One step of :meth:`EngineAdapter.stage_patches`: patch files that bring the engine from
    ``from_version`` to ``to_version``. A tuple, so an adapter may take plain ``(paths, from, to)``
    tuples and the engines' wire (a JSON list) is unchanged.

    Attributes:
        paths: the step's hand-off patch files (a squash or a rebase: one or several).
        from_version: the version the files apply to; to_version: the version they bring.
    """

    paths: Sequence[str]
    from_version: int
    to_version: int


class EngineAdapter(Protocol):
    """What the sidecar calls on an engine. Every method blocks; errors are ``SidecarError``s.

    State-changing methods (:meth:`pause`, :meth:`resume`, :meth:`apply_patch`,
    :meth:`stage_patches`, :meth:`commit_staged`, :meth:`load_snapshot`, :meth:`set_version`,
    :meth:`reset_prefix_cache`) act for the owner of the last :meth:`take_lease` and raise
    ``LeaseNotHeldError`` (nothing called) when its lease is not live.
    """

    def health(self) -> bool:
        """Whether the engine answers its health check."""

    def take_lease(self, owner: str, ttl_s: float) -> LeaseGrant:
        """Take the engine's lease for ``owner`` for ``ttl_s`` seconds, or renew it; the adapter's
        state-changing calls act for ``owner`` from then on. On a TP engine every rank's lease is
        taken; ranks that granted it are released again when another refuses.

        Raises:
            LeaseNotHeldError: another owner's lease is live (details ``holder``, ``expires_in_s``).
            EngineUnavailableError, EngineRequestError: the engine does not answer.
        """

    def release_lease(self, owner: str) -> None:
        """End ``owner``'s lease at once (a clean stop), on every rank; another owner's is left.

        Raises:
            EngineUnavailableError, EngineRequestError: the engine does not answer.
        """

    def known_lease(self) -> LeaseGrant | None:
        """The freshest grant this adapter knows of its owner's lease: its last take, or a later
        answer of the engine naming that owner as the holder (None: none taken, or refused or
        released since). Answers renew a live lease (a call by the holder does), so after a long
        call this may be later than the last take's."""

    def state(self, timeout_s: float | None = None) -> EngineState:
        """What the engine records (phase ``paused`` while paused and idle); ``timeout_s``: how
        long each call may wait for the engine's answer (None: the adapter's control-call timeout)."""

    def pause(self) -> None:
        """Stop scheduling; in-flight requests are kept and continue after :meth:`resume`."""

    def resume(self) -> None:
        """Resume scheduling."""

    def apply_patch(self, handoff_path: str | Sequence[str], from_version: int, to_version: int) -> dict[str, Any]:
        """Apply the hand-off patch file(s) of one version in place; returns the apply report."""

    def stage_patches(self, steps: Sequence[StageStep]) -> dict[str, Any]:
        """Validate and prepare :class:`StageStep` ``(paths, from_version, to_version)`` steps while the engine serves
        (nothing written); returns the staging report. :meth:`commit_staged` writes them."""

    def commit_staged(self, to_version: int) -> dict[str, Any]:
        """Write the staged update (engine paused), verified; returns the commit report."""

    def load_snapshot(
        self,
        paths: Sequence[str],
        version: int,
        checksums: dict[str, str] | None = None,
        layouts: Mapping[str, Layout] | None = None,
    ) -> dict[str, Any]:
        """Load a full snapshot (anchor shards) in place, verified against ``checksums``
        (``VersionManifest.checksums()``: xxh3-128, or xxh3_128_parts over ``layouts[name]`` for a tensor
        published in parts; None: the files' own); returns the load report."""

    def set_version(self, version: int, base: int | None = None) -> None:
        """Record ``version`` as the one the engine holds (boot checkpoint, empty delta), only if
        it records ``base`` now (None: no version); else EngineStateError, nothing recorded."""

    def reset_prefix_cache(self) -> None:
        """Drop KV blocks computed with older weights."""

    def checksums(self, names: Sequence[str], layouts: Mapping[str, Layout] | None = None) -> dict[str, str]:
        """xxh3-128 (hex) of the named checkpoint tensors as the engine holds them, or for a name ``layouts``
        lists its xxh3_128_parts over that layout (a tensor published in parts, ``VersionManifest.layouts()``);
        raises ApplyRefusedError for a name the engine has no place for."""


@runtime_checkable
class CountsOutputs(Protocol):
    """An engine that counts the output tokens of the requests the sidecar marked: the spans of
    requests in flight across a commit (:mod:`stitchboard.sidecar.spans`) need it."""

    def output_counts(self) -> dict[str, int]:
        """Output key (``<mark>:<prompt>:<choice>``) -> output tokens generated so far; call it
        while the engine is paused. Read-only: needs no lease."""
        ...


@runtime_checkable
class WaitsForStaging(Protocol):
    """An engine whose staging can be waited for inside the engine, which then schedules nothing: worth it
    while no request is in flight, when the staging would otherwise share the host's cores with the
    engine's answers to fast polls (vLLM: ``stitch_staged``'s ``wait_s``)."""

    def stage_patches_waiting(self, steps: Sequence[StageStep], idle: Callable[[], bool]) -> dict[str, Any]:
        """As :meth:`EngineAdapter.stage_patches`; each poll waits in the engine (up to a bound the engine
        sets) while ``idle()`` says no request is in flight, and returns at once otherwise."""
        ...


@runtime_checkable
class PausesKeepingCache(Protocol):
    """An engine that can pause without dropping its prefix cache: a version-salted commit
    (:mod:`stitchboard.sidecar.salt`) may then keep the cache instead of flushing it."""

    def pause_keeping_cache(self) -> None:
        """As :meth:`EngineAdapter.pause`, the prefix cache kept; needs the lease."""
        ...


@runtime_checkable
class ReplaysRouting(Protocol):
    """An engine whose worker captures the MoE routing of the marked requests, handed over on
    request (vLLM's routing replay, :mod:`stitchboard.sidecar.routed_experts`)."""

    def routed_experts(self, marks: list[str]) -> dict[str, Any]:
        """The captured routing of the requests marked ``marks``, handed over once; ``[]``:
        whether the model has MoE layers. Read-only: needs no lease."""
        ...


@runtime_checkable
class ServesAdapters(Protocol):
    """An engine that serves LoRA adapters beside its base model, loaded and unloaded at run time
    without a pause (issue #31; vLLM's room, ``docs/reference/adapter-engines.md``). Adapters are
    PEFT folders (``adapter_model.safetensors`` + ``adapter_config.json``) on the sidecar's
    memory-backed hand-off folder; tensors are named as PEFT saves them
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: ``lora_A`` [r, in],
    ``lora_B`` [out, r], the served dtype, bf16). An engine without this power (SGLang's room) says
    why in its descriptor, and the sidecar refuses adapter runs there with that reason."""

    def adapter_slots(self) -> int:
        """How many adapters the engine holds at once (vLLM's ``max_loras``); a load beyond them is
        refused (:class:`~stitchboard.sidecar.errors.AdapterLoadError`), never an eviction. Read-only."""
        ...

    def base_names(self) -> list[str]:
        """The checkpoint names of the base model's served view as the engine holds it (for the base
        checksum: :meth:`EngineAdapter.checksums` over these names). Read-only."""
        ...

    def load_adapter(self, name: str, folder: str, checksums: Mapping[str, str]) -> None:
        """Load the PEFT folder ``folder`` under ``name`` while the engine serves (no pause), verify
        every tensor the engine loaded against ``checksums`` (PEFT name -> xxh3-128 hex of its bits),
        and pin it so the engine can never evict it. Needs the lease.

        Raises:
            AdapterLoadError: the engine refused the load, a loaded tensor's bits or the tensor set
                differ from ``checksums``, or no slot is free; the adapter is unloaded again and the
                adapters loaded before keep serving.
            LeaseNotHeldError: the lease is not live (nothing called).
        """
        ...

    def unload_adapter(self, name: str) -> None:
        """Unload ``name`` and free its slot (an unknown name is a no-op). Needs the lease.

        Raises:
            AdapterLoadError: the engine refused the unload; LeaseNotHeldError: as above.
        """
        ...

    def loaded_adapters(self) -> list[str]:
        """The adapter names the engine holds now, sorted. Read-only."""
        ...
