"""stitchboard as a verl checkpoint engine: the module a verl user names in ``custom_backend_module``.

Runs in verl's Ray workers (verl 0.9.1, in its own environment: ``make venv-verl``): verl imports this module on
every actor and rollout-side checkpoint-engine worker before it builds the backend, and the import registers
:class:`StitchboardCheckpointEngine` as the backend ``stitchboard``::

    actor_rollout_ref.rollout.checkpoint_engine.backend=stitchboard
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=stitchboard.trainer_client.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.stitchboard.min_replicas=2

verl's ``CheckpointEngineManager.update_weights(global_steps)`` aborts the replicas' requests, calls ``prepare``,
``build_topology``, ``init_process_group`` on every worker, then ``send_weights`` on every actor worker and
``receive_weights`` on every rollout-side worker at the same time, then ``finalize``, and resumes generation.
Here ``send_weights`` publishes the streamed weights as the version of ``global_steps`` (rank 0 commits; the
others only consume the stream) and ``receive_weights`` returns once the stitchboard sidecars serve that version
(they pull it themselves: no tensor goes through verl). The rules are in :mod:`.verl_sync`; the supported mode
and what is not supported are in docs/integrations/verl.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry  # type: ignore[import-not-found]

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.fleet import FleetCount

from .verl_sync import StepPublisher, VerlOptions, this_rank, wait_for_step

#: The backend name verl's ``rollout.checkpoint_engine.backend`` selects.
BACKEND = "stitchboard"


@CheckpointEngineRegistry.register(BACKEND)
class StitchboardCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """verl's checkpoint engine ``stitchboard``: weights go through a stitchboard bulletin, not a process group.

    verl builds one per worker: ``CheckpointEngineRegistry.new("stitchboard", bucket_size=..., is_master=...,
    **engine_kwargs["stitchboard"])``; actor workers pass ``is_master`` (rank 0), rollout-side workers do not.

    Args:
        bucket_size: verl's ``update_weights_bucket_megabytes`` in bytes; unused (nothing is bucketed).
        is_master: on an actor worker, whether it commits (rank 0); None on a rollout-side worker.
        **engine_kwargs: :class:`~.verl_sync.VerlOptions` (``bulletin``, ``token``, ``run``, ``min_replicas``,
            ``timeout_s``, ``encoding``, ``assets``, ``workdir``, ``request_timeout_s``).

    Raises:
        pydantic.ValidationError: an unknown key or a bad value in ``engine_kwargs.stitchboard``.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool | None = None, **engine_kwargs: Any) -> None:
        self.options = VerlOptions(**engine_kwargs)
        self.bucket_size = bucket_size
        committer = is_master if is_master is not None else this_rank() == 0
        self.sender = StepPublisher(self.options, committer)
        #: Per-step results on this worker: the last publish (actor) or fleet count (rollout side).
        self.last: dict[str, Any] = {}

    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate or connect: the bulletin is reached over HTTP. Returns no metadata."""
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No process group joins the workers: empty keyword lists for ``init_process_group`` on both sides."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """Nothing to join (see :meth:`build_topology`)."""

    def finalize(self) -> None:
        """Nothing to free: the publisher and its kept view stay for the next step's delta."""

    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> dict[str, float]:
        """Publish the streamed ``(name, tensor)`` pairs as the version of ``global_steps``; every actor rank calls
        it with the same stream (its gathers are collective), rank 0 commits once.

        Returns:
            verl's per-sync metrics: ``stitchboard/version``, ``stitchboard/encoded_bytes`` (rank 0; else empty).

        Raises:
            ValueError: ``global_steps`` is None (a version records its step).
            StepConflictError: the step already has a version with other bits.
            BulletinError, PublishError: the publish failed; nothing was committed.
        """
        if global_steps is None:
            raise ValueError("stitchboard checkpoint engine: update_weights needs global_steps (a version's step)")
        published = await asyncio.to_thread(self.sender.publish, weights, global_steps)
        if published is None:
            return {}
        self.last = {"step": published.step, "version": published.version, "new": published.new}
        return {"stitchboard/version": float(published.version), "stitchboard/encoded_bytes": published.encoded_bytes}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Wait until ``min_replicas`` sidecars (every live one by default) applied and verified the version of
        ``global_steps``; yields nothing, since the sidecars pull the version themselves.

        Raises:
            ValueError: ``global_steps`` is None.
            StepTimeoutError: no version of the step within ``timeout_s``.
            FleetTimeoutError: too few sidecars applied it within ``timeout_s``; names the version and the replicas.
        """
        if global_steps is None:
            raise ValueError("stitchboard checkpoint engine: update_weights needs global_steps (a version's step)")
        count = await asyncio.to_thread(self._wait, global_steps)
        self.last = {"step": global_steps, "version": count.version, "replicas": count.at_or_above}
        nothing: tuple[tuple[str, torch.Tensor], ...] = ()  # verl's server adapter gets no tensor to load
        for pair in nothing:
            yield pair

    def _wait(self, step: int) -> FleetCount:
        url, run = self.options.target()
        with BulletinClient(url, self.options.token, timeout_s=self.options.request_timeout_s) as client:
            return wait_for_step(
                client, run, step, min_replicas=self.options.min_replicas, timeout_s=self.options.timeout_s
            )
