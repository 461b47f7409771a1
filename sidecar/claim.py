"""The sidecar's claim on the engine: boot, and the checks that keep the claim true (sidecar process).

:class:`ClaimKeeper` is the base of :class:`~.reconciler.Reconciler`: the state both share, the
boot (:meth:`ClaimKeeper.boot`: ask the engine what it holds, DESIGN.md invariant 7) and the
watch on the claim (invariant 1).

The lease (``docs/reference/engine-lease.md``, :mod:`.lease_keeper`): an engine has one owner.
Boot first takes the engine's lease, before anything that changes the engine (resuming a paused
engine it found included); while another sidecar holds it, boot waits, naming the holder in
``/health`` (503) and the metrics, and tries again every ``lease_renew_interval_s``, so it takes
the engine over, with no manual step, once that lease lapses (at once after a clean stop, which
releases it). The watch renews the lease every ``lease_renew_interval_s``; a lease lost (refused:
another sidecar took the engine; or lapsed unrenewed) drops the claim like a restarted engine and
boot takes the lease again. No version is claimed without the lease (:meth:`ClaimKeeper._set_applied`).

Boot: an engine caught mid-apply or paused (the previous sidecar died) is brought to a verified
version and resumed; a fresh engine is ``--boot-version`` or gets the nearest anchor loaded. A
version the sidecar did not apply itself (recorded by the engine, or ``--boot-version``) is
taken only once the engine's checksums match that version's manifest; otherwise (another run's
version, weights changed outside stitchboard) the nearest anchor is loaded.

The watch: every ``engine_check_interval_s``, at every ``/health`` and before every commit
(:meth:`ClaimKeeper.check_engine`), the engine's state is compared with what was verified: its
instance id (new at every engine start), its recorded version and its phase. An engine that
restarted, whose record changed or vanished, or that refuses or breaks the call, loses the claim
at once (the gate admits and stamps nothing) and the sidecar boots again. One that keeps the call
waiting (busy: a long step, a first-use kernel compile) has new requests held past
``engine_call_timeout_s`` and loses the claim past ``engine_stall_timeout_s``. After a drop:
the same engine instance back at the version this sidecar verified on it is taken as it is;
anything else is checked against the manifest (or gets the nearest anchor) before any version
is claimed.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ParamSpec, TypeVar

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import NotFoundError
from stitchboard.proto.errors import StitchError
from stitchboard.proto.schema import VersionManifest
from stitchboard.proto.sidecar_wire import Refusal, SidecarState, SyncReport

from .engines.base import EngineAdapter, EngineState
from .errors import (
    ApplyRefusedError,
    EngineChangedError,
    LeaseNotHeldError,
    NothingPublishedError,
    UnmappedTensorError,
)
from .fetch import Fetcher
from .gate import Gate
from .lease_keeper import LeaseKeeper
from .metrics import SidecarMetrics
from .settings import SidecarSettings

log = logging.getLogger("stitchboard.sidecar")

#: Engine phases in which its recorded version is trustworthy; any other (``applying``,
#: ``loading``, ``failed``) means a commit was interrupted and the weights are of no known version.
IDLE_PHASES = frozenset({None, "idle", "paused"})

P = ParamSpec("P")
T = TypeVar("T")


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


class ClaimKeeper(abc.ABC):
    """Boot and the claim's watch, for one run and one engine (base of the reconciler).

    Args:
        settings: sidecar settings (run, waits, backoff, engine checks).
        client: bulletin client.
        engine: the engine adapter (blocking methods).
        gate: the request gate of the app (updated from the event loop).
        metrics: where figures go.
        fetcher: fetches plans into the hand-off folder.
    """

    def __init__(
        self,
        settings: SidecarSettings,
        client: BulletinClient,
        engine: EngineAdapter,
        gate: Gate,
        metrics: SidecarMetrics,
        fetcher: Fetcher,
    ) -> None:
        self.settings = settings
        self.run_id = settings.run
        self.client = client
        self.engine = engine
        self.gate = gate
        self.metrics = metrics
        self.fetcher = fetcher
        self._state: SidecarState = "starting"
        self.last_error: ErrorRecord | None = None
        self.unhealthy_reason: str | None = None
        self.last_sync: SyncReport | None = None
        self.refused: Refusal | None = None  # the last plan that could not be staged, until one is applied
        self.pause_by_route: dict[str, float] = {}  # route kind -> its last pause, seconds
        self._refused_plans: dict[
            tuple[int | None, int], float
        ] = {}  # (from, to) -> when to try it again, Unix seconds
        self._failures = 0
        self._force_anchor = False
        self._resume_pending = False
        self._manifest: VersionManifest | None = None  # of the applied version, for lineage checks
        self._instance: str | None = None  # the engine instance this boot found
        self._trusted: tuple[str, int] | None = None  # (instance, version) this sidecar verified or applied
        self._reboot = asyncio.Event()  # set when the claim is dropped: the main loop boots again
        self._engine_lock = asyncio.Lock()  # held while boot or a commit works on the engine
        # Bulletin calls (long-polls, fetches, local file work) and engine calls run in pools of
        # their own: an engine call that blocks never holds up the long-poll or a fetch, nor the
        # reverse. One worker more than the loop uses at once in each: a call dropped by a
        # reboot keeps its thread until it ends.
        self._pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="stitch-bulletin")
        self._engine_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stitch-engine")
        # The engine's lease: nothing is changed or claimed without it.
        self.lease = LeaseKeeper(settings, engine, metrics)

    # -- plumbing ----------------------------------------------------------------------------

    async def _io(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a blocking bulletin call (or local file work) in the bulletin pool; its answer."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def _engine_io(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a blocking engine-adapter call in the engine pool; its answer."""
        return await asyncio.get_running_loop().run_in_executor(
            self._engine_pool, functools.partial(fn, *args, **kwargs)
        )

    @property
    def state(self) -> SidecarState:
        """What the sidecar is doing (``/health``, status, ``stitch_sidecar_state``); changed by :meth:`_set_state` only."""
        return self._state

    def _set_state(self, state: SidecarState, why: str) -> None:
        # The one place the state changes: logged (debug) and exported with the reason.
        if state != self._state:
            log.debug("state %s -> %s: %s", self._state, state, why)
            self.metrics.state.state(state)
        self._state = state

    def _publish(self) -> None:
        self.metrics.versions(self.gate.applied, self.gate.target)
        self.metrics.healthy.set(0 if self.unhealthy_reason else 1)

    def _set_target(self, version: int) -> None:
        self.gate.set_target(version)
        self._publish()

    def _set_applied(self, version: int | None, manifest: VersionManifest | None = None) -> None:
        if version is not None and not self.lease.held:  # the engine is another sidecar's: nothing is claimed
            log.warning("version %d is not claimed: this sidecar lost the engine's lease; booting again", version)
            version = None
            self._reboot.set()
        self._manifest = manifest if version is not None else None
        if version is not None and self._instance is not None:
            self._trusted = (self._instance, version)
        self.gate.set_applied(version)
        self._publish()

    def _error(self, exc: BaseException, during: str) -> None:
        kind = exc.type if isinstance(exc, StitchError) else type(exc).__name__
        self.last_error = ErrorRecord(kind, f"{during}: {exc}", time.time())
        log.warning("%s failed: %s: %s", during, kind, exc)
        if isinstance(exc, LeaseNotHeldError):  # the engine (or the adapter) refused for want of the lease
            self._lease_lost(self.lease.lost(exc))

    def close(self) -> None:
        """Release the engine's lease (a clean stop: another sidecar may take the engine at once)
        and the worker threads (a running blocking call finishes in the background)."""
        self.lease.release()
        self.lease.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._engine_pool.shutdown(wait=False, cancel_futures=True)

    # -- the claim: is the engine still what the sidecar verified? ----------------------------

    @property
    def engine_busy(self) -> bool:
        """True while boot or a commit works on the engine (they check it themselves)."""
        return self._engine_lock.locked()

    def _claim_broken(self, state: EngineState) -> str | None:
        # Why ``state`` does not back the applied version, or None when it does.
        if state.instance != self._instance:
            return f"the engine restarted (instance {self._instance} -> {state.instance}): the weights verified on it are gone"
        if self.gate.applied is None:
            return None
        if state.version != self.gate.applied:
            return f"the engine records version {state.version}, not the applied version {self.gate.applied}"
        if state.phase != "idle":
            return f"the engine is in phase {state.phase!r} outside a commit"
        return None

    def _drop_claim(self, reason: str) -> None:
        # Stop admitting and stamping at once, and have the main loop boot again.
        log.warning("dropping the claim on version %s: %s; booting again", self.gate.applied, reason)
        self.last_error = ErrorRecord(EngineChangedError.type, reason, time.time())
        self.metrics.claims_dropped.inc()
        self._set_applied(None)
        self._set_state("waiting_for_engine", "the claim was dropped")
        self._reboot.set()

    async def check_engine(self) -> str | None:
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
        if self.gate.applied is None or self.engine_busy:
            return None
        call_s = self.settings.engine_call_timeout_s
        stall_s = max(self.settings.engine_stall_timeout_s, call_s)
        async with self._engine_lock:
            call = asyncio.ensure_future(asyncio.to_thread(self.engine.state, stall_s))
            try:
                try:
                    state = await asyncio.wait_for(asyncio.shield(call), call_s)
                except TimeoutError:
                    log.warning(
                        "the engine has not answered its state call in %g s: new requests are held until it does (at most %g s)",
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
                reason = self._claim_broken(state)
            if reason is not None and self.gate.applied is not None:
                self._drop_claim(reason)
            return reason

    async def _watch_engine(self) -> None:
        # Background task: :meth:`check_engine` every ``engine_check_interval_s``, and the lease's
        # renewal every ``lease_renew_interval_s``.
        await asyncio.gather(self._check_engine_often(), self._keep_lease())

    async def _check_engine_often(self) -> None:
        while True:
            await asyncio.sleep(self.settings.engine_check_interval_s)
            try:
                await self.check_engine()
            except Exception:
                log.exception("engine check failed")

    async def _keep_lease(self) -> None:
        # Renew the held lease; a lost one drops the claim (boot takes the lease again).
        while True:
            await asyncio.sleep(self.settings.lease_renew_interval_s)
            if not self.lease.held:
                continue  # boot is taking it
            try:
                reason = await self.lease.renew(lambda: self.engine_busy)
            except Exception:
                log.exception("renewing the engine's lease failed")
                continue
            if reason is not None:
                self._lease_lost(reason)

    def _lease_lost(self, reason: str) -> None:
        # Another sidecar holds the engine now (or may): claim nothing, leave the engine to it
        # (a resume still pending is the holder's to do), and boot again (it waits for the lease).
        self._resume_pending = False
        if self.gate.applied is not None:
            self._drop_claim(f"the engine's lease is lost: {reason}")
        else:
            self._set_state("waiting_for_engine", "the lease was lost")
            self._reboot.set()

    async def _hold_lease(self) -> None:
        """Take the engine's lease; while another sidecar holds it, wait (claiming nothing) and try
        again every ``lease_renew_interval_s``.

        Raises:
            EngineUnavailableError, EngineRequestError: the engine does not answer (boot retries).
        """
        while True:
            try:
                await self.lease.take()
                return
            except LeaseNotHeldError:
                self._set_state("waiting_for_engine", "another sidecar holds the lease")
                await asyncio.sleep(self.settings.lease_renew_interval_s)

    async def _require_claim(self, before: str) -> None:
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
        reason = self._claim_broken(await self._engine_io(self.engine.state))
        if reason is not None:
            self._drop_claim(reason)
            raise EngineChangedError(f"before {before}: {reason}")

    # -- boot --------------------------------------------------------------------------------

    async def boot(self) -> None:
        """Take the engine's lease (waiting while another sidecar holds it); learn what the engine
        holds; finish an interrupted commit; load an anchor into a fresh engine.

        Raises:
            SidecarError, BulletinError, PatchError: on failure (the caller retries).
        """
        self._reboot.clear()
        self._set_state("waiting_for_engine", "boot: taking the lease")
        await self._hold_lease()
        async with self._engine_lock:
            target = await self._boot()
            await self.lease.take()  # renewed after boot's engine calls (a checksum pass can outlast the TTL)
        if target is not None:  # a fresh engine, or one that could not be verified
            await self.sync(target)

    async def _boot(self) -> int | None:
        # Everything but the anchor load; returns the version to load from the nearest anchor, if any.
        self._set_state("waiting_for_engine", "boot: asking the engine what it holds")
        info = await self._engine_io(self.engine.state)
        self._instance = info.instance
        version, phase = info.version, info.phase
        paused = phase == "paused"
        self._set_state("booting", f"the engine holds version {version} in phase {phase!r}")
        if self._trusted == (info.instance, version) and phase == "idle" and version is not None:
            # the engine process this sidecar verified, at the version it verified: it was only unreachable
            known = await self._io(self.client.manifest, self.run_id, version)
            log.info("the engine instance is back at version %d, as this sidecar left it", version)
            self._set_applied(version, known)
            self._set_state("idle", "the engine instance is back as this sidecar left it")
            return None
        if phase not in IDLE_PHASES or paused:
            log.warning(
                "engine is in phase %r (paused: %s) holding version %s: an earlier commit was interrupted; recovering",
                phase,
                paused,
                version,
            )
            await self._recover_interrupted(version if phase in IDLE_PHASES else None, paused)
            return None
        manifest: VersionManifest | None = None
        if version is not None:
            manifest = await self._verify_claim(version, "the engine records")
        elif self.settings.boot_version is not None and not self._force_anchor:
            manifest = await self._verify_claim(self.settings.boot_version, "--boot-version says")
            if manifest is not None:
                await self._engine_io(self.engine.set_version, manifest.version, None)
        if manifest is not None:
            self._force_anchor = False
            self._set_applied(manifest.version, manifest)
            self._set_state("idle", f"version {manifest.version} verified on the engine")
            return None
        target = await self._io(self.client.latest, self.run_id, -1, self.settings.poll_wait_s)
        if target is None:
            raise NothingPublishedError(f"run {self.run_id!r} has no version yet and the engine holds none")
        self._set_target(target)
        self._force_anchor = True
        return target

    async def _recover_interrupted(self, version: int | None, paused: bool) -> None:
        # A commit died: the engine is paused at a recorded ``version``, or holds no known version.
        # The record is checked first: should the check fail (bulletin down), the engine stays
        # as it is for the next boot attempt.
        manifest = await self._verify_claim(version, "the paused engine records") if version is not None else None
        self.gate.set_committing(True)
        self._force_anchor = manifest is None  # unless verified, this engine is no longer a fresh boot checkpoint
        try:
            try:
                if manifest is not None:
                    self._set_applied(manifest.version, manifest)
                    return
                self._set_applied(None)
                if not paused:  # no request may run on weights of no known version
                    await self._engine_io(self.engine.pause)
                target = await self._io(self.client.latest, self.run_id)
                if target is None:
                    raise NothingPublishedError(f"run {self.run_id!r} has no version to recover the engine to")
                self._set_target(target)
                await self._recover(target, time.perf_counter(), None)
            finally:
                await self._resume()
        finally:
            self.gate.set_committing(False)
            if self.gate.applied is not None:
                self._set_state("idle", "the interrupted commit was recovered")
            else:
                self._set_state("unhealthy", "the interrupted commit could not be recovered")

    async def _verify_claim(self, version: int, claim: str) -> VersionManifest | None:
        """This run's manifest of ``version`` if the engine's weights are that version, bit for bit
        (one checksum pass over the model, compared with the manifest), else None.

        Called before the sidecar takes a version it did not apply itself: the engine may hold
        another run's version of that number, or weights changed outside stitchboard. None:
        the caller loads the nearest anchor.

        Raises:
            EngineUnavailableError, BulletinError: the engine or the bulletin does not answer;
            ApplyRefusedError: the engine refused the checksum call for another reason than an
            unmapped name (boot retries).
        """
        try:
            manifest = await self._io(self.client.manifest, self.run_id, version)
        except NotFoundError:
            log.warning(
                "%s version %d, which run %r does not have: loading the nearest anchor", claim, version, self.run_id
            )
            return None
        want = manifest.checksums()
        try:
            held = await self._engine_io(self.engine.checksums, sorted(want))
        except ApplyRefusedError as exc:
            if exc.details.get("cause") != UnmappedTensorError.type:
                raise  # the engine could not answer now: boot retries
            # names the engine has no place for: another model
            log.warning(
                "%s version %d, but the engine cannot read run %r's tensors (%s): loading the nearest anchor",
                claim,
                version,
                self.run_id,
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
                self.run_id,
                differ[0],
            )
            return None
        return manifest

    async def _resume(self) -> None:
        # Resume the engine; a failure is kept and retried by the next step (requests would hang).
        self._resume_pending = True
        await self._engine_io(self.engine.resume)
        self._resume_pending = False

    # -- what the reconciler provides ----------------------------------------------------------

    @abc.abstractmethod
    async def sync(self, target: int) -> None:
        """Fetch and commit the plan to ``target`` (boot's anchor load goes through it)."""

    @abc.abstractmethod
    async def _recover(self, target: int, seen: float, paused_at: float | None) -> None:
        """Load the nearest anchor and the deltas to ``target`` into the paused engine."""
