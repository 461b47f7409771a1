"""The planner (pure) and the retention policy / gc (on both backends)."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from stitchboard.bulletin.cli import app as bulletin_cli
from stitchboard.bulletin.errors import InvalidRequestError, NotFoundError
from stitchboard.bulletin.ledger import Ledger, version_key
from stitchboard.bulletin.planner import make_plan
from stitchboard.bulletin.retention import GcReport, collect_garbage, collect_run, kept_from
from stitchboard.bulletin.stores import open_store
from stitchboard.proto.schema import FileRef, VersionManifest, canonical_json
from tests.bulletin.bulletin_helpers import make_manifest, sha, upload_version


def _f(role: str, size: int, tag: str) -> FileRef:
    return FileRef(path=f"{role}-{tag}", sha256=sha(tag.encode()), size_bytes=size, role=role)


def _history(spec: dict[int, tuple[int, int]]):
    """version -> (patch bytes, snapshot bytes) as manifests."""
    out = {}
    for v, (patch, snap) in spec.items():
        files = ([_f("patch", patch, f"p{v}")] if patch else []) + (
            [_f("snapshot", snap, f"s{v}"), _f("asset", 1, f"a{v}")] if snap else []
        )
        out[v] = make_manifest("r", v, files)
    return out


def test_plan_chooses_the_cheaper_route():
    h = _history({0: (0, 1000), 1: (10, 0), 2: (10, 0), 3: (600, 0), 4: (10, 1000), 5: (10, 0)})
    p = make_plan("r", 2, 5, h.get)
    assert [(s.version, s.kind) for s in p.steps] == [(3, "delta"), (4, "delta"), (5, "delta")] and p.total_bytes == 620
    p = make_plan("r", 1, 5, {**h, 3: make_manifest("r", 3, [_f("patch", 5000, "p3")])}.get)
    assert [(s.version, s.kind) for s in p.steps] == [(4, "snapshot"), (5, "delta")] and p.total_bytes == 1011
    assert {f.role for f in p.steps[0].files} == {"snapshot", "asset"}
    p = make_plan("r", None, 3, h.get)
    assert [(s.version, s.kind) for s in p.steps] == [(0, "snapshot"), (1, "delta"), (2, "delta"), (3, "delta")]
    p = make_plan("r", 5, 2, h.get)  # backwards: only via an anchor
    assert p.steps[0].kind == "snapshot" and p.to_version == 2
    assert make_plan("r", 3, 3, h.get).steps == []


def test_plan_skips_versions_removed_by_retention():
    h = _history({2: (10, 1000), 3: (10, 0), 4: (10, 0)})
    p = make_plan("r", 0, 4, h.get)  # 1 and 0 are gone: the delta route is incomplete
    assert [(s.version, s.kind) for s in p.steps] == [(2, "snapshot"), (3, "delta"), (4, "delta")]
    with pytest.raises(NotFoundError, match="no anchor"):
        make_plan("r", 0, 4, {3: h[3], 4: h[4]}.get)
    with pytest.raises(NotFoundError):
        make_plan("r", 0, 9, h.get)


def test_kept_from():
    assert kept_from([0, 5, 9], 2) == 5
    assert kept_from([0], 2) == 0
    assert kept_from([0, 5, 9], 1) == 9


def test_gc_keeps_policy_and_waits_out_the_grace_period(client, backend, run):
    # snapshots at 0, 3, 5; K=2 keeps 3.. ; versions 0-2 fall out once 5 is committed
    manifests = [
        upload_version(client, run, v, snapshot_bytes=100 if v in (0, 3, 5) else 0, patch_bytes=0 if v == 0 else 20)
        for v in range(7)
    ]
    orphan = b"never published"
    client.put_blob(run, sha(orphan), orphan)
    ledger = Ledger(open_store(backend.settings.store, backend.settings), cache_entries=0)

    report = collect_garbage(ledger, keep_snapshots=2, grace_s=3600, runs=[run])
    assert report.versions_removed == {} and report.blobs_removed == {}  # all within the grace period

    dry = collect_garbage(ledger, keep_snapshots=2, grace_s=0, runs=[run], dry_run=True)
    assert dry.versions_removed == {run: [0, 1, 2]}
    assert ledger.version_numbers(run) == list(range(7))

    report = GcReport()
    collect_run(ledger, run, 2, 60, report, now=time.time() + 120)
    assert report.versions_removed == {run: [0, 1, 2]}
    removed = set(report.blobs_removed[run])
    old_files = {f.sha256 for m in manifests[:3] for f in m.files}
    assert removed == old_files | {sha(orphan)}
    assert ledger.version_numbers(run) == [3, 4, 5, 6]
    for m in manifests[3:]:
        for f in m.files:
            assert ledger.stat_blob(run, f.sha256) is not None
    assert client.latest(run) == 6
    p = client.plan(run, from_version=1)
    assert p.steps[0].kind == "snapshot" and p.steps[0].version == 5
    with pytest.raises(NotFoundError):
        client.manifest(run, 0)


def test_gc_cli(client, backend, run):
    upload_version(client, run, 0, snapshot_bytes=10)
    upload_version(client, run, 1, snapshot_bytes=10, patch_bytes=5)
    env = {
        f"STITCH_BULLETIN_{k.upper()}": str(v)
        for k, v in backend.settings.model_dump(exclude={"tokens"}).items()
        if v is not None
    }
    result = CliRunner().invoke(
        bulletin_cli, ["gc", "--keep-snapshots", "1", "--grace-s", "0", "--run", run, "--dry-run", "--json"], env=env
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["versions_removed"] == {run: [0]}
    result = CliRunner().invoke(bulletin_cli, ["gc", "--keep-snapshots", "1", "--grace-s", "0", "--run", run], env=env)
    assert result.exit_code == 0 and "bytes freed" in result.output
    assert [i.version for i in client.versions(run)] == [1]


def test_plan_never_crosses_a_tensor_set_change_with_deltas():
    h = _history({0: (0, 1000), 1: (10, 0), 2: (10, 1000), 3: (10, 0)})
    grown = h[2].model_copy(
        update={"tensors": [*h[2].tensors, h[2].tensors[0].model_copy(update={"name": "model.new"})]}
    )
    h[2] = grown.model_copy(update={"stats": grown.stats.model_copy(update={"total_elements": 16})})
    h[3] = h[3].model_copy(
        update={"tensors": h[2].tensors, "stats": h[3].stats.model_copy(update={"total_elements": 16})}
    )
    p = make_plan("r", 1, 3, h.get)  # the delta of 2 is cheaper, but only 2's snapshot leads past the change
    assert [(s.version, s.kind) for s in p.steps] == [(2, "snapshot"), (3, "delta")]


def _at_version_0(tmp_path) -> tuple[Ledger, VersionManifest]:
    """A ledger on a folder with run ``r`` at version 0 (an anchor) and the blob of version 1's patch stored; the
    ledger and version 1's manifest (not published)."""
    ledger = Ledger(open_store(f"file://{tmp_path}"))
    for tag, size in (("s0", 4), ("p1", 2)):
        data = tag.encode().ljust(size, b"x")[:size]
        ledger.store.put_new(f"runs/r/blobs/{sha(data)}", data)
    snap = FileRef(path="model.safetensors", sha256=sha(b"s0xx"), size_bytes=4, role="snapshot")
    patch = FileRef(path="patch.safetensors", sha256=sha(b"p1"), size_bytes=2, role="patch")
    ledger.publish("r", make_manifest("r", 0, [snap]))
    return ledger, make_manifest("r", 1, [patch])


