"""Training steps on the bulletin: the lookup ``GET /v1/runs/{run}/versions?step=N`` (route, client, CLI,
its cost on a run of many versions) and the publish rule for steps, over real HTTP."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from stitchboard.bulletin.errors import InvalidRequestError, VersionConflictError
from stitchboard.bulletin.ledger import Ledger, blob_key
from stitchboard.bulletin.stores.folder import FileStore
from stitchboard.proto.cli import build_app
from stitchboard.proto.schema import FileRef, VersionManifest, canonical_json
from tests.bulletin.bulletin_helpers import make_manifest, sha, upload_version


def _again(m: VersionManifest, version: int, step: object) -> VersionManifest:
    """``m``'s tensors (the same bits) as version ``version``, an empty delta recording ``step``."""
    body = m.model_dump(mode="json")
    stats = {**body["stats"], "changed_elements": 0, "encoded_bytes": 0}
    return VersionManifest.model_validate(
        {
            **body,
            "version": version,
            "base_version": version - 1,
            "snapshot": False,
            "files": [],
            "stats": stats,
            "metadata": {"step": step},
        }
    )


def test_the_first_version_at_a_step(client, run):
    """Steps 0, 5, 7 (a gap) and 20: each step finds the first version at it or later; past the last, none."""
    for version, step in enumerate((0, 5, 7, 20)):
        upload_version(client, run, version, snapshot_bytes=10 if version == 0 else 0, metadata={"step": step})
    want = {0: 0, 1: 1, 5: 1, 6: 2, 7: 2, 8: 3, 19: 3, 20: 3}
    assert {s: client.version_for_step(run, s).version for s in want} == want
    assert client.version_for_step(run, 21) is None
    assert client.version_for_step("no-such-run", 0) is None
    answer = httpx.get(f"{client.url}/v1/runs/{run}/versions", params={"step": 21})
    assert answer.status_code == 404 and run in answer.json()["message"] and "step 21" in answer.json()["message"]
    assert httpx.get(f"{client.url}/v1/runs/{run}/versions", params={"step": -1}).status_code == 422
    page = httpx.get(f"{client.url}/v1/runs/{run}/versions").json()  # without step: the listing, as before
    assert [v["version"] for v in page["versions"]] == [0, 1, 2, 3]

    cli = CliRunner()
    out = cli.invoke(
        build_app(), ["versions", "at-step", "--bulletin", client.url, "--run", run, "--step", "6", "--json"]
    )
    assert out.exit_code == 0 and json.loads(out.output)["version"] == 2, out.output
    out = cli.invoke(build_app(), ["versions", "at-step", "--bulletin", client.url, "--run", run, "--step", "99"])
    assert out.exit_code == 3 and "no version at step 99" in out.output


def test_a_run_that_records_steps_from_a_later_version(client, run):
    upload_version(client, run, 0, snapshot_bytes=10)  # no step
    upload_version(client, run, 1, metadata={"step": 3})
    assert client.version_for_step(run, 0).version == 1
    with pytest.raises(InvalidRequestError, match="records no step, but version 1 records step 3"):
        upload_version(client, run, 2)
    assert client.latest(run) == 1


class _CountingStore(FileStore):
    """A folder store that counts the version objects it reads."""

    reads = 0

    def get(self, key: str) -> tuple[bytes, str]:
        if "/versions/" in key:
            self.reads += 1
        return super().get(key)


def test_the_lookup_reads_log2_of_the_versions(tmp_path, run):
    """300 versions at steps 0, 3, 6, ...: a lookup from a fresh ledger reads at most ceil(log2(301)) = 9
    manifests (and the one it answers from the cache); asked again, none (cache hits, revalidated by a
    metadata read)."""
    ledger = Ledger(FileStore(tmp_path))
    data = b"anchor"
    ledger.store.put_new(blob_key(run, sha(data)), data)
    snapshot = FileRef(path="model.safetensors", sha256=sha(data), size_bytes=len(data), role="snapshot")
    for version in range(300):
        files = [snapshot] if version == 0 else []
        ledger.publish(run, make_manifest(run, version, files, metadata={"step": 3 * version}))
    cold = Ledger(_CountingStore(tmp_path))
    assert cold.version_for_step(run, 451).version == 151
    assert cold.store.reads <= 9, cold.store.reads
    reads = cold.store.reads
    assert cold.version_for_step(run, 451).version == 151 and cold.store.reads == reads
    assert cold.version_for_step(run, 0).version == 0 and cold.version_for_step(run, 450).version == 150
    assert cold.version_for_step(run, 897).version == 299 and cold.version_for_step(run, 898) is None


def test_the_step_rule(client, run, backend):
    v0 = upload_version(client, run, 0, snapshot_bytes=10, metadata={"step": 0})
    v1 = upload_version(client, run, 1, patch_bytes=10, metadata={"step": 1})
    before = backend.keys()
    same = _again(v1, 2, 1)
    assert client.publish(same).version == 1  # the latest step with the same bits: that version, nothing written
    answer = httpx.post(f"{client.url}/v1/runs/{run}/versions", content=canonical_json(same))
    assert answer.status_code == 200 and answer.json()["version"] == 1
    assert backend.keys() == before and client.latest(run) == 1

    with pytest.raises(
        VersionConflictError, match="step 1 of run .* is version 1; version 2 records step 1 with other"
    ):
        client.publish(_again(v0, 2, 1))
    with pytest.raises(VersionConflictError, match="records step 0, below step 1 of version 1"):
        client.publish(_again(v1, 2, 0))
    with pytest.raises(InvalidRequestError, match="records no step"):
        client.publish(_again(v1, 2, None))
    for bad in ("1", 1.5, True, -1):
        with pytest.raises(InvalidRequestError, match="a step is an integer >= 0"):
            client.publish(_again(v1, 2, bad))
    assert backend.keys() == before
    assert client.publish(_again(v1, 2, 2)).version == 2  # a later step with the same bits is a new version
