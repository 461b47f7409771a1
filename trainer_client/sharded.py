"""Sharded publish: every rank of a ``torch.distributed`` job publishes a disjoint part of the view.

Each rank owns a set of whole checkpoint tensors (assigned by size, the largest first to the
least loaded rank, identically on every rank). For a sharded tensor (a ``DTensor`` from FSDP2
or tensor parallelism) every rank joins the gather (``full_tensor()``, a collective) and only
the owner keeps the bf16 copy. A rank keeps the last published view of its own tensors only,
so the kept memory is divided by the world size.

Then each rank diffs and uploads its part: ``patch-v{N}-r{rank}.safetensors`` and, in an
anchor, its snapshot shards (``model-0000i-of-0000n.safetensors``, numbered across ranks, with
one ``model.safetensors.index.json`` uploaded by rank 0). The ranks exchange what they encoded
and what they uploaded (two ``all_gather_object`` calls), and rank 0 commits one manifest
after every rank's files are in; the outcome is broadcast, so every rank returns the same
result or raises the same error. Everything else (resume, the snapshot rule, the recovery of
a lost commit answer, ``publish_async``) is :class:`~.publisher_core.PublisherCore`'s, as for
:class:`~.publisher.Publisher`.

The exchanges run over a gloo group of the publishing ranks of their own (not the training's),
so a background publish (``publish_async``) never interleaves its collectives with the
training's. A closed publisher leaves its group to the next publisher over the same ranks
(:class:`_ControlGroups`). The group waits ``exchange_timeout_s`` for a peer: a rank that hangs
(or dies) fails every rank's publish within that time instead of gloo's 30-minute default, and
the publisher is then closed to further publishes (gloo closes the group's connections on a
timeout): a new publisher resumes from what the bulletin holds.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar, Unpack, cast

import torch
import torch.distributed as dist

from stitchboard.proto.container import RawTensor
from stitchboard.proto.dtypes import DTYPE_SIZES
from stitchboard.proto.schema import FileRef

from .errors import PublishError
from .publish_result import PublishResult
from .publisher_core import AssetsArg, PublisherCore, PublisherOptions
from .served_view import TORCH_DTYPE_NAMES, cast_served, checkpoint_state, gather_full, served_dtype
from .stream import StreamedView
from .version_parts import PublishedVersion, ViewPart

T = TypeVar("T")
K = TypeVar("K")
S = TypeVar("S")


def assign_owners(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Tensor name -> owning rank: largest first to the least loaded rank (ties: lowest rank)."""
    load = [0] * world
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


class _ControlGroups:
    """Gloo groups for the publishers' exchanges, kept for reuse instead of destroyed.

    Groups are made with ``use_local_synchronization`` (only the publishing ranks take part),
    whose name torch derives from the ranks and the number of live groups: after a destroy, the
    next group over the same ranks gets the name again and can hang in its rendezvous on the
    keys the old one left in the store. So a closed publisher's group waits here for the next
    publisher over the same ranks (every rank makes and closes its publishers in the same order,
    so every rank takes the same group); groups end with the default process group.
    """

    def __init__(self) -> None:
        self._idle: dict[tuple[object, tuple[int, ...], float], list[dist.ProcessGroup]] = {}

    def take(self, ranks: list[int], timeout_s: float) -> dist.ProcessGroup:
        idle = self._idle.get((dist.group.WORLD, tuple(ranks), timeout_s))
        if idle:
            return idle.pop()
        timeout = timedelta(seconds=timeout_s)
        group: dist.ProcessGroup = dist.new_group(
            ranks, backend="gloo", use_local_synchronization=True, timeout=timeout
        )
        return group

    def give_back(self, ranks: list[int], timeout_s: float, group: dist.ProcessGroup) -> None:
        self._idle.setdefault((dist.group.WORLD, tuple(ranks), timeout_s), []).append(group)


_CONTROL_GROUPS = _ControlGroups()


