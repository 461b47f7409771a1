"""Issue 11 item 7: ``stitchboard pull`` never lets an asset stand in for the weights, and it
verifies the folder it wrote (weights read back and checked, assets hashed)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from stitchboard.bulletin.ledger import Ledger
from stitchboard.bulletin.stores import open_store
from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.proto.cli import build_app
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor
from stitchboard.proto.schema import FileRef, TensorSpec, VersionManifest, VersionStats
from stitchboard.trainer_client.errors import ResumeError
from stitchboard.trainer_client.resume import pull_version, verify_pulled

VIEW = {"model.w": RawTensor("BF16", (8,), np.arange(8, dtype=np.uint16))}


def _commit_v0(bulletin, store_root, run, tmp_path, asset_path: str) -> None:
    """Commit version 0 with one asset through the ledger, past the publish route's checks (as a version committed
    before them)."""
    save_checkpoint(tmp_path / "ckpt", VIEW)
    shard, asset = (tmp_path / "ckpt" / "model.safetensors").read_bytes(), json.dumps({"model_type": "toy"}).encode()
    files = []
    with bulletin.client() as client:
        for path, data, role in (("model-00001-of-00001.safetensors", shard, "snapshot"), (asset_path, asset, "asset")):
            digest = hashlib.sha256(data).hexdigest()
            client.put_blob(run, digest, data)
            files.append(FileRef(path=path, sha256=digest, size_bytes=len(data), role=role))
    tensors = [TensorSpec(name="model.w", dtype="BF16", shape=[8], checksums={"xxh3_128": checksum(VIEW["model.w"])})]
    stats = VersionStats(changed_elements=0, total_elements=8, encoded_bytes=0)
    manifest = VersionManifest(
        run_id=run,
        version=0,
        base_version=None,
        snapshot=True,
        encoding="xor",
        tensors=tensors,
        files=files,
        stats=stats,
        metadata={},
        schema_version=1,
    )
    Ledger(open_store(f"file://{store_root}")).publish(run, manifest)


def test_pull_refuses_an_asset_named_like_the_weights(bulletin, bulletin_store, run, tmp_path):
    _commit_v0(bulletin, bulletin_store, run, tmp_path, "model.safetensors")
    out = CliRunner().invoke(
        build_app(), ["pull", "--bulletin", bulletin.url, "--run", run, "-o", str(tmp_path / "pulled")]
    )
    assert out.exit_code == 1 and "named like checkpoint files" in out.output, out.output
    assert not (tmp_path / "pulled").exists()


@pytest.mark.parametrize("damage", ["weights", "asset"])
def test_pull_verifies_what_it_wrote(bulletin, bulletin_store, run, tmp_path, damage):
    _commit_v0(bulletin, bulletin_store, run, tmp_path, "config.json")
    with bulletin.client() as client:
        rebuilt = pull_version(client, run, tmp_path / "pulled")
    verify_pulled(rebuilt, tmp_path / "pulled")
    if damage == "weights":
        path = tmp_path / "pulled" / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    else:
        (tmp_path / "pulled" / "config.json").write_text("{}")
    with pytest.raises(ResumeError):
        verify_pulled(rebuilt, tmp_path / "pulled")


@pytest.mark.slow  # starts a process (docs/testing.md, the slow tier)
def test_pull_imports_no_torch():
    """The compose stack's boot step runs ``stitchboard pull`` in the sidecar image, which has no torch
    (deploy/docker/stitch-boot-weights.sh): the command's imports (a full run's and an adapter run's) must not need it.
    With torch unimportable, they import; adapter_run (the SDK's publish side, which needs torch) is not among them."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import stitchboard.trainer_client.cli, stitchboard.trainer_client.adapter_pull\n"
        "import stitchboard.trainer_client.resume\n"
        "assert 'stitchboard.trainer_client.adapter_run' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
