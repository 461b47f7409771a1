"""gc against publish, interleaved deterministically at the store seam; gc also cleans what crashed writes left.

:class:`HookStore` wraps a real store and runs a test's code at a chosen call, so each test
forces one interleaving of gc and a publish that reuses an old, unreferenced blob (a trainer
killed before its commit, restarted, publishing the same weights). Both stores.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3

from stitchboard.bulletin.errors import BlobMissingError
from stitchboard.bulletin.ledger import Ledger, blob_key, run_key, stored_digest, version_key
from stitchboard.bulletin.retention import GcReport, collect_run
from stitchboard.bulletin.stores import ObjectStat, Store, open_store
from stitchboard.proto.schema import FileRef
from tests.bulletin.bulletin_helpers import Backend, make_manifest, sha

#: gc runs "two minutes later" with a 60 s grace period: the orphan blob is old enough to collect.
LATER_S, GRACE_S = 120.0, 60.0


class HookStore:
    """A store that runs ``hook`` once, after (or before) the first call of ``method`` whose key or prefix contains
    ``where``."""

    def __init__(
        self, inner: Store, method: str, where: str, hook: Callable[[], None], *, before: bool = False
    ) -> None:
        self._inner, self._method, self._where, self._hook, self._before = inner, method, where, hook, before
        self.fired = threading.Event()

    def __getattr__(self, name: str):
        real = getattr(self._inner, name)
        if name != self._method:
            return real

        def call(key: str, *args, **kwargs):
            fire = self._where in key and not self.fired.is_set()
            if fire:
                self.fired.set()
                if self._before:
                    self._hook()
            result = real(key, *args, **kwargs)
            if name == "list":
                result = list(result)
            if fire and not self._before:
                self._hook()
            return iter(result) if name == "list" else result

        return call


class Watch:
    """A store that sets ``event`` at every ``list`` of a prefix containing ``where``."""

    def __init__(self, inner: Store, where: str) -> None:
        self._inner, self._where = inner, where
        self.event = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectStat]:
        if self._where in prefix:
            self.event.set()
        return self._inner.list(prefix, start_after)


def _setup(backend: Backend, run: str) -> tuple[Store, FileRef, bytes]:
    """v0 committed; v1's patch blob uploaded but never committed (the trainer was killed)."""
    store = open_store(backend.settings.store, backend.settings)
    Ledger(store).publish(run, make_manifest(run, 0, [_upload(store, run, os.urandom(100), "snapshot-0", "snapshot")]))
    data = os.urandom(50)
    return store, _upload(store, run, data, "patch-1", "patch"), data


def _upload(store: Store, run: str, data: bytes, path: str, role: str) -> FileRef:
    tmp = f"{tempfile.gettempdir()}/stitch-gc-race-{os.getpid()}-{sha(data)}"
    with open(tmp, "wb") as f:
        f.write(data)
    store.put_file(blob_key(run, sha(data)), Path(tmp))
    os.unlink(tmp)
    return FileRef(path=path, sha256=sha(data), size_bytes=len(data), role=role)


def _gc(store: Store, run: str) -> GcReport:
    report = GcReport()
    collect_run(Ledger(store, cache_entries=0), run, 2, GRACE_S, report, now=time.time() + LATER_S)
    return report


def test_gc_running_between_a_publishs_checks_and_its_commit_spares_the_blob(backend, run):
    store, patch, _ = _setup(backend, run)
    reports: list[GcReport] = []
    publishing = HookStore(
        store, "put_new", "versions/000000000001", lambda: reports.append(_gc(store, run)), before=True
    )
    Ledger(publishing).publish(run, make_manifest(run, 1, [patch]))
    assert publishing.fired.is_set() and reports[0].blobs_removed == {}
    assert stored_digest(store, blob_key(run, patch.sha256)) == patch.sha256  # v1 is committed and its blob is there


def test_gc_holding_a_blob_makes_a_publish_wait_then_spares_it(backend, run):
    store, patch, _ = _setup(backend, run)
    watched = Watch(store, "gc-locks/")
    errors: list[BaseException] = []

    def publish_while_gc_holds_the_lock() -> None:
        def target() -> None:
            try:
                Ledger(watched).publish(run, make_manifest(run, 1, [patch]))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        worker = threading.Thread(target=target)
        worker.start()
        assert watched.event.wait(10)  # the publish wrote its intent and sees gc's lock
        threads.append(worker)

    threads: list[threading.Thread] = []
    report = GcReport()
    collect_run(
        Ledger(HookStore(store, "put_new", "gc-locks/", publish_while_gc_holds_the_lock), cache_entries=0),
        run,
        2,
        GRACE_S,
        report,
        now=time.time() + LATER_S,
    )
    threads[0].join(10)
    assert errors == [] and report.blobs_removed == {}
    assert Ledger(store).latest(run).version == 1
    assert stored_digest(store, blob_key(run, patch.sha256)) == patch.sha256


def test_a_publish_that_starts_after_gc_decided_is_refused_and_a_reupload_repairs_it(backend, run):
    store, patch, data = _setup(backend, run)
    watched = Watch(store, "gc-locks/")
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []

    def publish_after_gc_read_the_intents() -> None:
        def target() -> None:
            try:
                Ledger(watched).publish(run, make_manifest(run, 1, [patch]))
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        threads.append(threading.Thread(target=target))
        threads[0].start()
        assert watched.event.wait(10)

    report = GcReport()
    collect_run(
        Ledger(HookStore(store, "list", "intents/", publish_after_gc_read_the_intents), cache_entries=0),
        run,
        2,
        GRACE_S,
        report,
        now=time.time() + LATER_S,
    )
    threads[0].join(10)
    assert report.blobs_removed == {run: [patch.sha256]}
    assert len(errors) == 1 and isinstance(errors[0], BlobMissingError)  # not committed over a missing blob
    assert store.stat(version_key(run, 1)) is None
    _upload(store, run, data, patch.path, patch.role)  # the trainer uploads it again and publishes
    Ledger(store).publish(run, make_manifest(run, 1, [patch]))
    assert stored_digest(store, blob_key(run, patch.sha256)) == patch.sha256


def test_gc_removes_temporaries_older_than_the_grace_period(backend, run):
    store, _, _ = _setup(backend, run)
    if backend.root is not None:
        folder = backend.root / run_key(run) / "versions"
        old, fresh = folder / ".tmp-old", folder / ".tmp-fresh"
        old.write_bytes(b"{")
        fresh.write_bytes(b"{")
        os.utime(old, (time.time() - 2 * GRACE_S,) * 2)
        report = GcReport()
        collect_run(Ledger(store), run, 2, GRACE_S, report)
        assert not old.exists() and fresh.exists() and report.temporaries_removed == {run: 1}
        return
    s3 = boto3.client("s3", endpoint_url=backend.settings.s3_endpoint_url, region_name="us-east-1")
    s3.create_multipart_upload(Bucket=backend.bucket, Key=f"stitch/{version_key(run, 1)}")
    report = GcReport()
    collect_run(Ledger(store), run, 2, 0, report)
    assert report.temporaries_removed == {run: 1}
    assert not s3.list_multipart_uploads(Bucket=backend.bucket).get("Uploads")
