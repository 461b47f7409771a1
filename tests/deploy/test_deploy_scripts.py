"""The images' scripts, run for real: the boot step against a live bulletin process, and the
sidecar entry point handing the pulled boot version to ``stitchboard sidecar run``."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from stitchboard.demo.processes import free_port
from tests.deploy.deploy_helpers import SCRIPTS

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STITCH")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


@pytest.fixture
def bulletin(tmp_path):
    """A real `stitchboard bulletin serve` process over a file store, with a publish and a read token."""
    port = free_port()
    tokens = {"trainer-tok": {"scopes": ["publish"]}, "rollout-tok": {"scopes": ["replica"]}}
    env = _env(STITCH_BULLETIN_TOKENS=json.dumps(tokens))
    proc = subprocess.Popen(
        [str(BIN / "stitchboard"), "bulletin", "serve", "--store", f"file://{tmp_path / 'store'}", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # the CLI imports heavy modules at start: tens of seconds on a loaded machine
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise AssertionError(f"bulletin exited: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"bulletin did not answer within 180 s: {proc.communicate()[1].decode()[-2000:]}")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=10)  # waits and closes the stderr pipe


def _publish(url: str, folder: Path, run: str) -> int:
    """What `stitchboard publish CKPT` does, in this process (saves a torch import per call)."""
    from stitchboard.proto.checkpoint import load_checkpoint
    from stitchboard.trainer_client.publisher import Publisher

    with Publisher(url, run, "trainer-tok", assets=folder, retries=1) as publisher:
        return publisher.publish_view(load_checkpoint(folder / "model.safetensors")).version


def test_boot_step_pulls_the_latest_version_for_the_engine(bulletin, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "toy"}')
    w = np.arange(64, dtype=np.uint16).reshape(8, 8)
    save_file({"w": w}, str(ckpt / "model.safetensors"))
    assert _publish(bulletin, ckpt, "toy") == 0
    w2 = w.copy()
    w2[0, 0] ^= 1
    save_file({"w": w2}, str(ckpt / "model.safetensors"))
    assert _publish(bulletin, ckpt, "toy") == 1

    models = tmp_path / "models"
    models.mkdir()
    env = _env(
        STITCH_SIDECAR_BULLETIN=bulletin,
        STITCH_SIDECAR_RUN="toy",
        STITCH_SIDECAR_TOKEN="rollout-tok",
        STITCH_BOOT_DIR=str(models),
    )
    r = subprocess.run(
        ["sh", str(SCRIPTS["stitch-boot-weights"])], env=env, check=False, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (models / "boot.version").read_text().strip() == "1"
    assert os.readlink(models / "boot") == "v1"
    pulled = load_file(str(models / "boot" / "model.safetensors"))
    assert pulled["w"].tobytes() == w2.tobytes()
    assert (models / "boot" / "config.json").read_text() == '{"model_type": "toy"}'

    # Run again with an explicit older version: pulled next to nothing else, the newer folder removed.
    r = subprocess.run(
        ["sh", str(SCRIPTS["stitch-boot-weights"])],
        env={**env, "STITCH_BOOT_VERSION": "0"},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (models / "boot.version").read_text().strip() == "0"
    assert sorted(p.name for p in models.iterdir()) == ["boot", "boot.version", "v0"]

    # Without the read token the bulletin refuses: the step keeps waiting instead of booting wrong weights.
    bad = {k: v for k, v in env.items() if k != "STITCH_SIDECAR_TOKEN"}
    proc = subprocess.Popen(
        ["sh", str(SCRIPTS["stitch-boot-weights"])],
        env={**bad, "STITCH_BOOT_DIR": str(tmp_path / "m2")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out = b""
    try:
        deadline = time.monotonic() + 120  # a loaded machine can take tens of seconds to start the CLI and print
        while b"waiting for a version of run toy" not in out:
            assert proc.poll() is None, (
                f"the boot step exited ({proc.returncode}) instead of waiting: {(out + proc.stdout.read()).decode()}"
            )
            assert time.monotonic() < deadline, f"the boot step printed no wait message within 120 s: {out.decode()}"
            if select.select([proc.stdout], [], [], 0.1)[0]:
                out += os.read(proc.stdout.fileno(), 65536)
        assert proc.poll() is None, f"the boot step exited ({proc.returncode}) instead of waiting: {out.decode()}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert not (tmp_path / "m2" / "boot.version").exists(), out.decode()


def test_boot_step_from_the_base_model_pulls_nothing(tmp_path):
    (tmp_path / "boot.version").write_text("7\n")
    env = _env(
        STITCH_SIDECAR_BULLETIN="http://127.0.0.1:9",
        STITCH_SIDECAR_RUN="toy",
        STITCH_BOOT_DIR=str(tmp_path),
        STITCH_BOOT_FROM="base",
    )
    r = subprocess.run(
        ["sh", str(SCRIPTS["stitch-boot-weights"])], env=env, check=False, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "boot.version").exists(), "the sidecar must not claim a boot version for a base model"
    r = subprocess.run(
        ["sh", str(SCRIPTS["stitch-boot-weights"])],
        env={**env, "STITCH_BOOT_FROM": "nope"},
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "STITCH_BOOT_FROM" in r.stderr


def test_sidecar_entry_point_passes_the_boot_version(tmp_path):
    """stitch-sidecar execs `stitchboard sidecar run ARGS` with STITCH_SIDECAR_BOOT_VERSION from boot.version."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "stitchboard").write_text('#!/bin/sh\necho "args=$*"\necho "boot=${STITCH_SIDECAR_BOOT_VERSION:-unset}"\n')
    (fake / "stitchboard").chmod(0o755)
    models = tmp_path / "models"
    models.mkdir()
    env = {"PATH": f"{fake}{os.pathsep}/usr/bin:/bin", "STITCH_BOOT_DIR": str(models)}

    def run(**extra: str) -> str:
        r = subprocess.run(
            ["sh", str(SCRIPTS["stitch-sidecar"]), "--log-level", "debug"],
            env={**env, **extra},
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert run() == "args=sidecar run --log-level debug\nboot=unset\n"
    (models / "boot.version").write_text("12\n")
    assert run() == "args=sidecar run --log-level debug\nboot=12\n"
    assert run(STITCH_SIDECAR_BOOT_VERSION="3") == "args=sidecar run --log-level debug\nboot=3\n"
