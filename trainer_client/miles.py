"""A Miles/slime post-write hook: each disk-delta version Miles writes becomes a stitchboard version (trainer
host: the process of Miles' training rank 0; the other ranks return at once).

Give Miles ``--custom-update-weight-post-write-path stitchboard.trainer_client.miles.post_write`` with
``--update-weight-transfer-mode disk-delta``. Miles calls ``post_write(args, version_dir, rollout_engines)``
on every training rank after a version's files are written and before its own engines pull them
(``delta.py``: ``_reload_engines``), and once at the start with the empty ``--update-weight-disk-dir``
(``_capture_baseline``). On rank 0 the hook:

* at the start: publishes Miles' baseline, its ``--hf-checkpoint`` (with its config and tokenizer as the run's
  assets), as the run's version at step 0; a run whose latest version is at a later step is refused
  (:class:`MilesBaseVersionError`: Miles restarted its versions at 0; give each Miles run its own run id);
* for ``weight_vNNNNNN/``: reads and checks the whole folder (all ranks' shards), checks that its base
  version is the step of the run's latest version, decodes it on the view it keeps (:mod:`.miles_delta`;
  replayed from the baseline and the earlier folders in a restarted process) one tensor at a time, each
  checked against its checksum and diffed against the publisher's kept view as it comes
  (:meth:`Publisher.stream_raw_view`), then publishes the new view as the next version (``step`` = Miles'
  version) with stitchboard's own encoding; a folder refused raises (Miles sees the failure) and publishes
  nothing; the same version again (a retried hook) publishes nothing more;
* then waits until ``STITCH_CLIENT_MILES_MIN_REPLICAS`` sidecars report that version applied.

Settings (environment, :class:`MilesHookSettings`): ``STITCH_CLIENT_BULLETIN``, ``STITCH_CLIENT_TOKEN``,
``STITCH_CLIENT_RUN``, ``STITCH_CLIENT_MILES_*``. The published view is Miles' bytes as written (the bf16
HF tensors); it is kept once, shared with the publisher's kept view, which the publisher updates in place
after each commit: memory is that view plus one decoded tensor and the changes.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.steps import recorded_step
from stitchboard.proto.schema import Encoding

from .errors import MilesBaseVersionError
from .fleet import wait_for_fleet
from .miles_delta import INDEX_NAME, MilesView, decode_stream, decode_tensor, read_version
from .publisher import Publisher
from .watch_layouts import read_stable

log = logging.getLogger("stitchboard.trainer_client")


class MilesHookSettings(BaseSettings):
    """The hook's settings, from ``STITCH_CLIENT_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="STITCH_CLIENT_", extra="ignore")

    bulletin: str = Field(..., description="Base URL of the bulletin, e.g. http://bulletin:8700.")
    run: str = Field(..., description="Run id the Miles versions are published to (one per Miles run).")
    token: str | None = Field(None, description="Bearer token with the publish scope (None: open bulletin).")
    miles_min_replicas: int = Field(
        1, ge=0, description="Replicas that must report a version applied before the hook returns (0: do not wait)."
    )
    miles_wait_s: float = Field(600.0, gt=0, description="Longest wait for those replicas, seconds (default 600).")
    miles_encoding: Encoding = Field("cond", description="stitchboard patch encoding: cond (default), xor, overwrite.")
    miles_snapshot_every: int = Field(10, ge=1, description="An anchor every this many versions (default 10).")
    miles_workdir: Path | None = Field(None, description="Folder for temporary snapshot shards (default: system temp).")


