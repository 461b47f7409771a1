"""The reconciler: keeps the engine at the run's latest version, bit-exact, one commit at a time.

One asyncio task in the sidecar's event loop; blocking calls (bulletin, engine, staging) run in
a small thread pool of its own so the proxy keeps serving. The loop:

1. **boot** (:meth:`Reconciler.boot`): ask the engine what it holds (DESIGN.md invariant 7).
   An engine caught mid-apply or paused (the previous sidecar died) is brought to a verified
   version and resumed; a fresh engine is ``--boot-version`` or gets the nearest anchor loaded.
   A version the sidecar did not apply itself (recorded by the engine, or ``--boot-version``)
   is taken only once the engine's checksums match that version's manifest; otherwise (another
   run's version, weights changed outside stitchboard) the nearest anchor is loaded.
2. **follow**: long-poll the bulletin for a version newer than the target.
3. **stage** (:mod:`.staging`): plan from the applied version, download, verify, decode; the
   engine keeps serving. Versions published meanwhile are coalesced into the same plan.
4. **commit**: a plan of deltas is first staged inside the engine while it serves (decoded,
   checked against the engine's bits, GEMM copies packed: :meth:`EngineAdapter.stage_patches`);
   then hold new requests -> pause the engine (in-flight requests kept) -> write the staged
   update (or apply each step, for a plan with a snapshot) -> verify the engine's recorded
   version -> clear the prefix cache -> mark applied -> resume (in a ``finally``) -> admit
   again. A plan of empty deltas only flips the version.

**The claim is watched.** Every ``engine_check_interval_s``, at every ``/health`` and before
every commit (:meth:`Reconciler.check_engine`), the sidecar compares the engine's state with
what it verified: the engine's instance id (new at every engine start), its recorded version
and its phase. An engine that restarted, whose record changed or vanished, or that does not
answer, loses the claim at once (the gate admits and stamps nothing) and the sidecar boots
again: the same engine instance back at the version this sidecar verified on it is taken as it
is; anything else is checked against the manifest (or gets the nearest anchor) before any
version is claimed. A flip (empty delta) is recorded only on an engine whose record is its base.

A failed apply never leaves a version claimed: the gate drops to "no version", the engine is
brought back from the nearest anchor inside the same pause, and if that fails too the sidecar
reports itself unhealthy with the reason (and keeps retrying with backoff).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import NotFoundError
from stitchboard.proto.errors import StitchError
from stitchboard.proto.schema import VersionManifest

from .engine import EngineAdapter, EngineState
from .errors import ApplyRefusedError, EngineChangedError, EngineVersionMismatchError, NothingPublishedError, UnmappedTensorError
from .gate import Gate
from .metrics import SidecarMetrics
from .settings import SidecarSettings
from .staging import StagedPlan, Stager

log = logging.getLogger("stitchboard.sidecar")

#: Exit status of a fault-injected exit (``fault_phase`` setting; the worker extension uses the same).
FAULT_EXIT_CODE = 86

#: Engine phases in which its recorded version is trustworthy; any other (``applying``,
#: ``loading``, ``failed``) means a commit was interrupted and the weights are of no known version.
IDLE_PHASES = frozenset({None, "idle", "paused"})
#: Sidecar states while a commit holds the engine paused (``/v1/stitch/status`` ``state``); in
#: ``resuming`` the new version is already marked applied and the engine is being resumed.
COMMIT_STATES = frozenset({"committing", "recovering", "resuming"})


@dataclass
class SyncReport:
    """Figures of the last completed sync (``/v1/stitch/status``).

    Attributes: versions moved, bytes downloaded, seconds staging files / staging in the engine
    (while it serves) / paused / applying / in total, whether it was an anchor load, and the
    wall-clock time it finished (Unix seconds).
    """

    from_version: int | None
    to_version: int
    bytes_fetched: int
    stage_seconds: float
    engine_stage_seconds: float
    pause_seconds: float
    apply_seconds: float
    total_seconds: float
    anchor: bool
    finished_at: float


class Reconciler:
    """Follows one run at the bulletin and applies its versions to one engine.

    Args:
        settings: sidecar settings (run, waits, backoff).
        client: bulletin client.
        engine: the engine adapter (blocking methods).
        gate: the request gate of the app (updated from the event loop).
        metrics: where figures go.
        stager: stages plans into the handoff folder.
    """

    def __init__(self, settings: SidecarSettings, client: BulletinClient, engine: EngineAdapter, gate: Gate, metrics: SidecarMetrics, stager: Stager) -> None:
        self.settings = settings
        self.run_id = settings.run
        self.client = client
        self.engine = engine
        self.gate = gate
        self.metrics = metrics
        self.stager = stager
        self.state = "starting"
        self.last_error: dict[str, Any] | None = None
        self.unhealthy_reason: str | None = None
        self.last_sync: SyncReport | None = None
        self._failures = 0
        self._force_anchor = False
        self._resume_pending = False
        self._manifest: VersionManifest | None = None  # of the applied version, for lineage checks
        self._instance: str | None = None  # the engine instance this boot found
        self._trusted: tuple[str, int] | None = None  # (instance, version) this sidecar verified or applied
        self._reboot = asyncio.Event()  # set when the claim is dropped: the main loop boots again
        self._engine_lock = asyncio.Lock()  # held while boot or a commit works on the engine
        # One worker more than the loop uses at once: a long-poll dropped by a reboot keeps its
        # thread until its wait ends.
        self._pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="stitch-reconcile")

    # -- plumbing ----------------------------------------------------------------------------

    async def _io(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def _publish(self) -> None:
        self.metrics.versions(self.gate.applied, self.gate.target)
        self.metrics.healthy.set(0 if self.unhealthy_reason else 1)

    def _set_target(self, version: int) -> None:
        self.gate.set_target(version)
        self._publish()

    def _set_applied(self, version: int | None, manifest: VersionManifest | None = None) -> None:
        self._manifest = manifest if version is not None else None
        if version is not None and self._instance is not None:
            self._trusted = (self._instance, version)
        self.gate.set_applied(version)
        self._publish()

    def _error(self, exc: BaseException, during: str) -> None:
        kind = exc.type if isinstance(exc, StitchError) else type(exc).__name__
        self.last_error = {"type": kind, "message": f"{during}: {exc}", "at": time.time()}
        log.warning("%s failed: %s: %s", during, kind, exc)

    def _fault(self, phase: str) -> None:
        # Crash tests: exit the process at once when the fault_phase setting names ``phase``.
        if self.settings.fault_phase == phase:
            log.error("stitchboard fault injection: sidecar exiting at phase %s", phase)
            os._exit(FAULT_EXIT_CODE)

    def close(self) -> None:
        """Release the worker threads (a running blocking call finishes in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- main loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Boot, then follow the bulletin until cancelled; boot again whenever the claim is dropped.
        Errors are recorded and retried with backoff."""
        watch = asyncio.create_task(self._watch_engine(), name="stitch-engine-watch")
        try:
            while True:
                await self._until_ok(self.boot, "boot", escalate=False)
                while not self._reboot.is_set():
                    await self._until_ok(self.step, "sync", escalate=True)
        finally:
            watch.cancel()

    async def _until_ok(self, fn: Any, during: str, *, escalate: bool) -> None:
        # Retries ``fn`` with backoff; with ``escalate``, repeated failures switch to the anchor
        # route. A dropped claim ends the retries of a sync: the caller boots again.
        delay = self.settings.retry_backoff_s
        while True:
            try:
                await fn()
                self._failures = 0
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is recorded, then retried
                if isinstance(exc, EngineChangedError) or (escalate and self._reboot.is_set()):
                    self._error(exc, during)
                    return
                self._failures += 1
                if escalate and self._failures >= self.settings.anchor_after_failures:
                    self._force_anchor = True
                self._error(exc, during)
                if self.state not in ("unhealthy", "waiting_for_engine"):
                    self.state = "retrying"
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.max_backoff_s)

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
        self.last_error = {"type": EngineChangedError.type, "message": reason, "at": time.time()}
        self.metrics.claims_dropped.inc()
        self._set_applied(None)
        self.state = "waiting_for_engine"
        self._reboot.set()

    async def check_engine(self) -> str | None:
        """Check that the engine is still the instance, at the version, that the sidecar verified.

        Does nothing (None) while nothing is claimed or while boot or a commit works on the
        engine (they check it themselves). Otherwise one state call, bounded by
        ``engine_call_timeout_s``; on a restarted engine, a changed or vanished record, a phase
        other than idle, or no answer, the claim is dropped at once and the sidecar boots again.

        Returns:
            None if the claim holds (or there is none to check), else why it was dropped.
        """
        if self.gate.applied is None or self.engine_busy:
            return None
        async with self._engine_lock:
            try:
                state = await asyncio.wait_for(asyncio.to_thread(self.engine.state), self.settings.engine_call_timeout_s)
            except Exception as exc:  # noqa: BLE001 - an engine that cannot say what it holds backs no claim
                reason: str | None = f"the engine does not answer its state call: {type(exc).__name__}: {exc}"
            else:
                reason = self._claim_broken(state)
            if reason is not None and self.gate.applied is not None:
                self._drop_claim(reason)
            return reason

    async def _watch_engine(self) -> None:
        # Background task: :meth:`check_engine` every ``engine_check_interval_s``.
        while True:
            await asyncio.sleep(self.settings.engine_check_interval_s)
            try:
                await self.check_engine()
            except Exception:  # noqa: BLE001 - the watch must outlive any one failure
                log.exception("engine check failed")

    async def _require_claim(self, before: str) -> None:
        """Before ``before`` writes to the engine: raise (dropping the claim) if the engine is
        not the instance this boot found, or no longer records the applied version.

        Raises:
            EngineChangedError: the main loop boots again.
        """
        reason = self._claim_broken(await self._io(self.engine.state))
        if reason is not None:
            self._drop_claim(reason)
            raise EngineChangedError(f"before {before}: {reason}")

    # -- boot --------------------------------------------------------------------------------

    async def boot(self) -> None:
        """Learn what the engine holds; finish an interrupted commit; load an anchor into a fresh engine.

        Raises:
            SidecarError, BulletinError, PatchError: on failure (the caller retries).
        """
        self._reboot.clear()
        async with self._engine_lock:
            target = await self._boot()
        if target is not None:  # a fresh engine, or one that could not be verified
            await self.sync(target)

    async def _boot(self) -> int | None:
        # Everything but the anchor load; returns the version to load from the nearest anchor, if any.
        self.state = "waiting_for_engine"
        info = await self._io(self.engine.state)
        self._instance = info.instance
        version, phase = info.version, info.phase
        paused = phase == "paused"
        self.state = "booting"
        if self._trusted == (info.instance, version) and phase == "idle" and version is not None:
            # the engine process this sidecar verified, at the version it verified: it was only unreachable
            manifest = await self._io(self.client.manifest, self.run_id, version)
            log.info("the engine instance is back at version %d, as this sidecar left it", version)
            self._set_applied(version, manifest)
            self.state = "idle"
            return None
        if phase not in IDLE_PHASES or paused:
            log.warning("engine is in phase %r (paused: %s) holding version %s: an earlier commit was interrupted; recovering", phase, paused, version)
            await self._recover_interrupted(version if phase in IDLE_PHASES else None, paused)
            return None
        manifest = None
        if version is not None:
            manifest = await self._verify_claim(version, "the engine records")
        elif self.settings.boot_version is not None and not self._force_anchor:
            manifest = await self._verify_claim(self.settings.boot_version, "--boot-version says")
            if manifest is not None:
                await self._io(self.engine.set_version, manifest.version, None)
        if manifest is not None:
            self._force_anchor = False
            self._set_applied(manifest.version, manifest)
            self.state = "idle"
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
                    await self._io(self.engine.pause)
                target = await self._io(self.client.latest, self.run_id)
                if target is None:
                    raise NothingPublishedError(f"run {self.run_id!r} has no version to recover the engine to")
                self._set_target(target)
                await self._recover(target, time.perf_counter(), None)
            finally:
                await self._resume()
        finally:
            self.gate.set_committing(False)
            self.state = "idle" if self.gate.applied is not None else "unhealthy"

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
            log.warning("%s version %d, which run %r does not have: loading the nearest anchor", claim, version, self.run_id)
            return None
        want = manifest.checksums()
        try:
            held = await self._io(self.engine.checksums, sorted(want))
        except ApplyRefusedError as exc:
            if exc.details.get("cause") != UnmappedTensorError.type:
                raise  # the engine could not answer now: boot retries
            # names the engine has no place for: another model
            log.warning("%s version %d, but the engine cannot read run %r's tensors (%s): loading the nearest anchor", claim, version, self.run_id, exc)
            return None
        differ = sorted(n for n in want if held.get(n) != want[n])
        if differ:
            log.warning("%s version %d, but %d of %d tensors differ from run %r's (first: %s): loading the nearest anchor", claim, version, len(differ), len(want), self.run_id, differ[0])
            return None
        return manifest

    async def _resume(self) -> None:
        # Resume the engine; a failure is kept and retried by the next step (requests would hang).
        self._resume_pending = True
        await self._io(self.engine.resume)
        self._resume_pending = False

    async def step(self) -> None:
        """Sync to the target if behind, else long-poll the bulletin once for a newer version."""
        if self._resume_pending:
            await self._resume()
        applied, target = self.gate.applied, self.gate.target
        if target is not None and (applied is None or target > applied):
            if self._failures:  # retrying: a newer version may route around what failed
                newer = await self._io(self.client.latest, self.run_id, target)
                if newer is not None and newer > target:
                    target = newer
                    self._set_target(target)
            await self.sync(target)
            return
        self.state = "idle" if applied is not None else self.state
        if target is None and applied is not None:  # booted on the engine's version: learn the run's latest now
            latest = await self._io(self.client.latest, self.run_id)
            if latest is not None:
                self._set_target(latest)
                return
        after = max(v for v in (applied, target, -1) if v is not None)
        latest = await self._unless_reboot(self._io(self.client.latest, self.run_id, after, self.settings.poll_wait_s))
        if latest is not None and latest > after:
            self._set_target(latest)

    async def _unless_reboot(self, call: Any) -> Any:
        # Await ``call`` (a long-poll), but give up on it (None) as soon as the claim is dropped;
        # its thread finishes the wait in the background and its answer is ignored.
        task = asyncio.ensure_future(call)
        reboot = asyncio.ensure_future(self._reboot.wait())
        try:
            await asyncio.wait({task, reboot}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            reboot.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return None

    # -- sync: stage, coalesce, commit -------------------------------------------------------

    async def sync(self, target: int) -> None:
        """Stage the plan to ``target`` (coalescing newer versions), then commit it.

        Raises:
            BulletinError, PatchError, StagingError: staging failed; the engine was not touched.
            SidecarError: the commit failed and the anchor recovery failed too (sidecar unhealthy).
        """
        seen = time.perf_counter()
        self.state = "staging"
        staged = await self._stage(target)
        while (newer := await self._io(self.client.latest, self.run_id, staged.to_version)) is not None and newer > staged.to_version:
            log.info("version %d appeared while staging %d: coalescing it into this commit", newer, staged.to_version)
            self._set_target(newer)
            staged = await self._stage(newer)
        await self.commit(staged, seen)

    async def _stage(self, target: int) -> StagedPlan:
        start = None if self._force_anchor else self.gate.applied
        plan = await self._io(self.client.plan, self.run_id, start, target)
        base = await self._base_manifest(start)
        staged = await self._io(self.stager.stage, plan, base)
        self.metrics.bytes_fetched.inc(staged.bytes_fetched)
        self.metrics.stage_seconds.observe(staged.seconds)
        return staged

    async def _base_manifest(self, version: int | None) -> VersionManifest | None:
        # The applied version's manifest (checks the first delta's base checksums); None if gone.
        if version is None:
            return None
        if self._manifest is None or self._manifest.version != version:
            try:
                self._manifest = await self._io(self.client.manifest, self.run_id, version)
            except NotFoundError:
                return None
        return self._manifest

    async def commit(self, staged: StagedPlan, seen: float) -> None:
        """Apply a staged plan to the engine; see the module docstring for the sequence.

        Raises:
            EngineChangedError: the engine is not what the sidecar verified (nothing written).
            SidecarError and engine errors: the apply and the anchor recovery both failed.
        """
        async with self._engine_lock:
            await self._commit(staged, seen)

    async def _commit(self, staged: StagedPlan, seen: float) -> None:
        await self._require_claim(f"committing versions {staged.from_version}->{staged.to_version}")
        if staged.steps and all(s.empty for s in staged.steps) and staged.from_version == self.gate.applied:
            await self._io(self.engine.set_version, staged.to_version, staged.from_version)
            self._finish(staged, seen, 0.0, 0.0, flipped=True)
            return
        prepared, refused, engine_stage_s = await self._stage_in_engine(staged)
        if prepared or refused is not None:  # time passed while the engine staged: look again
            await self._require_claim(f"pausing the engine for versions {staged.from_version}->{staged.to_version}")
        self.state = "committing"
        self.gate.set_committing(True)
        paused_at = None
        try:
            await self._io(self.engine.pause)
            paused_at = time.perf_counter()
            self._fault("paused")
            try:
                if refused is not None:
                    raise refused
                apply_s = await self._apply(staged, prepared)
            except Exception as exc:  # noqa: BLE001 - any apply failure leads to the anchor
                self._error(exc, f"applying versions {staged.from_version}->{staged.to_version}")
                self.metrics.commits.labels("failed").inc()
                self._set_applied(None)
                await self._recover(staged.to_version, seen, paused_at)
                return
            self._finish(staged, seen, time.perf_counter() - paused_at, apply_s, flipped=False, engine_stage_s=engine_stage_s)
        finally:
            try:
                await self._resume()
            finally:
                if paused_at is not None:
                    self.metrics.pause_seconds.observe(time.perf_counter() - paused_at)
                self.gate.set_committing(False)
            if self.state == "resuming":
                self.state = "idle"

    async def _stage_in_engine(self, staged: StagedPlan) -> tuple[bool, Exception | None, float]:
        """Before the pause: have the engine stage a plan of deltas from the applied version
        (decode, check, pre-pack) while it serves. Returns (staged, the refusal if any, seconds);
        a plan with a snapshot is applied step by step in the pause instead."""
        deltas = [s for s in staged.steps if not s.empty]
        if not deltas or staged.from_version != self.gate.applied or any(s.kind == "snapshot" for s in staged.steps):
            return False, None, 0.0
        # Empty deltas between them change no bit: each delta runs from the previous one's version.
        ends = [staged.from_version] + [s.version for s in deltas[:-1]] + [staged.to_version]
        steps = [([str(p) for p in s.paths], ends[i], ends[i + 1]) for i, s in enumerate(deltas)]
        self.state = "staging"
        start = time.perf_counter()
        try:
            await self._io(self.engine.stage_patches, steps)
        except Exception as exc:  # noqa: BLE001 - handled in the pause like a failed apply
            return False, exc, 0.0
        seconds = time.perf_counter() - start
        self.metrics.engine_stage_seconds.observe(seconds)
        return True, None, seconds

    async def _apply(self, staged: StagedPlan, prepared: bool = False) -> float:
        # Inside the pause: every step (or the engine's staged update), then verify, clear the
        # prefix cache. Returns apply seconds.
        start = time.perf_counter()
        if prepared:
            await self._io(self.engine.commit_staged, staged.to_version)
        else:
            for step in staged.steps:
                if step.kind == "snapshot":
                    await self._io(self.engine.load_snapshot, [str(p) for p in step.paths], step.version, step.manifest.checksums())
                elif step.empty:
                    await self._io(self.engine.set_version, step.version, step.version - 1)
                else:
                    await self._io(self.engine.apply_patch, [str(p) for p in step.paths], step.version - 1, step.version)
        held = (await self._io(self.engine.state)).version
        if held != staged.to_version:
            raise EngineVersionMismatchError(f"after applying, the engine records version {held}, expected {staged.to_version}")
        await self._io(self.engine.reset_prefix_cache)
        seconds = time.perf_counter() - start
        self.metrics.apply_seconds.observe(seconds)
        return seconds

    def _finish(self, staged: StagedPlan, seen: float, pause_s: float, apply_s: float, *, flipped: bool, engine_stage_s: float = 0.0) -> None:
        self._set_applied(staged.to_version, staged.steps[-1].manifest if staged.steps else self._manifest)
        self.unhealthy_reason = None
        self._force_anchor = False
        self._publish()
        total = time.perf_counter() - seen
        self.last_sync = SyncReport(staged.from_version, staged.to_version, staged.bytes_fetched, staged.seconds, engine_stage_s, pause_s, apply_s, total, staged.from_version is None, time.time())
        self.metrics.commits.labels("flipped" if flipped else "applied").inc()
        self.metrics.sync_seconds.observe(total)
        self.stager.discard()
        self.state = "idle" if flipped else "resuming"  # idle once the engine is resumed
        log.info("engine at version %d (from %s, %d bytes, %.3f s)", staged.to_version, staged.from_version, staged.bytes_fetched, total)

    async def _recover(self, target: int, seen: float, paused_at: float | None) -> None:
        # The engine is paused and holds no verified version: load the nearest anchor, then deltas.
        self.state = "recovering"
        try:
            plan = await self._io(self.client.plan, self.run_id, None, target)
            staged = await self._io(self.stager.stage, plan, None)
            self.metrics.bytes_fetched.inc(staged.bytes_fetched)
            apply_s = await self._apply(staged)
        except Exception as exc:
            self.unhealthy_reason = f"recovery from the anchor to version {target} failed: {type(exc).__name__}: {exc}"
            self.state = "unhealthy"
            self._force_anchor = True
            self.metrics.recoveries.labels("failed").inc()
            self._publish()
            raise
        self.metrics.recoveries.labels("ok").inc()
        self._finish(staged, seen, 0.0 if paused_at is None else time.perf_counter() - paused_at, apply_s, flipped=False)