def test_publish_refuses_a_tensor_set_change_without_snapshot(tmp_path):
    ledger, v1 = _at_version_0(tmp_path)
    changed = v1.model_copy(update={"tensors": [v1.tensors[0].model_copy(update={"shape": [2, 4]})]})
    with pytest.raises(InvalidRequestError, match="changes the tensor set"):
        ledger.publish("r", changed)
    assert ledger.publish("r", v1)[1] is True


def test_a_committed_version_is_read_from_memory_until_its_object_changes(tmp_path, monkeypatch):
    ledger, v1 = _at_version_0(tmp_path)
    store = ledger.store
    ledger.publish("r", v1)
    reads: list[str] = []
    get = store.get
    monkeypatch.setattr(store, "get", lambda key: reads.append(key) or get(key))
    for version in (1, 0):  # both filled by their commits: the next commit and the first readers parse neither
        found = ledger.committed("r", version)
        assert found.manifest_json == canonical_json(found.manifest)
    assert reads == [] and ledger.committed("r", 1).manifest == v1
    key = version_key("r", 1)
    data, _ = get(key)
    store.delete(key)
    time.sleep(0.01)  # another mtime: the object rewritten out of band has another etag
    store.put_new(key, data)
    assert ledger.committed("r", 1).manifest == v1 and reads == [key]
