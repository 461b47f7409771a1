"""The sidecar's claim on the engine: what boot finds, and the checks that keep the claim true (sidecar process).

:class:`Claim` is a component the :class:`~.reconciler.Reconciler` holds (``self.claim``); no
one else changes its fields. It answers what the engine holds (:meth:`Claim.find`, DESIGN.md
invariant 7), claims a version (:meth:`Claim.set_applied`), checks the claim
(:meth:`Claim.check`, :meth:`Claim.require`), drops it (:meth:`Claim.drop`), and keeps watch
(:meth:`Claim.watch`, invariant 1). The reconciler's boot, commits and recoveries use it.

The lease (``docs/reference/engine-lease.md``, :mod:`.lease_keeper`): an engine has one owner.
Boot first takes the engine's lease (:meth:`Claim.take`), before anything that changes the engine
(resuming a paused engine it found included); while another sidecar holds it, boot waits, naming
the holder in ``/health`` (503) and the metrics, and tries again every ``lease_renew_interval_s``,
so it takes the engine over, with no manual step, once that lease lapses (at once after a clean
stop, which releases it). The watch renews the lease every ``lease_renew_interval_s``; a lease
lost (refused: another sidecar took the engine; or lapsed unrenewed) drops the claim like a
restarted engine and boot takes the lease again. No version is claimed without the lease.

What boot finds (:meth:`Claim.find`): the engine instance this sidecar verified, back at that
version (taken as it is); an engine caught mid-apply or paused (the previous sidecar died: the
reconciler brings it to a verified version and resumes it); a version recorded by the engine or
given as ``--boot-version``, taken only once the engine's checksums match that version's
manifest; otherwise (a fresh engine, another run's version, weights changed outside
stitchboard) nothing, and the reconciler loads the nearest anchor.

The watch: every ``engine_check_interval_s``, at every ``/health`` and before every commit
(:meth:`Claim.check`, :meth:`Claim.require`), the engine's state is compared with what was
verified: its instance id (new at every engine start), its recorded version and its phase. An
engine that restarted, whose record changed or vanished, or that refuses or breaks the call,
loses the claim at once (the gate admits and stamps nothing) and the sidecar boots again. One
that keeps the call waiting (busy: a long step, a first-use kernel compile) has new requests held
past ``engine_call_timeout_s`` and loses the claim past ``engine_stall_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import NotFoundError
from stitchboard.proto.schema import VersionManifest

from .engines.base import EngineAdapter, EngineState
from .errors import ApplyRefusedError, EngineChangedError, LeaseNotHeldError, UnmappedTensorError
from .gate import Gate
from .lease_keeper import LeaseKeeper
from .loop_status import LoopStatus
from .metrics import SidecarMetrics
from .pools import Pools
from .settings import SidecarSettings

log = logging.getLogger("stitchboard.sidecar")

#: Engine phases in which its recorded version is trustworthy; any other (``applying``,
#: ``loading``, ``failed``) means a commit was interrupted and the weights are of no known version.
IDLE_PHASES = frozenset({None, "idle", "paused"})


@dataclass(frozen=True)
class Found:
    """What :meth:`Claim.find` found on the engine.

    Attributes:
        how: ``back`` (the instance this sidecar verified, at that version: claimed);
            ``verified`` (the engine's record or ``--boot-version`` checked against the
            manifest: claimed); ``interrupted`` (a commit died: the engine is mid-apply or
            paused); ``none`` (nothing claimable: the nearest anchor is to be loaded).
        version: for ``interrupted``, the version the engine records in an idle phase (None: of
            no known version).
        paused: for ``interrupted``, whether the engine is paused.
    """

    how: Literal["back", "verified", "interrupted", "none"]
    version: int | None = None
    paused: bool = False


class Claim:
    """The sidecar's claim on one engine, for one run: what was verified, the lease, the watch.

    Args:
        settings: sidecar settings (run, engine checks, lease timing, ``boot_version``).
        client: bulletin client (manifests to check against).
        engine: the engine adapter (blocking methods).
        gate: the request gate (the applied version is set here only).
        metrics: where figures go.
        pools: the thread pools blocking calls run in.
        status: the loop's state and last error.
    """

    def __init__(
        self,
        settings: SidecarSettings,
        client: BulletinClient,
        engine: EngineAdapter,
        gate: Gate,
        metrics: SidecarMetrics,
        pools: Pools,
        status: LoopStatus,
    ) -> None:
        self.settings = settings
        self.client = client
        self.engine = engine
        self.gate = gate
        self.metrics = metrics
        self.pools = pools
        self.status = status
        self.lease = LeaseKeeper(settings, engine, metrics)  # nothing is changed or claimed without it
        self.dropped = asyncio.Event()  # set when the claim is dropped: the main loop boots again
        self.lock = asyncio.Lock()  # held while boot or a commit works on the engine
        self._manifest: VersionManifest | None = None  # of the applied version, for lineage checks
        self._instance: str | None = None  # the engine instance this boot found
        self._trusted: tuple[str, int] | None = None  # (instance, version) this sidecar verified or applied
        self._resume_pending = False

    @property
    def manifest(self) -> VersionManifest | None:
        """The manifest of the claimed version (None: nothing claimed, or not known)."""
        return self._manifest

    @property
    def busy(self) -> bool:
        """True while boot or a commit works on the engine (they check it themselves)."""
        return self.lock.locked()

    @property
    def resume_pending(self) -> bool:
        """A resume of the engine failed and is to be tried again (:meth:`resume`)."""
        return self._resume_pending

    def set_applied(self, version: int | None, manifest: VersionManifest | None = None) -> None:
        """Claim ``version`` (verified or applied by this sidecar; None: claim nothing): the gate
        admits and stamps it. Without the engine's lease nothing is claimed and boot runs again."""
        if version is not None and not self.lease.held:  # the engine is another sidecar's: nothing is claimed
            log.warning("version %d is not claimed: this sidecar lost the engine's lease; booting again", version)
            version = None
            self.dropped.set()
        self._manifest = manifest if version is not None else None
        if version is not None and self._instance is not None:
            self._trusted = (self._instance, version)
        self.gate.set_applied(version)
        self.status.publish()

    async def resume(self) -> None:
        """Resume the engine; a failure is kept (:attr:`resume_pending`) and raised: the next step
        tries again (requests would hang)."""
        self._resume_pending = True
        await self.pools.engine(self.engine.resume)
        self._resume_pending = False

    def close(self) -> None:
        """Release the engine's lease (a clean stop: another sidecar may take the engine at once)."""
        self.lease.release()
        self.lease.close()

    # -- is the engine still what the sidecar verified? --------------------------------------

    def _broken(self, state: EngineState) -> str | None:
        # Why ``state`` does not back the applied version, or None when it does.
        if state.instance != self._instance:
            return (
                f"the engine restarted (instance {self._instance} -> {state.instance}): the weights verified on "
                "it are gone"
            )
        if self.gate.applied is None:
            return None
        if state.version != self.gate.applied:
            return f"the engine records version {state.version}, not the applied version {self.gate.applied}"
        if state.phase != "idle":
            return f"the engine is in phase {state.phase!r} outside a commit"
        return None

    def drop(self, reason: str) -> None:
        """Stop admitting and stamping at once, and have the main loop boot again."""
        log.warning("dropping the claim on version %s: %s; booting again", self.gate.applied, reason)
        self.status.note(EngineChangedError.type, reason)
        self.metrics.claims_dropped.inc()
        self.set_applied(None)
        self.status.set_state("waiting_for_engine", "the claim was dropped")
        self.dropped.set()

    async def check(self) -> str | None:
        """Check that the engine is still the instance, at the version, that the sidecar verified.

        Does nothing (None) while nothing is claimed or while boot or a commit works on the
        engine (they check it themselves). Otherwise one state call. On a restarted engine, a
        changed or vanished record, a phase other than idle, or a refused or broken call, the
        claim is dropped at once and the sidecar boots again. A call still unanswered after
        ``engine_call_timeout_s`` (the engine holds control calls behind a long step or a
        first-use kernel compile; a killed or restarted engine breaks or refuses them instead)
        holds new requests until it answers; unanswered after ``engine_stall_timeout_s``, the
        claim is dropped.

        Returns:
            None if the claim holds (or there is none to check), else why it was dropped.
        """
        if self.gate.applied is None or self.busy:
            return None
        call_s = self.settings.engine_call_timeout_s
        stall_s = max(self.settings.engine_stall_timeout_s, call_s)
        async with self.lock:
            call = asyncio.ensure_future(asyncio.to_thread(self.engine.state, stall_s))
            try:
                try:
                    state = await asyncio.wait_for(asyncio.shield(call), call_s)
                except TimeoutError:
                    log.warning(
                        "the engine has not answered its state call in %g s: new requests are held until it does (at "
                        "most %g s)",
                        call_s,
                        stall_s,
                    )
                    self.gate.set_stalled(True)
                    try:
                        state = await asyncio.wait_for(
                            call, stall_s - call_s + 1.0
                        )  # the call's own timeout ends it first
                    finally:
                        self.gate.set_stalled(False)
            except Exception as exc:  # noqa: BLE001 - an engine that cannot say what it holds backs no claim
                reason: str | None = f"the engine does not answer its state call: {type(exc).__name__}: {exc}"
            else:
                reason = self._broken(state)
            if reason is not None and self.gate.applied is not None:
                self.drop(reason)
            return reason

    async def require(self, before: str) -> None:
        """Before ``before`` writes to the engine: raise (dropping the claim) if this sidecar lost
        the engine's lease, or the engine is not the instance this boot found, or no longer
        records the applied version.

        Raises:
            LeaseNotHeldError: the lease was lost (boot takes it again).
            EngineChangedError: the main loop boots again.
        """
        if not self.lease.held:
            raise LeaseNotHeldError(
                f"before {before}: this sidecar does not hold the engine's lease",
                holder=self.lease.holder,
                expires_in_s=None,
                owner=self.lease.owner,
            )
        reason = self._broken(await self.pools.engine(self.engine.state))
        if reason is not None:
            self.drop(reason)
            raise EngineChangedError(f"before {before}: {reason}")

    async def holds(self, version: int | None) -> bool:
        """Whether the engine (the instance this boot found) still records ``version`` (None: the
        unverified weights it booted with, untouched), idle or paused; False if it cannot say."""
        try:
            state = await self.pools.engine(self.engine.state)
        except Exception:  # noqa: BLE001 - an engine that cannot say backs no claim
            return False
        return state.instance == self._instance and state.version == version and state.phase in ("idle", "paused")

    # -- the watch and the lease -------------------------------------------------------------

    async def watch(self) -> None:
        """Background task: :meth:`check` every ``engine_check_interval_s``, and the lease's
        renewal every ``lease_renew_interval_s``; runs until cancelled."""
        await asyncio.gather(self._check_often(), self._keep_lease())

    async def _check_often(self) -> None:
        while True:
            await asyncio.sleep(self.settings.engine_check_interval_s)
            try:
                await self.check()
            except Exception:
                log.exception("engine check failed")

    async def _keep_lease(self) -> None:
        # Renew the held lease; a lost one drops the claim (boot takes the lease again).
        while True:
            await asyncio.sleep(self.settings.lease_renew_interval_s)
            if not self.lease.held:
                continue  # boot is taking it
            try:
                reason = await self.lease.renew(lambda: self.busy)
            except Exception:
                log.exception("renewing the engine's lease failed")
                continue
            if reason is not None:
                self.lease_lost(reason)

    def lease_lost(self, reason: str) -> None:
        """Another sidecar holds the engine now (or may): claim nothing, leave the engine to it
        (a resume still pending is the holder's to do), and boot again (it waits for the lease)."""
        self._resume_pending = False
        if self.gate.applied is not None:
            self.drop(f"the engine's lease is lost: {reason}")
        else:
            self.status.set_state("waiting_for_engine", "the lease was lost")
            self.dropped.set()

    async def take(self) -> None:
        """Start a boot: take the engine's lease; while another sidecar holds it, wait (claiming
        nothing) and try again every ``lease_renew_interval_s``.

        Raises:
            EngineUnavailableError, EngineRequestError: the engine does not answer (boot retries).
        """
        self.dropped.clear()
        self.status.set_state("waiting_for_engine", "boot: taking the lease")
        while True:
            try:
                await self.lease.take()
                return
            except LeaseNotHeldError:
                self.status.set_state("waiting_for_engine", "another sidecar holds the lease")
                await asyncio.sleep(self.settings.lease_renew_interval_s)

    # -- boot: what does the engine hold? ----------------------------------------------------

    async def find(self, *, boot_version: bool) -> Found:
        """Ask the engine what it holds and claim it where it checks out (call under :attr:`lock`
        with the lease held). ``boot_version``: whether ``--boot-version`` may be taken for a
        fresh engine (not once the sidecar has fallen back to the anchor route).

        Raises:
            EngineUnavailableError, BulletinError, ApplyRefusedError: the engine or the bulletin
            does not answer (boot retries).
        """
        self.status.set_state("waiting_for_engine", "boot: asking the engine what it holds")
        info = await self.pools.engine(self.engine.state)
        self._instance = info.instance
        version, phase = info.version, info.phase
        paused = phase == "paused"
        self.status.set_state("booting", f"the engine holds version {version} in phase {phase!r}")
        if self._trusted == (info.instance, version) and phase == "idle" and version is not None:
            # the engine process this sidecar verified, at the version it verified: it was only unreachable
            known = await self.pools.io(self.client.manifest, self.settings.run, version)
            log.info("the engine instance is back at version %d, as this sidecar left it", version)
            self.set_applied(version, known)
            self.status.set_state("idle", "the engine instance is back as this sidecar left it")
            return Found("back")
        if phase not in IDLE_PHASES or paused:
            log.warning(
                "engine is in phase %r (paused: %s) holding version %s: an earlier commit was interrupted; recovering",
                phase,
                paused,
                version,
            )
            return Found("interrupted", version if phase in IDLE_PHASES else None, paused)
        manifest: VersionManifest | None = None
        if version is not None:
            manifest = await self.verify(version, "the engine records")
        elif self.settings.boot_version is not None and boot_version:
            manifest = await self.verify(self.settings.boot_version, "--boot-version says")
            if manifest is not None:
                await self.pools.engine(self.engine.set_version, manifest.version, None)
        if manifest is None:
            return Found("none")
        self.set_applied(manifest.version, manifest)
        self.status.set_state("idle", f"version {manifest.version} verified on the engine")
        return Found("verified")

    async def verify(self, version: int, claim: str) -> VersionManifest | None:
        """This run's manifest of ``version`` if the engine's weights are that version, bit for bit
        (one checksum pass over the model, compared with the manifest), else None.

        Called before the sidecar takes a version it did not apply itself: the engine may hold
        another run's version of that number, or weights changed outside stitchboard. None:
        the caller loads the nearest anchor. ``claim`` says who claims the version (logs).

        Raises:
            EngineUnavailableError, BulletinError: the engine or the bulletin does not answer;
            ApplyRefusedError: the engine refused the checksum call for another reason than an
            unmapped name (boot retries).
        """
        run = self.settings.run
        try:
            manifest = await self.pools.io(self.client.manifest, run, version)
        except NotFoundError:
            log.warning("%s version %d, which run %r does not have: loading the nearest anchor", claim, version, run)
            return None
        want = manifest.checksums()  # each tensor's own: xxh3_128_parts over its layout for one published in parts
        try:
            held = await self.pools.engine(self.engine.checksums, sorted(want), manifest.layouts())
        except ApplyRefusedError as exc:
            if exc.details.get("cause") != UnmappedTensorError.type:
                raise  # the engine could not answer now: boot retries
            # names the engine has no place for: another model
            log.warning(
                "%s version %d, but the engine cannot read run %r's tensors (%s): loading the nearest anchor",
                claim,
                version,
                run,
                exc,
            )
            return None
        differ = sorted(n for n in want if held.get(n) != want[n])
        if differ:
            log.warning(
                "%s version %d, but %d of %d tensors differ from run %r's (first: %s): loading the nearest anchor",
                claim,
                version,
                len(differ),
                len(want),
                run,
                differ[0],
            )
            return None
        return manifest
