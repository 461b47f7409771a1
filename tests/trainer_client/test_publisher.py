"""Publisher on a small model against a live bulletin: versions, anchors, retries, async, resume."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import AuthError, UnavailableError
from stitchboard.proto.checkpoint import INDEX_NAME, save_checkpoint
from stitchboard.trainer_client.encode_version import sha256_file
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import served_view
from tests.trainer_client.publisher_scenarios import (
    ASSETS,
    ONE_PROCESS,
    FlakyTransport,
    Side,
    commits,
    flaky_client,
    lost_commit,
    publish_async,
    resume,
)
from tests.trainer_client.ranks import run_ranks
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of

#: The publishers the shared scenarios run against: ``Publisher`` here, ``ShardedPublisher`` on 2 ranks (processes:
#: the slow tier).
SIDES = ["publisher", pytest.param("sharded", marks=pytest.mark.slow)]


def play(side: str, scenario: Callable[[Side, str, str, Path], None], url: str, run: str, tmp_path: Path) -> None:
    """Run a scenario of publisher_scenarios.py in this process, or on every rank of a 2-process sharded job."""
    if side == "publisher":
        scenario(ONE_PROCESS, url, run, tmp_path)
    else:
        run_ranks([scenario.__name__, url, run, str(tmp_path)], tmp_path)


def served_f32(t: torch.Tensor):
    return served_view({"w": t}, dtypes={"w": torch.float32})["w"]


def test_versions_anchors_and_bit_exact_rebuild(bulletin, run):
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run, snapshot_every=3, assets=ASSETS, backoff_s=0.01) as pub:
        results = []
        for step in range(7):
            results.append(pub.publish(trainer.model, step=step, anchor=(step == 5)))
            rebuilt = rebuild_version(pub.client, run, results[-1].version)
            assert_same_view(rebuilt.view, view_of(trainer.model))
            trainer.step()
    assert [r.version for r in results] == list(range(7))
    # 0: first; 3: three versions after 0; 5: asked; 6 is a delta (one since 5)
    assert [r.snapshot for r in results] == [True, False, False, True, False, True, False]
    assert all(0 < r.changed_elements < r.total_elements for r in results[1:])
    with bulletin.client() as client:
        for r in results:
            m = client.manifest(run, r.version)
            assert m.metadata["step"] == r.version and m.stats.encoded_bytes == r.encoded_bytes
            assert len(m.tensors) == 7 and m.encoding == "cond"  # the default
            roles = sorted({f.role for f in m.files})
            assert roles == (
                ["asset", "patch", "snapshot"]
                if r.snapshot and r.version
                else ["asset", "snapshot"]
                if r.snapshot
                else ["patch"]
            )
        plan = client.plan(run, 2, 6)
        assert [s.version for s in plan.steps] in ([3, 4, 5, 6], [5, 6])


def test_the_encoding_is_picked_per_run_and_recorded_in_every_manifest(bulletin, run):
    """``xor`` stays selectable (the fast choice): its patches rebuild bit-exact and every manifest says so."""
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run, encoding="xor", backoff_s=0.01) as pub:
        for _ in range(3):
            result = pub.publish(trainer.model)
            assert_same_view(rebuild_version(pub.client, run, result.version).view, view_of(trainer.model))
            trainer.step()
        assert {pub.client.manifest(run, v).encoding for v in range(3)} == {"xor"}
    with pytest.raises(ValueError, match="unknown encoding 'zstd'"):
        Publisher(bulletin.url, run, encoding="zstd")  # type: ignore[arg-type]


def test_a_sidecar_fetches_and_checks_cond_versions_without_their_base(bulletin, run, tmp_path):
    """The default ``cond`` patches decode only on their base, which the sidecar does not hold: its
    fetch check keeps the index and lineage checks (a patch whose base is not the previous version,
    or a delta on a base with another tensor set, is refused) and leaves the value decode to the engine."""
    from stitchboard.sidecar.errors import StagingError
    from stitchboard.sidecar.fetch import Fetcher

    trainer = ToyTrainer()
    with Publisher(bulletin.url, run, backoff_s=0.01) as pub:
        for _ in range(3):
            pub.publish(trainer.model)
            trainer.step()
        fetcher = Fetcher(pub.client, run, tmp_path / "handoff")
        try:
            staged = fetcher.fetch(pub.client.plan(run, 0, 2), pub.client.manifest(run, 0))
            assert [(s.version, s.kind, s.manifest.encoding) for s in staged.steps] == [
                (1, "delta", "cond"),
                (2, "delta", "cond"),
            ]
            with pytest.raises(StagingError, match="base checksum is not version 1's"):
                fetcher.fetch(pub.client.plan(run, 1, 2), pub.client.manifest(run, 0).model_copy(update={"version": 1}))
            v1 = pub.client.manifest(run, 1)
            first = v1.tensors[0].model_copy(update={"shape": [*v1.tensors[0].shape, 1]})
            reshaped = v1.model_copy(update={"tensors": [first, *v1.tensors[1:]]})
            with pytest.raises(StagingError, match="version 2 changes the tensor set of version 1"):
                fetcher.fetch(pub.client.plan(run, 1, 2), reshaped)
        finally:
            fetcher.close()


def test_an_anchor_is_the_checkpoint_save_checkpoint_writes(bulletin, run, tmp_path):
    """One shard/index writer: an anchor's snapshot files are byte for byte those of save_checkpoint."""
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run, max_shard_bytes=4096, backoff_s=0.01) as pub:
        pub.publish(trainer.model)
        snapshot = {f.path: f.sha256 for f in pub.client.manifest(run, 0).files_of("snapshot")}
    written = save_checkpoint(tmp_path / "checkpoint", view_of(trainer.model), max_shard_bytes=4096)
    assert INDEX_NAME in snapshot and len(snapshot) > 2
    assert snapshot == {p.name: sha256_file(p) for p in written}