def _portable(exc: Exception, rank: int) -> Exception:
    """``exc`` if it survives pickling (to be raised on the other ranks), else a PublishError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any error that does not pickle is sent as its repr
        return PublishError(f"rank {rank} failed: {exc!r}", rank=rank)
    return exc


def _exchange_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is the publishers' group failing (a peer past the timeout, or gone): torch raises a
    ``DistError``, or for gloo's transport a plain ``RuntimeError`` naming gloo."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


class ShardedPublisher(PublisherCore):
    """Publishes one version from all ranks of a process group; rank 0 commits.

    Every rank must make the publisher, call each method (:meth:`publish`, :meth:`publish_view`,
    :meth:`publish_async`, :meth:`flush`, :meth:`close`) in the same order with the same
    arguments, and gets the same versions, results and errors. :meth:`publish_view` takes the
    whole view on every rank (each keeps its own tensors).

    Args:
        url, run, token: as :class:`~stitchboard.trainer_client.publisher.Publisher`.
        group: the process group (default: the world); must be initialized. Its ranks make a
            gloo group of their own for the publisher's exchanges (only they take part).
        exchange_timeout_s: how long a rank waits for the others at an exchange (seconds; the
            slowest rank's encode and upload of its part count against it, so leave room for an
            anchor's upload). Past it, or when a peer dies, every rank's publish raises
            PublishError and this publisher takes no further publish.
        options: the keyword arguments of ``Publisher`` (``encoding``, ``snapshot_every``,
            ``resume``, ``max_pending``...), with the same meaning; ``assets`` are read on rank
            0 only, and with ``resume="rebuild"`` every rank rebuilds the last version and keeps
            its own tensors of it at the first publish.

    Raises:
        ValueError: ``exchange_timeout_s`` is not positive.
        PublishError: ``torch.distributed`` is not initialized; from a publish: a peer hung past
            ``exchange_timeout_s`` or died (the version may be committed if rank 0 had committed it:
            a new publisher resumes from the bulletin), or this publisher failed so before.
        the errors of ``Publisher`` construction, on every rank when one rank fails (e.g.
            ``AssetsError`` from rank 0).
    """

    _lockstep = True

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        exchange_timeout_s: float = 1800.0,
        **options: Unpack[PublisherOptions],
    ) -> None:
        if not exchange_timeout_s > 0:  # also NaN
            raise ValueError(f"exchange_timeout_s must be a positive number of seconds, got {exchange_timeout_s!r}")
        if not dist.is_initialized():
            raise PublishError("ShardedPublisher needs torch.distributed initialized (init_process_group)")
        self.group = group
        self._ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.exchange_timeout_s = float(exchange_timeout_s)
        self._control = _CONTROL_GROUPS.take(self._ranks, self.exchange_timeout_s)
        self.rank, self.world = dist.get_rank(self._control), dist.get_world_size(self._control)
        self._group_returned = False
        self._broken: str | None = None  # why the publishers' group failed; it takes no further exchange
        try:
            super().__init__(url, run, token, **options)
        except BaseException:
            self._give_back_group()  # every rank failed here (the ranks agree)
            raise

    def close(self) -> None:
        """Flush, stop the worker, close the bulletin client (if this publisher made it) and
        leave the publisher's gloo group to the next one. Idempotent."""
        try:
            super().close()
        finally:
            self._give_back_group()

    def _give_back_group(self) -> None:
        if not self._group_returned:
            self._group_returned = True
            if self._broken is None:  # a failed group's connections are closed: nobody may take it
                _CONTROL_GROUPS.give_back(self._ranks, self.exchange_timeout_s, self._control)

    def _publish_view(
        self,
        view: ViewPart | StreamedView,
        step: int | None,
        anchor: bool,
        metadata: Mapping[str, Any] | None,
        cast_s: float,
    ) -> PublishResult:
        publish = super()._publish_view
        return self._exchanging(lambda: publish(view, step, anchor, metadata, cast_s))

    def _exchanging(self, work: Callable[[], T]) -> T:
        """Run ``work`` (which exchanges over the publishers' group); a failure of the group becomes a
        PublishError, and this publisher takes no further exchange."""
        if self._broken is not None:
            raise PublishError(
                f"run {self.run!r}: this publisher's exchanges failed before on rank {self.rank} ({self._broken}); "
                "make a new publisher on every rank (it resumes from what the bulletin holds)",
                rank=self.rank,
            )
        try:
            return work()
        except Exception as exc:
            if not _exchange_failed(exc):
                raise
            self._broken = str(exc)[:500]
            raise PublishError(
                f"run {self.run!r}: rank {self.rank} lost the other publishing ranks ({self._broken}): a peer hung "
                f"past exchange_timeout_s={self.exchange_timeout_s:g} or died. A version is committed only if rank 0 "
                "committed it before; make a new publisher on every rank (it resumes from what the bulletin holds)",
                rank=self.rank,
            ) from exc

    # -- the view: whole tensors per rank ----------------------------------------------------

    def _take_view(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> ViewPart:
        state = checkpoint_state(model_or_state_dict)
        sizes = {}
        for n, t in state.items():
            dtype = TORCH_DTYPE_NAMES.get(served_dtype(n, t, self.dtypes, self.default_dtype), "U8")
            sizes[n] = t.numel() * DTYPE_SIZES[dtype]
        owners = assign_owners(sizes, self.world)
        view: dict[str, RawTensor] = {}
        error: Exception | None = None
        for name in sorted(state):
            full = gather_full(state[name])  # collective for a DTensor: every rank joins, in order
            if owners[name] == self.rank and error is None:
                try:
                    view[name] = cast_served(name, full, self.dtypes, self.default_dtype)
                except Exception as exc:  # noqa: BLE001 - raised on every rank once the ranks compare
                    error = exc
            del full
        return ViewPart(view, frozenset(state), error)

    def _own_view(self, view: Mapping[str, RawTensor]) -> ViewPart:
        owners = assign_owners({n: t.nbytes for n, t in view.items()}, self.world)
        return ViewPart({n: view[n] for n in sorted(view) if owners[n] == self.rank}, frozenset(view))

    # -- the collectives ---------------------------------------------------------------------

    def agree(self, value: T) -> T:
        """Rank 0's ``value`` on every rank (a pickled broadcast over the publishers' group): for a decision the
        ranks must take alike because it starts collectives (publish again after a failure, or not).

        Collective: every rank of the publisher calls it, with no publish of this publisher in flight (its
        exchanges use the same group). ``value`` must pickle.
        """
        box: list[Any] = [value]
        self._exchanging(lambda: dist.broadcast_object_list(box, group=self._control, group_src=0))
        return cast(T, box[0])

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self._control)
        return out

    def _exchange(self, what: str, work: Callable[[], tuple[K, S]]) -> tuple[K, list[S]]:
        """Every rank runs ``work``; if one fails, every rank raises a PublishError naming the ranks."""
        cause: Exception | None = None
        try:
            kept, shared = work()
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before raising
            cause = exc
            gathered = self._gather((repr(exc), None))
        else:
            gathered = self._gather((None, shared))
        failed = [r for r, (error, _) in enumerate(gathered) if error is not None]
        if failed:
            raise PublishError(
                f"{what} of run {self.run!r} failed on rank(s) {failed}: {gathered[failed[0]][0]}; "
                "nothing was committed, publish again once it is fixed",
                ranks=failed,
            ) from cause
        return kept, [s for _, s in gathered]

    def _on_committer(self, work: Callable[[], T]) -> T:
        """Rank 0 runs ``work``; every rank returns its value or raises its error (the same type)."""
        outcome: list[Any] = [None]
        failure: Exception | None = None
        if self.rank == 0:
            try:
                outcome[0] = (work(), None)
            except Exception as exc:  # noqa: BLE001 - sent to every rank, then raised
                failure = exc
                outcome[0] = (None, _portable(exc, 0))
        dist.broadcast_object_list(outcome, group=self._control, group_src=0)
        if failure is not None:
            raise failure
        value, error = outcome[0]
        if error is not None:
            raise error
        return cast(T, value)  # rank 0's work() result, come through the pickled broadcast

    def _start(self, mode: str, assets: AssetsArg) -> tuple[PublishedVersion | None, list[FileRef], dict[str, bytes]]:
        """Resume on every rank; a rank's failure is raised on all; every rank takes rank 0's asset refs."""
        try:
            published, refs, data = super()._start(mode, assets)
        except Exception as exc:
            self._gather((_portable(exc, self.rank), None))
            raise
        gathered = self._gather((None, refs))
        failure = next((error for error, _ in gathered if error is not None), None)
        if failure is not None:
            raise failure
        return published, gathered[0][1], data

    def _patch_metadata(self, version: int) -> dict[str, str]:
        return {**super()._patch_metadata(version), "rank": str(self.rank)}
