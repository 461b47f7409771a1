"""``Publisher``: the call a trainer adds to its loop to publish its served view as a version.

Per publish: snapshot the served view (bf16 cast by default, see :mod:`.served_view`), diff it
bitwise against the last published view kept in host memory, encode the patch, upload the
files (by sha256; files the bulletin already has are skipped), then commit the manifest. The
commit is the only point where the version comes to exist (DESIGN.md invariant 4).

Versions: the first publish of a run is version 0, an anchor (full snapshot + run assets).
Every later publish is a delta from the previous version; it also carries a snapshot
(an anchor) every ``snapshot_every`` versions, when the tensor set or a dtype/shape changed,
or when asked (``anchor=True``). A retried publish is idempotent: files and manifest are
deterministic, so the same weights give the same version with the same bytes.

Memory: the last published view is kept on the host, one copy (2 bytes per bf16 element:
269 MB for SmolLM2-135M, 16 GB for an 8B model) plus its checksums (~100 bytes per tensor).
Each publish in flight holds one more copy until it is committed (``max_pending`` of them with
``publish_async``). Snapshot shards are written to a temporary folder (``workdir``) and removed
after upload.

Failures: the bulletin client retries transport errors and 5xx answers with exponential
backoff and never retries 4xx; what still fails is raised (``UnavailableError``,
``VersionConflictError``, ``AuthError``...), and the publisher's state stays at the last
committed version. If the commit's answer was lost (``UnavailableError`` at commit), publishing
the same weights again is a no-op success for the same version; publishing newer weights finds
that version taken, checks that it is the lost commit, and carries on after it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import UnavailableError, VersionConflictError
from stitchboard.proto.checkpoint import DEFAULT_SHARD_BYTES, save_checkpoint
from stitchboard.proto.container import RawTensor
from stitchboard.proto.schema import XXH3_128, Encoding, FileRef, VersionManifest, canonical_json, check_run_id

from .assets import Asset, check_same_assets, load_assets
from .async_publish import BoundedWorker
from .encode_version import BaseTensor, build_manifest, bytes_ref, encode_part, file_ref, tensor_specs, version_metadata
from .publish_result import PublishResult, log_result
from .resume import rebuild_version
from .served_view import DtypeMap, served_view
from .uploads import upload_assets, upload_files

log = logging.getLogger("stitchboard.trainer_client")


@dataclass
class _Published:
    """The last committed version: its view (None after ``resume="anchor"``) and tensor facts."""

    version: int
    view: dict[str, RawTensor] | None
    tensors: dict[str, BaseTensor]
    since_anchor: int


class Publisher:
    """Publishes a trainer's served view to a bulletin run, one version per call.

    Args:
        url: bulletin base URL, e.g. ``http://bulletin:8700``.
        run: run id (1-128 of ``[A-Za-z0-9._-]``).
        token: bearer token with the ``publish`` scope (None for an open bulletin).
        encoding: patch encoding, ``xor`` (default, smallest) or ``overwrite``.
        snapshot_every: a version also carries a snapshot when this many versions passed since
            the last one (>= 1; default 10).
        dtypes: per-tensor served dtype (checkpoint name or fnmatch pattern -> torch dtype).
        default_dtype: served dtype of the other floating tensors (default bf16).
        assets: the model's non-weight files (a folder, or ``{file name: bytes}``), published
            with version 0 and referenced by every anchor; see :mod:`.assets`.
        resume: for a run that already has versions, ``"rebuild"`` rebuilds the last version
            from the bulletin and verifies it against its manifest (downloads one anchor and
            the deltas after it); ``"anchor"`` skips that and makes the next version an anchor
            whose delta sends every changed tensor whole (``overwrite``).
        max_pending: publishes in flight with :meth:`publish_async` (running + queued, >= 1).
        max_shard_bytes: largest snapshot shard file, bytes (default 2 GiB).
        retries, backoff_s, timeout_s: the bulletin client's retries after a transport error
            or 5xx, first backoff delay (doubling, seconds) and per-request timeout (seconds).
        workdir: folder for temporary snapshot shards, created if missing (default: the system temp folder).
        client: a ready :class:`BulletinClient` to use instead of one built from ``url``/``token``.

    Raises:
        SchemaError: bad run id.
        AssetsError: ``assets`` invalid, or differ from the assets the run already carries.
        ResumeError, BulletinError, PatchError: resuming an existing run failed (see
            :func:`~stitchboard.trainer_client.resume.rebuild_version`).
    """

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        encoding: Encoding = "xor",
        snapshot_every: int = 10,
        dtypes: DtypeMap | None = None,
        default_dtype: torch.dtype = torch.bfloat16,
        assets: str | os.PathLike[str] | Mapping[str, bytes] | None = None,
        resume: Literal["rebuild", "anchor"] = "rebuild",
        max_pending: int = 2,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 60.0,
        workdir: str | os.PathLike[str] | None = None,
        client: BulletinClient | None = None,
    ) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.run = check_run_id(run)
        self.encoding: Encoding = encoding
        self.snapshot_every = snapshot_every
        self.dtypes = dtypes
        self.default_dtype = default_dtype
        self.max_shard_bytes = max_shard_bytes
        self.workdir = workdir
        if workdir is not None:
            Path(workdir).mkdir(parents=True, exist_ok=True)
        self._owns_client = client is None
        self.client = client or BulletinClient(url, token, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        self._worker = BoundedWorker(max_pending)
        self._lock = threading.Lock()
        self._pending: tuple[VersionManifest, _Published] | None = None
        given = load_assets(assets) if assets is not None else None
        self._published, self._assets = self._resume(resume, given)
        self._asset_data = {a.path: a.data for a in given or []}

    # -- resume ------------------------------------------------------------------------------

    def _resume(self, mode: str, given: list[Asset] | None) -> tuple[_Published | None, list[FileRef]]:
        latest = self.client.latest(self.run)
        if latest is None:
            return None, [a.ref for a in given or []]
        if mode == "rebuild":
            rebuilt = rebuild_version(self.client, self.run, latest, workdir=self.workdir)
            view, manifest = rebuilt.view, rebuilt.manifest
            assets = rebuilt.assets
            since = latest - self.client.plan(self.run, None, latest).steps[0].version
        elif mode == "anchor":
            manifest, view, since = self.client.manifest(self.run, latest), None, 0
            assets = [f for f in self.client.plan(self.run, None, latest).steps[0].files if f.role == "asset"]
        else:
            raise ValueError(f"resume must be 'rebuild' or 'anchor', got {mode!r}")
        if given is not None:
            check_same_assets(assets, given)
        tensors = {t.name: BaseTensor(t.dtype, tuple(t.shape), t.checksums[XXH3_128]) for t in manifest.tensors}
        log.info("run %s: resuming after version %d (%s)", self.run, latest, "view rebuilt and verified" if view else "next version is an anchor")
        return _Published(latest, view, tensors, since), assets

    @property
    def last_version(self) -> int | None:
        """The last version this publisher committed or resumed from (None: the run is empty)."""
        return self._published.version if self._published else None

    # -- public API --------------------------------------------------------------------------

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
            model_or_state_dict: the model (its ``state_dict``) or a state dict.
            step: the training step, stored in the manifest's metadata.
            anchor: ``True`` forces a snapshot in this version; ``None``/``False`` follow the policy.
            metadata: extra JSON-serializable manifest metadata (keep it deterministic).

        Returns:
            The :class:`PublishResult` (``.version`` is the committed version).

        Raises:
            BulletinError: after the client's retries (UnavailableError), or at once on a 4xx;
                the version is then not committed, or committed with exactly these bytes.
            ServedViewError, PublishError: see :mod:`.served_view`, :mod:`.async_publish`.
        """
        self._worker.admit()
        try:
            self._worker.flush()
            t0 = time.perf_counter()
            view = served_view(model_or_state_dict, self.dtypes, self.default_dtype)
            return self._publish_view(view, step, bool(anchor), metadata, time.perf_counter() - t0)
        finally:
            self._worker.release()

    def publish_view(
        self,
        view: Mapping[str, RawTensor],
        step: int | None = None,
        anchor: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> PublishResult:
        """Publish an already-made served view (checkpoint name -> raw tensor, any dtypes), e.g. a
        checkpoint read with :func:`stitchboard.proto.checkpoint.load_checkpoint`.

        The tensors are kept as the base of the next delta and must not change afterwards.
        Arguments, result and errors as :meth:`publish`.
        """
        self._worker.admit()
        try:
            self._worker.flush()
            return self._publish_view(dict(sorted(view.items())), step, bool(anchor), metadata, 0.0)
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
        at once. Blocks while ``max_pending`` publishes are in flight (backpressure). If an
        earlier background publish failed, its error is raised here (and by :meth:`flush` /
        :meth:`close`), once.

        Returns:
            A future resolving to the :class:`PublishResult`.
        """
        self._worker.admit()
        try:
            t0 = time.perf_counter()
            view = served_view(model_or_state_dict, self.dtypes, self.default_dtype)
            cast_s = time.perf_counter() - t0
        except BaseException:
            self._worker.release()
            raise
        return self._worker.submit(lambda: self._publish_view(view, step, bool(anchor), metadata, cast_s))

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

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one version -------------------------------------------------------------------------

    def _adopt_pending(self, version: int) -> bool:
        """After a commit whose answer was lost: if ``version`` holds exactly that pending
        manifest, take it as the last published version and return True."""
        if self._pending is None or self._pending[0].version != version:
            return False
        manifest, published = self._pending
        self._pending = None
        if canonical_json(self.client.manifest(self.run, version)) != canonical_json(manifest):
            return False
        log.warning("run %s: version %d was committed although its publish reported a failure", self.run, version)
        self._published = published
        return True

    def _publish_view(self, view: dict[str, RawTensor], step: int | None, anchor: bool, metadata: Mapping[str, Any] | None, cast_s: float) -> PublishResult:
        with self._lock:
            while True:
                try:
                    return self._attempt(view, step, anchor, metadata, cast_s)
                except VersionConflictError:
                    # The same weights again would have been a no-op success; other weights
                    # meet the version whose commit answer was lost: go on after it.
                    if not self._adopt_pending(0 if self._published is None else self._published.version + 1):
                        raise

    def _attempt(self, view: dict[str, RawTensor], step: int | None, anchor: bool, metadata: Mapping[str, Any] | None, cast_s: float) -> PublishResult:
        last = self._published
        version = 0 if last is None else last.version + 1
        meta = {"run": self.run, "version": str(version), "base_version": str(version - 1)}
        t0 = time.perf_counter()
        part = encode_part(view, last.tensors if last else None, last.view if last else None, self.encoding, meta)
        t1 = time.perf_counter()
        snapshot = last is None or anchor or last.view is None or part.tensor_set_changed or last.since_anchor + 1 >= self.snapshot_every
        with tempfile.TemporaryDirectory(prefix="stitchboard-publish-", dir=self.workdir) as tmp:
            patches = [bytes_ref(f"patch-v{version}-r0.safetensors", part.patch, "patch")] if part.patch is not None else []
            shard_paths = save_checkpoint(Path(tmp), view, max_shard_bytes=self.max_shard_bytes) if snapshot else []
            snapshots = [file_ref(p, "snapshot") for p in shard_paths]
            t2 = time.perf_counter()
            items = [(ref, part.patch) for ref in patches] + list(zip(snapshots, shard_paths, strict=True))
            uploaded = upload_files(self.client, self.run, items)
            if snapshot:
                uploaded += upload_assets(self.client, self.run, self._assets, self._asset_data)
        t3 = time.perf_counter()
        manifest = build_manifest(
            self.run,
            version,
            tensors=tensor_specs(view, part.checksums),
            patches=patches,
            snapshots=snapshots,
            assets=self._assets,
            encoding=part.encoding,
            changed_elements=part.changed_elements,
            metadata=version_metadata(step, part, metadata),
        )
        tensors = {n: BaseTensor(view[n].dtype, tuple(view[n].shape), part.checksums[n]) for n in view}
        published = _Published(version, view, tensors, 0 if snapshot else last.since_anchor + 1)
        try:
            self.client.publish(manifest)
        except UnavailableError:
            self._pending = (manifest, published)  # the answer may be lost after a commit
            raise
        self._published, self._pending = published, None
        t4 = time.perf_counter()
        result = PublishResult(
            version=version,
            snapshot=snapshot,
            changed_elements=part.changed_elements,
            total_elements=part.total_elements,
            changed_tensors=len(part.changed_tensors),
            encoded_bytes=manifest.stats.encoded_bytes,
            snapshot_bytes=sum(f.size_bytes for f in snapshots),
            uploaded_bytes=uploaded,
            view_bytes=sum(t.nbytes for t in view.values()),
            cast_s=cast_s,
            diff_s=t1 - t0,
            write_s=t2 - t1,
            upload_s=t3 - t2,
            commit_s=t4 - t3,
        )
        log_result(self.run, result)
        return result
