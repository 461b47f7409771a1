"""``PublisherCore``: what :class:`~.publisher.Publisher` and :class:`~.sharded.ShardedPublisher` share.

One class builds every version: construction and resume, the snapshot rule, the files, the
manifest, the commit, the recovery of a commit whose answer was lost, the result, and the
background publishes (``publish_async``). A subclass says how it takes its part of the served
view (:meth:`PublisherCore._take_view`, :meth:`PublisherCore._own_view`) and, with several
ranks, how the ranks meet: :meth:`PublisherCore._exchange` (every rank runs a step and shares
a record) and :meth:`PublisherCore._on_committer` (rank 0 runs a step, every rank gets its
outcome). The defaults here are those of one process, which is rank 0 of 1.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, TypedDict, TypeVar

import torch

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import NotFoundError, UnavailableError, VersionConflictError
from stitchboard.proto.adapter import AdapterSpec
from stitchboard.proto.checkpoint import (
    DEFAULT_SHARD_BYTES,
    INDEX_NAME,
    TensorLayout,
    index_json,
    shard_groups,
    write_shards,
    write_shards_streaming,
)
from stitchboard.proto.codec import ENCODINGS
from stitchboard.proto.container import RawTensor
from stitchboard.proto.fleet import FleetCount
from stitchboard.proto.schema import XXH3_128, Encoding, FileRef, VersionManifest, canonical_json, check_run_id

from .adapter_run import AdapterRun
from .assets import load_assets
from .async_publish import BoundedWorker
from .encode_version import (
    BaseTensor,
    EncodedPart,
    build_manifest,
    bytes_ref,
    encode_part,
    file_ref,
    tensor_specs,
    version_metadata,
)
from .errors import PublishError
from .fleet import FleetPacing, wait_for_fleet
from .publish_result import PublishResult, log_result
from .recipes import check_served_options
from .resume import resume_publisher
from .served_view import DtypeMap
from .squash import DEFAULT_SQUASH_DEPTHS, Squasher
from .stream import StreamedView
from .uploads import upload_assets, upload_files
from .version_parts import (
    EncodeReport,
    PublishedVersion,
    RankPart,
    ViewPart,
    needs_snapshot,
    shard_layout,
    version_result,
)

log = logging.getLogger("stitchboard.trainer_client")

T = TypeVar("T")
K = TypeVar("K")
S = TypeVar("S")

#: The ``assets`` argument: a folder, ``{file name: bytes}``, or None.
AssetsArg = str | os.PathLike[str] | Mapping[str, bytes] | None


class PublisherOptions(TypedDict, total=False):
    """The keyword arguments of :class:`PublisherCore` (see ``Publisher``), for a subclass to pass on."""

    encoding: Encoding
    snapshot_every: int
    dtypes: DtypeMap | None
    default_dtype: torch.dtype
    served: str
    assets: AssetsArg
    resume: Literal["rebuild", "anchor"]
    max_pending: int
    max_shard_bytes: int
    retries: int
    backoff_s: float
    timeout_s: float
    workdir: str | os.PathLike[str] | None
    client: BulletinClient | None
    pacing: FleetPacing | None
    squash_depths: Sequence[int]
    device_kept_view: bool


@dataclass(frozen=True)
class _Pending:
    """A version whose commit reported ``UnavailableError``: it may exist all the same (``adopt``: take it as the
    last published version; a streamed one then writes its changes into the kept view)."""

    manifest: VersionManifest
    adopt: Callable[[], PublishedVersion]


class PublisherCore(ABC):
    """Publishes a trainer's served view to a bulletin run, one version per call.

    The constructor arguments, methods, results and errors are documented on
    :class:`~stitchboard.trainer_client.publisher.Publisher`.
    """

    #: This process's rank among the publishing ranks; rank 0 commits.
    rank: int = 0
    #: The number of publishing ranks.
    world: int = 1
    #: Background failures surface only once every rank knows them (see :class:`BoundedWorker`).
    _lockstep: ClassVar[bool] = False
    #: Whether :meth:`_take_view` applies a served-view recipe other than bf16 (``served=``).
    _applies_recipes: ClassVar[bool] = False

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        encoding: Encoding = "cond",
        snapshot_every: int = 10,
        dtypes: DtypeMap | None = None,
        default_dtype: torch.dtype = torch.bfloat16,
        served: str = "bf16",
        assets: AssetsArg = None,
        resume: Literal["rebuild", "anchor"] = "rebuild",
        max_pending: int = 2,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 60.0,
        workdir: str | os.PathLike[str] | None = None,
        client: BulletinClient | None = None,
        pacing: FleetPacing | None = None,
        squash_depths: Sequence[int] = DEFAULT_SQUASH_DEPTHS,
        device_kept_view: bool = False,
    ) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        if encoding not in ENCODINGS:
            raise ValueError(
                f"unknown encoding {encoding!r}: use one of {ENCODINGS} (cond: smallest, the default; xor: fastest)"
            )
        self.run = check_run_id(run)
        self.encoding: Encoding = encoding
        self.snapshot_every = snapshot_every
        self.dtypes = dtypes
        self.default_dtype = default_dtype
        self.served = check_served_options(served, dtypes, default_dtype)
        if self.served.name != "bf16" and not self._applies_recipes:
            raise ValueError(f"{type(self).__name__} publishes served='bf16' only; use Publisher for served={served!r}")
        self._adapter_run = AdapterRun(  # a PEFT model: its adapter alone; a resumed run's kind read once
            self.served.name, dtypes, default_dtype, self._resumed_run_spec
        )
        self.max_shard_bytes = max_shard_bytes
        self.workdir = workdir
        if workdir is not None:
            Path(workdir).mkdir(parents=True, exist_ok=True)
        self._owns_client = client is None
        self.client = client or BulletinClient(url, token, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        self._worker = BoundedWorker(max_pending, lockstep=self._lockstep)
        self.pacing = pacing  # publish waits for the fleet (trainer_client/fleet.py)
        self.device_kept_view = device_kept_view  # a GPU model's kept view mirrored there (device_diff.py)
        self._lock = threading.Lock()
        self._pending: _Pending | None = None
        try:
            self._published, self._assets, self._asset_data = self._start(resume, assets)
        except BaseException:  # refused at the start (changed assets, bulletin down): no client or thread left open
            PublisherCore.close(self)  # this class's part only: a subclass undoes its own (ShardedPublisher: its group)
            raise
        self._squasher = Squasher(self.client, self.run, self.rank, squash_depths, encoding)

    # -- resume ------------------------------------------------------------------------------

    def _start(self, mode: str, assets: AssetsArg) -> tuple[PublishedVersion | None, list[FileRef], dict[str, bytes]]:
        """Read the given assets (on rank 0, which uploads them) and resume the run:
        (last version, asset refs, asset bytes)."""
        given = load_assets(assets) if assets is not None and self.rank == 0 else None
        given = None if given is None else [self.served.asset(a) for a in given]  # config.json's quantization_config
        published, refs = resume_publisher(self.client, self.run, mode, given, workdir=self.workdir)
        if published is not None and published.view is not None:  # rebuilt here: this publisher's own copies
            published = replace(published, owned=frozenset(published.view))
        if published is not None and self.rank == 0:
            log.info(
                "run %s: resuming after version %d (%s)",
                self.run,
                published.version,
                "view rebuilt and verified" if published.view else "next version is an anchor",
            )
        return published, refs, {a.path: a.data for a in given or []}

    def _resumed_run_spec(self) -> tuple[bool, AdapterSpec | None]:
        """Whether the run has a version already, and the adapter of the last one (None: a full run, or none)."""
        last = self._published
        return (False, None) if last is None else (True, self.client.manifest(self.run, last.version).adapter)

    @property
    def last_version(self) -> int | None:
        """The last version this publisher committed or resumed from (None: the run is empty)."""
        return self._published.version if self._published else None

    # -- what a subclass provides ------------------------------------------------------------

    @abstractmethod
    def _take_view(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> ViewPart:
        """This rank's part of the served view of a model or state dict (a fresh host copy)."""

    @abstractmethod
    def _own_view(self, view: Mapping[str, RawTensor]) -> ViewPart:
        """This rank's part of an already-made served view (no copy)."""

    def _stream_of(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> StreamedView | None:
        """The served view of a model taken tensor by tensor against the kept view, or None where this publisher
        takes it whole (:meth:`_take_view`); the default: always whole."""
        return None

    def _exchange(self, what: str, work: Callable[[], tuple[K, S]]) -> tuple[K, list[S]]:
        """Run ``work`` on every rank: (what this rank keeps, every rank's shared record in rank order)."""
        kept, shared = work()
        return kept, [shared]

    def _on_committer(self, work: Callable[[], T]) -> T:
        """Run ``work`` on rank 0; every rank returns its value or raises its error."""
        return work()

    def _patch_metadata(self, version: int) -> dict[str, str]:
        """The ``__metadata__`` strings of this rank's patch file."""
        return {"run": self.run, "version": str(version), "base_version": str(version - 1)}

    # -- public API (documented on Publisher) ------------------------------------------------

    def publish(
        self,
        model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        step: int | None = None,
        anchor: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> PublishResult:
        """Publish the served view of ``model_or_state_dict`` as the run's next version; blocks until committed.

        Waits for earlier :meth:`publish_async` calls first (versions stay in call order).

        Args:
            model_or_state_dict: the model (its ``state_dict``) or a state dict; a ``peft.PeftModel`` (LoRA)
                publishes its adapter alone, as a version of an adapter run (:mod:`.adapter_run`).
            step: the training step, stored in the manifest's metadata.
            anchor: ``True`` forces a snapshot in this version; ``None``/``False`` follow the policy.
            metadata: extra JSON-serializable manifest metadata (keep it deterministic).

        Returns:
            The :class:`PublishResult` (``.version`` is the committed version).

        Raises:
            BulletinError: after the client's retries (UnavailableError), or at once on a 4xx;
                the version is then not committed, or committed with exactly these bytes.
            ServedViewError, PublishError: see :mod:`.served_view`, :mod:`.async_publish`.
            AdapterRefusedError: a PEFT model an adapter run does not serve, or a change of the run's kind or
                adapter (:mod:`.adapter_run`); nothing is uploaded.
        """
        self._worker.admit()
        try:
            self._worker.flush()
            t0 = time.perf_counter()
            model_or_state_dict = self._adapter_run.take(model_or_state_dict)
            view = self._stream_of(model_or_state_dict) or self._take_view(model_or_state_dict)
            return self._publish_view(view, step, bool(anchor), metadata, time.perf_counter() - t0)
        finally:
            self._worker.release()

    def publish_view(
        self,
        view: Mapping[str, RawTensor] | StreamedView,
        step: int | None = None,
        anchor: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> PublishResult:
        """Publish an already-made served view (checkpoint name -> raw tensor, any dtypes), e.g. a
        checkpoint read with :func:`stitchboard.proto.checkpoint.load_checkpoint`.

        The tensors are kept as the base of the next delta and must not change afterwards (the publisher
        never writes them: a streamed publish copies a tensor of theirs before writing its change). A
        :class:`~.stream.StreamedView` (``Publisher.stream_view``) is published as the view it holds.
        Arguments, result and errors as :meth:`publish`; also:

        Raises:
            PublishError: a streamed view was diffed against another version than the last published one.
        """
        self._worker.admit()
        try:
            self._worker.flush()
            own: ViewPart | StreamedView
            if not isinstance(view, StreamedView):
                own = self._own_view(view)
            elif view.base_version is None:  # no kept view: the stream's tensors are the whole new view
                own = ViewPart(dict(view.whole), frozenset(view.whole), owned=view.owns_whole)
            else:
                own = view
            return self._publish_view(own, step, bool(anchor), metadata, 0.0)
        finally:
            self._worker.release()

    def publish_async(
        self,
        model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        step: int | None = None,
        anchor: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Future[PublishResult]:
        """Snapshot the served view now, publish it in the background; returns a future.

        The copy is taken before returning, so the next optimizer step may change the weights
        at once: each publish in flight holds a whole new served view besides the kept one (unlike
        :meth:`publish`, which streams a delta tensor by tensor). Blocks while ``max_pending``
        publishes are in flight (backpressure). If an earlier background publish failed, its error
        is raised here (and by :meth:`flush` / :meth:`close`), once.

        Returns:
            A future resolving to the :class:`PublishResult`.
        """
        self._worker.admit()
        try:
            t0 = time.perf_counter()
            view = self._take_view(self._adapter_run.take(model_or_state_dict))
            cast_s = time.perf_counter() - t0
        except BaseException:
            self._worker.release()
            raise
        return self._worker.submit(lambda: self._publish_view(view, step, bool(anchor), metadata, cast_s))

    def wait_for_fleet(
        self, version: int, *, min_replicas: int | None = None, fraction: float | None = None, timeout_s: float = 300.0
    ) -> FleetCount:
        """Block until enough live replicas serve ``version`` or later (see :func:`.fleet.wait_for_fleet`; neither
        ``min_replicas`` nor ``fraction``: every live replica).

        Raises :class:`FleetTimeoutError` naming the laggards."""
        return wait_for_fleet(
            self.client, self.run, version, min_replicas=min_replicas, fraction=fraction, timeout_s=timeout_s
        )

    def flush(self) -> None:
        """Wait until every :meth:`publish_async` is committed; raise the first failure, if any."""
        self._worker.flush()

    def close(self) -> None:
        """Flush, stop the worker and close the bulletin client (if this publisher made it)."""
        try:
            self._worker.close()
        finally:
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one version -------------------------------------------------------------------------

    def _adopt_pending(self, version: int) -> bool:
        """After a commit whose answer was lost: if ``version`` holds exactly that pending
        manifest, take it as the last published version and return True."""
        pending = self._pending
        if pending is None or pending.manifest.version != version:
            return False
        self._pending = None
        if not self._on_committer(
            lambda: canonical_json(self.client.manifest(self.run, version)) == canonical_json(pending.manifest)
        ):
            return False
        log.warning("run %s: version %d was committed although its publish reported a failure", self.run, version)
        self._published = pending.adopt()
        return True

    def _resolve_pending(self) -> None:
        """Settle a publish whose commit answer was lost before a stream is diffed against the kept view: adopt
        its version if the bulletin holds it, else forget it (that publish then never happened).

        Raises:
            BulletinError: reading the version failed (other than not found); the pending publish is kept.
        """
        pending = self._pending
        if pending is not None:
            try:
                self._adopt_pending(pending.manifest.version)
            except NotFoundError:
                log.info("run %s: version %d was not committed", self.run, pending.manifest.version)
            except BaseException:
                self._pending = pending
                raise

    def _publish_view(
        self,
        view: ViewPart | StreamedView,
        step: int | None,
        anchor: bool,
        metadata: Mapping[str, Any] | None,
        cast_s: float,
    ) -> PublishResult:
        with self._lock:
            if self.pacing is not None:
                pacing = self.pacing
                self._on_committer(
                    lambda: pacing.before_publish(
                        self.client, self.run, 0 if self._published is None else self._published.version + 1
                    )
                )
            while True:
                try:
                    return self._attempt(view, step, anchor, metadata, cast_s)
                except VersionConflictError:
                    # The same weights again would have been a no-op success; other weights
                    # meet the version whose commit answer was lost: go on after it.
                    if not self._adopt_pending(0 if self._published is None else self._published.version + 1):
                        raise

    def _encode(
        self, view: ViewPart | StreamedView, last: PublishedVersion | None, version: int
    ) -> tuple[EncodedPart, EncodeReport]:
        if isinstance(view, StreamedView):
            if last is None or view.base_version != last.version:
                raise PublishError(
                    f"run {self.run}: the streamed view was diffed against version {view.base_version}, but the "
                    f"last published version is {None if last is None else last.version}: stream it again"
                )
            part = view.part(self._patch_metadata(version))
            changed = set(last.tensors) != set(view.layout) or part.tensor_set_changed
            nbytes = sum(t.nbytes for t in view.layout.values())
            return part, EncodeReport(changed, shard_groups(view.layout, self.max_shard_bytes), nbytes)
        if view.error is not None:
            raise view.error
        base = None if last is None else {n: last.tensors[n] for n in view.tensors if n in last.tensors}
        part = encode_part(
            view.tensors, base, last.view if last else None, self.encoding, self._patch_metadata(version)
        )
        changed = last is not None and (set(last.tensors) != view.names or part.tensor_set_changed)
        return part, EncodeReport(
            changed, shard_groups(view.tensors, self.max_shard_bytes), sum(t.nbytes for t in view.tensors.values())
        )

    def _write_and_upload(
        self,
        folder: Path,
        version: int,
        view: ViewPart | StreamedView,
        part: EncodedPart,
        weight_map: dict[str, str],
        index: tuple[FileRef, bytes] | None,
        snapshot: bool,
    ) -> tuple[float, RankPart]:
        """Write this rank's patch and shards, upload them (rank 0: the index and assets too);
        (write seconds, record)."""
        t0 = time.perf_counter()
        items: list[tuple[FileRef, bytes | Path]] = []
        if part.patch is not None:
            items.append((bytes_ref(f"patch-v{version}-r{self.rank}.safetensors", part.patch, "patch"), part.patch))
        layout: Mapping[str, TensorLayout]
        if isinstance(view, StreamedView):
            layout, kept = view.layout, self._published.view if self._published else None
            own = {n: shard for n, shard in weight_map.items() if n in layout}
            shards = write_shards_streaming(folder, layout, own, lambda n: view.tensor(n, kept or {}))
        else:
            layout = view.tensors
            own = {n: shard for n, shard in weight_map.items() if n in layout}
            shards = write_shards(folder, view.tensors, own)
        items += [(file_ref(p, "snapshot"), p) for p in shards]
        write_s = time.perf_counter() - t0
        uploaded = upload_files(
            self.client, self.run, items + ([index] if index is not None and self.rank == 0 else [])
        )
        if snapshot and self.rank == 0:
            uploaded += upload_assets(self.client, self.run, self._assets, self._asset_data)
        specs = tensor_specs(layout, part.checksums)
        return write_s, RankPart(
            part.encoding, [ref for ref, _ in items], specs, part.changed_elements, len(part.changed_tensors), uploaded
        )

    def _adopter(
        self, view: ViewPart | StreamedView, last: PublishedVersion | None, manifest: VersionManifest, snapshot: bool
    ) -> Callable[[], PublishedVersion]:
        """What makes the committed ``manifest`` the last published version: the new view kept (a streamed one
        written into the kept view in place, only then)."""
        tensors = {t.name: BaseTensor(t.dtype, tuple(t.shape), t.checksums[XXH3_128]) for t in manifest.tensors}
        since = 0 if snapshot or last is None else last.since_anchor + 1
        if isinstance(view, ViewPart):
            owned = frozenset(view.tensors) if view.owned else frozenset()
            return lambda: PublishedVersion(manifest.version, view.tensors, tensors, since, owned)
        assert last is not None and last.view is not None  # _encode checked the stream's base

        def commit() -> PublishedVersion:
            kept, owned = view.commit_into(last.view or {}, last.owned)
            return PublishedVersion(manifest.version, kept, tensors, since, owned)

        return commit

    def _attempt(
        self,
        view: ViewPart | StreamedView,
        step: int | None,
        anchor: bool,
        metadata: Mapping[str, Any] | None,
        cast_s: float,
    ) -> PublishResult:
        last = self._published
        version = 0 if last is None else last.version + 1
        t0 = time.perf_counter()
        part, encoded = self._exchange(f"encoding version {version}", lambda: self._encode(view, last, version))
        tensor_set_changed = any(e.tensor_set_changed for e in encoded)
        snapshot = needs_snapshot(last, anchor, tensor_set_changed, self.snapshot_every)
        weight_map = shard_layout([e.shard_groups for e in encoded]) if snapshot else {}
        index = None
        if len(set(weight_map.values())) > 1:
            data = index_json(weight_map, sum(e.view_bytes for e in encoded))
            index = (bytes_ref(INDEX_NAME, data, "snapshot"), data)
        t1 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="stitchboard-publish-", dir=self.workdir) as tmp:
            write_s, parts = self._exchange(
                f"uploading version {version}",
                lambda: self._write_and_upload(Path(tmp), version, view, part, weight_map, index, snapshot),
            )
        t2 = time.perf_counter()
        files = [f for p in parts for f in p.files]
        manifest = build_manifest(
            self.run,
            version,
            tensors=[t for p in parts for t in p.tensors],
            patches=[f for f in files if f.role == "patch"],
            snapshots=[f for f in files if f.role == "snapshot"] + ([index[0]] if index is not None else []),
            assets=self._assets,
            encoding=parts[0].encoding,
            changed_elements=sum(p.changed_elements for p in parts),
            metadata=version_metadata(step, tensor_set_changed, metadata),
        ).model_copy(update={"served": self.served.name, "adapter": self._adapter_run.spec})
        adopt = self._adopter(view, last, manifest, snapshot)
        try:
            committed = self._on_committer(lambda: self.client.publish(manifest))
        except UnavailableError:
            self._pending = _Pending(manifest, adopt)  # the answer may be lost after a commit
            raise
        self._pending = None
        if committed.version != version:  # the latest version holds this step with these bits: a no-op
            log.info("run %s: step %s is version %d with the same bits; nothing new", self.run, step, committed.version)
            return replace(
                version_result(
                    manifest,
                    snapshot,
                    parts,
                    cast_s=cast_s,
                    diff_s=t1 - t0,
                    write_s=write_s,
                    upload_s=t2 - t1 - write_s,
                    commit_s=time.perf_counter() - t2,
                ),
                version=committed.version,
                snapshot=committed.snapshot,
                encoded_bytes=committed.size_bytes,
                snapshot_bytes=committed.snapshot_bytes,
            )
        old = None if last is None or tensor_set_changed else last.view
        self._published = adopt()
        t3 = time.perf_counter()
        if isinstance(view, ViewPart):  # a streamed publish runs only without squashes (Publisher._stream_of)
            self._squasher.after_commit(
                manifest,
                old,
                self._published.view or {},  # this rank's tensors of the new view (a shard-local one's: its pieces)
                {n: t.checksum for n, t in last.tensors.items()} if last else {},
                self._exchange,
                self._on_committer,
            )
        result = version_result(
            manifest,
            snapshot,
            parts,
            cast_s=cast_s,
            diff_s=t1 - t0,
            write_s=write_s,
            upload_s=t2 - t1 - write_s,
            commit_s=t3 - t2,
        )
        if self.rank == 0:
            log_result(self.run, result)
        return result
