"""The reconciler: keeps the engine at the run's latest version, bit-exact, one commit at a time.

One asyncio task in the sidecar's event loop (sidecar process); blocking calls (bulletin,
engine, fetching) run in thread pools of its own (:mod:`.pools`) so the proxy keeps serving. What
the engine holds and the watch that keeps that true are the claim's (:class:`~.claim.Claim`,
``self.claim``); state and errors go to :class:`~.loop_status.LoopStatus`; refused plans to
:class:`~.refusals.RefusalBook`. The loop, in the order this file reads:

1. **boot**: take the engine's lease, find what the engine holds (:meth:`~.claim.Claim.find`),
   finish a commit a dead sidecar left, or load the nearest anchor; the claim's watch runs beside.
2. **follow**: long-poll the bulletin for a version newer than the target.
3. **fetch** (:mod:`.fetch`): plan from the applied version (squash steps accepted: one patch
   from an older version where that is cheaper than the chain; a squash that fails a check, at
   fetch, in the engine's staging or at apply, is quarantined and plans avoid it from then on,
   :mod:`.quarantine`), download, verify, decode; the engine keeps serving. Versions published
   meanwhile are coalesced into the same plan.
4. **commit**: a plan of deltas is first staged inside the engine while it serves (decoded,
   checked against the engine's bits, GEMM copies packed: :meth:`EngineAdapter.stage_patches`);
   then hold new requests -> pause the engine (in-flight requests kept) -> write the staged
   update (or apply each step, for a plan with a snapshot) -> verify the engine's recorded
   version -> clear the prefix cache -> mark applied -> resume (in a ``finally``) -> admit
   again. A plan of empty deltas only flips the version, and only on an engine whose record is
   its base. Before every commit the engine must still be the instance, at the version, verified.
   An anchor route (a snapshot, then deltas) on an engine that holds a verified version is
   staged while it serves too (:mod:`.rebase`: the target built here, only the tensors that
   differ sent, as one patch); only on an engine holding no verified version is it applied
   step by step inside the pause (nothing is served then). Pause seconds are reported per route
   kind (:data:`~stitchboard.proto.sidecar_wire.RouteKind`).

A plan that cannot be staged (the engine refuses it, e.g. a tensor it lacks; nothing is written)
never takes the replica out of service: the held version keeps serving (requests that accept it
are admitted, those that need the refused version get 409 after their wait) and the refusal is
reported (``refused`` in status and ``/health``, ``stitch_sidecar_refusals_total``). A transient
refusal is tried again after ``refused_retry_s`` (at once when a newer version appears). A
permanent one (a tensor name, dtype or shape the engine does not have, :mod:`.refusals`) is never
tried again: the sidecar waits for a version with another tensor set, and a version with the
refused tensor set is refused without touching the engine, so no engine is paused in a loop.

A failed apply never leaves a version claimed: the gate drops to "no version", the engine is
brought back from the nearest anchor inside the same pause, and if that fails too the sidecar
reports itself unhealthy with the reason (and keeps retrying with backoff).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import NotFoundError
from stitchboard.proto.schema import VersionManifest
from stitchboard.proto.sidecar_wire import COMMIT_STATES, Refusal, RouteKind, SidecarState, SyncReport

from .claim import Claim
from .engines.base import CountsOutputs, EngineAdapter, PausesKeepingCache, StageStep, WaitsForStaging
from .errors import (
    ApplyRefusedError,
    EngineChangedError,
    EngineVersionMismatchError,
    LeaseNotHeldError,
    NothingPublishedError,
    PlanRefusedError,
    StagingError,
)
from .fetch import FetchedPlan, Fetcher
from .gate import Gate
from .lease_keeper import LeaseKeeper
from .loop_status import ErrorRecord, LoopStatus
from .metrics import SidecarMetrics
from .pools import Pools
from .quarantine import SquashQuarantine
from .rebase import build_rebase
from .refusals import RefusalBook, is_permanent
from .salt import CacheSalter
from .settings import SidecarSettings
from .spans import SpanLedger

log = logging.getLogger("stitchboard.sidecar")

T = TypeVar("T")

#: Exit status of a fault-injected exit (``fault_phase`` setting; the worker extension uses the same).
FAULT_EXIT_CODE = 86

__all__ = ["COMMIT_STATES", "FAULT_EXIT_CODE", "Reconciler"]


def _cancelling() -> bool:
    """Whether the running task was asked to stop: an exception raised in a ``finally`` on the way
    out (a failed resume) replaces the ``CancelledError``, and a retry loop must not take it for
    a failure to retry (the sidecar then never stopped while its engine was down)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Reconciler:
    """Follows one run at the bulletin and applies its versions to one engine.

    Args:
        settings: sidecar settings (run, waits, backoff, engine checks).
        client: bulletin client.
        engine: the engine adapter (blocking methods).
        gate: the request gate of the app (updated from the event loop).
        metrics: where figures go.
        fetcher: fetches plans into the hand-off folder.

    ``spans`` (requests that want per-token version spans) and ``salter`` (the cache salt) are
    shared with the proxy: the engine's output-token counts are read at each pause for the
    former (:mod:`.spans`), and the latter says whether a commit resets the prefix cache (:mod:`.salt`).
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
        self.pools = Pools()
        self.status = LoopStatus(gate, metrics)
        self.claim = Claim(settings, client, engine, gate, metrics, self.pools, self.status)
        self.refusals = RefusalBook(metrics, settings.refused_retry_s)
        self.quarantine = SquashQuarantine(metrics.squash_quarantines)  # /health's squash_quarantine
        self.spans = SpanLedger()  # the requests in flight that want spans (shared with the proxy)
        self.salter = CacheSalter(settings.salt_cache, settings.engine)  # the cache salt (shared with the proxy)
        self.last_sync: SyncReport | None = None
        self.pause_by_route: dict[str, float] = {}  # route kind -> its last pause, seconds
        self._failures = 0
        self._force_anchor = False  # the next plan starts from the nearest anchor
        self._pause_counts: dict[str, int] | None = None
        self._keep_cache = False  # this commit's pause kept the prefix cache (salted, nothing old in flight)

    # -- what the app, /health and the fleet report read -------------------------------------

    @property
    def state(self) -> SidecarState:
        """What the sidecar is doing (:class:`~.loop_status.LoopStatus`)."""
        return self.status.state

    @property
    def last_error(self) -> ErrorRecord | None:
        """The last failure, if any."""
        return self.status.last_error

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the last recovery left the sidecar unhealthy (None: it did not)."""
        return self.status.unhealthy_reason

    @property
    def refused(self) -> Refusal | None:
        """The last plan that could not be staged, until a version is applied."""
        return self.refusals.refused

    @property
    def lease(self) -> LeaseKeeper:
        """The engine's lease (the claim's)."""
        return self.claim.lease

    @property
    def engine_busy(self) -> bool:
        """True while boot or a commit works on the engine (they check it themselves)."""
        return self.claim.busy

    async def check_engine(self) -> str | None:
        """:meth:`.claim.Claim.check`: None if the claim holds (or there is none), else why it was dropped."""
        return await self.claim.check()

    def close(self) -> None:
        """Release the engine's lease (a clean stop: another sidecar may take the engine at once)
        and the worker threads (a running blocking call finishes in the background)."""
        self.claim.close()
        self.pools.close()

    # -- main loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Boot, then follow the bulletin until cancelled; boot again whenever the claim is dropped.
        Errors are recorded and retried with backoff."""
        watch = asyncio.create_task(self.claim.watch(), name="stitch-engine-watch")
        try:
            while True:
                await self._until_ok(self.boot, "boot", escalate=False)
                while not self.claim.dropped.is_set():
                    await self._until_ok(self.step, "sync", escalate=True)
        finally:
            watch.cancel()

    async def _until_ok(self, fn: Callable[[], Awaitable[None]], during: str, *, escalate: bool) -> None:
        # Retries ``fn`` with backoff; with ``escalate``, repeated failures switch to the anchor
        # route. A dropped claim ends the retries of a sync: the caller boots again.
        delay = self.settings.retry_backoff_s
        while True:
            try:
                await fn()
                if self.refused is None:  # waiting out a refusal is no success: the route escalates
                    self._failures = 0
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure is recorded, then retried (a clean-up failure on the way out, not)
                if _cancelling():  # cancelled, and a clean-up on the way out (the resume in a finally) failed: stop
                    self._error(exc, during)
                    raise asyncio.CancelledError(f"stopped while {during} failed: {exc}") from exc
                if isinstance(exc, EngineChangedError) or (escalate and self.claim.dropped.is_set()):
                    self._error(exc, during)
                    return
                self._failures += 1
                if escalate and self._failures >= self.settings.anchor_after_failures:
                    self._force_anchor = True
                self._error(exc, during)
                if self.state not in ("unhealthy", "waiting_for_engine"):
                    self.status.set_state("retrying", f"{during} failed")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.max_backoff_s)

    def _error(self, exc: BaseException, during: str) -> None:
        self.status.error(exc, during)
        if isinstance(exc, LeaseNotHeldError):  # the engine (or the adapter) refused for want of the lease
            self.claim.lease_lost(self.claim.lease.lost(exc))

    def _set_target(self, version: int) -> None:
        self.gate.set_target(version)
        self.status.publish()

    # -- boot --------------------------------------------------------------------------------

    async def boot(self) -> None:
        """Take the engine's lease (waiting while another sidecar holds it); learn what the engine
        holds; finish an interrupted commit; load an anchor into a fresh engine.

        Raises:
            SidecarError, BulletinError, PatchError: on failure (the caller retries).
        """
        await self.claim.take()
        target = None
        async with self.claim.lock:
            found = await self.claim.find(boot_version=not self._force_anchor)
            if found.how == "interrupted":
                await self._recover_interrupted(found.version, found.paused)
            elif found.how == "verified":
                self._force_anchor = False
            elif found.how == "none":  # a fresh engine, or one that could not be verified
                target = await self.pools.io(self.client.latest, self.run_id, -1, self.settings.poll_wait_s)
                if target is None:
                    raise NothingPublishedError(f"run {self.run_id!r} has no version yet and the engine holds none")
                self._set_target(target)
                self._force_anchor = True
            await self.claim.lease.take()  # renewed after boot's engine calls (a checksum pass can outlast the TTL)
        if target is not None:
            await self.sync(target)

    async def _recover_interrupted(self, version: int | None, paused: bool) -> None:
        # A commit died: the engine is paused at a recorded ``version``, or holds no known version.
        # The record is checked first: should the check fail (bulletin down), the engine stays
        # as it is for the next boot attempt.
        manifest = await self.claim.verify(version, "the paused engine records") if version is not None else None
        self.gate.set_committing(True)
        self._force_anchor = manifest is None  # unless verified, this engine is no longer a fresh boot checkpoint
        try:
            try:
                if manifest is not None:
                    self.claim.set_applied(manifest.version, manifest)
                    return
                self.claim.set_applied(None)
                if not paused:  # no request may run on weights of no known version
                    await self.pools.engine(self.engine.pause)
                target = await self.pools.io(self.client.latest, self.run_id)
                if target is None:
                    raise NothingPublishedError(f"run {self.run_id!r} has no version to recover the engine to")
                self._set_target(target)
                await self._recover(target, time.perf_counter(), None)
            finally:
                await self.claim.resume()
        finally:
            self.gate.set_committing(False)
            if self.gate.applied is not None:
                self.status.set_state("idle", "the interrupted commit was recovered")
            else:
                self.status.set_state("unhealthy", "the interrupted commit could not be recovered")

    # -- follow ------------------------------------------------------------------------------

    async def step(self) -> None:
        """Sync to the target if behind, else long-poll the bulletin once for a newer version."""
        if self.claim.resume_pending:
            await self.claim.resume()
        applied, target = self.gate.applied, self.gate.target
        if target is not None and (applied is None or target > applied):
            if self._failures:  # retrying: a newer version may route around what failed
                newer = await self.pools.io(self.client.latest, self.run_id, target)
                if newer is not None and newer > target:
                    target = newer
                    self._set_target(target)
            await self.sync(target)
            return
        if applied is not None:
            self.status.set_state("idle", f"at the target, version {applied}")
        if target is None and applied is not None:  # booted on the engine's version: learn the run's latest now
            latest = await self.pools.io(self.client.latest, self.run_id)
            if latest is not None:
                self._set_target(latest)
                return
        after = max(v for v in (applied, target, -1) if v is not None)
        latest = await self._unless_dropped(
            self.pools.io(self.client.latest, self.run_id, after, self.settings.poll_wait_s)
        )
        if latest is not None and latest > after:
            self._set_target(latest)

    async def _wait_out_refusal(self, target: int) -> bool:
        # True when the plan to ``target`` was refused and its retry time has not come: long-poll
        # the bulletin for a newer version until then (the held version serves meanwhile).
        left = self.refusals.wait_s(None if self._force_anchor else self.gate.applied, target)
        if left <= 0:
            return False
        self.status.set_state("retrying", f"the plan to version {target} waits out its refusal")
        latest = await self._unless_dropped(
            self.pools.io(self.client.latest, self.run_id, target, min(left, self.settings.poll_wait_s))
        )
        if latest is not None and latest > target:
            self._set_target(latest)
        return True

    async def _unless_dropped(self, call: Awaitable[T]) -> T | None:
        # Await ``call`` (a long-poll), but give up on it (None) as soon as the claim is dropped;
        # its thread finishes the wait in the background and its answer is ignored.
        task = asyncio.ensure_future(call)
        dropped = asyncio.ensure_future(self.claim.dropped.wait())
        try:
            await asyncio.wait({task, dropped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dropped.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return None

    # -- sync: stage, coalesce, commit -------------------------------------------------------

    async def sync(self, target: int) -> None:
        """Stage the plan to ``target`` (coalescing newer versions), then commit it.

        Returns at once (after a long-poll for a newer version) while the plan to ``target`` waits
        out its refusal.

        Raises:
            BulletinError, PatchError, StagingError: staging failed; the engine was not touched.
            PlanRefusedError: the engine refused the plan, or refused its tensor set before (nothing written).
            SidecarError: the commit failed and the anchor recovery failed too (sidecar unhealthy).
        """
        if await self._wait_out_refusal(target):
            return
        seen = time.perf_counter()
        self.status.set_state("staging", f"fetching the plan to version {target}")
        staged = await self._stage(target)
        while (
            newer := await self.pools.io(self.client.latest, self.run_id, staged.to_version)
        ) is not None and newer > staged.to_version:
            log.info("version %d appeared while staging %d: coalescing it into this commit", newer, staged.to_version)
            self._set_target(newer)
            staged = await self._stage(newer)
        await self.commit(staged, seen)

    async def _stage(self, target: int) -> FetchedPlan:
        start = None if self._force_anchor else self.gate.applied
        await self._refuse_known_tensor_set(start, target)
        base = await self._base_manifest(start)
        while True:  # each failing squash is quarantined and the plan asked again: ends with the chain
            plan = await self.pools.io(self.quarantine.plan, self.client, self.run_id, start, target)
            try:
                staged = await self.pools.io(self.fetcher.fetch, plan, base)
                break
            except StagingError as exc:
                if not self.quarantine.blame_fetch(plan, exc):
                    raise
        self.metrics.bytes_fetched.inc(staged.bytes_fetched)
        self.metrics.stage_seconds.observe(staged.seconds)
        return staged

    async def _refuse_known_tensor_set(self, start: int | None, target: int) -> None:
        # A version with the tensor set the engine refused permanently is refused here, before any
        # download and without an engine call (the engine would refuse it the same way).
        known = self.refusals.tensor_set
        if known is None:
            return
        manifest = await self.pools.io(self.client.manifest, self.run_id, target)
        if manifest.layout() == known.tensors:
            route: RouteKind = "anchor" if start is None else "delta"
            why = f"{known.cause}: {known.message} (the engine refused this tensor set at version {known.version})"
            raise self._refuse(start, target, route, ApplyRefusedError(why, cause=known.cause), manifest)

    async def _base_manifest(self, version: int | None) -> VersionManifest | None:
        # The applied version's manifest (checks the first delta's base checksums); None if gone.
        if version is None:
            return None
        known = self.claim.manifest
        if known is not None and known.version == version:
            return known
        try:
            return await self.pools.io(self.client.manifest, self.run_id, version)
        except NotFoundError:
            return None

    async def commit(self, staged: FetchedPlan, seen: float) -> None:
        """Apply a staged plan to the engine; see the module docstring for the sequence.

        Raises:
            EngineChangedError: the engine is not what the sidecar verified (nothing written).
            SidecarError and engine errors: the apply and the anchor recovery both failed.
        """
        async with self.claim.lock:
            await self._commit(staged, seen)

    async def _commit(self, staged: FetchedPlan, seen: float) -> None:
        await self.claim.require(f"committing versions {staged.from_version}->{staged.to_version}")
        if staged.steps and all(s.empty for s in staged.steps) and staged.from_version == self.gate.applied:
            await self.pools.engine(self.engine.set_version, staged.to_version, staged.from_version)
            self._finish(staged, seen, 0.0, 0.0, flipped=True, route="flip")
            return
        route, held = self._route_of(staged), self.gate.applied
        target = staged.steps[-1].manifest if staged.steps else None
        try:
            prepared, engine_stage_s = await self._stage_in_engine(staged, route)
        except LeaseNotHeldError:  # another sidecar holds the engine: no refusal of the plan
            raise
        except Exception as exc:  # nothing was written: the held version keeps serving
            if self.quarantine.blame_engine(staged, exc, "stage"):  # no refusal: the retry plans around it
                raise StagingError(
                    f"a squash of the plan failed in staging, quarantined; planning again: {exc}"
                ) from exc
            raise self._refuse(staged.from_version, staged.to_version, route, exc, target) from exc
        if prepared is None:  # an anchor route that changes no bit of what the engine holds
            await self.pools.engine(
                self.engine.set_version,
                staged.to_version,
                staged.from_version if route == "delta" else self.gate.applied,
            )
            self._finish(staged, seen, 0.0, 0.0, flipped=True, route="flip")
            return
        if prepared:  # time passed while the engine staged: look again
            await self.claim.require(f"pausing the engine for versions {staged.from_version}->{staged.to_version}")
        self.status.set_state("committing", f"pausing the engine for version {staged.to_version}")
        self.gate.set_committing(True)
        paused_at = None
        try:
            engine = self.engine
            self._keep_cache = False
            pause = engine.pause
            if isinstance(engine, PausesKeepingCache) and not self.salter.needs_reset(self.gate.in_flight):
                self._keep_cache, pause = True, engine.pause_keeping_cache
            await self.pools.engine(pause)
            paused_at = time.perf_counter()
            self._fault("paused")
            await self._read_counts()
            try:
                apply_s = await self._apply(staged, prepared)
            except Exception as exc:  # any apply failure leads to the anchor, unless nothing was written
                if isinstance(exc, LeaseNotHeldError):  # the engine is another sidecar's now: it recovers it
                    raise
                refused = isinstance(exc, ApplyRefusedError) and (prepared or is_permanent(exc))
                if refused and await self.claim.holds(held):  # refused before the write: the held version serves on
                    raise self._refuse(staged.from_version, staged.to_version, route, exc, target) from exc
                self.quarantine.blame_engine(staged, exc, "apply")  # the recovery plans no squash; later plans avoid it
                self._error(exc, f"applying versions {staged.from_version}->{staged.to_version}")
                self.metrics.commits.labels("failed").inc()
                self.claim.set_applied(None)
                route = "recovery"
                await self._recover(staged.to_version, seen, paused_at)
                return
            self._finish(
                staged,
                seen,
                time.perf_counter() - paused_at,
                apply_s,
                flipped=False,
                engine_stage_s=engine_stage_s,
                route=route,
            )
        finally:
            try:
                await self.claim.resume()
            finally:
                if paused_at is not None:
                    self.metrics.pause_seconds.labels(route).observe(time.perf_counter() - paused_at)
                self.gate.set_committing(False)
            if self.state == "resuming":
                self.status.set_state("idle", "the engine resumed")

    def _route_of(self, staged: FetchedPlan) -> RouteKind:
        # How the plan reaches the engine: staged while serving (a delta plan from the applied
        # version; an anchor route on an engine holding a verified version), or in the pause.
        applied = self.gate.applied
        if applied is None:
            return "anchor"
        if any(s.kind == "snapshot" for s in staged.steps):
            return "staged_anchor" if self.settings.stage_anchor_routes else "anchor"
        return "delta" if staged.from_version == applied else "anchor"

    async def _stage_in_engine(self, staged: FetchedPlan, route: RouteKind) -> tuple[bool | None, float]:
        """Before the pause, while the engine serves: have it stage the plan (decode, check,
        pre-pack; nothing written). Returns (True: staged; False: the ``anchor`` route, applied
        step by step in the pause; None: nothing to write, seconds).

        Raises:
            any error of the engine or the build: nothing was written (the caller refuses the plan).
        """
        if route == "anchor":
            return False, 0.0
        self.status.set_state("staging", f"the engine stages the plan to version {staged.to_version}")
        start = time.perf_counter()
        applied = self.gate.applied
        assert applied is not None  # both routes staged while serving start from a verified version (_route_of)
        steps: list[StageStep]
        if route == "staged_anchor":
            names = sorted(t.name for t in staged.steps[-1].manifest.tensors)
            held = await self.pools.engine(self.engine.checksums, names)  # xxh3-128 of each whole tensor
            path, _ = await self.pools.io(
                build_rebase, staged, held, self.fetcher.folder_of(staged.to_version, "rebase")
            )
            if path is None:
                return None, time.perf_counter() - start
            steps = [StageStep([str(path)], applied, staged.to_version)]
        else:
            # Empty deltas between them change no bit: each delta runs from the previous one's version.
            deltas = [s for s in staged.steps if not s.empty]
            ends = [applied, *(s.version for s in deltas[:-1])]  # the delta route starts at the applied version
            steps = [
                StageStep([str(p) for p in s.paths], ends[i], s.version if i < len(deltas) - 1 else staged.to_version)
                for i, s in enumerate(deltas)
            ]
        engine = self.engine
        if isinstance(engine, WaitsForStaging):  # polls wait in the engine while no request is in flight
            report = await self.pools.engine(engine.stage_patches_waiting, steps, lambda: self.gate.in_flight == 0)
        else:
            report = await self.pools.engine(engine.stage_patches, steps)
        seconds = time.perf_counter() - start
        log.info(
            "staged versions %s->%s in the engine in %.3f s: %s",
            steps[0].from_version,
            steps[-1].to_version,
            seconds,
            ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(report.items())),
        )
        self.metrics.engine_stage_seconds.observe(seconds)
        return True, seconds

    def _refuse(
        self, start: int | None, end: int, route: RouteKind, exc: Exception, target: VersionManifest | None
    ) -> PlanRefusedError:
        # Record a plan that could not be staged (nothing written; :class:`~.refusals.RefusalBook`).
        error = self.refusals.record(start, end, route, exc, target, self.gate.applied)
        self.status.set_state("retrying", f"versions {start}->{end} refused")
        return error

    async def _read_counts(self) -> None:
        # In the pause: the engine's output-token counts of the marked requests (None: an engine that cannot count).
        engine = self.engine
        try:
            self._pause_counts = (
                {}
                if not self.spans.wanted()
                else await self.pools.engine(engine.output_counts)
                if isinstance(engine, CountsOutputs)
                else None
            )
        except Exception as exc:  # noqa: BLE001 - spans are lost for these requests, the commit goes on
            log.warning(
                "the engine could not count output tokens at the pause (the requests in flight get no spans): %r", exc
            )
            self._pause_counts = None

    def _fault(self, phase: str) -> None:
        # Crash tests: exit the process at once when the fault_phase setting names ``phase``.
        if self.settings.fault_phase == phase:
            log.error("stitchboard fault injection: sidecar exiting at phase %s", phase)
            os._exit(FAULT_EXIT_CODE)

    async def _apply(self, staged: FetchedPlan, prepared: bool = False) -> float:
        # Inside the pause: every step (or the engine's staged update), then verify, clear the
        # prefix cache. Returns apply seconds.
        start = time.perf_counter()
        if prepared:
            await self.pools.engine(self.engine.commit_staged, staged.to_version)
        else:
            for step in staged.steps:
                if step.kind == "snapshot":
                    await self.pools.engine(
                        self.engine.load_snapshot,
                        [str(p) for p in step.paths],
                        step.version,
                        step.manifest.checksums(),
                        step.manifest.layouts(),
                    )
                elif step.empty:
                    await self.pools.engine(self.engine.set_version, step.version, step.base_version)
                else:  # a delta, or a squash from its base
                    assert step.base_version is not None  # a delta or squash step names its base (FetchedStep)
                    await self.pools.engine(
                        self.engine.apply_patch, [str(p) for p in step.paths], step.base_version, step.version
                    )
        held = (await self.pools.engine(self.engine.state)).version
        if held != staged.to_version:
            raise EngineVersionMismatchError(
                f"after applying, the engine records version {held}, expected {staged.to_version}"
            )
        if self.gate.applied is None or not self._keep_cache:
            await self.pools.engine(self.engine.reset_prefix_cache)
            self.salter.was_reset()
        seconds = time.perf_counter() - start
        self.metrics.apply_seconds.observe(seconds)
        return seconds

    def _finish(
        self,
        staged: FetchedPlan,
        seen: float,
        pause_s: float,
        apply_s: float,
        *,
        flipped: bool,
        route: RouteKind,
        engine_stage_s: float = 0.0,
    ) -> None:
        self.claim.set_applied(staged.to_version, staged.steps[-1].manifest if staged.steps else self.claim.manifest)
        self.status.unhealthy_reason = None
        self._force_anchor = False
        self.refusals.clear()
        if not flipped:
            self.pause_by_route[route] = pause_s
            self.spans.commit(staged.to_version, self._pause_counts)
        self._pause_counts, self._keep_cache = None, False
        self.status.publish()
        total = time.perf_counter() - seen
        self.last_sync = SyncReport(
            from_version=staged.from_version, to_version=staged.to_version, bytes_fetched=staged.bytes_fetched,
            stage_seconds=staged.seconds, engine_stage_seconds=engine_stage_s,
            pause_seconds=pause_s, apply_seconds=apply_s, total_seconds=total, anchor=staged.from_version is None,
            finished_at=time.time(), route=route,
        )  # fmt: skip
        self.metrics.commits.labels("flipped" if flipped else "applied").inc()
        self.metrics.sync_seconds.observe(total)
        self.fetcher.discard()
        if flipped:
            self.status.set_state("idle", f"flipped to version {staged.to_version}")
        else:  # idle once the engine is resumed
            self.status.set_state("resuming", f"version {staged.to_version} applied")
        log.info(
            "engine at version %d (from %s, %d bytes, %.3f s)",
            staged.to_version,
            staged.from_version,
            staged.bytes_fetched,
            total,
        )

    async def _recover(self, target: int, seen: float, paused_at: float | None) -> None:
        # The engine is paused and holds no verified version: load the nearest anchor, then deltas.
        self.status.set_state("recovering", f"loading the nearest anchor, then the deltas to version {target}")
        staged_target: VersionManifest | None = None
        try:
            plan = await self.pools.io(self.client.plan, self.run_id, None, target)
            staged = await self.pools.io(self.fetcher.fetch, plan, None)
            staged_target = staged.steps[-1].manifest if staged.steps else None
            self.metrics.bytes_fetched.inc(staged.bytes_fetched)
            apply_s = await self._apply(staged)
        except Exception as exc:
            self.refusals.failed_recovery(target, staged_target, exc)  # later versions of a refused set: not tried
            reason = f"recovery from the anchor to version {target} failed: {type(exc).__name__}: {exc}"
            self.status.unhealthy_reason = reason
            self.status.set_state("unhealthy", reason)
            self._force_anchor = True
            self.metrics.recoveries.labels("failed").inc()
            self.status.publish()
            raise
        self.metrics.recoveries.labels("ok").inc()
        self._finish(
            staged,
            seen,
            0.0 if paused_at is None else time.perf_counter() - paused_at,
            apply_s,
            flipped=False,
            route="recovery",
        )