def test_tensor_set_change_forces_an_anchor(bulletin, run):
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run, backoff_s=0.01) as pub:
        pub.publish(trainer.model)
        state = dict(trainer.model.state_dict())
        state["extra.weight"] = torch.ones(3)
        r = pub.publish(state)
        assert r.snapshot
        del state["3.bias"]
        pub.dtypes = {"0.weight": torch.float32}  # a dtype change
        r = pub.publish(state)
        assert r.snapshot
        m = pub.client.manifest(run, r.version)
        assert m.metadata["tensor_set_changed"] is True and m.tensor_map()["0.weight"].dtype == "F32"
        want = view_of(trainer.model)
        want.pop("3.bias")
        want["extra.weight"] = view_of({"extra.weight": torch.ones(3)})["extra.weight"]
        want["0.weight"] = served_f32(trainer.model[0].weight)
        assert_same_view(rebuild_version(pub.client, run).view, want)


def test_bulletin_down_then_back_no_torn_or_duplicate_version(bulletin, run):
    trainer = ToyTrainer()
    down = {"on": False, "left": 0}

    def mode(request):
        if down["on"] and commits(request):
            return "down"
        if down["left"] and commits(request):
            down["left"] -= 1
            return "down"
        return None

    client, transport = flaky_client(bulletin.url, mode)
    with Publisher(bulletin.url, run, client=client) as pub:
        pub.publish(trainer.model)
        trainer.step()
        down["left"] = 2  # two refused commits, then up: the client's retries get through
        assert pub.publish(trainer.model).version == 1
        trainer.step()
        down["on"] = True  # down for longer than the retries: fails loudly
        with pytest.raises(UnavailableError, match="unreachable"):
            pub.publish(trainer.model)
        assert [c for c in transport.calls if c[2] == "down"][-3:] == [("POST", f"/v1/runs/{run}/versions", "down")] * 3
        assert [i.version for i in pub.client.versions(run)] == [0, 1]
        down["on"] = False
        assert pub.publish(trainer.model).version == 2
        assert [i.version for i in pub.client.versions(run)] == [0, 1, 2]
        assert_same_view(rebuild_version(pub.client, run, 2).view, view_of(trainer.model))
    client.close()


@pytest.mark.parametrize("side", SIDES)
def test_lost_commit_answer_is_the_same_version_not_a_duplicate(bulletin, run, tmp_path, side):
    play(side, lost_commit, bulletin.url, run, tmp_path)


def test_4xx_is_not_retried(bulletin, run):
    calls = []

    def mode(request):
        calls.append(request.url.path)

    transport = FlakyTransport(mode)
    transport.inner = httpx.MockTransport(
        lambda r: httpx.Response(403, json={"type": "Forbidden", "message": "no publish scope"})
    )
    client = BulletinClient(bulletin.url, retries=3, backoff_s=0.01, transport=transport)
    with pytest.raises(AuthError, match="no publish scope"):
        Publisher(bulletin.url, run, client=client)
    assert len(calls) == 1
    client.close()


@pytest.mark.parametrize("side", SIDES)
def test_publish_async_overlaps_bounds_and_surfaces_errors(bulletin, run, tmp_path, side):
    play(side, publish_async, bulletin.url, run, tmp_path)


@pytest.mark.parametrize("side", SIDES)
def test_resume_rebuilds_or_starts_an_anchor(bulletin, run, tmp_path, side):
    play(side, resume, bulletin.url, run, tmp_path)
