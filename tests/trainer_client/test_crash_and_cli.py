"""A trainer killed between upload and commit; publishing and pulling checkpoints from the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from stitchboard.bulletin.retention import collect_garbage
from stitchboard.proto.checkpoint import load_checkpoint, save_checkpoint
from stitchboard.proto.cli import build_app
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from tests.support.pythonpath import repo_on_pythonpath
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

KILLED_TRAINER = """
import os, signal
from tests.trainer_client.toy import ToyTrainer
from stitchboard.bulletin.client import BulletinClient
from stitchboard.trainer_client.publisher import Publisher
trainer = ToyTrainer()
pub = Publisher({url!r}, {run!r})
pub.publish(trainer.model)
trainer.step()
BulletinClient.publish = lambda self, manifest: os.kill(os.getpid(), signal.SIGKILL)  # dies before the commit
pub.publish(trainer.model, anchor=True)
"""


def _stored_blobs(bulletin, run) -> set[str]:
    return {o.key.rsplit("/", 1)[-1] for o in bulletin.app.state.bulletin.ledger.store.list(f"runs/{run}/blobs/")}


def _referenced(client, run) -> set[str]:
    return {f.sha256 for i in client.versions(run) for f in client.manifest(run, i.version).files}


def test_killed_after_upload_before_commit(bulletin, run):
    code = KILLED_TRAINER.format(url=bulletin.url, run=run)
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, timeout=120, env=repo_on_pythonpath()
    )  # it imports tests.trainer_client.toy
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    with bulletin.client() as client:
        assert [i.version for i in client.versions(run)] == [0]  # version 1 does not exist
        orphans = _stored_blobs(bulletin, run) - _referenced(client, run)
        assert len(orphans) == 2  # its patch and its snapshot shard

        trainer = ToyTrainer(seed=1)  # a restarted trainer, other weights: resumes from version 0
        with Publisher(bulletin.url, run) as pub:
            assert pub.publish(trainer.model).version == 1
        assert_same_view(rebuild_version(client, run, 1).view, view_of(trainer.model))

        ledger = bulletin.app.state.bulletin.ledger
        report = collect_garbage(ledger, keep_snapshots=2, grace_s=3600, runs=[run])
        assert not report.blobs_removed and _stored_blobs(bulletin, run) >= orphans  # within the grace period
        report = collect_garbage(ledger, keep_snapshots=2, grace_s=0, runs=[run])
        assert set(report.blobs_removed[run]) == orphans
        assert _stored_blobs(bulletin, run) == _referenced(client, run)
        assert_same_view(rebuild_version(client, run, 1).view, view_of(trainer.model))


def test_cli_publish_checkpoints_and_pull_them_back(bulletin, run, tmp_path):
    app = build_app()
    cli = CliRunner()
    trainer = ToyTrainer()
    views = []
    for step in range(3):
        folder = tmp_path / f"ckpt-{step}"
        views.append(view_of(trainer.model))
        # step 1 is sharded (index + 2 files); the others are one model.safetensors
        save_checkpoint(folder, views[-1], max_shard_bytes=4096 if step == 1 else 1 << 30)
        (folder / "config.json").write_text(json.dumps({"model_type": "toy", "step": step}))
        args = ["publish", str(folder), "--bulletin", bulletin.url, "--run", run, "--step", str(step)]
        out = cli.invoke(app, args + (["--anchor"] if step == 2 else []))
        assert out.exit_code == 0, out.output
        assert out.output.strip().splitlines()[-1] == str(step)
        trainer.step()
    with bulletin.client() as client:
        assert client.manifest(run, 2).snapshot and not client.manifest(run, 1).snapshot
    for version in (1, 2):
        target = tmp_path / f"pulled-{version}"
        out = cli.invoke(
            app, ["pull", "--bulletin", bulletin.url, "--run", run, "--version", str(version), "-o", str(target)]
        )
        assert out.exit_code == 0, out.output
        assert_same_view(load_checkpoint(target), views[version])
        # run assets are the ones published with version 0, immutable
        assert json.loads((target / "config.json").read_text())["step"] == 0
    out = cli.invoke(app, ["pull", "--bulletin", bulletin.url, "--run", run, "-o", str(tmp_path / "pulled-1")])
    assert out.exit_code == 1 and "not empty" in out.output
    out = cli.invoke(
        app, ["pull", "--bulletin", bulletin.url, "--run", run, "--version", "9", "-o", str(tmp_path / "x")]
    )
    assert out.exit_code == 1 and "NotFound" in out.output
    assert os.listdir(tmp_path / "pulled-2")
