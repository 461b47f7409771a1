"""stitchboard as a verl checkpoint engine, driven by verl 0.9.1's own classes in .venv-verl (a subprocess, as the
SGLang tests drive .venv-sglang), ending bit-exact in real vLLM behind a sidecar.

* The registry: ``stitchboard`` is unknown to verl's ``CheckpointEngineRegistry`` until verl's own
  ``import_external_libs`` loads the ``custom_backend_module``; then ``CheckpointEngineRegistry.new`` builds the
  backend from ``engine_kwargs`` as verl's workers do, and an unknown key is refused.
* The manager: verl's real ``CheckpointEngineManager`` on a local CPU Ray cluster (examples/verl/verl_driver.py:
  verl's RayWorkerGroup, its CheckpointEngineWorker on the rollout side) syncs the loaded SmolLM2 weights
  (step 0: the run's version 0, a no-op), two real AdamW steps (versions 1, 2) and step 2 again (a retried
  manager: a no-op); the sidecar beside the session's vLLM applies each version, and at the end the engine holds
  exactly the bits of the trainer's last served view (checksums of every tensor: trainer, bulletin, engine).

One engine start at most: the session's vLLM (tests/sidecar/vllm_fixtures.py), brought back to version 0's bits
after. ``make venv-verl`` builds .venv-verl (CI does); without it the tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from stitchboard.bulletin.app import create_app as create_bulletin
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
from stitchboard.trainer_client.publisher import Publisher
from tests.sidecar.sidecar_helpers import AppServer
from tests.sidecar.vllm_fixtures import SidecarProcess, load_checkpoint_as_version_0
from tests.support.vllm_server import VllmServer

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
DRIVER = ROOT / "examples" / "verl" / "verl_driver.py"


def require_verl() -> None:
    """Skip the calling test when .venv-verl is missing, except under CI (``CI`` set): fail there."""
    if os.access(VERL_PYTHON, os.X_OK):
        return
    message = f"no verl environment at {VERL_PYTHON}: `make venv-verl` builds it"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def run_verl(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run .venv-verl's Python with ``args`` from the repo root."""
    return subprocess.run(
        [str(VERL_PYTHON), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )


REGISTRY_CHECK = textwrap.dedent(
    """
    import json
    import pydantic
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    out = {}
    try:
        CheckpointEngineRegistry.get("stitchboard")
        out["before"] = "registered"
    except ValueError as exc:
        out["before"] = str(exc)
    import_external_libs("stitchboard.trainer_client.verl")  # what verl does with custom_backend_module
    cls = CheckpointEngineRegistry.get("stitchboard")
    engine = CheckpointEngineRegistry.new(
        "stitchboard", bucket_size=1 << 20, is_master=True, bulletin="http://b:8700", run="r", min_replicas=2
    )
    out["class"] = f"{cls.__module__}.{cls.__qualname__}"
    out["is_engine"] = isinstance(engine, CheckpointEngine)
    out["options"] = engine.options.model_dump(include={"bulletin", "run", "min_replicas"})
    out["committer"] = engine.sender.committer
    out["topology"] = cls.build_topology(2, 4, [{}] * 6)
    out["prepare"] = engine.prepare()
    try:
        CheckpointEngineRegistry.new("stitchboard", bucket_size=1, min_repicas=2)
        out["typo"] = "accepted"
    except pydantic.ValidationError as exc:
        out["typo"] = str(exc)
    print("REGISTRY " + json.dumps(out))
    """
)


def test_verl_loads_the_backend_through_custom_backend_module() -> None:
    require_verl()
    proc = run_verl(["-c", REGISTRY_CHECK], timeout_s=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REGISTRY ")), None)
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-4000:]
    out = json.loads(line.removeprefix("REGISTRY "))
    assert "Checkpoint engine stitchboard not registered" in out["before"]
    assert out["class"] == "stitchboard.trainer_client.verl.StitchboardCheckpointEngine" and out["is_engine"]
    assert out["options"] == {"bulletin": "http://b:8700", "run": "r", "min_replicas": 2}
    assert out["committer"] is True
    assert out["topology"] == [{}, {}] and out["prepare"] == {}
    assert "min_repicas" in out["typo"] and "Extra inputs are not permitted" in out["typo"]


def test_verl_manager_syncs_real_adamw_steps_into_vllm_bit_exact(
    vllm_engine: VllmServer, smollm2_dir: Path, tmp_path: Path
) -> None:
    require_verl()
    run = "verl-manager"
    bulletin = AppServer(
        create_bulletin(
            BulletinSettings(store=f"file://{tmp_path / 'store'}", poll_interval_s=0.05, fleet_poll_interval_s=0.2)
        )
    )
    client = BulletinClient(bulletin.url)
    sidecar = None
    try:
        with Publisher(bulletin.url, run, assets=smollm2_dir, workdir=tmp_path / "pub") as publisher:
            publisher.publish_view(load_checkpoint(smollm2_dir), step=0)  # version 0: what the engine boots from
        load_checkpoint_as_version_0(vllm_engine.url, smollm2_dir, client.manifest(run, 0).checksums())
        sidecar = SidecarProcess(SimpleNamespace(bulletin=bulletin, run=run), vllm_engine.url, tmp_path, {})
        sidecar.wait_applied(0)

        proc = run_verl(
            [str(DRIVER), "--model", str(smollm2_dir), "--bulletin", bulletin.url, "--run", run, "--steps", "2"],
            timeout_s=900,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("VERL_DRIVER ")), None)
        assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-6000:]
        out = json.loads(line.removeprefix("VERL_DRIVER "))

        assert [(s["step"], s["version"], s["new"]) for s in out["syncs"]] == [
            (0, 0, False),  # the loaded weights are version 0's bits: nothing new
            (1, 1, True),
            (2, 2, True),
            (2, 2, False),  # the retried sync
        ]
        assert out["losses"][1] < out["losses"][0]  # real AdamW steps
        assert out["rollout_last"] == [{"step": 2, "version": 2, "replicas": 1}]  # verl's rollout side saw it served
        assert client.latest(run) == 2
        manifest = client.manifest(run, 2)
        assert manifest.metadata["step"] == 2
        assert manifest.checksums() == out["sums"], "the bulletin's version 2 is not the trainer's served view"
        assert manifest.checksums() != client.manifest(run, 1).checksums() != client.manifest(run, 0).checksums()
        status = sidecar.wait_applied(2, timeout_s=60)
        assert status["applied_version"] == 2
        engine = VllmEngine(vllm_engine.url, timeout_s=60)
        try:
            state = engine.state()
            assert (state.version, state.phase) == (2, "idle")
            assert engine.checksums(sorted(out["sums"])) == out["sums"], "vLLM does not hold the trainer's bits"
        finally:
            engine.close()
    finally:
        if sidecar is not None:
            sidecar.stop()
        try:
            load_checkpoint_as_version_0(vllm_engine.url, smollm2_dir, client.manifest(run, 0).checksums())
        finally:
            client.close()
            bulletin.stop()
