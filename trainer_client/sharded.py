"""Sharded publish: every rank of a ``torch.distributed`` job publishes a disjoint part of the view.

Each rank owns a set of whole checkpoint tensors (assigned by size, the largest first to the
least loaded rank, identically on every rank). For a sharded tensor (a ``DTensor`` from FSDP2
or tensor parallelism) every rank joins the gather (``full_tensor()``, a collective) and only
the owner keeps the bf16 copy. A rank keeps the last published view of its own tensors only,
so the kept memory is divided by the world size.

Then each rank diffs and uploads its part: ``patch-v{N}-r{rank}.safetensors`` and, in an
anchor, its snapshot shards (``model-0000i-of-0000n.safetensors``, numbered across ranks, with
one ``model.safetensors.index.json`` written by rank 0). The ranks exchange their file lists,
checksums and counts (two ``all_gather_object`` calls), and rank 0 commits one manifest after
every rank's files are in; the outcome is broadcast, so every rank returns the same result or
raises. Every rank must call :meth:`ShardedPublisher.publish` with the same arguments.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.checkpoint import DEFAULT_SHARD_BYTES, INDEX_NAME, plan_shards
from stitchboard.proto.dtypes import DTYPE_SIZES
from stitchboard.proto.schema import XXH3_128, Encoding, check_run_id

from .assets import load_assets
from .encode_version import BaseTensor, build_manifest, bytes_ref, encode_part, file_ref, tensor_specs, version_metadata, write_shards
from .errors import PublishError
from .publish_result import PublishResult, log_result
from .uploads import upload_assets, upload_files
from .resume import rebuild_version
from .served_view import TORCH_DTYPE_NAMES, DtypeMap, cast_served, checkpoint_state, gather_full, served_dtype


def assign_owners(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Tensor name -> owning rank: largest first to the least loaded rank (ties: lowest rank)."""
    load = [0] * world
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


