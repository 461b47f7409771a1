"""The Miles post-write hook's versions through a sidecar beside a real SGLang server on the CPU (issue #30 item 3).

Miles is not on the package index: a Miles-format writer (tests/trainer_client/miles_writer.py) writes the
disk-delta folders Miles writes, from real AdamW steps on SmolLM2, and the test calls the hook as Miles does
(the baseline with the empty disk dir, then each ``weight_vNNNNNN``). The hook returns only once the sidecar
reports the version applied; the engine then holds exactly the trainer's bits (checked tensor by tensor
against the trainer's own view) and answers stamped with that version. One SGLang server: the shared one.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from stitchboard.bulletin.app import create_app
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.codec import checksum
from stitchboard.sidecar.engines.sglang.adapter import SglangEngine
from stitchboard.trainer_client import miles
from stitchboard.trainer_client.served_view import to_raw
from tests.sidecar.sglang_helpers import require_sglang
from tests.sidecar.vllm_fixtures import SidecarProcess
from tests.support.app_server import AppServer
from tests.support.training import CpuTrainer
from tests.trainer_client.miles_writer import MilesWriter

pytestmark = pytest.mark.slow

RUN = "miles-sglang"


@pytest.fixture
def bulletin_server(tmp_path: Path) -> Iterator[AppServer]:
    """A bulletin (file store) on loopback."""
    server = AppServer(create_app(BulletinSettings(store=f"file://{tmp_path / 'store'}", poll_interval_s=0.05)))
    yield server
    server.stop()


def test_hook_versions_reach_sglang_through_the_sidecar_bit_exact(
    sglang_engine, bulletin_server, smollm2_dir, tmp_path, monkeypatch
):
    require_sglang()
    for name, value in {"BULLETIN": bulletin_server.url, "RUN": RUN, "MILES_MIN_REPLICAS": "1"}.items():
        monkeypatch.setenv(f"STITCH_CLIENT_{name}", value)
    monkeypatch.setenv("STITCH_CLIENT_MILES_WAIT_S", "300")
    monkeypatch.delenv("RANK", raising=False)
    sidecar = SidecarProcess(
        SimpleNamespace(bulletin=bulletin_server, run=RUN),
        sglang_engine.url,
        tmp_path,
        {"STITCH_SIDECAR_ENGINE": "sglang", "STITCH_SIDECAR_BOOT_VERSION": "0"},
    )
    delta_dir = tmp_path / "delta"
    args = Namespace(update_weight_disk_dir=str(delta_dir), hf_checkpoint=str(smollm2_dir))
    trainer = CpuTrainer(smollm2_dir, batch_size=1, seq_len=32)
    writer = MilesWriter(delta_dir, smollm2_dir, encoding="xor", checksum_format="xxh3-128", ranks=2)
    records = tmp_path / "handoff" / f"sidecar-{sidecar.url.rsplit(':', 1)[1]}" / "sglang-records"
    try:
        miles.post_write(args, str(delta_dir), [])  # the baseline: version 0, waits for the sidecar
        assert sidecar.status()["applied_version"] == 0
        for version in (1, 2):
            trainer.step()
            state = {n: t.detach().clone() for n, t in trainer.served_view().items()}
            miles.post_write(args, str(writer.write(state)), [])  # returns once the sidecar applied it
            assert sidecar.status()["applied_version"] == version
        want = {n: checksum(to_raw(t)) for n, t in state.items()}
        with BulletinClient(bulletin_server.url) as client:
            assert client.manifest(RUN, 2).checksums() == want
        engine = SglangEngine(sglang_engine.url, records, timeout_s=60)
        try:
            assert (engine.state().version, engine.state().phase) == (2, "idle")
            assert engine.checksums(sorted(want)) == want, "SGLang's weights are not the trainer's bits"
        finally:
            engine.close()
        answer = httpx.post(
            f"{sidecar.url}/v1/completions",
            json={"model": sglang_engine.model, "prompt": "The capital of France is", "max_tokens": 4},
            timeout=600,
        )
        assert answer.status_code == 200 and answer.headers["X-Stitch-Version-End"] == "2"
    finally:
        miles.close_bridges()
        sidecar.stop()
