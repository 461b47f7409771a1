"""``stitchboard watch`` as a process: killed and started again it publishes nothing twice; its metrics;
a folder of another layout; options that do not go together."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.cli import build_app
from stitchboard.trainer_client.resume import rebuild_version
from tests.bulletin.bulletin_helpers import free_port
from tests.support.pythonpath import repo_on_pythonpath
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of
from tests.trainer_client.watch_frameworks import bf16_state, tiny_llama, write_hf_checkpoint, write_prime_rl

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow


def _watch(url: str, run: str, root: Path, *extra: str) -> subprocess.Popen:
    command = [str(Path(sys.executable).with_name("stitchboard")), "watch", str(root), "--bulletin", url, "--run", run]
    return subprocess.Popen(
        [*command, "--poll-s", "0.1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=repo_on_pythonpath(),
    )


def _wait_for(client: BulletinClient, run: str, version: int, proc: subprocess.Popen) -> None:
    """Long-poll until ``version`` of ``run`` is committed; fail with the watcher's output if it exits first."""
    while (client.latest(run) or -1) < version:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the watcher exited ({proc.returncode}) before version {version}:\n{out}\n{err}")
        client.latest(run, after=version - 1, wait_s=2.0)


def test_killed_and_started_again_it_publishes_nothing_twice(bulletin, run, tmp_path):
    root = tmp_path / "broadcasts"
    trainer, views = ToyTrainer(), {}
    for step in (1, 2):
        trainer.step()
        views[step] = view_of(trainer.model)
        write_prime_rl(root, step, bf16_state(trainer.model))
    port = free_port()
    with BulletinClient(bulletin.url) as client:
        first = _watch(bulletin.url, run, root, "--layout", "prime-rl", "--metrics-port", str(port))
        try:
            _wait_for(client, run, 1, first)
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            assert "stitch_watch_published_total 2.0" in metrics and "stitch_watch_last_step 2.0" in metrics
        finally:
            first.kill()  # SIGKILL: no clean-up of any kind
            first.communicate()
        trainer.step()
        views[3] = view_of(trainer.model)
        write_prime_rl(root, 3, bf16_state(trainer.model))

        second = _watch(bulletin.url, run, root)
        try:
            _wait_for(client, run, 2, second)
        finally:
            second.send_signal(signal.SIGTERM)
            out, err = second.communicate(timeout=60)
        assert second.returncode == 0, err
        assert "latest version 1 at step 2" in out and "step 3 -> version 2: " in out, out
        assert "step 1" not in out and "step 2 ->" not in out and "not published" not in out, out
        assert [client.manifest(run, i.version).metadata["step"] for i in client.versions(run)] == [1, 2, 3]
        for version, step in enumerate((1, 2, 3)):
            assert_same_view(rebuild_version(client, run, version).view, views[step])


def test_a_folder_of_another_layout(bulletin, run, tmp_path):
    write_hf_checkpoint(tmp_path / "out", 4, tiny_llama())
    proc = _watch(bulletin.url, run, tmp_path / "out", "--layout", "prime-rl")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out, err)
    assert "holds hf-trainer checkpoints (checkpoint-4), not prime-rl's step_N/" in err, err
    assert "--layout hf-trainer" in err


def test_options_that_do_not_go_together(tmp_path):
    cli, app = CliRunner(), build_app()
    base = ["watch", str(tmp_path), "--bulletin", "http://127.0.0.1:9", "--run", "r"]
    for extra, says in (
        (["--pattern", "ckpt-*"], "--complete-marker FILE or --settle-s"),
        (["--pattern", "ckpt-*", "--settle-s", "5", "--layout", "prime-rl"], "not both"),
        (["--complete-marker", "DONE"], "goes with --pattern"),
        (["--encoding", "gzip"], "use one of"),
    ):
        out = cli.invoke(app, base + extra, env={"COLUMNS": "300"})  # one line per message
        assert out.exit_code == 2 and says in out.output, out.output