class ShardedPublisher:
    """Publishes one version from all ranks of a process group; rank 0 commits.

    Args:
        url, run, token, encoding, snapshot_every, dtypes, default_dtype, assets,
            max_shard_bytes, retries, backoff_s, timeout_s, workdir, client: as
            :class:`~stitchboard.trainer_client.publisher.Publisher` (``assets`` are read on
            rank 0 only).
        group: the process group (default: the world); must be initialized.

    A run that already has versions is resumed: every rank rebuilds the last version from the
    bulletin (verified against its manifest) and keeps its own tensors at the first publish.

    Raises:
        PublishError: ``torch.distributed`` is not initialized.
        the errors of ``Publisher`` construction.
    """

    def __init__(
        self,
        url: str,
        run: str,
        token: str | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        encoding: Encoding = "xor",
        snapshot_every: int = 10,
        dtypes: DtypeMap | None = None,
        default_dtype: torch.dtype = torch.bfloat16,
        assets: str | os.PathLike[str] | Mapping[str, bytes] | None = None,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 60.0,
        workdir: str | os.PathLike[str] | None = None,
        client: BulletinClient | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise PublishError("ShardedPublisher needs torch.distributed initialized (init_process_group)")
        self.run = check_run_id(run)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.encoding: Encoding = encoding
        self.snapshot_every = snapshot_every
        self.dtypes, self.default_dtype = dtypes, default_dtype
        self.max_shard_bytes, self.workdir = max_shard_bytes, workdir
        if workdir is not None:
            Path(workdir).mkdir(parents=True, exist_ok=True)
        self._owns_client = client is None
        self.client = client or BulletinClient(url, token, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        given = load_assets(assets) if assets is not None and self.rank == 0 else []
        self._asset_data = {a.path: a.data for a in given}
        self._assets = [a.ref for a in given]
        self._version: int | None = None
        self._since_anchor = 0
        self._view: dict = {}
        self._tensors: dict[str, BaseTensor] = {}
        latest = self.client.latest(self.run)
        if latest is not None:
            rebuilt = rebuild_version(self.client, self.run, latest, workdir=workdir)
            self._version, self._view, self._assets = latest, rebuilt.view, rebuilt.assets
            self._tensors = {t.name: BaseTensor(t.dtype, tuple(t.shape), t.checksums[XXH3_128]) for t in rebuilt.manifest.tensors}
            self._since_anchor = latest - self.client.plan(self.run, None, latest).steps[0].version

    def close(self) -> None:
        """Close the bulletin client (if this publisher made it)."""
        if self._owns_client:
            self.client.close()

    def _all(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _raise_any(self, errors: list[str | None], what: str) -> None:
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            raise PublishError(f"{what} failed on rank(s) {[r for r, _ in failed]}: {failed[0][1]}", ranks=[r for r, _ in failed])

    def publish(
        self,
        model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        step: int | None = None,
        anchor: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> PublishResult:
        """Publish this rank's part of the served view; collective, returns the same result on every rank.

        Raises:
            PublishError: a rank failed to encode, upload or commit (naming the ranks);
                nothing is committed unless every rank's files are in.
        """
        t0 = time.perf_counter()
        state = checkpoint_state(model_or_state_dict)
        sizes = {}
        for n, t in state.items():
            dtype = TORCH_DTYPE_NAMES.get(served_dtype(n, t, self.dtypes, self.default_dtype), "U8")
            sizes[n] = t.numel() * DTYPE_SIZES[dtype]
        owners = assign_owners(sizes, self.world)
        view, error, part = {}, None, None
        for name in sorted(state):
            full = gather_full(state[name])  # collective for a DTensor: every rank joins, in order
            if owners[name] == self.rank and error is None:
                try:
                    view[name] = cast_served(name, full, self.dtypes, self.default_dtype)
                except Exception as exc:
                    error = repr(exc)
            del full
        cast_s = time.perf_counter() - t0
        version = 0 if self._version is None else self._version + 1
        try:
            if error is not None:
                raise PublishError(error)
            base = None if self._version is None else {n: self._tensors[n] for n in view if n in self._tensors}
            set_changed = self._version is not None and set(self._tensors) != set(state)
            meta = {"run": self.run, "version": str(version), "base_version": str(version - 1), "rank": str(self.rank)}
            part = encode_part(view, base, self._view if base is not None else None, self.encoding, meta)
            set_changed = set_changed or part.tensor_set_changed
            groups = sorted(set(plan_shards(view, self.max_shard_bytes).values())) if view else []
        except Exception as exc:
            error, set_changed, groups = repr(exc), False, []
        t1 = time.perf_counter()
        first = self._all((error, set_changed, len(groups)))
        self._raise_any([e for e, _, _ in first], f"encoding version {version}")
        snapshot = version == 0 or bool(anchor) or any(c for _, c, _ in first) or self._since_anchor + 1 >= self.snapshot_every
        total_shards = sum(k for _, _, k in first)
        offset = sum(k for _, _, k in first[: self.rank])
        with tempfile.TemporaryDirectory(prefix="stitchboard-publish-", dir=self.workdir) as tmp:
            error, files, weight_map, uploaded = None, [], {}, 0
            try:
                patches = [bytes_ref(f"patch-v{version}-r{self.rank}.safetensors", part.patch, "patch")] if part.patch is not None else []
                items = [(ref, part.patch) for ref in patches]
                if snapshot and view:
                    local = plan_shards(view, self.max_shard_bytes)
                    rename = {g: _shard_name(offset + i, total_shards) for i, g in enumerate(groups)}
                    weight_map = {n: rename[g] for n, g in local.items()}
                    paths = write_shards(Path(tmp), view, weight_map)
                    items += [(file_ref(p, "snapshot"), p) for p in paths]
                uploaded = upload_files(self.client, self.run, items)
                files = [ref for ref, _ in items]
            except Exception as exc:
                error = repr(exc)
        t2 = time.perf_counter()
        specs = tensor_specs(view, part.checksums) if part else []
        second = self._all((error, files, weight_map, specs, part.changed_elements if part else 0, len(part.changed_tensors) if part else 0, uploaded))
        self._raise_any([x[0] for x in second], f"uploading version {version}")
        outcome: list[Any] = [None]
        if self.rank == 0:
            outcome[0] = self._commit(version, snapshot, second, part.encoding, version_metadata(step, part, metadata))
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        error, extra_uploaded, snapshot_bytes = outcome[0]
        if error:
            raise PublishError(f"committing version {version} of run {self.run!r} failed: {error}")
        self._version, self._view = version, view
        self._tensors = {s.name: BaseTensor(s.dtype, tuple(s.shape), s.checksums[XXH3_128]) for x in second for s in x[3]}
        self._since_anchor = 0 if snapshot else self._since_anchor + 1
        t3 = time.perf_counter()
        result = PublishResult(
            version=version,
            snapshot=snapshot,
            changed_elements=sum(x[4] for x in second),
            total_elements=sum(s.numel for x in second for s in x[3]),
            changed_tensors=sum(x[5] for x in second),
            encoded_bytes=sum(f.size_bytes for x in second for f in x[1] if f.role == "patch"),
            snapshot_bytes=snapshot_bytes,
            uploaded_bytes=sum(x[6] for x in second) + extra_uploaded,
            view_bytes=sum(s.size_bytes for x in second for s in x[3]),
            cast_s=cast_s,
            diff_s=t1 - t0 - cast_s,
            write_s=0.0,
            upload_s=t2 - t1,
            commit_s=t3 - t2,
        )
        if self.rank == 0:
            log_result(self.run, result)
        return result

    def _commit(self, version: int, snapshot: bool, parts: list[tuple], encoding: Encoding, metadata: dict) -> tuple[str | None, int, int]:
        """Rank 0: write the index, upload it and the assets, commit; returns (error, bytes sent, snapshot bytes)."""
        try:
            files = [f for x in parts for f in x[1]]
            sent = 0
            if snapshot:
                weight_map = {n: s for x in parts for n, s in x[2].items()}
                if len(set(weight_map.values())) > 1:
                    index = json.dumps({"metadata": {"total_size": sum(s.size_bytes for x in parts for s in x[3])}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
                    ref = bytes_ref(INDEX_NAME, index.encode(), "snapshot")
                    sent += upload_files(self.client, self.run, [(ref, index.encode())])
                    files.append(ref)
                sent += upload_assets(self.client, self.run, self._assets, self._asset_data)
            manifest = build_manifest(
                self.run,
                version,
                tensors=[s for x in parts for s in x[3]],
                patches=[f for f in files if f.role == "patch"],
                snapshots=[f for f in files if f.role == "snapshot"],
                assets=self._assets,
                encoding=encoding,
                changed_elements=sum(x[4] for x in parts),
                metadata=metadata,
            )
            self.client.publish(manifest)
            return None, sent, sum(f.size_bytes for f in files if f.role == "snapshot")
        except Exception as exc:
            return repr(exc), 0, 0


def _shard_name(index: int, total: int) -> str:
    return "model.safetensors" if total == 1 else f"model-{index + 1:05d}-of-{total:05d}.safetensors"
