"""``stitchboard sidecar run`` as a process: settings from env and options, a down engine reported, not fatal."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from stitchboard.demo.processes import free_port
from stitchboard.sidecar.cli import app


def test_missing_settings_exit_2_with_the_names(monkeypatch):
    for name in ("STITCH_SIDECAR_BULLETIN", "STITCH_SIDECAR_RUN"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(app, ["run", "--run", "r1"])
    assert result.exit_code == 2
    assert "bulletin: Field required" in result.output


def test_replica_id_option_is_checked_like_its_setting(monkeypatch):
    monkeypatch.setenv("STITCH_SIDECAR_BULLETIN", "http://127.0.0.1:9")
    result = CliRunner().invoke(app, ["run", "--run", "r1", "--replica-id", "no spaces/allowed"])
    assert result.exit_code == 2
    assert "replica_id" in result.output


@pytest.mark.slow  # starts a process (docs/testing.md, the slow tier)
def test_process_serves_status_while_the_engine_is_down(sc_bulletin, sc_publisher, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "STITCH_SIDECAR_BULLETIN": sc_bulletin.url,
        "STITCH_SIDECAR_ENGINE_URL": "http://127.0.0.1:9",
        "STITCH_SIDECAR_HANDOFF_DIR": str(tmp_path / "handoff"),
        "STITCH_SIDECAR_LOG_LEVEL": "warning",
        "STITCH_SIDECAR_RETRY_BACKOFF_S": "0.1",
    }
    cmd = [
        sys.executable,
        "-c",
        "from stitchboard.proto.cli import main; main()",
        "sidecar",
        "run",
        "--run",
        sc_publisher.run,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # the CLI imports torch at start: tens of seconds on a loaded machine
        while True:
            try:
                status = httpx.get(f"{url}/v1/stitch/status", timeout=1).json()
                if status["last_error"]:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "timeout"
            )
            time.sleep(0.1)
        assert status["run_id"] == sc_publisher.run and status["state"] == "waiting_for_engine"
        assert status["last_error"]["type"] == "EngineUnavailable"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.headers["retry-after"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers={"X-Stitch-Wait-S": "0"})
        assert r.status_code == 503 and r.json()["type"] == "NotReady"
        assert httpx.post(f"{url}/collective_rpc", json={}).status_code == 403
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stderr.close()
