"""What the sidecar checks before it serves an adapter run (sidecar process, the app's event loop).

:func:`run_kind` tells an adapter run from a full-model run (the app then starts the adapter
follower, :mod:`.adapter_follower`, or the reconciler); :func:`check_engine_serves` is the
follower's boot check of an engine: it serves adapters (:class:`~.engines.base.ServesAdapters`;
an engine kind without the power says why in its descriptor, ``adapters_unsupported``), has at
least ``adapter_resident + 1`` adapter slots, and holds the run's base model: the
:func:`~stitchboard.proto.adapter.view_checksum` of the engine's checksums of its base's
checkpoint names is the run's ``base_checksum``.
"""

from __future__ import annotations

import asyncio

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.adapter import AdapterSpec, view_checksum

from .engines.base import EngineAdapter, ServesAdapters
from .engines.registry import lookup
from .errors import AdapterRunRefusedError, NothingPublishedError
from .loop_status import LoopStatus
from .pools import Pools
from .settings import SidecarSettings


async def run_kind(
    client: BulletinClient, settings: SidecarSettings, engine: EngineAdapter, status: LoopStatus, pools: Pools
) -> AdapterSpec | None:
    """Whether the run is an adapter run, from its latest manifest: its :class:`AdapterSpec`, or
    None for a full-model run. While the run has no version, or the bulletin does not answer, it
    waits, reporting in ``status`` what the reconciler's boot would: the engine's error and
    ``waiting_for_engine`` while the engine does not answer (whether the bulletin answers or not),
    else ``NothingPublished``; bulletin errors are recorded too and retried with backoff.

    Raises:
        asyncio.CancelledError: the app stops.
    """
    delay = settings.retry_backoff_s
    while True:
        try:
            latest = await pools.io(client.latest, settings.run, -1, 0)
            if latest is not None:
                return (await pools.io(client.manifest, settings.run, latest)).adapter
            if await _engine_answers(engine, settings, status, pools):
                status.error(NothingPublishedError(f"run {settings.run!r} has no version yet"), "boot")
                status.set_state("retrying", "nothing published")
            await pools.io(client.latest, settings.run, -1, min(settings.poll_wait_s, 1.0))
        except Exception as exc:  # noqa: BLE001 - the bulletin is down or refuses: asked again after a backoff
            status.error(exc, "reading the run's latest manifest")
            await _engine_answers(engine, settings, status, pools)  # a sidecar up first names the engine it waits for
            await asyncio.sleep(delay)
            delay = min(delay * 2, settings.max_backoff_s)


async def _engine_answers(engine: EngineAdapter, settings: SidecarSettings, status: LoopStatus, pools: Pools) -> bool:
    """Ask the engine its state, as the reconciler's boot would; while it does not answer, record its
    error and the ``waiting_for_engine`` state in ``status``. Returns whether it answered."""
    try:
        await pools.engine(engine.state, settings.engine_call_timeout_s)
    except Exception as exc:  # noqa: BLE001 - the engine is not up yet: say so, as boot would
        status.error(exc, "boot")
        status.set_state("waiting_for_engine", "the engine does not answer")
        return False
    return True


async def check_engine_serves(
    engine: EngineAdapter, settings: SidecarSettings, spec: AdapterSpec, pools: Pools
) -> None:
    """Check that ``engine`` can serve the adapter run ``spec`` (see the module docstring).

    Raises:
        AdapterRunRefusedError: it cannot, naming why (the engine kind's reason; both slot counts;
            both base checksums).
        SidecarError: an engine call failed.
    """
    if not isinstance(engine, ServesAdapters):
        kind = lookup(settings.engine)
        why = kind.adapters_unsupported or "its engine room does not implement ServesAdapters"
        raise AdapterRunRefusedError(
            f"run {settings.run!r} is an adapter run, which the {kind.name} engine cannot serve: {why}",
            engine=kind.name,
        )
    slots = await pools.engine(engine.adapter_slots)
    want = settings.adapter_resident + 1
    if slots < want:
        raise AdapterRunRefusedError(
            f"the engine holds {slots} adapters at once, but adapter_resident={settings.adapter_resident} "
            f"needs {want} (K resident + 1 loading): start the engine with at least {want} adapter slots "
            f"(vLLM --max-loras {want}) or lower STITCH_SIDECAR_ADAPTER_RESIDENT",
            adapter_slots=slots,
            needed_slots=want,
        )
    names = await pools.engine(engine.base_names)
    held = await pools.engine(engine.checksums, names)
    served = view_checksum(held)
    if served != spec.base_checksum:
        raise AdapterRunRefusedError(
            f"run {settings.run!r} is an adapter for base model {spec.base_model!r} with base checksum "
            f"{spec.base_checksum}, but the engine's base view ({len(names)} tensors) has checksum "
            f"{served}: serve the run beside its own base model",
            base_model=spec.base_model,
            run_base_checksum=spec.base_checksum,
            engine_base_checksum=served,
        )
