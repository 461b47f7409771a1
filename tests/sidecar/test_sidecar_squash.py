"""Squashed catch-up end to end over real HTTP: the trainer's Publisher stores squashes, a sidecar
k versions behind (fake engine, real codec) fetches ONE squash instead of the k deltas and ends
verified; on a folder store and on S3 (moto's server on loopback).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.schema import canonical_json
from stitchboard.trainer_client.publisher import Publisher
from tests.bulletin.bulletin_helpers import S3_ENV, ThreadServer, make_backend
from tests.bulletin.conftest import moto_endpoint  # noqa: F401  (the S3 backend's endpoint)
from tests.sidecar.fake_engine import FakeEngine, copy_view
from tests.sidecar.sidecar_helpers import same_bits
from tests.support.squash_chain import rl_steps


@pytest.fixture(params=["file", "s3"])
def squash_bulletin(
    request: pytest.FixtureRequest, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ThreadServer]:
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    server = ThreadServer(make_backend(request.param, request, tmp_path, max_blob_bytes=8 << 20).settings)
    yield server
    server.stop()


def test_sidecar_k_behind_catches_up_with_one_squash(squash_bulletin, sc_start, tmp_path):
    run = f"run-{uuid.uuid4().hex[:8]}"
    views = rl_steps(3, 5)
    with BulletinClient(squash_bulletin.url, retries=1, backoff_s=0.01) as client:
        with Publisher(squash_bulletin.url, run, client=client, squash_depths=(4,), workdir=tmp_path / "pub") as pub:
            results = [pub.publish_view(v) for v in views]
        squashes = client.squashes(run)
        assert [(s.base_version, s.target_version) for s in squashes] == [(0, 4), (1, 5)]
        squash = squashes[1]
        chain = sum(r.encoded_bytes for r in results[2:])
        assert squash.size_bytes < chain, (squash.size_bytes, chain)
        assert (
            client.plan(run, 1, 5).steps[0].kind == "delta"
        )  # a client that did not ask for squash steps gets the chain
        planned = client.plan(run, 1, 5, squash=True)
        assert [(s.kind, s.base_version, s.version) for s in planned.steps] == [("squash", 1, 5)]

        engine = FakeEngine(copy_view(views[1]))
        sidecar = sc_start(engine, client=client, bulletin=squash_bulletin.url, run=run, boot_version=1)
        status = sidecar.wait_applied(5)
        assert engine.version == 5 and same_bits(engine.weights, views[5]), "the engine holds version 5's exact bits"
        assert status["last_sync"]["bytes_fetched"] == squash.size_bytes, "one squash downloaded, not the four deltas"
        staged = [args for name, args in engine.calls if name == "stage_patches"]
        assert len(staged) == 1 and len(staged[0]) == 1 and staged[0][0][1:] == (1, 5), staged


def test_a_resumed_publisher_squashes_from_the_version_it_resumed_at(sc_client, tmp_path):
    run = f"run-{uuid.uuid4().hex[:8]}"
    views = rl_steps(6, 3)
    with Publisher(sc_client.url, run, client=sc_client, workdir=tmp_path / "a") as pub:
        pub.publish_view(views[0])
    with Publisher(
        sc_client.url, run, client=sc_client, workdir=tmp_path / "b", squash_depths=(3,)
    ) as pub:  # resumes at version 0
        for v in views[1:]:
            pub.publish_view(v)
    assert [(s.base_version, s.target_version) for s in sc_client.squashes(run)] == [(0, 3)]


def test_a_squash_that_fails_its_checks_falls_back_to_the_chain(sc_publisher, sc_client, sc_start, tmp_path):
    """A squash record written around the bulletin's checks (straight into the store: the span
    2 -> 4 pointing at the patch of 1 -> 4) is caught by the sidecar before the engine sees it,
    and the replica takes the chain at once."""
    run = sc_publisher.run
    views = rl_steps(8, 4)
    with Publisher(sc_client.url, run, client=sc_client, squash_depths=(3,), workdir=tmp_path / "pub") as pub:
        results = [pub.publish_view(v) for v in views]
    _, s14 = sc_client.squashes(run)  # 0 -> 3 and 1 -> 4
    assert (s14.base_version, s14.target_version) == (1, 4) and s14.size_bytes < results[3].encoded_bytes + results[
        4
    ].encoded_bytes
    v2 = hashlib.sha256(
        canonical_json(sc_client.manifest(run, 2))
    ).hexdigest()  # the record names version 2's manifest: only the patch's index gives it away
    forged = s14.model_copy(update={"base_version": 2, "base_manifest_sha256": v2})
    (tmp_path / "store" / "runs" / run / "squashes" / "000000000004-000000000002.json").write_bytes(
        canonical_json(forged)
    )
    assert [(s.kind, s.base_version) for s in sc_client.plan(run, 2, 4, squash=True).steps] == [("squash", 2)]
    engine = FakeEngine(copy_view(views[2]))
    sidecar = sc_start(engine, boot_version=2)
    sidecar.wait_applied(4)
    assert engine.version == 4 and same_bits(engine.weights, views[4])
    staged = [args for name, args in engine.calls if name == "stage_patches"]
    assert len(staged) == 1 and [step[1:] for step in staged[0]] == [(2, 3), (3, 4)], (
        "the chain, and the forged squash never reached the engine"
    )