class MilesBridge:
    """Publishes one Miles run's versions (one per process and run; :func:`post_write` keeps it).

    Args:
        settings: the hook's settings. hf_checkpoint: Miles' ``--hf-checkpoint`` (version 0).
        delta_dir: Miles' ``--update-weight-disk-dir``.
    """

    def __init__(self, settings: MilesHookSettings, hf_checkpoint: Path, delta_dir: Path) -> None:
        self.settings, self.hf_checkpoint, self.delta_dir = settings, Path(hf_checkpoint), Path(delta_dir)
        self.client = BulletinClient(settings.bulletin, settings.token, retries=5, backoff_s=0.5)
        self.view = MilesView(lambda: read_stable(self.hf_checkpoint))
        self._publisher: Publisher | None = None

    def close(self) -> None:
        """Close the publisher and the bulletin client."""
        if self._publisher is not None:
            self._publisher.close()
        self.client.close()

    def on_write(self, version_dir: Path) -> int:
        """Publish what Miles wrote to ``version_dir`` (its disk dir itself: the baseline) and wait for the
        fleet; returns the stitchboard version.

        Raises:
            MilesDeltaError, MilesChecksumError, MilesBaseVersionError: refused; nothing published.
            BulletinError, FleetTimeoutError: the bulletin failed, or too few replicas applied it in time.
        """
        if Path(version_dir).resolve() == self.delta_dir.resolve():
            version = self._publish_base()
        else:
            version = self._publish_version(Path(version_dir))
        if self.settings.miles_min_replicas > 0:
            wait_for_fleet(
                self.client,
                self.settings.run,
                version,
                min_replicas=self.settings.miles_min_replicas,
                timeout_s=self.settings.miles_wait_s,
            )
        return version

    def _latest(self) -> tuple[int, int | None] | None:
        info = self.client.latest_info(self.settings.run)
        if info is None:
            return None
        return info.version, recorded_step(self.client.manifest(self.settings.run, info.version))

    def _publisher_for(self) -> Publisher:
        if self._publisher is None:
            s = self.settings
            self._publisher = Publisher(
                s.bulletin,
                s.run,
                encoding=s.miles_encoding,
                snapshot_every=s.miles_snapshot_every,
                assets=self.hf_checkpoint,
                workdir=s.miles_workdir,
                client=self.client,
            )
        return self._publisher

    def _publish_base(self) -> int:
        latest = self._latest()
        if latest is not None and latest[1] != 0:
            raise MilesBaseVersionError(
                f"{self.delta_dir}: Miles starts its versions over (baseline = {self.hf_checkpoint}), but run "
                f"{self.settings.run!r} is at step {latest[1]} (version {latest[0]}): publish this Miles run to a new "
                "run id (STITCH_CLIENT_RUN)",
                folder=str(self.delta_dir),
                version=0,
                file=str(self.hf_checkpoint),
                base_version=None,
                latest_step=latest[1],
            )
        view = self.view.at(self.delta_dir, 0)
        if latest is not None:
            return latest[0]  # the baseline was published (a restarted or retried start)
        result = self._publisher_for().publish_view(view, step=0, metadata={"checkpoint": self.hf_checkpoint.name})
        log.info("miles baseline %s -> version %d", self.hf_checkpoint, result.version)
        return result.version

    def _publish_version(self, folder: Path) -> int:
        mv = read_version(folder)
        latest = self._latest()
        if latest is not None and latest[1] == mv.version:
            return latest[0]  # this version is published: a retried hook
        if latest is None or latest[1] != mv.base_version:
            index = folder / INDEX_NAME
            raise MilesBaseVersionError(
                f"{index}: version {mv.version} is based on version {mv.base_version}, but run {self.settings.run!r}'s "
                f"latest version is at step {latest[1] if latest else None}: nothing published",
                folder=str(folder),
                version=mv.version,
                file=str(index),
                base_version=mv.base_version,
                latest_step=latest[1] if latest else None,
            )
        base = self.view.at(self.delta_dir, mv.base_version)
        publisher = self._publisher_for()
        # one tensor decoded at a time, its checksum checked, diffed against the publisher's kept view and dropped;
        # a refused tensor stops the stream before anything is published
        streamed = publisher.stream_raw_view(decode_stream(self.view.check_base(mv), mv))
        result = publisher.publish_view(streamed, step=mv.version, metadata={"checkpoint": folder.name})
        kept = publisher.kept_view() if publisher.last_version == result.version else {}
        self.view.commit(  # the publisher's kept view is this version's: share its tensors (one view on this host)
            mv.version,
            {n: kept[n] if n in kept else decode_tensor(base, mv, n) if n in mv.tensors else base[n] for n in base},
        )
        log.info("miles %s -> version %d (%d tensors changed)", folder.name, result.version, len(mv.tensors))
        return result.version


_BRIDGES: dict[tuple[str, str, str], MilesBridge] = {}
_LOCK = threading.Lock()


def close_bridges() -> None:
    """Close every kept :class:`MilesBridge` (at exit; tests call it)."""
    with _LOCK:
        while _BRIDGES:
            _BRIDGES.popitem()[1].close()


atexit.register(close_bridges)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


def post_write(args: Any, version_dir: str, rollout_engines: Any) -> None:
    """Miles' post-write hook (``--custom-update-weight-post-write-path stitchboard.trainer_client.miles.post_write``).

    Args:
        args: Miles' parsed arguments (``update_weight_disk_dir``, ``hf_checkpoint`` are read).
        version_dir: the folder Miles just wrote (``weight_vNNNNNN``), or its disk dir at the baseline.
        rollout_engines: Miles' engine handles; not used (the sidecars pull the version themselves).

    Raises:
        MilesDeltaError, MilesChecksumError, MilesBaseVersionError: the folder was refused; nothing published.
        BulletinError, FleetTimeoutError: publishing or the wait for the replicas failed.
        pydantic.ValidationError: ``STITCH_CLIENT_BULLETIN`` or ``STITCH_CLIENT_RUN`` unset.
    """
    if _rank() != 0:
        return
    settings = MilesHookSettings()
    key = (settings.bulletin, settings.run, str(Path(args.update_weight_disk_dir).resolve()))
    with _LOCK:
        bridge = _BRIDGES.get(key)
        if bridge is None:
            bridge = _BRIDGES[key] = MilesBridge(settings, Path(args.hf_checkpoint), Path(args.update_weight_disk_dir))
        bridge.on_write(Path(version_dir))
