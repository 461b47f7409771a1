"""The reconciler: keeps the engine at the run's latest version, bit-exact, one commit at a time.

One asyncio task in the sidecar's event loop (sidecar process); blocking calls (bulletin,
engine, fetching) run in a small thread pool of its own so the proxy keeps serving. The loop:

1. **boot** (:meth:`~.claim.ClaimKeeper.boot`, with the watch that keeps the claim true).
2. **follow**: long-poll the bulletin for a version newer than the target.
3. **fetch** (:mod:`.fetch`): plan from the applied version, download, verify, decode; the
   engine keeps serving. Versions published meanwhile are coalesced into the same plan.
4. **commit**: a plan of deltas is first staged inside the engine while it serves (decoded,
   checked against the engine's bits, GEMM copies packed: :meth:`EngineAdapter.stage_patches`);
   then hold new requests -> pause the engine (in-flight requests kept) -> write the staged
   update (or apply each step, for a plan with a snapshot) -> verify the engine's recorded
   version -> clear the prefix cache -> mark applied -> resume (in a ``finally``) -> admit
   again. A plan of empty deltas only flips the version, and only on an engine whose record is
   its base. Before every commit the engine must still be the instance, at the version, verified.

A failed apply never leaves a version claimed: the gate drops to "no version", the engine is
brought back from the nearest anchor inside the same pause, and if that fails too the sidecar
reports itself unhealthy with the reason (and keeps retrying with backoff).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from stitchboard.bulletin.errors import NotFoundError
from stitchboard.proto.schema import VersionManifest
from stitchboard.proto.sidecar_wire import COMMIT_STATES, SyncReport

from .claim import ClaimKeeper
from .errors import EngineChangedError, EngineVersionMismatchError
from .fetch import FetchedPlan

log = logging.getLogger("stitchboard.sidecar")

#: Exit status of a fault-injected exit (``fault_phase`` setting; the worker extension uses the same).
FAULT_EXIT_CODE = 86

__all__ = ["COMMIT_STATES", "FAULT_EXIT_CODE", "Reconciler"]


class Reconciler(ClaimKeeper):
    """Follows one run at the bulletin and applies its versions to one engine (arguments: see
    :class:`~.claim.ClaimKeeper`)."""

    def _fault(self, phase: str) -> None:
        # Crash tests: exit the process at once when the fault_phase setting names ``phase``.
        if self.settings.fault_phase == phase:
            log.error("stitchboard fault injection: sidecar exiting at phase %s", phase)
            os._exit(FAULT_EXIT_CODE)

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

    async def _stage(self, target: int) -> FetchedPlan:
        start = None if self._force_anchor else self.gate.applied
        plan = await self._io(self.client.plan, self.run_id, start, target)
        base = await self._base_manifest(start)
        staged = await self._io(self.fetcher.fetch, plan, base)
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

    async def commit(self, staged: FetchedPlan, seen: float) -> None:
        """Apply a staged plan to the engine; see the module docstring for the sequence.

        Raises:
            EngineChangedError: the engine is not what the sidecar verified (nothing written).
            SidecarError and engine errors: the apply and the anchor recovery both failed.
        """
        async with self._engine_lock:
            await self._commit(staged, seen)

    async def _commit(self, staged: FetchedPlan, seen: float) -> None:
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

    async def _stage_in_engine(self, staged: FetchedPlan) -> tuple[bool, Exception | None, float]:
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

    async def _apply(self, staged: FetchedPlan, prepared: bool = False) -> float:
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

    def _finish(self, staged: FetchedPlan, seen: float, pause_s: float, apply_s: float, *, flipped: bool, engine_stage_s: float = 0.0) -> None:
        self._set_applied(staged.to_version, staged.steps[-1].manifest if staged.steps else self._manifest)
        self.unhealthy_reason = None
        self._force_anchor = False
        self._publish()
        total = time.perf_counter() - seen
        self.last_sync = SyncReport(
            from_version=staged.from_version, to_version=staged.to_version, bytes_fetched=staged.bytes_fetched, stage_seconds=staged.seconds, engine_stage_seconds=engine_stage_s,
            pause_seconds=pause_s, apply_seconds=apply_s, total_seconds=total, anchor=staged.from_version is None, finished_at=time.time(),
        )  # fmt: skip
        self.metrics.commits.labels("flipped" if flipped else "applied").inc()
        self.metrics.sync_seconds.observe(total)
        self.fetcher.discard()
        self.state = "idle" if flipped else "resuming"  # idle once the engine is resumed
        log.info("engine at version %d (from %s, %d bytes, %.3f s)", staged.to_version, staged.from_version, staged.bytes_fetched, total)

    async def _recover(self, target: int, seen: float, paused_at: float | None) -> None:
        # The engine is paused and holds no verified version: load the nearest anchor, then deltas.
        self.state = "recovering"
        try:
            plan = await self._io(self.client.plan, self.run_id, None, target)
            staged = await self._io(self.fetcher.fetch, plan, None)
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
