"""Fetching (runs in the sidecar): download a plan's files into the hand-off folder, verify and
decode them; the engine is untouched. (Staging *inside* the engine is :mod:`.engines.vllm.update`.)

Files land at ``<folder>/<run>/v<version>-<kind>/<path>`` (a memory-backed folder the engine
reads; ``kind`` is ``delta``, ``squash`` or ``snapshot``, so a step's folder holds its files only). Downloads run
concurrently (``concurrency`` at once) through
:meth:`BulletinClient.download_blob`, which retries, resumes partial files and verifies sha256
and size; with regional relays configured each blob is asked of them first (:mod:`.relays`). A
file staged earlier (a coalesced re-plan, or a restart) is re-hashed and reused.

Each step is then checked against its manifest before anything reaches the engine
(DESIGN.md invariant 5), by the files' sha256 (at download), their indexes and their lineage;
the sidecar never decodes a payload (DESIGN.md, "Decoded once, where it is written"): the
engine process decodes and validates every patch in full before its first write
(:mod:`.engines.vllm.update`, :mod:`.engines.sglang.inplace`), and refuses a malformed one:

* delta: every patch file's container, index and payload size are checked, reading no payload
  (:func:`~stitchboard.proto.decode.read_patch_index`); the patch's encoding, tensor names,
  dtypes and shapes agree with the manifest, its target checksums are the manifest's, its base
  checksums are the previous version's (when that manifest is known), and tensors it does not
  touch keep the previous version's checksums;
* squash (one patch from an older version ``base`` straight to ``version``): the same checks as
  a delta by the patch indexes, against the manifests of ``base`` (fetched when the plan does
  not hold it: a squash is always checked against its base) and ``version``
  (:func:`~stitchboard.proto.squash_schema.check_patch_lineage`); the engine applies it like a
  delta, from ``base``. A squash step that fails here (its bytes are not its sha256, as a copy
  corrupted in the store; its blob is gone; its index disagrees) raises a :class:`StagingError`
  naming it (details ``squash_base``, ``squash_target``): the reconciler sets it aside
  (:mod:`.quarantine`) and plans without it;
* snapshot: the shards hold exactly the manifest's tensors, dtypes and shapes (their headers);
  the engine checks each tensor's checksum against the manifest before its first write.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import BlobMismatchError, NotFoundError
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.proto.decode import PatchIndex, read_patch_index
from stitchboard.proto.errors import PatchError, PatchFormatError, SchemaError, StitchError
from stitchboard.proto.parts import same_checksum
from stitchboard.proto.schema import FileRef, Plan, PlanStep, VersionManifest
from stitchboard.proto.squash_schema import check_patch_lineage

from .errors import StagingError
from .relays import Relays

_CHUNK = 1 << 20


@dataclass(frozen=True)
class FetchedStep:
    """One verified step, ready for the engine.

    Attributes:
        version: the version this step brings the engine to.
        kind: ``snapshot`` (load the shards), ``delta`` or ``squash`` (apply the patch files, all at once).
        folder: the step's hand-off folder (its files and nothing else).
        paths: staged patch files, or snapshot shards (``.safetensors``; an index json is not listed).
        manifest: the version's manifest (target checksums).
        base_version: the version the patch files apply to (``version - 1`` for a delta, the
            squash's base; ``None`` for a snapshot).
    """

    version: int
    kind: Literal["snapshot", "delta", "squash"]
    folder: Path
    paths: list[Path]
    manifest: VersionManifest
    base_version: int | None = None

    @property
    def empty(self) -> bool:
        """An empty delta (or squash): the version flips without touching the engine."""
        return self.kind != "snapshot" and not self.paths


@dataclass
class FetchedPlan:
    """A plan whose files are all staged and verified.

    Attributes:
        from_version: the version the plan starts from (None: nothing; the first step is a snapshot).
        to_version: the version the plan ends at.
        steps: the steps in order.
        bytes_fetched: bytes downloaded for it (reused files excluded).
        seconds: wall time spent staging it, seconds.
    """

    from_version: int | None
    to_version: int
    steps: list[FetchedStep] = field(default_factory=list)
    bytes_fetched: int = 0
    seconds: float = 0.0


def squash_failed(step: PlanStep, exc: Exception) -> StagingError:
    """The error of a squash step that failed a check (``exc``), naming its span in its details."""
    message = exc.message if isinstance(exc, StitchError) else str(exc)
    return StagingError(
        f"squash {step.from_version} -> {step.version}: {type(exc).__name__}: {message}",
        squash_base=step.from_version,
        squash_target=step.version,
    )


def patch_index(path: Path) -> PatchIndex:
    """A patch file's container, index and payload size, checked without reading its payload.

    Raises:
        PatchFormatError: as :func:`~stitchboard.proto.decode.read_patch_index`, or the file
            shrank while being read.
    """
    with path.open("rb") as f:

        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            data = f.read(length)
            if len(data) != length:
                raise PatchFormatError(f"{path}: {length} bytes at {offset} wanted, {len(data)} read (file changed?)")
            return data

        return read_patch_index(read, path.stat().st_size, what=str(path))


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Fetcher:
    """Stages plans of one run into ``folder/<run>`` (blocking; call from a worker thread).

    Args:
        client: the bulletin client (shared, thread-safe).
        run: run id.
        folder: the handoff folder (created if needed).
        concurrency: files downloaded at once.
        relays: regional relays asked for each blob before the bulletin (None: the bulletin only).
    """

    def __init__(
        self,
        client: BulletinClient,
        run: str,
        folder: str | Path,
        concurrency: int = 4,
        relays: Relays | None = None,
    ) -> None:
        self.client = client
        self.relays = relays
        self.run = run
        self.root = Path(folder) / run
        self.root.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="stitch-fetch")

    def close(self) -> None:
        """Stop the download threads (running downloads finish in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def folder_of(self, version: int, kind: str) -> Path:
        """The hand-off folder of one step."""
        return self.root / f"v{version}-{kind}"

    def _fetch(self, step: PlanStep, ref: FileRef) -> int:
        # Returns the bytes downloaded (0 when a verified earlier copy was reused).
        dest = self.folder_of(step.version, step.kind) / ref.path
        if dest.exists() and dest.stat().st_size == ref.size_bytes and _sha256_of(dest) == ref.sha256:
            return 0
        try:
            if self.relays is not None:
                self.relays.download(self.client, self.run, ref.sha256, dest, ref.size_bytes)
            else:
                self.client.download_blob(self.run, ref.sha256, dest, ref.size_bytes)
        except (BlobMismatchError, NotFoundError) as exc:  # a squash's stored copy is corrupt or gone
            if step.kind == "squash":
                raise squash_failed(step, exc) from exc
            raise
        return ref.size_bytes

    def fetch(self, plan: Plan, base: VersionManifest | None) -> FetchedPlan:
        """Download and verify every file of ``plan``; the engine is not touched.

        Args:
            plan: from the bulletin.
            base: manifest of ``plan.from_version`` (checks the first delta's base checksums), or None.

        Returns:
            The :class:`FetchedPlan`.

        Raises:
            BulletinError: a manifest or file cannot be fetched (``BlobMismatchError``: wrong bytes).
            PatchFormatError: a patch's container or index is malformed (its payload is the engine's to decode).
            StagingError: a file disagrees with its manifest; a squash step's file is corrupt, gone
                or disagrees with its versions (details ``squash_base``, ``squash_target``).
        """
        start = time.perf_counter()
        manifests = list(self._pool.map(lambda s: self.client.manifest(self.run, s.version), plan.steps))
        wanted = [(s, f) for s in plan.steps for f in s.files if f.role != "asset"]
        fetched = sum(self._pool.map(lambda args: self._fetch(*args), wanted))
        staged = FetchedPlan(plan.from_version, plan.to_version, bytes_fetched=fetched)
        previous = base
        for step, manifest in zip(plan.steps, manifests, strict=True):
            if manifest.version != step.version:
                raise StagingError(f"the bulletin answered manifest {manifest.version} for version {step.version}")
            folder = self.folder_of(step.version, step.kind)
            if step.kind == "snapshot":
                paths = [folder / f.path for f in manifest.files_of("snapshot") if not f.path.endswith(".json")]
                self._check_snapshot(manifest, folder)
            elif step.kind == "squash":
                paths = [folder / f.path for f in step.files]
                self._check_squash(step, manifest, paths, previous)
            else:
                paths = [folder / f.path for f in manifest.files_of("patch")]
                self._check_delta(manifest, paths, previous)
            staged.steps.append(FetchedStep(step.version, step.kind, folder, paths, manifest, step.from_version))
            previous = manifest
        staged.seconds = time.perf_counter() - start
        return staged

    def _check_snapshot(self, manifest: VersionManifest, folder: Path) -> None:
        shards = manifest.files_of("snapshot")
        index = [f for f in shards if f.path.endswith(".json")]
        where = folder / index[0].path if index else folder / shards[0].path
        if not index and len(shards) > 1:
            raise StagingError(f"snapshot of version {manifest.version} has {len(shards)} shards but no index json")
        tensors = load_checkpoint(where)
        want = manifest.tensor_map()
        if set(tensors) != set(want):
            raise StagingError(
                f"snapshot of version {manifest.version}: tensors differ from the manifest (missing "
                f"{sorted(set(want) - set(tensors))[:3]}, extra {sorted(set(tensors) - set(want))[:3]})"
            )
        for name, t in tensors.items():
            spec = want[name]
            if t.dtype != spec.dtype or list(t.shape) != spec.shape:  # its checksum: the engine, before writing
                raise StagingError(
                    f"snapshot of version {manifest.version}: tensor {name!r} differs from the manifest (dtype or "
                    "shape)"
                )

    def _check_delta(self, manifest: VersionManifest, paths: list[Path], previous: VersionManifest | None) -> None:
        v = manifest.version
        want = manifest.tensor_map()
        adjacent = previous if previous is not None and previous.version == v - 1 else None
        before = adjacent.tensor_map() if adjacent is not None else None
        if adjacent is not None and adjacent.layout() != manifest.layout():
            raise StagingError(
                f"version {v} changes the tensor set of version {v - 1}: a delta cannot, it needs an anchor"
            )
        touched: set[str] = set()
        for path in paths:
            patch = patch_index(path)
            if patch.encoding != manifest.encoding:
                raise StagingError(
                    f"{path}: encoding {patch.encoding!r}, the manifest of version {v} says {manifest.encoding!r}"
                )
            for name, entry in patch.entries.items():
                spec = want.get(name)
                if spec is None or entry.dtype != spec.dtype or list(entry.shape) != spec.shape:
                    raise StagingError(
                        f"{path}: tensor {name!r} is not in version {v}'s manifest with that dtype and shape"
                    )
                if name in touched:
                    raise StagingError(f"version {v}: tensor {name!r} appears in two patch files")
                if not same_checksum(entry.target, spec.checksums):
                    raise StagingError(f"{path}: tensor {name!r} target checksum differs from version {v}'s manifest")
                if before is not None and not same_checksum(entry.base, before[name].checksums):
                    raise StagingError(f"{path}: tensor {name!r} base checksum is not version {v - 1}'s")
                touched.add(name)
        if before is not None:
            moved = sorted(
                n for n in want if n not in touched and not same_checksum(want[n].checksums, before[n].checksums)
            )
            if moved:
                raise StagingError(f"version {v}: tensors {moved[:3]} change checksum but no patch touches them")

    def _check_squash(
        self, step: PlanStep, manifest: VersionManifest, paths: list[Path], previous: VersionManifest | None
    ) -> None:
        base_version = step.from_version
        assert base_version is not None  # a squash step always names its base (PlanStep checks it)
        base = (
            previous
            if previous is not None and previous.version == base_version
            else self.client.manifest(self.run, base_version)
        )
        indexes = []
        try:
            for path in paths:
                indexes.append((str(path), patch_index(path).entries))
            check_patch_lineage(indexes, base, manifest)
        except (PatchError, SchemaError) as exc:
            raise squash_failed(step, exc) from None

    def discard(self) -> None:
        """Remove every staged file of the run (after a commit: the engine has what it needs)."""
        for child in self.root.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
