"""The logic of stitchboard's verl checkpoint engine, without verl: publish a step, wait for the fleet to serve it.

Runs in verl's processes: :class:`StepPublisher` in every actor (training) worker, where verl's checkpoint engine
sends the weights; :func:`wait_for_step` in every rollout-side checkpoint-engine worker, where verl would receive
them. The backend class verl loads (:mod:`stitchboard.trainer_client.verl`) is a thin adapter over this module, so
the rules here are tested without verl installed (tests/trainer_client/test_verl_sync.py).

* A step is published once: ``step = global_steps``, a delta from the publisher's kept view. The same step again
  (verl's manager retried, or the trainer restarted from the step's checkpoint) with the same bits is a no-op
  answering the step's version; with other bits it is refused with :class:`StepConflictError`.
* A receiver waits until the bulletin has a version of that step, then until the fleet view shows
  ``min_replicas`` sidecars (every live one by default) that applied and verified it or a later one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.steps import recorded_step
from stitchboard.proto.env import env_setting
from stitchboard.proto.fleet import FleetCount
from stitchboard.proto.schema import Encoding, VersionInfo

from .errors import StepConflictError, StepTimeoutError
from .fleet import POLL_S, wait_for_fleet
from .publisher import Publisher

log = logging.getLogger("stitchboard.trainer_client")


class VerlOptions(BaseModel):
    """The backend's options: verl's ``rollout.checkpoint_engine.engine_kwargs.stitchboard`` (each key optional).

    The bulletin, token and run default to the ``STITCH_CLIENT_*`` environment variables of the worker processes
    (``STITCH_CLIENT_BULLETIN``, ``STITCH_CLIENT_TOKEN``, ``STITCH_CLIENT_RUN``); a key given here wins.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bulletin: str | None = Field(
        default_factory=lambda: env_setting("STITCH_CLIENT_BULLETIN"),
        description="bulletin base URL, e.g. http://bulletin:8700 (default: STITCH_CLIENT_BULLETIN)",
    )
    token: str | None = Field(
        default_factory=lambda: env_setting("STITCH_CLIENT_TOKEN"),
        description="bearer token: the `publish` scope on the actor side, `read` on the rollout side "
        "(default: STITCH_CLIENT_TOKEN; unset: an open bulletin)",
    )
    run: str | None = Field(
        default_factory=lambda: env_setting("STITCH_CLIENT_RUN"), description="run id (default: STITCH_CLIENT_RUN)"
    )
    min_replicas: int | None = Field(
        default=None, ge=1, description="sidecars that must serve a step before verl resumes generation (None: all)"
    )
    timeout_s: float = Field(default=600.0, gt=0, description="longest wait of a receiver for its step, seconds")
    encoding: Encoding = Field(default="cond", description="patch encoding of the run's versions")
    assets: str | None = Field(
        default=None, description="model folder whose config/tokenizer go with version 0 when the run is empty"
    )
    workdir: str | None = Field(default=None, description="folder of the publisher's temporary snapshot shards")
    request_timeout_s: float = Field(default=60.0, gt=0, description="per-request timeout of the bulletin client, s")

    def target(self) -> tuple[str, str]:
        """(bulletin URL, run id).

        Raises:
            ValueError: either is unset, naming the key and the environment variable that set it.
        """
        if not self.bulletin or not self.run:
            missing = [k for k in ("bulletin", "run") if not getattr(self, k)]
            raise ValueError(
                f"stitchboard checkpoint engine: no {' or '.join(missing)}: set engine_kwargs.stitchboard."
                f"{missing[0]} or STITCH_CLIENT_{missing[0].upper()} on every worker"
            )
        return self.bulletin, self.run


