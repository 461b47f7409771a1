"""``stitchboard squash list | drop | rebuild``: a run's squashes are derived, so they can be dropped and made again.

``rebuild`` needs nothing but the bulletin: it rebuilds the oldest view it needs from the stored
anchor and deltas (:func:`~.resume.rebuild_version`), then replays the stored deltas one by one
with the codec's own apply (touched tensors copied, verified by their checksums), noting each in
a :class:`~.squash.RecentViews` exactly as the publisher does, and at each target version has a
:class:`~.squash.Squasher` encode, upload and store the squashes of the given depths. Spans
already stored are skipped (drop them first to replace them).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, cast

import typer

from stitchboard.bulletin.cli_options import Bulletin, Run, Token
from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.apply import apply_to_copy
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.logs import LogFormat, LogFormatOption, configure_logging
from stitchboard.proto.schema import Encoding, VersionManifest
from stitchboard.proto.squash_schema import SquashManifest

from .resume import rebuild_version
from .squash import SUGGESTED_SQUASH_DEPTHS, Squasher, check_depths

app = typer.Typer(
    help="A run's squashes (one patch from an older version to a newer one): list, drop, rebuild.", no_args_is_help=True
)
log = logging.getLogger("stitchboard.trainer_client")


def _alone(what: str, work: Callable[[], tuple[Any, Any]]) -> tuple[Any, list[Any]]:
    kept, shared = work()
    return kept, [shared]


def rebuild_squashes(
    client: BulletinClient,
    run: str,
    depths: Sequence[int] = SUGGESTED_SQUASH_DEPTHS,
    since: int | None = None,
    encoding: Encoding = "cond",
    workdir: str | Path | None = None,
) -> list[SquashManifest]:
    """Make the squashes ``target - d -> target`` of ``run`` for every stored target >= ``since`` and depth ``d``.

    Args:
        client: the bulletin client (publish scope).
        run: the run.
        depths: squash depths (each >= 2).
        since: the first target version (default: every stored version that has a base).
        encoding: the squashes' encoding.
        workdir: folder for temporary downloads (default: the system temp folder).

    Returns:
        The records stored now (a squash not smaller than its chain is not stored).

    Raises:
        ValueError: a depth below 2, or a version holding tensors in parts (a shard-local publish, whose
            squashes its publisher makes: ``squash_depths``). NotFoundError: the run has no version.
        BulletinError, PatchError, ResumeError: the stored versions cannot be rebuilt.
    """
    depths = check_depths(depths)
    numbers = [i.version for i in client.versions(run)]
    if not numbers or not depths:
        return []
    first_target = max(numbers[0] + min(depths), since if since is not None else 0)
    start = max(numbers[0], first_target - max(depths))
    have = {(s.base_version, s.target_version) for s in client.squashes(run)}
    rebuilt = rebuild_version(client, run, start, workdir)
    _whole(run, rebuilt.manifest)
    squasher = Squasher(client, run, 0, depths, encoding)
    squasher.views.start(rebuilt.manifest)
    view: dict[str, RawTensor] = rebuilt.view
    previous = rebuilt.manifest
    out: list[SquashManifest] = []
    with tempfile.TemporaryDirectory(prefix="stitchboard-squash-", dir=workdir) as tmp:
        for version in [v for v in numbers if v > start]:
            manifest = client.manifest(run, version)
            _whole(run, manifest)
            if version != previous.version + 1 or manifest.layout() != previous.layout():
                view, previous = (
                    rebuild_version(client, run, version, workdir).view,
                    manifest,
                )  # a gap or a new tensor set: start again here
                squasher.views.start(manifest)
                continue
            new = view
            for ref in manifest.files_of("patch"):
                path = client.download_blob(run, ref.sha256, Path(tmp) / ref.sha256, ref.size_bytes)
                new = apply_to_copy(
                    new, read_patch(path.read_bytes(), ref.size_bytes, what=f"{ref.path} of version {version}")
                )
                path.unlink()
            missing = tuple(d for d in depths if version >= first_target and (version - d, version) not in have)
            if missing:
                squasher.depths = missing
                out += squasher.after_commit(manifest, view, new, previous.checksums(), _alone, lambda work: work())
            else:
                squasher.views.record(manifest, view, new, previous.checksums())
            view, previous = new, manifest
    return out


def _whole(run: str, manifest: VersionManifest) -> None:
    """Refuse a version with tensors in parts: its squashes' entries must be parted as its tensors are, which only
    the shard-local publisher that wrote them makes (``squash_depths``)."""
    parted = sorted(manifest.layouts())
    if parted:
        raise ValueError(
            f"run {run!r} version {manifest.version} holds tensors in parts ({parted[:3]}, a shard-local publish): "
            "its squashes are made by its publisher (ShardLocalPublisher(..., squash_depths=...)); "
            "`stitchboard squash rebuild` makes them for runs published whole"
        )


def _depths(text: str) -> tuple[int, ...]:
    try:
        return check_depths(int(d) for d in text.split(",") if d.strip())
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error ({getattr(exc, 'type', type(exc).__name__)}): {getattr(exc, 'message', exc)}", err=True)
    return typer.Exit(1)


@app.command("list")
def list_(bulletin: Bulletin, run: Run, token: Token = None) -> None:
    """Print the run's squashes: base, target, bytes, encoding."""
    from stitchboard.proto.errors import StitchError

    try:
        with BulletinClient(bulletin, token) as client:
            for s in client.squashes(run):
                typer.echo(f"{s.base_version} -> {s.target_version}\t{s.size_bytes}\t{s.encoding}")
    except StitchError as exc:
        raise _fail(exc) from exc


