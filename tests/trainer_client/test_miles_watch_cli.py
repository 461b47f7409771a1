"""``stitchboard watch --layout miles --base DIR`` as a process, on Miles-format folders of a tiny Llama's AdamW steps
(fast: no SmolLM2); and its options that do not go together."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.cli import build_app
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import to_raw
from tests.support.pythonpath import repo_on_pythonpath
from tests.trainer_client.miles_writer import MilesWriter
from tests.trainer_client.toy import assert_same_view
from tests.trainer_client.watch_frameworks import bf16_state, llama_step, tiny_llama, write_shards

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow


def test_watch_layout_miles_publishes_each_folder_on_the_one_before(bulletin, run, tmp_path):
    model = tiny_llama()
    base = tmp_path / "hf"
    write_shards(base, bf16_state(model), None)
    model.config.save_pretrained(base)
    writer = MilesWriter(tmp_path / "delta", base, encoding="overwrite", checksum_format="adler32", ranks=2)
    views = []
    for seed in (1, 2):
        llama_step(model, seed)
        state = bf16_state(model)
        views.append({n: to_raw(t) for n, t in state.items()})
        writer.write(state)
    command = [str(Path(sys.executable).with_name("stitchboard")), "watch", str(tmp_path / "delta")]
    proc = subprocess.Popen(
        [
            *command,
            "--layout",
            "miles",
            "--base",
            str(base),
            "--bulletin",
            bulletin.url,
            "--run",
            run,
            "--poll-s",
            "0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=repo_on_pythonpath(),
    )
    try:
        with BulletinClient(bulletin.url) as client:
            while (client.latest(run) or -1) < 1:
                assert proc.poll() is None, proc.communicate()
                client.latest(run, after=0, wait_s=2.0)
            for version, want in enumerate(views):
                assert client.manifest(run, version).metadata["step"] == version + 1
                assert_same_view(rebuild_version(client, run, version).view, want)
            assert "config.json" in {a.path for a in client.manifest(run, 0).files_of("asset")}  # --base: the assets
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_miles_layout_options(tmp_path):
    cli, app = CliRunner(), build_app()
    head = ["watch", str(tmp_path), "--bulletin", "http://127.0.0.1:9", "--run", "r"]
    for extra in (["--layout", "miles"], ["--layout", "prime-rl", "--base", str(tmp_path)]):
        out = cli.invoke(app, head + extra, env={"COLUMNS": "300"})
        assert out.exit_code == 2 and "--layout miles needs --base" in out.output, out.output
