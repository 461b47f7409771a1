"""Real vLLM follows a run published shard-local by two gloo ranks (SmolLM2 under FSDP2, real AdamW steps:
tests/trainer_client/shard_local_worker.py), whose sharded tensors carry only ``xxh3_128_parts`` over their parts:
the anchor loads verified by those checksums (a wrong one is refused before any write), a sidecar takes the version
the engine records by them and applies the next two versions in one squash made by the ranks (its sharded tensors'
parts assembled by their writer ranks), and the engine then holds the last version's bits.

One engine start at most: the session's vLLM (tests/sidecar/vllm_fixtures.py), brought back to the checkpoint
after.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from stitchboard.bulletin.app import create_app as create_bulletin
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.checkpoint import load_checkpoint
from stitchboard.proto.codec import checksum
from stitchboard.proto.schema import XXH3_128
from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
from stitchboard.sidecar.errors import ApplyRefusedError
from tests.sidecar.sidecar_helpers import AppServer
from tests.sidecar.vllm_fixtures import SidecarProcess, load_checkpoint_as_version_0
from tests.support import lease
from tests.support.vllm_server import VllmServer
from tests.trainer_client.ranks import run_ranks

WORKER = Path(__file__).resolve().parents[1] / "trainer_client" / "shard_local_worker.py"
EMBED = "model.embed_tokens.weight"


def test_vllm_follows_a_run_published_shard_local_by_two_ranks(
    vllm_engine: VllmServer, smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMOLLM2_DIR", str(smollm2_dir))
    run = "shard-local"
    bulletin = AppServer(create_bulletin(BulletinSettings(store=f"file://{tmp_path / 'store'}", poll_interval_s=0.05)))
    client = BulletinClient(bulletin.url)
    engine = VllmEngine(vllm_engine.url, timeout_s=60)
    sidecar = None
    try:
        run_ranks(["smollm2", bulletin.url, run, str(tmp_path)], tmp_path, worker=WORKER, timeout_s=400)
        first, last = client.manifest(run, 0), client.manifest(run, 2)
        spec = first.tensor_map()[EMBED]
        assert spec.parts == [(0, 0, 24576), (0, 24576, 49152)] and XXH3_128 not in spec.checksums
        paths = [
            str(client.download_blob(run, f.sha256, tmp_path / "anchor" / f.path, f.size_bytes))
            for f in first.files_of("snapshot")
            if f.path.endswith(".safetensors")  # the shards, not their index
        ]
        wrong = {**first.checksums(), EMBED: "0" * 32}
        with lease.holding(engine, "shard-local"):
            engine.pause()
            try:
                held = engine.state()
                with pytest.raises(ApplyRefusedError, match=EMBED):
                    engine.load_snapshot(paths, 0, wrong, first.layouts())
                assert engine.state() == held, "a refused snapshot changes nothing"
                report = engine.load_snapshot(paths, 0, first.checksums(), first.layouts())
                engine.reset_prefix_cache()
            finally:
                engine.resume()
        assert report["tensors"] == len(first.tensors)

        sidecar = SidecarProcess(SimpleNamespace(bulletin=bulletin, run=run), vllm_engine.url, tmp_path, {})
        status = sidecar.wait_applied(2, timeout_s=300)
        assert (status["last_sync"]["from_version"], status["last_sync"]["anchor"]) == (0, False), (
            "version 0 is taken by its parts checksums and the update applied, not the anchor loaded again"
        )
        (squash,) = client.squashes(run)
        assert (squash.base_version, squash.target_version) == (0, 2)
        assert status["last_sync"]["bytes_fetched"] == squash.size_bytes, "the sidecar took the squash, not the chain"
        names = sorted(t.name for t in last.tensors)
        assert engine.checksums(names, last.layouts()) == last.checksums(), "vLLM does not hold version 2's bits"
        assert engine.checksums(names, last.layouts()) != first.checksums()
    finally:
        if sidecar is not None:
            sidecar.stop()
        try:
            sums = {n: checksum(t) for n, t in load_checkpoint(smollm2_dir).items()}
            load_checkpoint_as_version_0(vllm_engine.url, smollm2_dir, sums)
        finally:
            engine.close()
            client.close()
            bulletin.stop()
