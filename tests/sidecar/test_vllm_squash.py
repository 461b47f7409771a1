"""Squashed catch-up on a real vLLM (CPU build): a replica three versions behind applies ONE squash.

The module's run publishes real AdamW steps of SmolLM2 with ``squash_depths=(3,)`` (the trainer's
squashes; :mod:`stitchboard.trainer_client.squash`); the session engine holds version 0, and a
real ``stitchboard sidecar run`` process brings it to version 3 through the squash 0 -> 3 (a
``cond`` patch decoded by the worker extension on the engine's own bits), verified bit for bit.
A squash whose index is right but whose stream is damaged (uploaded around the trainer's check)
is refused by the engine's staging, quarantined by the sidecar, and the chain taken instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stitchboard.proto.schema import FileRef
from stitchboard.trainer_client.publisher import Publisher
from tests.sidecar.test_sidecar_vllm import assert_verified
from tests.sidecar.vllm_fixtures import VllmRun
from tests.support.vllm_server import require_vllm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_run(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmRun]:
    """This module's run (overrides the shared fixture): the same, with a publisher that stores squashes 0 -> 3, 1 -> 4,
    ..."""
    require_vllm()
    folder = tmp_path_factory.mktemp("vllm-squash-run")
    run = VllmRun(smollm2_dir, folder)
    run.publisher.close()  # resumed below with squashes on (rebuilds version 0 from the bulletin)
    run.publisher = Publisher(
        run.bulletin.url, run.run, client=run.client, workdir=folder / "publisher", squash_depths=(3,)
    )
    yield run
    run.close()


def test_a_replica_three_versions_behind_catches_up_through_one_squash(vllm_run_engine, vllm_run, vllm_sidecars):
    assert vllm_run.latest == 0
    for _ in range(3):
        vllm_run.step()
    (squash,) = vllm_run.client.squashes(vllm_run.run)
    assert (squash.base_version, squash.target_version, squash.encoding) == (0, 3, "cond")
    chain = sum(vllm_run.client.manifest(vllm_run.run, v).stats.encoded_bytes for v in (1, 2, 3))
    assert squash.size_bytes < chain
    sidecar = vllm_sidecars(vllm_run_engine.url)  # the engine records version 0
    status = sidecar.wait_applied(3)
    assert status["last_sync"]["from_version"] == 0 and status["last_sync"]["bytes_fetched"] == squash.size_bytes, (
        status["last_sync"]
    )
    assert_verified(vllm_run_engine.url, vllm_run, 3)


def test_a_squash_the_engine_refuses_is_quarantined_and_the_chain_taken(
    vllm_run_engine, vllm_run, vllm_sidecars, tmp_path
):
    base = vllm_run.latest  # the engine holds it (3 after the test above, 0 alone)
    for _ in range(3):
        vllm_run.step()
    client, run, target = vllm_run.client, vllm_run.run, base + 3
    (real,) = [s for s in client.squashes(run) if (s.base_version, s.target_version) == (base, target)]
    (ref,) = real.files
    data = bytearray(client.download_blob(run, ref.sha256, tmp_path / ref.path, ref.size_bytes).read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    payload = json.loads(data[8 : 8 + hlen])["__payload__"]["data_offsets"]
    data[8 + hlen + (payload[0] + payload[1]) // 2] ^= 0xFF  # the stream damaged, the index untouched
    sha = hashlib.sha256(data).hexdigest()
    client.put_blob(run, sha, bytes(data))
    assert client.drop_squash(run, base, target)
    damaged = real.model_copy(
        update={"files": [FileRef(path=ref.path, sha256=sha, size_bytes=len(data), role="patch")]}
    )
    assert client.put_squash(damaged) is True, "the bulletin checks indexes only"

    sidecar = vllm_sidecars(vllm_run_engine.url)  # the engine records version ``base``
    status = sidecar.wait_applied(target)
    assert status["last_sync"]["from_version"] == base and status["last_sync"]["route"] == "delta"
    assert_verified(vllm_run_engine.url, vllm_run, target)
    (quarantined,) = httpx.get(f"{sidecar.url}/health", timeout=30).json()["squash_quarantine"]
    assert (quarantined["base_version"], quarantined["target_version"], quarantined["during"]) == (
        base,
        target,
        "stage",
    )
    assert 'stitch_sidecar_squash_quarantines_total{during="stage"} 1.0' in sidecar.metrics()
