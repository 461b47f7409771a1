"""Squash records at the bulletin over real HTTP, on both stores: what a put checks, plans, drop, retention and gc.

The squashes are the real trainer's (``Publisher(squash_depths=...)``) over small RL-like views.
"""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from stitchboard.bulletin import squash_store
from stitchboard.bulletin.errors import InvalidRequestError, NotFoundError, VersionConflictError
from stitchboard.bulletin.retention import GcReport, collect_garbage, collect_run
from stitchboard.trainer_client import squash_cli
from stitchboard.trainer_client.publisher import Publisher
from tests.support.squash_chain import rl_steps


def publish(server, client, run, views, tmp_path, **options) -> list:
    with Publisher(server.url, run, client=client, workdir=tmp_path / "pub", **options) as pub:
        return [pub.publish_view(v) for v in views]


def spans(client, run) -> list[tuple[int, int]]:
    return [(s.base_version, s.target_version) for s in client.squashes(run)]


def test_a_squash_put_is_checked_against_its_versions(server, client, run, tmp_path, backend):
    publish(server, client, run, rl_steps(1, 4, numel=4096), tmp_path, squash_depths=(3,))
    assert spans(client, run) == [(0, 3), (1, 4)]
    s03, s14 = client.squashes(run)
    assert client.put_squash(s14) is False, "the identical record again is a no-op"
    with pytest.raises(VersionConflictError, match="drop it first"):
        client.put_squash(s14.model_copy(update={"changed_elements": s14.changed_elements + 1}))
    assert client.drop_squash(run, 1, 4) is True and client.drop_squash(run, 1, 4) is False
    assert all(s.kind == "delta" for s in client.plan(run, 1, 4, squash=True).steps), (
        "a dropped squash is no longer planned"
    )
    before = backend.keys()
    bad = [
        (
            s14.model_copy(update={"target_manifest_sha256": s03.target_manifest_sha256}),
            InvalidRequestError,
            "names manifest",
        ),
        (
            s14.model_copy(update={"base_version": 0, "base_manifest_sha256": s03.base_manifest_sha256}),
            InvalidRequestError,
            "base checksum",
        ),
        (s14.model_copy(update={"files": s03.files, "size_bytes": s03.size_bytes}), InvalidRequestError, "checksum"),
        (s14.model_copy(update={"target_version": 7}), NotFoundError, "no version 7"),
    ]
    for record, error, words in bad:
        with pytest.raises(error, match=words):
            client.put_squash(record)
    assert backend.keys() == before, "a refused put writes nothing"
    assert client.put_squash(s14) is True, "a dropped squash can be stored again"
    assert [s.kind for s in client.plan(run, 1, 4, squash=True).steps] == ["squash"]
    old_client = httpx.get(
        f"{server.url}/v1/runs/{run}/plan", params={"from": 1, "to": 4}
    ).json()  # a client that does not know squash steps
    assert [sorted(step) for step in old_client["steps"]] == [["files", "kind", "size_bytes", "version"]] * 3 and {
        s["kind"] for s in old_client["steps"]
    } == {"delta"}


def test_retention_drops_squashes_with_their_versions(server, client, run, tmp_path):
    publish(server, client, run, rl_steps(2, 8, numel=4096), tmp_path, squash_depths=(2,), snapshot_every=3)
    records = {(s.base_version, s.target_version): s for s in client.squashes(run)}
    assert set(records) == {(v - 2, v) for v in range(2, 9)}
    ledger = server.app.state.bulletin.ledger
    report = collect_garbage(ledger, keep_snapshots=1, grace_s=0.0, runs=[run])
    assert report.versions_removed[run] == [0, 1, 2, 3, 4, 5]
    assert sorted(report.squashes_removed[run]) == [(v - 2, v) for v in range(2, 8)], (
        "every squash with a removed base or target goes"
    )
    assert spans(client, run) == [(6, 8)]
    for span, record in records.items():
        stored = client.has_blob(run, record.files[0].sha256) is not None
        assert stored == (span == (6, 8)), span
    assert [s.kind for s in client.plan(run, 6, 8, squash=True).steps] == ["squash"]


def test_gc_never_deletes_the_blobs_of_a_squash_being_written(server, client, run, tmp_path, monkeypatch):
    publish(server, client, run, rl_steps(3, 3, numel=4096), tmp_path, squash_depths=(3,))
    (record,) = client.squashes(run)
    client.drop_squash(run, 0, 3)  # its blob is now referenced by nothing
    ledger = server.app.state.bulletin.ledger
    report = GcReport()
    check = squash_store._check_files

    def gc_first(ledger_, squash):  # gc runs after the put declared its intent, before it checks the blobs
        collect_run(ledger_, run, keep_snapshots=1, grace_s=0.0, report=report)
        check(ledger_, squash)

    monkeypatch.setattr(squash_store, "_check_files", gc_first)
    assert client.put_squash(record) is True
    assert run not in report.blobs_removed, "the intent protected the squash's blob"
    monkeypatch.undo()
    collect_garbage(ledger, keep_snapshots=1, grace_s=0.0, runs=[run])
    assert client.has_blob(run, record.files[0].sha256) == record.size_bytes, "the stored record protects it"
    client.drop_squash(run, 0, 3)
    gone = collect_garbage(ledger, keep_snapshots=1, grace_s=0.0, runs=[run])
    assert gone.blobs_removed[run] == [record.files[0].sha256], "a dropped squash's blob goes with the next gc"


def test_dropped_squashes_are_rebuilt_from_the_stored_anchor_and_deltas(server, client, run, tmp_path):
    publish(server, client, run, rl_steps(4, 6, numel=4096), tmp_path, squash_depths=(3, 5), snapshot_every=4)
    original = {(s.base_version, s.target_version): s for s in client.squashes(run)}
    assert set(original) == {(0, 3), (1, 4), (2, 5), (0, 5), (3, 6), (1, 6)}
    cli = CliRunner()
    dropped = cli.invoke(squash_cli.app, ["drop", "--bulletin", server.url, "--run", run, "0-3", "1-6"])
    assert (
        dropped.exit_code == 0
        and dropped.output.strip() == "2"
        and set(spans(client, run)) == set(original) - {(0, 3), (1, 6)}
    )
    assert cli.invoke(squash_cli.app, ["drop", "--bulletin", server.url, "--run", run]).output.strip() == "4"
    rebuilt = cli.invoke(squash_cli.app, ["rebuild", "--bulletin", server.url, "--run", run, "--depths", "3,5"])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert len(rebuilt.output.splitlines()) == 6
    again = {(s.base_version, s.target_version): s for s in client.squashes(run)}
    assert again == original, "the rebuild makes the very records (and patch files) the publisher made"
    assert squash_cli.rebuild_squashes(client, run, (3, 5)) == [], "spans already stored are skipped"
