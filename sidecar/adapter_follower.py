"""The adapter follower: serves an adapter run's versions beside a base model that keeps serving (sidecar process).

One asyncio task in the sidecar's event loop, in place of the :class:`~.reconciler.Reconciler`
when the run is an adapter run (its manifests carry ``adapter``, :class:`~stitchboard.proto.adapter.AdapterSpec`;
:func:`~.adapter_checks.run_kind`). Blocking calls run in its own thread pools (:mod:`.pools`). The
engine is never paused: adapters are loaded and unloaded while the base model and the other adapters serve.

1. **boot** (every new engine instance): take the engine's lease; the engine must serve adapters
   with at least ``adapter_resident + 1`` slots and hold the run's base model
   (:func:`~.adapter_checks.check_engine_serves`), else the run is refused on ``/health`` with why.
   The versions the sidecar holds in memory are loaded again and verified (an engine restart)
   before any adapter request is admitted.
2. **follow**: long-poll the bulletin for a version newer than the newest resident one. A sidecar with
   nothing resident (a fresh start) or more than one version behind loads the newest ``adapter_resident``
   versions in order, oldest first (one whose route is gone is skipped), so the last K are resident.
3. **fetch and rebuild** (:mod:`.fetch`, :mod:`.adapter_build`): the plan's files are downloaded
   and sha256-checked, the version's tensors rebuilt in the sidecar's memory from the newest
   resident version's (or the plan's snapshot) with the codec's own decode and apply on raw bits,
   and checked against the manifest's checksums.
4. **load** (:mod:`.adapter_slots`): the PEFT folder is written to the memory-backed hand-off folder, loaded by the
   engine's own LoRA loader under ``<run>@<N>`` and verified against the manifest's checksums
   (:meth:`~.engines.base.ServesAdapters.load_adapter`), then the folder is removed. Only then is
   the version resident (:class:`~.adapter_set.ResidentAdapters`). A failed load leaves the
   previous versions serving and is reported (``/health``'s ``adapters.last_failed_load``, the
   status's ``last_error``, the fleet report); it is tried again with backoff.
5. **retire**: versions past the newest ``adapter_resident`` get no new request and are unloaded
   once no admitted request uses them. When every slot is held (the engine's slots are full of
   versions in use), the next load waits and ``/health`` says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import NotFoundError
from stitchboard.proto.adapter import AdapterSpec, adapter_name
from stitchboard.proto.sidecar_wire import Refusal, SidecarState, SyncReport

from .adapter_build import rebuild
from .adapter_checks import check_engine_serves
from .adapter_set import ResidentAdapters
from .adapter_slots import AdapterSlots
from .engines.base import EngineAdapter, ServesAdapters
from .errors import AdapterRunRefusedError, EngineChangedError, LeaseNotHeldError, StagingError
from .fetch import Fetcher
from .gate import Gate
from .lease_keeper import LeaseKeeper
from .loop_status import ErrorRecord, LoopStatus
from .metrics import SidecarMetrics
from .pools import Pools
from .quarantine import SquashQuarantine
from .settings import SidecarSettings

log = logging.getLogger("stitchboard.sidecar")


class AdapterFollower:
    """Follows one adapter run and keeps its newest versions resident in one engine.

    Args:
        settings: sidecar settings (``adapter_resident``, waits, backoff, lease).
        client: bulletin client.
        engine: the engine adapter (must implement :class:`ServesAdapters`, checked at boot).
        gate: the app's gate (its ``applied`` is the newest resident version).
        metrics: where figures go.
        fetcher: fetches plans into the hand-off folder.
        spec: the run's adapter, from its latest manifest.

    The attributes ``/health``, the status route and the fleet report read are the reconciler's
    (``state``, ``last_error``, ``unhealthy_reason``, ``refused``, ``lease``, ``engine_busy``,
    ``quarantine``, ``last_sync``, ``pause_by_route``, :meth:`check_engine`), plus
    :attr:`resident` and :meth:`health_body`.
    """

    def __init__(
        self,
        settings: SidecarSettings,
        client: BulletinClient,
        engine: EngineAdapter,
        gate: Gate,
        metrics: SidecarMetrics,
        fetcher: Fetcher,
        spec: AdapterSpec,
    ) -> None:
        self.settings = settings
        self.run_id = settings.run
        self.client = client
        self.engine = engine
        self.gate = gate
        self.metrics = metrics
        self.fetcher = fetcher
        self.spec = spec
        self.pools = Pools()
        self.status = LoopStatus(gate, metrics)
        self.lease = LeaseKeeper(settings, engine, metrics)
        self.resident = ResidentAdapters(settings.run, gate)
        self.quarantine = SquashQuarantine(metrics.squash_quarantines)  # plans of adapter runs take squashes too
        self.refused: Refusal | None = None
        self.last_sync: SyncReport | None = None
        self.pause_by_route: dict[str, float] = {}  # adapters never pause the engine
        self.instance: str | None = None  # the engine instance the resident versions serve in (None: boot)
        self._loaded_into: str | None = None  # the instance they were last loaded into and verified in
        self._floor = 0  # versions below it have no route left (gc): not loaded
        self.slots = AdapterSlots(
            settings.run, engine, self.resident, self.pools, self.status,
            Path(settings.handoff_dir) / f"sidecar-{settings.port}" / "adapters",
            settings.adapter_resident, settings.engine_check_interval_s,
        )  # fmt: skip

    # -- what /health, the status route and the fleet report read ----------------------------

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
        """Why the sidecar cannot serve the run (a refused run), else None."""
        return self.status.unhealthy_reason

    @property
    def engine_busy(self) -> bool:
        """True while a load or unload works on the engine."""
        return self.slots.busy

    async def check_engine(self) -> str | None:
        """None while the engine is the instance the resident versions were loaded into; else why not
        (the follower loads them again before admitting adapter requests)."""
        if self.instance is None:
            return None
        try:
            state = await self.pools.engine(self.engine.state, self.settings.engine_call_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure: the engine cannot be vouched for
            return f"the engine does not answer its state check: {type(exc).__name__}: {exc}"
        if state.instance != self.instance:
            self._lost_engine(f"the engine restarted (instance {self.instance} -> {state.instance})")
            return "the engine restarted: its adapters are being loaded again"
        return None

    def health_body(self) -> dict[str, Any]:
        """``/health``'s ``adapters``: the resident set (:meth:`ResidentAdapters.body`), the run's
        ``base_model``, ``slots`` and the ``last_failed_load`` (None: none since the last load)."""
        failed = self.slots.last_failed_load
        return {
            **self.resident.body(),
            "base_model": self.spec.base_model,
            "resident_max": self.settings.adapter_resident,
            "last_failed_load": None if failed is None else failed.body(),
        }

    def close(self) -> None:
        """Release the engine's lease and the worker threads."""
        self.lease.release()
        self.lease.close()
        self.pools.close()
        self.slots.close()

    # -- main loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Boot, then follow the bulletin until cancelled; boot again on a new engine instance.
        Errors are recorded and retried with backoff."""
        renew = asyncio.create_task(self._keep_lease(), name="stitch-adapter-lease")
        try:
            while True:
                await self._until_ok(
                    self.boot if self.instance is None else self.step, "boot" if self.instance is None else "sync"
                )
        finally:
            renew.cancel()

    async def _until_ok(self, fn: Callable[[], Awaitable[None]], during: str) -> None:
        delay = self.settings.retry_backoff_s
        while True:
            try:
                await fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is recorded, then retried after a backoff
                self.status.error(exc, during)
                if isinstance(exc, LeaseNotHeldError):
                    self.lease.lost(exc)
                    self._lost_engine(f"the engine's lease is lost: {exc}")
                if isinstance(exc, EngineChangedError):
                    return
                if self.state != "unhealthy":
                    self.status.set_state("retrying", f"{during} failed")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.max_backoff_s)

    async def _keep_lease(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_renew_interval_s)
            if not self.lease.held:
                continue
            try:
                reason = await self.lease.renew(lambda: self.slots.busy)
            except Exception:
                log.exception("renewing the engine's lease failed")
                continue
            if reason is not None:
                self._lost_engine(f"the engine's lease is lost: {reason}")

    def _lost_engine(self, why: str) -> None:
        # The engine restarted (its adapters are gone) or is another sidecar's: admit no adapter
        # request until boot has loaded and verified the resident versions again.
        if self.instance is not None:
            log.warning("%s: adapter requests are held until the resident versions are loaded again", why)
            self.status.note("EngineChanged", why)
        self.instance = None
        self.resident.set_ready(False)

    # -- boot --------------------------------------------------------------------------------

    async def boot(self) -> None:
        """Take the lease; check the engine serves this run's adapters over this run's base; load
        the versions held in memory again (or the newest published one).

        Raises:
            AdapterRunRefusedError: the engine cannot serve the run (reported unhealthy; retried).
            SidecarError, BulletinError, PatchError: on failure (retried).
        """
        self.status.set_state("waiting_for_engine", "boot: taking the lease")
        while True:
            try:
                await self.lease.take()
                break
            except LeaseNotHeldError:
                await asyncio.sleep(self.settings.lease_renew_interval_s)
        self.status.set_state("booting", "checking the engine's adapter slots and base model")
        engine = self.engine
        state = await self.pools.engine(engine.state, self.settings.engine_call_timeout_s)
        same = state.instance == self._loaded_into  # a lapsed lease on the engine that verified them: kept
        try:
            if not same:
                await check_engine_serves(engine, self.settings, self.spec, self.pools)
        except AdapterRunRefusedError as exc:
            self.status.unhealthy_reason = exc.message
            self.status.set_state("unhealthy", "adapter run refused")
            self.status.publish()
            raise
        assert isinstance(engine, ServesAdapters)  # check_engine_serves refused it otherwise
        self.status.unhealthy_reason = None
        loaded = set(await self.pools.engine(engine.loaded_adapters))
        slots = self.slots
        for version in sorted(self.resident.retired) if not same else []:  # a new engine: not loaded again
            slots.forget(version)
        mine = {v: adapter_name(self.run_id, v) for v in slots.held}
        slots.busy = True
        try:
            for version, name in sorted(mine.items()):  # an engine restart lost them: load and verify again
                if same and name in loaded:  # loaded, verified and pinned in this very instance
                    continue
                if name in loaded:  # loaded by another sidecar: unload, then load what this one verified
                    await self.pools.engine(engine.unload_adapter, name)
                await slots.load(version, slots.held[version], slots.manifests[version])
            for name in sorted(loaded - set(mine.values())):  # this run's names of an earlier sidecar: not verified
                if name.partition("@")[0] == self.run_id:
                    await self.pools.engine(engine.unload_adapter, name)
        finally:
            slots.busy = False
        self.instance = self._loaded_into = state.instance
        self.resident.set_ready(True)
        self.status.set_state("idle", "booted")
        self.status.publish()

    # -- follow ------------------------------------------------------------------------------

    async def step(self) -> None:
        """Unload retired versions no request uses; then load the next version if one is newer
        than the newest resident, else long-poll the bulletin for one."""
        if await self.check_engine() is not None:
            return
        await self.slots.unload_unused()
        newest = self.slots.newest
        target = self.gate.target
        if target is None or (newest is not None and target <= newest):
            wait_s = min(self.settings.poll_wait_s, self.settings.engine_check_interval_s)
            found = await self.pools.io(self.client.latest, self.run_id, -1 if newest is None else newest, wait_s)
            if found is not None and (target is None or found > target):
                self.gate.set_target(found)
                self.status.publish()
            return
        version = max(self._next_version(newest, target), self._floor)
        try:
            await self.sync(version)
        except NotFoundError:
            if version >= target:
                raise
            # an older one of the newest K has no route left (gc): the next one is loaded instead
            log.warning("adapter version %d of run %r has no route left: loading the next one", version, self.run_id)
            self._floor = version + 1

    def _next_version(self, newest: int | None, target: int) -> int:
        """The next version to load on the way to ``target``: the oldest of the newest ``adapter_resident``
        versions up to ``target`` that is newer than the newest resident one, so that a booting (nothing
        resident) or lagging sidecar loads the last K versions in order and ends with them resident."""
        oldest_kept = max(0, target - self.settings.adapter_resident + 1)
        return oldest_kept if newest is None else max(newest + 1, oldest_kept)

    async def sync(self, target: int) -> None:
        """Fetch, rebuild, check and load version ``target`` (the newest resident stays the plan's start).

        Raises:
            StagingError: the version is not of this run's adapter (another base), or its tensors
                differ from its manifest; AdapterLoadError: the engine refused or could not verify
                it (the previous versions keep serving); BulletinError, PatchError.
        """
        seen = time.perf_counter()
        self.status.set_state("staging", f"fetching adapter version {target}")
        slots = self.slots
        start = slots.newest
        plan = await self.pools.io(self.client.plan, self.run_id, start, target)
        fetched = await self.pools.io(
            self.fetcher.fetch, plan, slots.manifests.get(start) if start is not None else None
        )
        try:
            manifest = fetched.steps[-1].manifest if fetched.steps else None
            if (
                manifest is None
                or manifest.adapter is None
                or manifest.adapter.base_checksum != self.spec.base_checksum
            ):
                raise StagingError(
                    f"version {target} of run {self.run_id!r} is not an adapter over the base this sidecar serves "
                    f"(base checksum {self.spec.base_checksum})"
                )
            tensors = await self.pools.io(rebuild, fetched, slots.held)
        finally:
            self.fetcher.discard()
        await slots.make_room()
        slots.busy = True
        try:
            await slots.load(target, tensors, manifest)
        finally:
            slots.busy = False
        slots.retire_past_k()
        await slots.unload_unused()
        total = time.perf_counter() - seen
        self.last_sync = SyncReport(
            from_version=start, to_version=target, bytes_fetched=fetched.bytes_fetched, stage_seconds=fetched.seconds,
            engine_stage_seconds=0.0, pause_seconds=0.0, apply_seconds=total - fetched.seconds, total_seconds=total,
            anchor=start is None, finished_at=time.time(), route="flip",
        )  # fmt: skip
        self.metrics.bytes_fetched.inc(fetched.bytes_fetched)
        self.metrics.sync_seconds.observe(total)
        self.status.set_state("idle", f"adapter version {target} resident")
        self.status.publish()
        log.info(
            "adapter %s resident (%d bytes fetched, %.3f s)",
            adapter_name(self.run_id, target),
            fetched.bytes_fetched,
            total,
        )
