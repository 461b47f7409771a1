"""``Watcher``: follows a folder a training framework writes checkpoints to and publishes every
complete checkpoint as the run's next version (trainer host, the ``stitchboard watch`` process).

Each pass (every ``poll_s`` seconds; polling, not inotify, so network filesystems work) lists the
folder's checkpoints of the layout (:mod:`.watch_layouts`), takes those after the last published
step in step order, and publishes each complete one with a :class:`~.publisher.Publisher`: the
checkpoint is read whole, checked unchanged across the read, and published as torch tensors with
``Publisher.publish``, so its served view is exactly the SDK's for the same weights (the bf16 cast
of fp32 masters, the run's ``served`` recipe, a tied ``lm_head`` folded or refused), a delta
against the last version (an anchor every ``snapshot_every``). The manifest records the
framework's step (``step``) and the folder's name (``checkpoint``).

Restarts: the watcher starts after the step of the run's latest version (the bulletin keeps steps
in order, :mod:`stitchboard.bulletin.steps`), so nothing is published twice. Faults: a checkpoint
deleted before or while it is read is skipped; one changed while read is read again at the next
pass, and so is one the bulletin could not take (unreachable), the later checkpoints waiting for
it; a malformed, truncated or refused one is logged (naming the file) and skipped until its files
change, and the next good one publishes; a gap in steps is no matter (versions stay consecutive).
A lower step still incomplete when a later one is complete is passed over (versions only move
forward).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import ConflictError, InvalidRequestError, UnavailableError
from stitchboard.bulletin.steps import recorded_step
from stitchboard.proto.errors import PatchError

from .assets import ASSET_NAMES
from .errors import CheckpointChangedError, CheckpointError, CheckpointGoneError, ServedViewError
from .publisher import Publisher
from .publisher_core import PublisherOptions
from .served_view import from_raw
from .watch_layouts import Layout, checkpoints, choose_layout

#: Per-checkpoint failures: logged, the checkpoint skipped until its files change.
#: A folder's files as (relative name, size in bytes, modification time in ns), sorted: equal listings, same files.
Listing = tuple[tuple[str, int, int], ...]

_REFUSALS = (CheckpointError, PatchError, ServedViewError, ConflictError, InvalidRequestError)


class WatchMetrics:
    """The watcher's Prometheus metrics, in a registry of their own (``stitch_watch_*``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.published = Counter("stitch_watch_published", "checkpoints published as versions", registry=r)
        self.skipped = Counter(
            "stitch_watch_skipped",
            "checkpoints not published: deleted, changed (read again later), refused, passed over",
            ["reason"],
            registry=r,
        )
        self.uploaded = Counter("stitch_watch_uploaded_bytes", "bytes sent to the bulletin", registry=r)
        self.seconds = Histogram(
            "stitch_watch_publish_seconds", "read + publish of one checkpoint, seconds", registry=r
        )
        self.step = Gauge("stitch_watch_last_step", "step of the last version published or resumed from", registry=r)
        self.version = Gauge("stitch_watch_last_version", "last version published", registry=r)
        self.changed = Gauge("stitch_watch_changed_fraction", "changed elements / elements, last version", registry=r)
        self.pending = Gauge(
            "stitch_watch_pending",
            "complete checkpoints after the last step, neither published nor refused",
            registry=r,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> Callable[[], None]:
        """Serve ``/metrics`` on ``addr:port`` in a thread; returns the function that stops it."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server.shutdown


@dataclass(frozen=True)
class Outcome:
    """What a pass did with one checkpoint: ``published`` (``version`` set), ``skipped`` (deleted: gone for
    good), ``retry`` (changed while read, or the bulletin unreachable: read again at the next pass, and the
    later checkpoints wait for it) or ``failed`` (refused or malformed: not read again until its files change)."""

    step: int
    folder: Path
    status: str
    version: int | None = None
    message: str = ""


class Watcher:
    """Publishes the complete checkpoints a framework writes into ``folder``, in step order.

    Args:
        folder: the folder holding the checkpoint folders (may not exist yet).
        run: the run to publish to.
        client: the bulletin client (scope ``publish``); the publisher shares it.
        layout: a layout of :mod:`.watch_layouts`; None: the one found in ``folder`` (auto).
        poll_s: seconds between passes.
        settle_s: also wait until a checkpoint's files stayed unchanged this many seconds (0: no wait).
        assets: folder of the run's non-weight files for a new run; None: the first checkpoint's
            folder when it holds any of them (an HF Trainer checkpoint does).
        options: :class:`~.publisher.Publisher` keyword arguments (``served``, ``encoding``,
            ``snapshot_every``, ``workdir``...).
        metrics: where to count (default: a registry of its own).
        say: where progress lines go, one per checkpoint (default ``print``).
    """

    def __init__(
        self,
        folder: Path,
        run: str,
        client: BulletinClient,
        *,
        layout: Layout | None = None,
        poll_s: float = 2.0,
        settle_s: float = 0.0,
        assets: Path | None = None,
        options: PublisherOptions | None = None,
        metrics: WatchMetrics | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.folder, self.run, self.client = Path(folder), run, client
        self.wanted, self.poll_s, self.settle_s = layout, poll_s, settle_s
        self.assets = assets
        self.options: PublisherOptions = options if options is not None else {}
        self.metrics = metrics or WatchMetrics()
        self.say = say
        self.last_step: int | None = None
        self._publisher: Publisher | None = None
        self._failed: dict[str, Listing] = {}  # folder name -> listing it failed with
        self._seen: dict[str, tuple[Listing, float]] = {}  # folder name -> (listing, first seen unchanged), settle_s

    def resume(self) -> int | None:
        """Start after the step of the run's latest version (None: publish every checkpoint); returns it."""
        info = self.client.latest_info(self.run)
        if info is None:
            self.say(f"run {self.run}: no version yet; publishing every complete checkpoint in {self.folder}")
            return None
        self.last_step = recorded_step(self.client.manifest(self.run, info.version))
        if self.last_step is not None:
            self.metrics.step.set(self.last_step)
        self.say(
            f"run {self.run}: latest version {info.version} at step {self.last_step}; publishing the checkpoints "
            f"after it in {self.folder}"
        )
        return self.last_step

    def run_until(self, stop: threading.Event) -> None:
        """Resume, then pass over the folder every ``poll_s`` seconds until ``stop`` is set.

        Raises:
            WatchLayoutError: the folder holds another layout's checkpoints.
            AuthError, AssetsError, ResumeError: the run cannot be published to.
        """
        self.resume()
        while not stop.is_set():
            self.poll()
            stop.wait(self.poll_s)

    def close(self) -> None:
        """Close the publisher (the client is the caller's)."""
        if self._publisher is not None:
            self._publisher.close()

    def poll(self) -> list[Outcome]:
        """One pass: publish every complete checkpoint after the last step, in step order."""
        layout = choose_layout(self.folder, self.wanted)
        if layout is None:
            return []
        found = [(s, p) for s, p in checkpoints(self.folder, layout) if self.last_step is None or s > self.last_step]
        names = {p.name for _, p in found}
        self._failed = {n: listing for n, listing in self._failed.items() if n in names}
        self._seen = {n: seen for n, seen in self._seen.items() if n in names}
        ready = [(s, p) for s, p in found if layout.is_complete(p) and self._settled(p)]
        waiting = [(s, p) for s, p in found if (s, p) not in ready]
        outcomes: list[Outcome] = []
        for step, path in ready:
            if self._failed.get(path.name) == _listing(path):
                continue
            before = self.last_step
            outcomes.append(self._publish(step, path, layout))
            if outcomes[-1].status == "published":
                self._pass_over(step, [(s, p) for s, p in waiting if (before is None or s > before) and s < step])
            elif outcomes[-1].status == "retry":
                break  # later checkpoints wait: versions keep the step order
        self.metrics.pending.set(
            sum(1 for s, p in ready if p.name not in self._failed and (self.last_step is None or s > self.last_step))
        )
        return outcomes

    def _pass_over(self, step: int, earlier: list[tuple[int, Path]]) -> None:
        for s, p in earlier:
            self.metrics.skipped.labels("passed_over").inc()
            self.say(f"step {s}: {p.name} was not complete when step {step} was; passed over")

    def _settled(self, path: Path) -> bool:
        if self.settle_s <= 0:
            return True
        listing, now = _listing(path), time.monotonic()
        seen = self._seen.get(path.name)
        if seen is None or seen[0] != listing:
            self._seen[path.name] = (listing, now)
            return False
        return now - seen[1] >= self.settle_s

    def _publisher_for(self, path: Path) -> Publisher:
        if self._publisher is None:
            assets = self.assets
            if assets is None and any((path / n).is_file() for n in ASSET_NAMES):
                assets = path if self.client.latest(self.run) is None else None
            options: PublisherOptions = {**self.options, "assets": assets, "client": self.client}
            self._publisher = Publisher(self.client.url, self.run, **options)
        return self._publisher

    def _publish(self, step: int, path: Path, layout: Layout) -> Outcome:
        t0 = time.perf_counter()
        try:
            view = layout.read(path)
            read_s = time.perf_counter() - t0
            state = {name: from_raw(t) for name, t in view.items()}
            result = self._publisher_for(path).publish(state, step=step, metadata={"checkpoint": path.name})
        except CheckpointGoneError as exc:
            return self._skip(step, path, "deleted", f"{exc.message}; skipped")
        except CheckpointChangedError as exc:
            return self._skip(step, path, "changed", f"{exc.message}; read again at the next pass", "retry")
        except UnavailableError as exc:
            return self._skip(step, path, "unavailable", f"{exc.message}; tried again at the next pass", "retry")
        except _REFUSALS as exc:
            self._failed[path.name] = _listing(path)
            self.metrics.skipped.labels("refused").inc()
            message = getattr(exc, "message", str(exc))
            self.say(f"step {step}: {path.name} not published: {type(exc).__name__}: {message}")
            return Outcome(step, path, "failed", message=message)
        seconds = time.perf_counter() - t0
        self.last_step = step
        m = self.metrics
        m.published.inc()
        m.uploaded.inc(result.uploaded_bytes)
        m.seconds.observe(seconds)
        m.step.set(step)
        m.version.set(result.version)
        m.changed.set(result.changed_fraction)
        snapshot = f" + snapshot {result.snapshot_bytes:,} bytes" if result.snapshot else ""
        self.say(
            f"step {step} -> version {result.version}{' (anchor)' if result.snapshot else ''}: "
            f"{100 * result.changed_fraction:.3f} % changed, patch {result.encoded_bytes:,} bytes{snapshot}, "
            f"uploaded {result.uploaded_bytes:,} bytes, {seconds:.2f} s (read {read_s:.2f} s)"
        )
        return Outcome(step, path, "published", result.version)

    def _skip(self, step: int, path: Path, reason: str, message: str, status: str = "skipped") -> Outcome:
        self.metrics.skipped.labels(reason).inc()
        self.say(f"step {step}: {message}")
        return Outcome(step, path, status, message=message)


def _listing(path: Path) -> Listing:
    """(relative name, size, modification time in ns) of every file under ``path``; () when it is gone."""
    out = []
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            out.append((os.path.relpath(os.path.join(root, name), path), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))