@app.command()
def drop(
    bulletin: Bulletin,
    run: Run,
    token: Token = None,
    span: Annotated[
        list[str] | None, typer.Argument(help="BASE-TARGET spans to drop (none: every squash of the run)")
    ] = None,
) -> None:
    """Drop squashes (plans stop using them at once; their blobs go with the next gc); print how many."""
    from stitchboard.proto.errors import StitchError

    try:
        with BulletinClient(bulletin, token) as client:
            spans = (
                [tuple(int(x) for x in s.split("-", 1)) for s in span]
                if span
                else [(s.base_version, s.target_version) for s in client.squashes(run)]
            )
            typer.echo(sum(client.drop_squash(run, base, target) for base, target in spans))
    except (StitchError, ValueError) as exc:
        raise _fail(exc) from exc


@app.command()
def rebuild(
    bulletin: Bulletin,
    run: Run,
    token: Token = None,
    depths: Annotated[
        str, typer.Option(help="comma-separated squash depths (versions back from each target)")
    ] = ",".join(map(str, SUGGESTED_SQUASH_DEPTHS)),
    since: Annotated[int | None, typer.Option(help="first target version (default: every stored version)")] = None,
    encoding: Annotated[str, typer.Option(help="cond (smallest), xor or overwrite")] = "cond",
    log_format: LogFormatOption = LogFormat.text,
) -> None:
    """Make the run's squashes again from its stored anchor and deltas; print each span stored."""
    from stitchboard.proto.errors import StitchError

    if encoding not in ("cond", "xor", "overwrite"):
        raise typer.BadParameter(f"unknown encoding {encoding!r}")
    configure_logging(log_format, logging.WARNING, {"run": run}, text_format="%(message)s")
    try:
        with BulletinClient(bulletin, token, retries=5, backoff_s=0.5) as client:
            stored = rebuild_squashes(client, run, _depths(depths), since, cast(Encoding, encoding))
    except (StitchError, OSError, ValueError) as exc:
        raise _fail(exc) from exc
    for s in stored:
        typer.echo(f"{s.base_version} -> {s.target_version}\t{s.size_bytes}")
