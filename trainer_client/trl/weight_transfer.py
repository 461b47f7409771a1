"""TRL's ``AsyncGRPOTrainer`` publishing through stitchboard: a ``WeightTransferProtocol`` implementation.

Runs in the trainer process, on rank 0 only: ``AsyncGRPOTrainer`` calls its weight-transfer object there, once
before its rollout worker starts (``init_weight_transfer``, then a first ``send_weights``) and then every
``weight_sync_steps`` optimizer steps (``pause``, ``send_weights``, ``resume``); ``destroy`` at the end of
training. Each ``send_weights`` publishes one version of the run (the served view of the streamed parameters,
recording the trainer's ``state.global_step`` as the version's ``step``) through the SDK's
:class:`~stitchboard.trainer_client.publisher.Publisher`, and by default waits until every live sidecar of the
run serves it, so the trainer's ``model_version`` (bumped after ``resume``) names weights the fleet holds.

The fleet is never stopped: ``pause``/``resume`` do nothing, since each sidecar applies a version in a short pause
of its own engine and gates and stamps every request (DESIGN.md invariant 8). TRL's default transfer calls engine
routes (``/pause``, ``/init_weight_transfer_engine``, ``/update_weights``) that a sidecar refuses (403).

User guide: docs/integrations/trl-async.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, Self

import torch

from stitchboard.bulletin.errors import (
    AuthError,
    BulletinError,
    ConflictError,
    RequestTimeoutError,
    UnavailableError,
)
from stitchboard.proto.container import RawTensor

from ..errors import PublishError
from ..fleet import wait_for_fleet
from ..publisher import Publisher
from ..served_view import cast_served, checkpoint_name, checkpoint_state

log = logging.getLogger("stitchboard.trainer_client")


class WeightTransfer:
    """``weight_transfer=`` for ``trl.experimental.async_grpo.AsyncGRPOTrainer``: every weight sync is a version.

    Usage (the trainer's ``vllm_server_base_url`` is a sidecar's URL, or a load balancer over the run's sidecars)::

        transfer = WeightTransfer("http://bulletin:8700", "grpo-run-1")
        trainer = AsyncGRPOTrainer(model=..., args=config, weight_transfer=transfer, ...)
        transfer.attach(trainer)

    Args:
        url: the bulletin's base URL.
        run: the run id (1-128 of ``[A-Za-z0-9._-]``).
        token: a bearer token with the ``publish`` scope (None for an open bulletin).
        wait_for_fleet: after each publish, wait until every live replica of the run (at least one) serves the
            version, as TRL's own transfer returns once its server holds the weights; False returns once the
            version is committed (rollouts then run on older versions for a while; the sidecars' stamps say which).
        fleet_timeout_s: how long that wait may take, seconds (default 600).
        publisher_options: keyword arguments of :class:`~stitchboard.trainer_client.publisher.Publisher`
            (``encoding``, ``snapshot_every``, ``served``, ``assets``, ``dtypes``, ``squash_depths``...).

    The publisher is made in :meth:`init_weight_transfer` (rank 0 only) and closed in :meth:`destroy`.
    """

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        wait_for_fleet: bool = True,
        fleet_timeout_s: float = 600.0,
        **publisher_options: Any,
    ) -> None:
        self.url = url
        self.run = run
        self.token = token
        self.wait_for_fleet = wait_for_fleet
        self.fleet_timeout_s = fleet_timeout_s
        self.publisher_options = publisher_options
        self.publisher: Publisher | None = None
        self._trainer: Any = None
        #: The version of each step this object published, in order ((step, version) pairs).
        self.published: list[tuple[int, int]] = []

    def attach(self, trainer: Any) -> Self:
        """Read the step (``trainer.state.global_step``) and the model (for parameters TRL does not stream) from
        ``trainer``, an ``AsyncGRPOTrainer`` made with ``weight_transfer=self``. Returns ``self``."""
        self._trainer = trainer
        return self

    def init_weight_transfer(self) -> None:
        """Make the publisher: resumes the run from the bulletin when it has versions already.

        Raises:
            PublishError: not attached to a trainer (:meth:`attach`).
            BulletinError: the bulletin is down (after the client's retries) or refused the run.
        """
        if self._trainer is None:
            raise PublishError("WeightTransfer: call transfer.attach(trainer) before trainer.train()")
        self.publisher = Publisher(self.url, self.run, self.token, **self.publisher_options)

    def pause(self) -> None:
        """Nothing: the fleet keeps serving; each sidecar pauses its own engine briefly to apply a version."""

    def resume(self) -> None:
        """Nothing (see :meth:`pause`)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish the streamed parameters' served view as the run's next version, recording the trainer's step.

        ``iterator`` yields ``(name, tensor)`` (any device, fp32 or bf16; names as in ``model.named_parameters()``
        with ``module.`` and PEFT wrappers removed). It is consumed once: each tensor is cast to its served dtype
        (a host copy) before the next is taken, so memory grows by one tensor beyond the new view, which becomes
        the publisher's kept view. Entries of the model's state the stream leaves out (frozen parameters,
        persistent buffers) are taken from the attached trainer's model, so every version holds the whole view.
        Publishing the same step again with the same bits (a resumed run's first sync) is a no-op.

        Raises:
            PublishError: called before :meth:`init_weight_transfer`; a streamed tensor that is not floating point,
                that the stream holds twice (after wrapper prefixes are stripped), or whose shape or dtype is not the
                model's (a local shard; checked when the model's state is known, i.e. not under PEFT): refused
                before anything is published, naming the tensor; or the publish failed (the bulletin unreachable
                after the client's retries, or it refused the version: a step going back, other bits at the run's
                last step, a token without the publish scope); names the step, the run's versions are unchanged.
            FleetTimeoutError: the version was published but the fleet did not serve it within
                ``fleet_timeout_s``; names the step, the version and the replicas that lag.
            ServedViewError: a tensor has no served dtype.
        """
        if self.publisher is None:
            raise PublishError("WeightTransfer.send_weights before init_weight_transfer (the trainer calls it)")
        step = int(self._trainer.state.global_step)
        t0 = time.perf_counter()
        view = self._served(iterator)
        try:
            result = self.publisher.publish_view(self.publisher.served.apply(view), step=step)
        except BulletinError as exc:
            raise PublishError(
                f"AsyncGRPOTrainer weight sync at step {step}: {_why_not_published(exc, self.run, self.url)}",
                run_id=self.run,
                step=step,
                cause=exc.type,
            ) from exc
        self.published.append((step, result.version))
        if self.wait_for_fleet:
            wait_for_fleet(
                self.publisher.client,
                self.run,
                result.version,
                timeout_s=self.fleet_timeout_s,
                what=f"waiting for the fleet to serve version {result.version} (AsyncGRPOTrainer step {step})",
            )
        log.info("run %s: step %d is version %d (%.2f s)", self.run, step, result.version, time.perf_counter() - t0)

    def destroy(self) -> None:
        """Close the publisher (waits for nothing: every publish has returned)."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def _served(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> dict[str, RawTensor]:
        """The served view of the streamed tensors, completed from the model's state (one tensor held at a time).

        Raises:
            PublishError: a streamed name is no checkpoint name of the model (fused MoE experts) or comes twice, a
                streamed tensor is not floating point or differs from the model's in shape or dtype, or a tensor the
                stream leaves out is sharded.
        """
        model = self._trainer.accelerator.unwrap_model(self._trainer.model)
        state = None if getattr(model, "peft_config", None) else checkpoint_state(model)  # PEFT: merged base, whole
        view: dict[str, RawTensor] = {}
        for name, tensor in iterator:
            key = checkpoint_name(name)
            if state is not None and key not in state:
                raise PublishError(
                    f"AsyncGRPOTrainer streams {name!r}, which is not a checkpoint name of the model (fused MoE"
                    " experts?): publish with Publisher.publish(model) from a callback instead",
                    name=name,
                )
            _check_streamed(name, key, tensor, None if state is None else state[key], key in view)
            view[key] = self._cast(key, tensor)
            del tensor
        for key, tensor in (state or {}).items():
            if key in view:
                continue
            if hasattr(tensor, "full_tensor"):
                raise PublishError(
                    f"{key!r} is sharded (DTensor) but AsyncGRPOTrainer does not stream it (frozen): gathering"
                    " it on rank 0 alone would hang; leave it trainable or unsharded",
                    name=key,
                )
            view[key] = self._cast(key, tensor)
        return view

    def _cast(self, name: str, tensor: torch.Tensor) -> RawTensor:
        assert self.publisher is not None
        return cast_served(name, tensor, self.publisher.dtypes, self.publisher.default_dtype)


def _check_streamed(name: str, key: str, tensor: torch.Tensor, model_tensor: torch.Tensor | None, seen: bool) -> None:
    """Refuse a streamed tensor that cannot be the model's parameter ``key``: a second one under that name, one not
    floating point, or one whose shape or dtype is not ``model_tensor``'s (its global shape, for a DTensor; None:
    the model's state is not known, under PEFT).

    Raises:
        PublishError: naming the tensor, its shape and dtype and the model's.
    """
    got = f"{tuple(tensor.shape)} {tensor.dtype}"
    if seen:
        also = "" if key == name else f" (checkpoint name {key!r})"
        raise PublishError(
            f"AsyncGRPOTrainer streams {name!r}{also} twice in one weight sync: each parameter is streamed once;"
            " nothing was published",
            name=name,
        )
    if not tensor.is_floating_point():
        raise PublishError(
            f"AsyncGRPOTrainer streams {name!r} as {got}: parameters are floating point; nothing was published",
            name=name,
            dtype=str(tensor.dtype),
        )
    if model_tensor is not None and (tensor.shape != model_tensor.shape or tensor.dtype != model_tensor.dtype):
        raise PublishError(
            f"AsyncGRPOTrainer streams {name!r} as {got}, but the model's {key!r} is"
            f" {tuple(model_tensor.shape)} {model_tensor.dtype} (a local shard? stream full tensors, as"
            " DTensor.full_tensor() gives); nothing was published",
            name=name,
            shape=list(tensor.shape),
            model_shape=list(model_tensor.shape),
        )


def _why_not_published(exc: BulletinError, run: str, url: str) -> str:
    """Why a version was not committed, by its cause: the bulletin unreachable, or the bulletin's refusal."""
    if isinstance(exc, UnavailableError | RequestTimeoutError):
        return (
            f"the bulletin at {url} was unreachable for run {run!r} ({exc.type}: {exc}); no version was committed."
            " Start the bulletin or check its logs; a restarted trainer resumes the run"
        )
    if isinstance(exc, ConflictError):
        advice = (
            "A run's steps only move forward and a step's weights are published once: resume the trainer from the"
            " checkpoint of the run's last step, or publish to a new run"
        )
    elif isinstance(exc, AuthError):
        advice = "Give the WeightTransfer a token with the publish scope for this run"
    else:
        advice = "The bulletin's reason above says what to change"
    return (
        f"the bulletin refused the version of run {run!r} ({exc.status} {exc.type}: {exc}); "
        f"no version was committed. {advice}"
    )
