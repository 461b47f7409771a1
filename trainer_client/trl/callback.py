"""``PublishCallback``: a TRL/transformers ``TrainerCallback`` that publishes the policy after each optimizer step.

Runs in the trainer process (every rank of it). Version 0, the anchor of the starting weights, is
published at ``on_train_begin`` unless the run already has versions (the user published it, or a
resumed run; a trainer starting behind the run's last step is refused with ``ResumeError``); then one
version per optimizer step at ``on_step_end``, recording TRL's
``state.global_step`` as the version's ``step``. The view is taken on the training thread (a bf16
copy, the only part that blocks the step) and published in the background by the publisher's
bounded worker (:meth:`Publisher.publish_async`), so the next step runs while it uploads.

Ranks: by default rank 0 publishes. Under FSDP every rank then joins the gather of the full state
dict (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), which only rank 0 keeps;
under DDP each rank holds the whole model and no collective is needed. With ``shard_local=True``
(FSDP2 or tensor-parallel DTensor models) every rank makes a
:class:`~stitchboard.trainer_client.shard_local.ShardLocalPublisher` and publishes the blocks it
holds: no full tensor is gathered anywhere, the ranks exchange metadata and encoded changes only.
Then every decision that starts a collective is taken alike on every rank: a step end first waits
for the previous publish (so at most one publish is in flight, and every rank sees its outcome),
and whether to retry a failed publish is rank 0's call, broadcast (:meth:`ShardedPublisher.agree`).
A rollout asking :meth:`PublishCallback.version_for_step` then only waits; a failed publish is
published again at the next step end.

Faults (the bulletin or the network down), ``on_fault``:

* ``block`` (default): a failed publish is found at the next step end (or when a rollout asks for
  its version); the trainer then publishes its current weights again, retrying until they commit
  or ``block_timeout_s`` runs out (or the asking rollout's wait); then the step is skipped with a log
  line. Never raises.
* ``skip``: each failed publish is logged and skipped; the next step's version carries its changes
  (a delta from the last committed version); the last step's, at ``on_train_end``, is tried once
  more. Never raises.

``skipped_steps``: the steps without a version of their own (one redone, or whose commit landed
although its answer was lost, is taken off).
* ``raise``: the failure is raised into the training loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from stitchboard.bulletin.errors import UnavailableError
from stitchboard.proto.errors import StitchError

from ..errors import ResumeError
from ..publish_result import PublishResult
from ..publisher import Publisher
from ..publisher_core import PublisherCore
from ..sharded import ShardedPublisher

log = logging.getLogger("stitchboard.trainer_client.trl")

FaultPolicy = Literal["block", "skip", "raise"]
FAULT_POLICIES: tuple[str, ...] = ("block", "skip", "raise")


@dataclass
class Published:
    """One publish the callback started: the training ``step``, its future (None once settled), the
    committed ``version`` and its :class:`PublishResult` (None while in flight, or when it failed:
    ``failed`` True)."""

    step: int
    future: Future[PublishResult] | None
    version: int | None = None
    failed: bool = False
    result: PublishResult | None = None


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds FSDP (1 or 2) modules, whose full weights only a collective gathers."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel | FSDPModule) for m in model.modules())


def full_state_dict(model: torch.nn.Module) -> Mapping[str, torch.Tensor] | torch.nn.Module:
    """What to publish for ``model``: the model itself, or under FSDP its gathered full state dict
    (bf16/fp32 tensors as trained, on the host), which every rank must join and only rank 0 receives
    (an empty dict elsewhere)."""
    if not is_sharded(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}


def _committed(p: Published) -> int | None:
    """The version ``p`` committed, read without settling it (None: failed or in flight)."""
    future = p.future
    if future is None:
        return p.version
    if not future.done() or future.exception() is not None:
        return None
    return future.result().version


class PublishCallback(TrainerCallback):
    """Publishes the served view of the policy after every optimizer step (a ``TrainerCallback``).

    Args:
        publisher: a :class:`~stitchboard.trainer_client.publisher.Publisher`, or a function making one,
            called on rank 0 only (the other ranks never contact the bulletin).
        on_fault: ``block`` (default), ``skip`` or ``raise`` (see the module docstring).
        block_timeout_s: under ``block``, how long to retry a failed publish, seconds (default 300).
        retry_interval_s: pause between those retries, seconds (default 2).
        background: publish in the background (default); False: each publish commits before the
            step ends.
        shard_local: every rank calls ``publisher`` (a factory) and publishes its own blocks with the
            :class:`~stitchboard.trainer_client.shard_local.ShardLocalPublisher` it returns (see the module
            docstring); default False: rank 0 publishes the gathered full state dict.

    Raises:
        ValueError: an unknown ``on_fault``, or a timeout < 0; ``shard_local`` with a publisher instance
            instead of a factory, or a factory that returns no ``ShardedPublisher`` (at the first publish).
        ResumeError (``on_train_begin``): the trainer starts at a step behind the run's last version.

    The callback is the rollout's source of versions in the same process: :meth:`version_for_step`.
    """

    def __init__(
        self,
        publisher: Publisher | Callable[[], PublisherCore],
        *,
        on_fault: FaultPolicy = "block",
        block_timeout_s: float = 300.0,
        retry_interval_s: float = 2.0,
        background: bool = True,
        shard_local: bool = False,
    ) -> None:
        if on_fault not in FAULT_POLICIES:
            raise ValueError(f"on_fault must be one of {FAULT_POLICIES}, got {on_fault!r}")
        if shard_local and isinstance(publisher, Publisher):
            raise ValueError("shard_local=True needs a factory every rank calls (lambda: ShardLocalPublisher(...))")
        if block_timeout_s < 0 or retry_interval_s < 0:
            raise ValueError(f"timeouts must be >= 0 s, got {block_timeout_s} and {retry_interval_s}")
        self._make = publisher if callable(publisher) and not isinstance(publisher, Publisher) else None
        self.publisher: PublisherCore | None = publisher if isinstance(publisher, Publisher) else None
        self.on_fault: FaultPolicy = on_fault
        self.block_timeout_s = block_timeout_s
        self.retry_interval_s = retry_interval_s
        self.background = background
        self.shard_local = shard_local
        self.published: list[Published] = []
        self.skipped_steps: list[int] = []
        self._lock = threading.Lock()
        self._model: torch.nn.Module | None = None  # the model of the last step end (unsharded), and its step
        self._step = 0

    # -- TrainerCallback hooks ----------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Publish version 0 (the anchor of the starting weights), unless the run already has versions."""
        found = self._rank_zero_view(state, kwargs.get("model"))
        if found is None:
            return
        publisher, what, _model = found
        if publisher.last_version is not None:
            self._check_resume(publisher, state.global_step)
            log.info(
                "run %s: resuming after version %d at step %d: no anchor published",
                publisher.run,
                publisher.last_version,
                state.global_step,
            )
            return
        self._publish_blocking(publisher, what, state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Publish the weights after optimizer step ``state.global_step`` (rank 0; every rank joins an FSDP gather)."""
        found = self._rank_zero_view(state, kwargs.get("model"))
        if found is None:
            return
        publisher, what, model = found
        self._model = None if self.shard_local or is_sharded(model) else model  # republished by version_for_step
        self._step = state.global_step
        if self._settle(wait=self.shard_local):
            self._publish_blocking(publisher, what, state.global_step)  # block: the bulletin was down
        elif self.background:
            self._publish_async(publisher, what, state.global_step)
        else:
            self._publish_blocking(publisher, what, state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Wait for the publishes in flight; publish the final weights again if one failed under ``block``, or
        under ``skip`` if the last step's failed (no next version carries it): once, logged if it fails."""
        if not (state.is_world_process_zero or self.shard_local) or self.publisher is None:
            return
        model = kwargs.get("model")
        again = self._settle(wait=True) or (self.on_fault == "skip" and state.global_step in self.skipped_steps)
        if again and model is not None and self.shard_local:  # every rank: its own blocks
            self._publish_blocking(self.publisher, model, state.global_step)
        elif again and model is not None and not is_sharded(model):  # no collective on rank 0 alone
            self._publish_blocking(self.publisher, full_state_dict(model), state.global_step)

    # -- versions for the rollout ---------------------------------------------------------------

    def version_for_step(self, step: int, timeout_s: float) -> int | None:
        """The first version this callback published at training step ``step`` or later, once committed.

        Waits up to ``timeout_s`` seconds for the publishes in flight. Under ``block``, a failed one is
        published again first (the current weights, blocking, as at the next step end). Returns None when
        none of this callback's publishes is at ``step`` or later (ask the bulletin's step lookup then),
        or each of them failed or is still in flight at the deadline.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            pending = [p.future for p in self.published if p.step >= step and p.future is not None]
        for future in pending:
            try:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return None
        if self.shard_local:  # no collective here, and the outcomes stay for the step end to settle alike
            with self._lock:
                found = [_committed(p) for p in self.published if p.step >= step]
            return next((v for v in found if v is not None), None)
        if self._settle(wait=False) and self.publisher is not None and self._model is not None:
            self._publish_blocking(self.publisher, self._model, self._step, deadline)
        with self._lock:
            done = [p.version for p in self.published if p.step >= step and p.version is not None]
        return done[0] if done else None

    # -- internals --------------------------------------------------------------------------------

    def _rank_zero_view(
        self, state: TrainerState, model: torch.nn.Module | None
    ) -> tuple[PublisherCore, Mapping[str, torch.Tensor] | torch.nn.Module, torch.nn.Module] | None:
        """On rank 0 (on every rank with ``shard_local``): the publisher, what to publish and the model; None
        elsewhere, without a model, or without a publisher. Every rank calls it: under FSDP each joins the
        full-state-dict gather (none with ``shard_local``: each publishes its own blocks of the model)."""
        if model is None:
            return None
        if self.shard_local:
            publisher = self._publisher(state.global_step)
            return None if publisher is None else (publisher, model, model)
        what = full_state_dict(model)
        if not state.is_world_process_zero:
            return None
        publisher = self._publisher(state.global_step)
        return None if publisher is None else (publisher, what, model)

    def _publisher(self, step: int) -> PublisherCore | None:
        if self.publisher is None and self._make is not None:
            try:
                made = self._make()
            except StitchError as exc:
                self._fault(exc, step)
                return None
            if self.shard_local and not isinstance(made, ShardedPublisher):
                made.close()
                raise ValueError(
                    f"shard_local=True: the publisher factory made a {type(made).__name__}; every rank needs a "
                    "ShardLocalPublisher (lambda: ShardLocalPublisher(url, run, ...))"
                )
            self.publisher = made
        return self.publisher

    def _check_resume(self, publisher: PublisherCore, step: int) -> None:
        """Refuse a trainer at ``step`` behind the run's last version (resumed from an older checkpoint): its
        steps would meet the run's versions of those steps (other bits: refused) and its rollouts would get them.

        Raises:
            ResumeError: naming the run, its last version and step, the trainer's step and what to do.
        """
        last = publisher.last_version
        if last is None:
            return
        last_step = self._recorded_step(publisher, last)
        if isinstance(last_step, int) and last_step > step:
            raise ResumeError(
                f"run {publisher.run}: its last version {last} is at training step {last_step}, but the trainer "
                f"starts at step {step}: its steps {step + 1}..{last_step} already have versions of another "
                f"history, which the bulletin keeps and the rollouts would get. Resume from the checkpoint of step "
                f"{last_step} or later, or publish to a new run id",
                run=publisher.run,
                version=last,
                version_step=last_step,
                trainer_step=step,
            )

    def _recorded_step(self, publisher: PublisherCore, version: int) -> object:
        """The training step recorded in ``version`` (None when the bulletin cannot answer now: a fault, not a
        conflict, left to the fault policy at the first step end). With ``shard_local`` rank 0 reads it and every
        rank takes its answer (:meth:`ShardedPublisher.agree`), so the ranks refuse or go on alike: a read that
        failed on one rank only would leave the others waiting in the next exchange.

        Raises:
            ResumeError: with ``shard_local``, rank 0's read failed other than unavailable (on every rank).
            the bulletin client's errors other than ``UnavailableError``, without ``shard_local``.
        """
        sharded = publisher if isinstance(publisher, ShardedPublisher) else None
        answer: tuple[object, str | None] = (None, None)
        failure: Exception | None = None
        if sharded is None or sharded.rank == 0:
            try:
                answer = (publisher.client.manifest(publisher.run, version).metadata.get("step"), None)
            except UnavailableError as exc:
                log.warning(
                    "run %s: could not read version %d's step to check the resume (%s)", publisher.run, version, exc
                )
            except Exception as exc:
                if sharded is None:
                    raise
                failure, answer = exc, (None, repr(exc))
        if sharded is not None:
            answer = sharded.agree(answer)
        recorded, error = answer
        if error is not None:
            raise ResumeError(
                f"run {publisher.run}: rank 0 could not read version {version}'s step to check the resume: {error}; "
                "fix the bulletin's answer and start the trainer again",
                run=publisher.run,
                version=version,
            ) from failure
        return recorded

    def _fault(self, exc: BaseException, step: int) -> None:
        """Apply the policy to a failed publish of ``step`` that is not retried (raise, or log the skip)."""
        if self.on_fault == "raise":
            raise exc
        with self._lock:
            if step not in self.skipped_steps:
                self.skipped_steps.append(step)
        log.warning(
            "step %d: not published (%s: %s); the next version carries its changes", step, type(exc).__name__, exc
        )

    def _record(self, entry: Published) -> None:
        with self._lock:
            self.published.append(entry)
            if entry.version is not None and entry.step in self.skipped_steps:
                self.skipped_steps.remove(entry.step)  # published again (block, or at the train end)
        if entry.version is not None:
            self._find_lost_commit(entry.version)

    def _find_lost_commit(self, version: int) -> None:
        """After ``version`` committed: if the version before it is none of this callback's, it is a publish
        whose commit answer was lost (the publisher adopted it, :meth:`Publisher.publish`): its manifest's step
        is taken off ``skipped_steps`` and recorded with it. One manifest read, only when a skipped step waits."""
        lost = version - 1
        with self._lock:
            if not self.skipped_steps or lost < 0 or any(p.version == lost for p in self.published):
                return
        if self.publisher is None:
            return
        try:
            step = self.publisher.client.manifest(self.publisher.run, lost).metadata.get("step")
        except StitchError:
            return
        with self._lock:
            if step not in self.skipped_steps:
                return
            self.skipped_steps.remove(step)
            at = next((i for i, p in enumerate(self.published) if p.step > step), len(self.published))
            self.published.insert(at, Published(step, None, lost))
        log.warning("step %d: committed as version %d after all (its answer was lost)", step, lost)

    def _publish_async(self, publisher: PublisherCore, what: Any, step: int) -> None:
        for attempt in (1, 2):
            try:
                future = publisher.publish_async(what, step=step)
            except StitchError as exc:
                if attempt == 1:  # an earlier publish failed since _settle looked (raised once: its record says it)
                    continue
                self._fault(exc, step)
                return
            self._record(Published(step, future))
            return

    def _publish_blocking(self, publisher: PublisherCore, what: Any, step: int, deadline: float | None = None) -> None:
        """Publish now; under ``block`` retry an unreachable bulletin until ``block_timeout_s``, or until
        ``deadline`` (``time.monotonic()``) if sooner (a rollout's wait)."""
        deadline = min(time.monotonic() + self.block_timeout_s, deadline if deadline is not None else float("inf"))
        while True:
            try:
                result = publisher.publish(what, step=step)
            except StitchError as exc:
                retry = (
                    isinstance(exc, UnavailableError)
                    and self.on_fault == "block"
                    and time.monotonic() + self.retry_interval_s < deadline
                )
                if self.shard_local and isinstance(publisher, ShardedPublisher):
                    retry = publisher.agree(retry)  # rank 0's call: every rank publishes again, or none
                if retry:
                    log.warning(
                        "step %d: bulletin unavailable (%s); retrying for up to %.0f s", step, exc, self.block_timeout_s
                    )
                    time.sleep(self.retry_interval_s)
                    continue
                self._fault(exc, step)
                return
            self._record(Published(step, None, result.version, result=result))
            return

    def _settle(self, wait: bool) -> bool:
        """Record the outcome of finished publishes (``wait``: of all of them). Failures are logged as skipped
        (``block``, ``skip``) or raised (``raise``); returns True when one failed under ``block`` (the caller
        then publishes the current weights, blocking)."""
        with self._lock:
            open_ = [p for p in self.published if p.future is not None and (wait or p.future.done())]
        failed = False
        for p in open_:
            future = p.future
            if future is None:
                continue
            exc = future.exception()
            with self._lock:
                if p.future is None:  # settled by another caller meanwhile
                    continue
                p.future, p.failed = None, exc is not None
                p.result = None if exc is not None else future.result()
                p.version = None if p.result is None else p.result.version
            if exc is None:
                self._find_lost_commit(future.result().version)
                continue
            failed = True
            if self.publisher is not None:
                try:
                    self.publisher.flush()  # the worker keeps the failure to raise it once: take it here
                except Exception:  # noqa: BLE001, S110 - it is the failure handled below
                    pass
            self._fault(exc, p.step)
        return failed and self.on_fault == "block"