def this_rank() -> int:
    """This process's rank among the training workers: torch.distributed's when initialized, else ``RANK`` (0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class StepPublished:
    """What one :meth:`StepPublisher.publish` did on rank 0.

    Attributes:
        step, version: the training step and its version.
        new: False when the step already had that version with the same bits (a retry: nothing written).
        encoded_bytes: bytes of the new version's delta (0 for a no-op).
    """

    step: int
    version: int
    new: bool
    encoded_bytes: int


class StepPublisher:
    """Publishes one version per training step from a stream of ``(name, tensor)`` pairs (verl's ``send_weights``).

    Args:
        options: where and how to publish (:class:`VerlOptions`).
        committer: whether this process commits (verl's ``is_master``: rank 0); the others consume the stream only.

    The publisher is made on first use and kept (its view is the base of the next delta). Memory on rank 0: the
    kept view (2 bytes per bf16 element) plus one streamed tensor (or up to 32 of at most 4 MiB, waiting for the
    worker threads that diff them) and the changed positions and bits, each tensor cast as it arrives
    (:meth:`Publisher.stream_view`; the first step, with no kept view yet, holds the new view whole); on other
    ranks one streamed tensor.
    """

    def __init__(self, options: VerlOptions, committer: bool) -> None:
        self.options = options
        self.committer = committer
        self._publisher: Publisher | None = None

    @property
    def publisher(self) -> Publisher:
        """The rank-0 publisher (made on first use; resumes the run after its last version)."""
        if self._publisher is None:
            url, run = self.options.target()
            self._publisher = Publisher(
                url,
                run,
                token=self.options.token,
                encoding=self.options.encoding,
                assets=self.options.assets,
                workdir=self.options.workdir,
                timeout_s=self.options.request_timeout_s,
            )
        return self._publisher

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], step: int) -> StepPublished | None:
        """Consume the stream; on the committer, publish it as the version of ``step``.

        Returns:
            On the committer, what was published; elsewhere None.

        Raises:
            StepConflictError: ``step`` already has a version with other bits (naming step and version).
            BulletinError, PublishError, ServedViewError: as :meth:`Publisher.publish_view`.
        """
        if not self.committer:
            for _ in named_tensors:  # every rank takes part in the stream's gathers
                pass
            return None
        publisher = self.publisher
        view = publisher.stream_view(named_tensors)
        client, run = publisher.client, publisher.run
        found = client.version_for_step(run, step)
        if found is not None:
            manifest = client.manifest(run, found.version)
            if recorded_step(manifest) == step:
                sums = view.checksums
                if manifest.checksums() != sums or manifest.served != publisher.served.name:
                    differ = sorted(
                        n for n in set(sums) | set(manifest.checksums()) if sums.get(n) != manifest.checksums().get(n)
                    )
                    raise StepConflictError(
                        f"run {run!r}: step {step} is already version {found.version} with other bits "
                        f"({len(differ)} tensors differ, e.g. {differ[:3]}); a restarted trainer must resume from "
                        f"the checkpoint of step {step} or later, or publish to a new run id",
                        run=run,
                        step=step,
                        version=found.version,
                        tensors=differ[:20],
                    )
                log.info("run %s: step %d is version %d with the same bits; nothing new", run, step, found.version)
                return StepPublished(step, found.version, False, 0)
        result = publisher.publish_view(view, step=step)
        return StepPublished(step, result.version, True, result.encoded_bytes)

    def close(self) -> None:
        """Close the publisher (its bulletin client and worker thread), if one was made."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


def _version_of_step(client: BulletinClient, run: str, step: int, deadline: float) -> VersionInfo:
    """Wait for the first version of ``run`` at ``step`` or later (long-polling for new commits)."""
    known = -1
    while True:
        found = client.version_for_step(run, step)
        if found is not None:
            return found
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            latest = client.latest(run)
            raise StepTimeoutError(
                f"run {run!r}: no version of step {step} was published within the wait (the latest version is "
                f"{latest}); did the trainer's send_weights fail? Raise engine_kwargs.stitchboard.timeout_s if it "
                "is only slow",
                run=run,
                step=step,
                latest_version=latest,
            )
        info = client.latest_info(run, after=known, wait_s=min(remaining, POLL_S))
        known = info.version if info is not None else known


def wait_for_step(
    client: BulletinClient, run: str, step: int, *, min_replicas: int | None = None, timeout_s: float = 600.0
) -> FleetCount:
    """Block until the version of training ``step`` is served by enough sidecars.

    Args:
        client: a bulletin client (a token with ``read``).
        run: the run id.
        step: verl's ``global_steps``.
        min_replicas: live sidecars that must have applied (and verified) the step's version or a later one;
            None: every live one.
        timeout_s: the whole wait (the version's commit, then the fleet), seconds.

    Returns:
        The fleet's count at the step's version.

    Raises:
        StepTimeoutError: no version of ``step`` (or later) committed within ``timeout_s``.
        FleetTimeoutError: the version committed but too few sidecars applied it in time; names the version and
            the replicas seen (state and last error).
        BulletinError: the bulletin failed or refused the query.
    """
    deadline = time.monotonic() + timeout_s
    version = _version_of_step(client, run, step, deadline).version
    remaining = max(0.0, deadline - time.monotonic())
    return wait_for_fleet(
        client,
        run,
        version,
        min_replicas=min_replicas,
        timeout_s=remaining,
        what=f"waiting for step {step} (version {version}) of run {run!r} on "
        f"{min_replicas if min_replicas is not None else 'every live'} sidecar(s)",
    )
