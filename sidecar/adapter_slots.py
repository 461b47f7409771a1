"""The engine's adapter slots as one adapter run uses them (sidecar process, the adapter follower's event loop).

:class:`AdapterSlots` holds the versions the sidecar loaded (their tensors and manifests: a plan starts from
the newest one, an engine restart loads them all again), loads a version (writes its PEFT folder to the
memory-backed hand-off folder, has the engine load and verify it, removes the folder; resident only then),
makes room for the next load and unloads retired versions once no admitted request uses them. Which versions
are resident, retired and in use is :class:`~.adapter_set.ResidentAdapters`'s.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from stitchboard.proto.adapter import adapter_name
from stitchboard.proto.schema import VersionManifest

from .adapter_build import AdapterTensors, checksums_of, write_peft_folder
from .adapter_set import ResidentAdapters
from .engines.base import EngineAdapter, ServesAdapters
from .loop_status import ErrorRecord, LoopStatus
from .pools import Pools


class AdapterSlots:
    """The loaded versions of one adapter run and the loads and unloads that change them.

    Args:
        run_id: the run (adapters are named ``<run>@<N>``).
        engine: the engine adapter (a :class:`ServesAdapters`, checked at the follower's boot).
        resident: the resident set the gate and routes read.
        pools: the follower's thread pools (engine calls, file writes).
        status: the follower's status (a failed load is recorded there too).
        folder: where PEFT folders are written for the engine to load (memory-backed).
        resident_max: ``adapter_resident`` (K): versions past the newest K are retired.
        check_interval_s: how often a load waiting for a slot looks again, seconds.

    Attributes:
        held: version -> its tensors (as loaded and verified); ``manifests``: version -> its manifest.
        busy: True while a load or unload works on the engine.
        last_failed_load: the last failed load's error (None after a load succeeds).
    """

    def __init__(
        self,
        run_id: str,
        engine: EngineAdapter,
        resident: ResidentAdapters,
        pools: Pools,
        status: LoopStatus,
        folder: Path,
        resident_max: int,
        check_interval_s: float,
    ) -> None:
        self.run_id = run_id
        self.engine = engine
        self.resident = resident
        self.pools = pools
        self.status = status
        self.folder = folder
        self.resident_max = resident_max
        self.check_interval_s = check_interval_s
        self.held: dict[int, AdapterTensors] = {}
        self.manifests: dict[int, VersionManifest] = {}
        self.busy = False
        self.last_failed_load: ErrorRecord | None = None

    @property
    def newest(self) -> int | None:
        """The newest loaded version (a plan starts from it), or None."""
        return max(self.held) if self.held else None

    def forget(self, version: int) -> None:
        """Drop a version from what is held and resident (it is not loaded in the engine any more)."""
        self.resident.remove(version)
        self.held.pop(version, None)
        self.manifests.pop(version, None)

    async def load(self, version: int, tensors: AdapterTensors, manifest: VersionManifest) -> None:
        """Write version ``version``'s PEFT folder, have the engine load it under ``<run>@<N>`` and verify it
        against ``manifest``'s checksums, remove the folder; the version is resident only then. The caller marks
        :attr:`busy` around it (a boot reloads several versions under one mark).

        Raises:
            AdapterLoadError, EngineUnavailableError, OSError...: the engine refused or could not verify it, or
                the folder could not be written; nothing is resident, the error is ``last_failed_load``.
        """
        engine = self.engine
        assert isinstance(engine, ServesAdapters)  # the follower's boot refused any other engine
        name = adapter_name(self.run_id, version)
        folder = self.folder / name
        try:
            await self.pools.io(write_peft_folder, folder, tensors, manifest.adapter.config if manifest.adapter else {})
            await self.pools.engine(engine.load_adapter, name, str(folder), checksums_of(manifest))
        except Exception as exc:
            self.last_failed_load = self.status.error(exc, f"loading adapter {name}")
            raise
        finally:
            await self.pools.io(shutil.rmtree, folder, True)
        self.last_failed_load = None
        self.held[version], self.manifests[version] = tensors, manifest
        self.resident.add(version)

    async def make_room(self) -> None:
        """Wait for a free slot for the next load: retired versions no request uses are unloaded; if none, the
        oldest resident version no request uses is retired (the newest always stays); while every slot holds a
        version in use, the load waits (and ``/health`` says so)."""
        engine = self.engine
        assert isinstance(engine, ServesAdapters)
        slots = await self.pools.engine(engine.adapter_slots)
        while len(self.resident.refs) >= slots:
            if not self.resident.unused_retired():
                idle = [v for v in self.resident.versions[:-1] if self.resident.refs[v] == 0]
                if idle:
                    self.resident.retire(idle[0])
            if self.resident.unused_retired():
                await self.unload_unused()
                continue
            in_use = {adapter_name(self.run_id, v): n for v, n in sorted(self.resident.refs.items())}
            self.resident.set_waiting(
                f"every one of the engine's {slots} adapter slots holds a version admitted requests use "
                f"({in_use}): the next load waits for one to end"
            )
            await self.resident.changed(self.check_interval_s)
        self.resident.set_waiting(None)

    def retire_past_k(self) -> None:
        """Retire the versions past the newest ``resident_max``: no new request gets them (unloaded once unused)."""
        for version in self.resident.versions[: -self.resident_max]:
            self.resident.retire(version)

    async def unload_unused(self) -> None:
        """Unload every retired version no admitted request uses."""
        engine = self.engine
        if not isinstance(engine, ServesAdapters):
            return
        for version in self.resident.unused_retired():
            self.busy = True
            try:
                await self.pools.engine(engine.unload_adapter, adapter_name(self.run_id, version))
            finally:
                self.busy = False
            self.forget(version)

    def close(self) -> None:
        """Remove the folder of PEFT folders (memory-backed)."""
        shutil.rmtree(self.folder, ignore_errors=True)
