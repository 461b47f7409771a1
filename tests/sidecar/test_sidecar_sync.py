"""The reconciler over real HTTP: boot, restart, coalescing, bad files, failed applies, crash recovery.

The fake engine applies patches with the real codec, so each test also checks that the engine's
bits equal the published view of the version the sidecar reports (DESIGN.md invariant 1).
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import UnavailableError
from stitchboard.proto.diff import diff_views
from stitchboard.proto.schema import FileRef, VersionManifest
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import assert_at, make_view, mutate, same_bits, wait_for


def test_fresh_engine_gets_the_anchor_then_deltas(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1, patch_files=2)
    sidecar = sc_start(FakeEngine())
    assert_at(sidecar, sc_publisher, 1)
    assert [m for m, _ in sidecar.engine.calls if m != "health"] == [
        "pause",
        "load_snapshot",
        "apply_patch",
        "reset_prefix_cache",
        "resume",
    ]
    sc_publisher.step(2, patch_files=3)
    assert_at(sidecar, sc_publisher, 2)
    status = sidecar.status()
    assert (
        status["last_sync"]["from_version"] == 1
        and status["last_sync"]["bytes_fetched"] == sc_publisher.manifests[2].stats.encoded_bytes
    )
    assert status["lag_versions"] == 0 and status["state"] == "idle"
    assert not any(Path(sidecar.app.state.reconciler.fetcher.root).iterdir()), "staged files are removed after a commit"


def test_boot_version_skips_the_anchor(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    sc_publisher.step(2)
    engine = FakeEngine(sc_publisher.views[1])  # booted from version 1's checkpoint
    sidecar = sc_start(engine, boot_version=1)
    assert_at(sidecar, sc_publisher, 2)
    assert engine.count("load_snapshot") == 0 and engine.count("stage_patches") == engine.count("commit_staged") == 1


def test_restarted_sidecar_does_not_reapply(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    first = sc_start(FakeEngine())
    assert_at(first, sc_publisher, 1)
    engine = first.engine
    first.stop()
    calls = list(engine.calls)
    second = sc_start(engine, boot_version=0)  # ignored: the engine records what it holds
    assert_at(second, sc_publisher, 1)
    assert [m for m, _ in engine.calls[len(calls) :] if m != "health"] == [
        "checksums"
    ]  # the record is checked, nothing loaded
    sc_publisher.step(2)
    assert_at(second, sc_publisher, 2)


@pytest.mark.parametrize("claim", ["recorded", "boot_version", "paused", "another model"])
def test_an_engine_is_taken_at_its_version_only_if_it_holds_that_versions_bits(claim, sc_publisher, sc_start):
    """The version an engine records (say, left by another run's sidecar; or recorded while paused)
    or ``--boot-version`` is checked against the manifest's checksums before any request is
    admitted; weights that differ, or tensors the engine has no place for, get the nearest
    anchor loaded instead."""
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    other = mutate(sc_publisher.views[1], seed=99)  # another run's version 1
    if claim == "another model":  # the engine has no place for one of the run's tensors
        other = make_view(5, tensors=3)
    engine = FakeEngine(other, version=None if claim == "boot_version" else 1)
    engine.paused = claim == "paused"
    sidecar = sc_start(engine, boot_version=1)
    assert_at(sidecar, sc_publisher, 1)
    assert engine.count("checksums") == 1 and engine.count("load_snapshot") == 1 and not engine.paused


def test_a_refused_check_is_retried_not_taken_for_another_model(sc_publisher, sc_start):
    """Only a name the engine has no place for means another model; any other refusal of the
    checksum call is retried, and the engine's bits, once checked, are taken without a load."""
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    engine = FakeEngine(sc_publisher.views[1], version=1)
    engine.refuse_checksums = 1
    assert_at(sc_start(engine), sc_publisher, 1)
    assert engine.count("checksums") == 2 and engine.count("load_snapshot") == 0


class _DownClient(BulletinClient):
    """A bulletin client whose first ``failures`` manifest requests fail as if the bulletin were down."""

    def __init__(self, *args, failures: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failures = failures

    def manifest(self, *args, **kwargs):
        if self.failures:
            self.failures -= 1
            raise UnavailableError("the bulletin is down (test)")
        return super().manifest(*args, **kwargs)


def test_a_paused_engine_stays_paused_until_its_record_can_be_checked(sc_publisher, sc_start, sc_bulletin):
    """Bulletin down while a restarted sidecar finds the engine paused at a version: the engine is
    not resumed on weights nobody checked; once the check passes it is, and the next version is
    an ordinary staged delta (no anchor reload)."""
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    engine = FakeEngine(sc_publisher.views[1], version=1)
    engine.paused = True
    engine._running.clear()
    client = _DownClient(sc_bulletin.url, retries=0, failures=3)
    sidecar = sc_start(engine, client=client)
    assert_at(sidecar, sc_publisher, 1)
    assert client.failures == 0 and [m for m, _ in engine.calls if m != "health"] == ["checksums", "resume"]
    sc_publisher.step(2)
    assert_at(sidecar, sc_publisher, 2)
    assert engine.count("load_snapshot") == 0 and engine.count("commit_staged") == 1


def test_empty_delta_flips_the_version_without_touching_the_engine(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine())
    assert_at(sidecar, sc_publisher, 0)
    pauses = sidecar.engine.count("pause")
    sc_publisher.same()
    assert_at(sidecar, sc_publisher, 1)
    assert sidecar.engine.count("pause") == pauses and sidecar.engine.calls[-1] == ("set_version", (1,))
    assert 'stitch_sidecar_commits_total{outcome="flipped"} 1.0' in sidecar.http.get("/metrics").text


class _HeldClient(BulletinClient):
    """A bulletin client whose next download waits for :attr:`release` once :attr:`armed`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def download_blob(self, *args, **kwargs):
        if self.armed:
            self.armed = False
            self.entered.set()
            self.release.wait(10)
        return super().download_blob(*args, **kwargs)


def test_versions_published_while_staging_are_coalesced(sc_publisher, sc_start, sc_bulletin):
    """Versions 1-3 land in one commit, staged in the engine as one update; the empty delta of
    version 2 changes no bit, so the engine gets two steps: 0 -> 1 and 1 -> 3."""
    sc_publisher.publish(make_view(0))
    client = _HeldClient(sc_bulletin.url, retries=1, backoff_s=0.01)
    sidecar = sc_start(FakeEngine(), client=client)
    assert_at(sidecar, sc_publisher, 0)
    before = len(sidecar.engine.calls)
    client.armed = True
    sc_publisher.step(1)
    assert client.entered.wait(10)
    sc_publisher.same()
    sc_publisher.step(3)
    client.release.set()
    assert_at(sidecar, sc_publisher, 3)
    commit = [c for c in sidecar.engine.calls[before:] if c[0] != "health"]
    assert [m for m, _ in commit] == ["stage_patches", "pause", "commit_staged", "reset_prefix_cache", "resume"]
    assert [step[1:] for step in commit[0][1]] == [(0, 1), (1, 3)] and commit[2][1] == (3,)


def _corrupt_blob(store: Path, run: str, sha256: str) -> None:
    blob = store / "runs" / run / "blobs" / sha256
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))


def test_corrupted_file_is_rejected_before_touching_the_engine(sc_publisher, sc_start, sc_bulletin, tmp_path):
    sc_publisher.publish(make_view(0))
    client = _HeldClient(sc_bulletin.url, retries=1, backoff_s=0.01)
    sidecar = sc_start(FakeEngine(), client=client)
    assert_at(sidecar, sc_publisher, 0)
    calls = len(sidecar.engine.calls)
    view1 = mutate(sc_publisher.views[0], seed=1)
    m1 = sc_publisher.prepare(view1)
    client.armed = True
    sc_publisher.commit(m1, view1)  # the bulletin checks the blob at the commit: the bit rot comes after it
    assert client.entered.wait(10)
    _corrupt_blob(tmp_path / "store", sc_publisher.run, m1.files_of("patch")[0].sha256)  # bit rot in the store
    client.release.set()
    wait_for(
        lambda: (sidecar.status()["last_error"] or {}).get("type") == "BlobMismatch",
        what="the checksum mismatch reported",
    )
    status = sidecar.status()
    assert status["applied_version"] == 0 and status["target_version"] == 1 and status["lag_versions"] == 1
    assert [c for c in sidecar.engine.calls[calls:] if c[0] != "health"] == [], "the engine was not touched"
    assert same_bits(sidecar.engine.weights, sc_publisher.views[0])
    assert sidecar.http.get("/health").status_code == 200  # still serving verified version 0
    sc_publisher.step(2, anchor=True)  # a route around the bad file: the anchor of version 2
    assert_at(sidecar, sc_publisher, 2)


def test_patch_from_another_base_is_rejected_at_staging(sc_publisher, sc_start, sc_client):
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine())
    assert_at(sidecar, sc_publisher, 0)
    calls = len(sidecar.engine.calls)
    good = sc_publisher.step(1)
    sidecar.wait_applied(1)  # else the sidecar may plan 0 -> 2 and never apply 1
    wrong_base = make_view(99)
    target = sc_publisher.views[1]
    stray = diff_views(wrong_base, target).patch  # right targets, base checksums of some other view
    sha = hashlib.sha256(stray).hexdigest()
    sc_client.put_blob(sc_publisher.run, sha, stray)
    files = [FileRef(path="patch-r0.safetensors", sha256=sha, size_bytes=len(stray), role="patch")]
    m2 = VersionManifest(
        **{
            **good.model_dump(),
            "version": 2,
            "base_version": 1,
            "files": files,
            "stats": {**good.stats.model_dump(), "encoded_bytes": len(stray)},
        }
    )
    sc_client.publish(m2)
    wait_for(
        lambda: (sidecar.status()["last_error"] or {}).get("type") == "StagingError", what="the lineage error reported"
    )
    assert "base checksum" in sidecar.status()["last_error"]["message"]
    assert sidecar.status()["applied_version"] == 1
    assert [m for m, _ in sidecar.engine.calls[calls:] if m != "health"] == [
        "stage_patches",
        "pause",
        "commit_staged",
        "reset_prefix_cache",
        "resume",
    ]  # version 1 only


@pytest.mark.parametrize(
    ("fault", "commit_calls", "error"),
    [
        (
            "fail_apply",
            ["stage_patches", "pause", "commit_staged", "load_snapshot", "apply_patch", "reset_prefix_cache", "resume"],
            "injected apply failure",
        ),
    ],
)
def test_failed_apply_recovers_from_the_anchor_in_the_same_pause(fault, commit_calls, error, sc_publisher, sc_start):
    """A commit that fails after writing is recovered from the anchor inside the same pause (a
    refusal while staging writes nothing and keeps serving: test_sidecar_refusals.py)."""
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine())
    assert_at(sidecar, sc_publisher, 0)
    before = len(sidecar.engine.calls)
    setattr(sidecar.engine, fault, 1)
    sc_publisher.step(1)
    assert_at(sidecar, sc_publisher, 1)
    assert [m for m, _ in sidecar.engine.calls[before:] if m != "health"] == commit_calls
    status = sidecar.status()
    assert (
        status["last_error"]["message"].startswith("applying versions 0->1")
        and error in status["last_error"]["message"]
    )
    assert status["last_sync"]["anchor"] is True
    assert 'stitch_sidecar_recoveries_total{outcome="ok"} 1.0' in sidecar.http.get("/metrics").text


#: The state metric's sample for one state while the sidecar is in it.
_STATE = 'stitch_sidecar_state{{stitch_sidecar_state="{}"}} 1.0'


def test_failed_recovery_marks_the_sidecar_unhealthy_until_it_succeeds(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine())
    assert_at(sidecar, sc_publisher, 0)
    engine = sidecar.engine
    engine.fail_apply, engine.fail_snapshot = 1, 1000
    sc_publisher.step(1)
    wait_for(lambda: sidecar.http.get("/health").json()["status"] == "unhealthy", what="unhealthy")
    health = sidecar.http.get("/health").json()
    assert health["status"] == "unhealthy" and "recovery from the anchor to version 1 failed" in health["reason"]
    status = sidecar.status()
    assert status["applied_version"] is None and status["healthy"] is False
    assert status["state"] == "unhealthy" and _STATE.format("unhealthy") in sidecar.http.get("/metrics").text
    wait_for(lambda: not engine.paused, what="engine resumed after the failed recovery")
    r = sidecar.http.post("/v1/completions", json={"prompt": "x"}, headers={"X-Stitch-Wait-S": "0.1"})
    assert r.status_code == 503 and r.json()["type"] == "NotReady"
    engine.fail_snapshot = 0
    assert_at(sidecar, sc_publisher, 1)
    assert sidecar.http.get("/health").status_code == 200
    wait_for(lambda: _STATE.format("idle") in sidecar.http.get("/metrics").text, what="the state metric back at idle")


def test_restart_finds_an_engine_mid_apply_and_recovers_it(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    sc_publisher.step(2)
    engine = FakeEngine(sc_publisher.views[1])
    engine.weights["model.layers.0.w"].bits[:8] ^= 1  # half-written when the previous sidecar died
    engine.version, engine.phase, engine.paused = None, "applying", True
    engine._running.clear()
    sidecar = sc_start(engine, boot_version=1)  # ignored: the engine is mid-apply, not fresh
    assert_at(sidecar, sc_publisher, 2)
    assert not engine.paused and engine.phase == "idle"
    # the adapter cannot tell whether an engine mid-apply is paused: the sidecar pauses it (idempotent)
    assert [m for m, _ in engine.calls if m != "health"] == [
        "pause",
        "load_snapshot",
        "apply_patch",
        "apply_patch",
        "reset_prefix_cache",
        "resume",
    ]


def test_restart_finds_a_paused_engine_and_resumes_it(sc_publisher, sc_start):
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    engine = FakeEngine(sc_publisher.views[0], version=0)
    engine.paused = True
    engine._running.clear()
    sidecar = sc_start(engine)
    assert_at(sidecar, sc_publisher, 1)
    assert not engine.paused
    assert [m for m, _ in engine.calls if m != "health"] == [
        "checksums",
        "resume",
        "stage_patches",
        "pause",
        "commit_staged",
        "reset_prefix_cache",
        "resume",
    ]


def test_a_sidecar_stops_at_once_when_its_engine_went_away_mid_commit(sc_publisher, sc_start):
    """Stopping the sidecar (SIGTERM: the app's shutdown cancels the reconciler) during a commit
    whose engine went away: the resume in the commit's ``finally`` fails, and that failure, which
    replaces the cancellation, must not be retried as a failed sync (the process then kept
    retrying the resume until it was killed)."""
    sc_publisher.publish(make_view(0))
    sidecar = sc_start(FakeEngine())
    assert_at(sidecar, sc_publisher, 0)
    engine = sidecar.engine
    engine.write_s_per_tensor, engine.fail_resume = 0.5, True
    sc_publisher.step(1)
    wait_for(lambda: engine.count("commit_staged"), what="the commit under way")
    started = time.monotonic()
    sidecar.stop()
    assert not sidecar.server.thread.is_alive(), "the sidecar did not stop: its reconciler kept retrying the resume"
    assert time.monotonic() - started < 5
