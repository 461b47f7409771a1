"""Rebuilding a published version from the bulletin alone: plan -> anchor + deltas -> verify.

Used by a restarted publisher (:func:`resume_publisher`, to continue a run from its last
published view) and by ``stitchboard pull`` (to materialize any version as a plain checkpoint).
The result is checked against the target manifest's checksums, tensor by tensor, before it is returned.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto import parts
from stitchboard.proto.apply import apply_patch
from stitchboard.proto.checkpoint import load_checkpoint, save_checkpoint
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.schema import FileRef, VersionManifest, is_checkpoint_file

from .assets import Asset, check_same_assets
from .encode_version import BaseTensor, sha256_file
from .errors import ResumeError
from .version_parts import PublishedVersion


@dataclass
class RebuiltVersion:
    """A version rebuilt from the bulletin.

    Attributes:
        manifest: the version's manifest.
        view: checkpoint name -> tensor (writable host arrays), verified against ``manifest``.
        checksums: checkpoint name -> xxh3-128 hex digest (from the manifest, verified).
        assets: the run asset files the plan's anchor references (role ``asset``).
    """

    manifest: VersionManifest
    view: dict[str, RawTensor]
    checksums: dict[str, str]
    assets: list[FileRef]


def verify_view(manifest: VersionManifest, view: dict[str, RawTensor]) -> dict[str, str]:
    """Check ``view`` against every tensor of ``manifest`` (names, dtypes, shapes, xxh3-128).

    Returns:
        name -> checksum.

    Raises:
        ResumeError: listing missing, extra and mismatching tensors.
    """
    specs = manifest.tensor_map()
    missing, extra = sorted(set(specs) - set(view)), sorted(set(view) - set(specs))
    bad = []
    sums = {}
    for name in sorted(set(specs) & set(view)):
        spec, t = specs[name], view[name]
        if (spec.dtype, tuple(spec.shape)) != (t.dtype, tuple(t.shape)):
            bad.append(name)
            continue
        sums[name] = parts.tensor_checksum(t.bits, t.shape, None if spec.parts is None else tuple(spec.parts))
        if sums[name] != spec.checksum():
            bad.append(name)
    if missing or extra or bad:
        raise ResumeError(
            f"version {manifest.version} of run {manifest.run_id!r} rebuilt from the bulletin does not match its "
            f"manifest: missing {missing[:3]}, extra {extra[:3]}, different {bad[:3]}",
            tensors=missing + extra + bad,
        )
    return sums


def _download(client: BulletinClient, run: str, ref: FileRef, folder: Path) -> Path:
    return client.download_blob(run, ref.sha256, folder / ref.path, expected_size=ref.size_bytes)


def rebuild_version(
    client: BulletinClient, run: str, version: int | None = None, workdir: str | os.PathLike[str] | None = None
) -> RebuiltVersion:
    """Rebuild ``version`` (None: the latest) of ``run`` from its anchor and deltas, and verify it.

    Downloads the anchor's snapshot shards into a temporary folder under ``workdir`` (default:
    the system temp), loads them into memory (one host copy of the view), applies each delta in
    order, checks every tensor against the manifest and removes the temporary files.

    Raises:
        NotFoundError: no such run or version, or no complete route (retention).
        BulletinError: other bulletin failures (after the client's retries).
        PatchError: a downloaded patch is malformed or does not apply to its base.
        ResumeError: the plan has no anchor, or the result differs from the manifest.
    """
    plan = client.plan(run, None, version)
    manifest = client.manifest(run, plan.to_version)
    if not plan.steps or plan.steps[0].kind != "snapshot":
        raise ResumeError(f"the plan to version {plan.to_version} of run {run!r} does not start at an anchor")
    anchor = plan.steps[0]
    with tempfile.TemporaryDirectory(prefix="stitchboard-rebuild-", dir=workdir) as tmp:
        folder = Path(tmp)
        for ref in anchor.files:
            if ref.role == "snapshot":
                _download(client, run, ref, folder / "anchor")
        loaded = load_checkpoint(folder / "anchor")
        view = {name: RawTensor(t.dtype, tuple(t.shape), t.bits.copy()) for name, t in loaded.items()}
        del loaded
        for step in plan.steps[1:]:
            for ref in step.files:
                path = _download(client, run, ref, folder / f"v{step.version}")
                apply_patch(
                    view, read_patch(path.read_bytes(), ref.size_bytes, what=f"{ref.path} of version {step.version}")
                )
    sums = verify_view(manifest, view)
    return RebuiltVersion(manifest, view, sums, [f for f in anchor.files if f.role == "asset"])


def verify_pulled(rebuilt: RebuiltVersion, out: Path) -> None:
    """Check what a pull wrote into ``out``: the checkpoint there, as loaded back, holds exactly the
    manifest's tensors bit for bit, and every asset file has its sha256.

    Raises:
        ResumeError: naming the tensors or asset files that differ.
    """
    verify_view(rebuilt.manifest, load_checkpoint(out))
    bad = [
        ref.path
        for ref in rebuilt.assets
        if not (out / ref.path).is_file() or sha256_file(out / ref.path) != ref.sha256
    ]
    if bad:
        raise ResumeError(
            f"version {rebuilt.manifest.version} of run {rebuilt.manifest.run_id!r}: "
            f"asset files written to {out} differ from the manifest: {bad[:3]}",
            files=bad,
        )


def empty_folder(out: str | os.PathLike[str]) -> Path:
    """``out`` as a path, checked to be a folder a pull may write: absent or empty.

    Raises:
        FileExistsError: ``out`` exists and is not empty.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pull into a new folder")
    return out


def download_assets(
    client: BulletinClient, rebuilt: RebuiltVersion, out: Path, reserved: Callable[[str], bool]
) -> None:
    """Download the version's asset files into ``out`` (created) after checking none is named like a file the pull
    writes itself (``reserved``), so an asset can never stand in for the weights.

    Raises:
        ResumeError: an asset is named like a reserved file (nothing is written).
    """
    shadows = [ref.path for ref in rebuilt.assets if reserved(ref.path)]
    if shadows:
        raise ResumeError(
            f"version {rebuilt.manifest.version} of run {rebuilt.manifest.run_id!r} lists assets named like "
            f"checkpoint files {shadows[:3]}; they would replace the weights: publish a new run with renamed assets",
            files=shadows,
        )
    out.mkdir(parents=True, exist_ok=True)
    for ref in rebuilt.assets:
        _download(client, rebuilt.manifest.run_id, ref, out)


def pull_version(
    client: BulletinClient, run: str, out: str | os.PathLike[str], version: int | None = None
) -> RebuiltVersion:
    """Materialize a version as a plain HF folder: safetensors checkpoint + run assets, verified.

    ``out`` must not exist or be empty. The weights are verified against the manifest before
    they are written, and what was written is read back and verified again (:func:`verify_pulled`),
    so an asset can never stand in for the weights. (A version of an adapter run is written this
    way too, under PEFT's names; ``stitchboard pull`` writes it as a PEFT folder instead:
    :mod:`.adapter_pull`.)

    Raises:
        FileExistsError: ``out`` exists and is not empty.
        ResumeError: an asset is named like a checkpoint file (nothing is written), or the folder
            written does not match the manifest.
        the errors of :func:`rebuild_version`.
    """
    out = empty_folder(out)
    rebuilt = rebuild_version(client, run, version, workdir=out.parent if out.parent.exists() else None)
    download_assets(client, rebuilt, out, is_checkpoint_file)
    save_checkpoint(out, rebuilt.view)
    verify_pulled(rebuilt, out)
    return rebuilt


def resume_publisher(
    client: BulletinClient,
    run: str,
    mode: str,
    given: list[Asset] | None,
    workdir: str | os.PathLike[str] | None = None,
) -> tuple[PublishedVersion | None, list[FileRef]]:
    """Where a publisher starting on ``run`` goes on from: (its last version, the run's asset refs).

    Args:
        mode: for a run with versions, ``"rebuild"`` rebuilds the latest one and verifies it
            (:func:`rebuild_version`); ``"anchor"`` reads only its manifest (the view is None,
            so the next version is an anchor).
        given: the assets the publisher was given (None: none, or not on this rank); checked
            against the run's, or the refs of a new run.

    Returns:
        (None, refs of ``given``) for a run without versions.

    Raises:
        ValueError: ``mode`` is neither, for a run with versions.
        AssetsError: ``given`` differ from the assets the run carries.
        the errors of :func:`rebuild_version`.
    """
    latest = client.latest(run)
    if latest is None:
        return None, [a.ref for a in given or []]
    if mode == "rebuild":
        rebuilt = rebuild_version(client, run, latest, workdir=workdir)
        view: dict[str, RawTensor] | None = rebuilt.view
        manifest, assets = rebuilt.manifest, rebuilt.assets
        since = latest - client.plan(run, None, latest).steps[0].version
    elif mode == "anchor":
        manifest, view, since = client.manifest(run, latest), None, 0
        assets = [f for f in client.plan(run, None, latest).steps[0].files if f.role == "asset"]
    else:
        raise ValueError(f"resume must be 'rebuild' or 'anchor', got {mode!r}")
    if given is not None:
        check_same_assets(assets, given)
    tensors = {t.name: BaseTensor(t.dtype, tuple(t.shape), t.checksum()) for t in manifest.tensors}
    return PublishedVersion(latest, view, tensors, since), assets
