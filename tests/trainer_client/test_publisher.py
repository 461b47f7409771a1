"""Publisher on a small model against a live bulletin: versions, anchors, retries, async, resume."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import torch

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import AuthError, UnavailableError
from stitchboard.proto.apply import apply_patch
from stitchboard.proto.decode import read_patch
from stitchboard.trainer_client.errors import AssetsError, PublishError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import served_view
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of

ASSETS = {"config.json": b'{"model_type": "toy"}', "tokenizer.json": b"{}"}


class FlakyTransport(httpx.BaseTransport):
    """Real HTTP, except requests for which ``mode(request)`` says "down" (connection refused)
    or "lose" (the request reaches the bulletin, the answer is lost)."""

    def __init__(self, mode) -> None:
        self.inner = httpx.HTTPTransport()
        self.mode = mode
        self.calls: list[tuple[str, str, str | None]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        mode = self.mode(request)
        self.calls.append((request.method, request.url.path, mode))
        if mode == "down":
            raise httpx.ConnectError("connection refused (test)", request=request)
        response = self.inner.handle_request(request)
        if mode == "lose":
            response.read()
            response.close()
            raise httpx.ReadError("connection reset (test)", request=request)
        return response


def served_f32(t: torch.Tensor):
    return served_view({"w": t}, dtypes={"w": torch.float32})["w"]


def commits(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.endswith("/versions")


def flaky_client(bulletin, mode, retries: int = 2) -> tuple[BulletinClient, FlakyTransport]:
    transport = FlakyTransport(mode)
    return BulletinClient(bulletin.url, retries=retries, backoff_s=0.01, transport=transport), transport


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
            assert len(m.tensors) == 7 and m.encoding == "xor"
            roles = sorted({f.role for f in m.files})
            assert roles == (["asset", "patch", "snapshot"] if r.snapshot and r.version else ["asset", "snapshot"] if r.snapshot else ["patch"])
        plan = client.plan(run, 2, 6)
        assert [s.version for s in plan.steps] in ([3, 4, 5, 6], [5, 6])


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

    client, transport = flaky_client(bulletin, mode)
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


def test_lost_commit_answer_is_the_same_version_not_a_duplicate(bulletin, run):
    trainer = ToyTrainer()
    lose = {"left": 0}

    def mode(request):
        if lose["left"] and commits(request):
            lose["left"] -= 1
            return "lose"
        return None

    client, _ = flaky_client(bulletin, mode, retries=0)
    with Publisher(bulletin.url, run, client=client) as pub:
        pub.publish(trainer.model)
        trainer.step()
        lose["left"] = 1
        with pytest.raises(UnavailableError):
            pub.publish(trainer.model)  # committed, but the trainer does not know
        v1 = pub.client.manifest(run, 1)
        # retrying the same weights: same version, same bytes (a no-op for the bulletin)
        assert pub.publish(trainer.model).version == 1
        assert pub.client.manifest(run, 1) == v1
        trainer.step()
        assert pub.publish(trainer.model).version == 2
        lose["left"] = 1
        trainer.step()
        with pytest.raises(UnavailableError):
            pub.publish(trainer.model)
        trainer.step()  # different weights next: the publisher learns version 3 exists and goes on
        assert pub.publish(trainer.model).version == 4
        assert [i.version for i in pub.client.versions(run)] == [0, 1, 2, 3, 4]
        assert_same_view(rebuild_version(pub.client, run, 4).view, view_of(trainer.model))
    client.close()


def test_4xx_is_not_retried(bulletin, run):
    calls = []

    def mode(request):
        calls.append(request.url.path)
        return None

    transport = FlakyTransport(mode)
    transport.inner = httpx.MockTransport(lambda r: httpx.Response(403, json={"type": "Forbidden", "message": "no publish scope"}))
    client = BulletinClient(bulletin.url, retries=3, backoff_s=0.01, transport=transport)
    with pytest.raises(AuthError, match="no publish scope"):
        Publisher(bulletin.url, run, client=client)
    assert len(calls) == 1
    client.close()


def test_publish_async_overlaps_bounds_and_surfaces_errors(bulletin, run):
    trainer = ToyTrainer()
    gate, fail = threading.Event(), threading.Event()
    gate.set()

    def mode(request):
        gate.wait(60)
        return "down" if fail.is_set() and commits(request) else None

    client, _ = flaky_client(bulletin, mode, retries=0)
    pub = Publisher(bulletin.url, run, client=client, max_pending=1)
    futures = []
    for _ in range(3):
        futures.append(pub.publish_async(trainer.model))
        trainer.step()  # mutates weights at once: the snapshot was taken
    pub.flush()
    assert [f.result().version for f in futures] == [0, 1, 2]
    # backpressure: with the bulletin stalled, a second call blocks until the first is done
    gate.clear()
    first = pub.publish_async(trainer.model)
    t = threading.Thread(target=lambda: futures.append(pub.publish_async(trainer.model)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not first.done()
    gate.set()
    t.join(60)
    assert not t.is_alive(), "the second publish_async call still blocks after the first publish finished"
    pub.flush()
    assert first.result().version == 3 and futures[-1].result().version == 4
    # a failure in the background surfaces on the next call, once
    fail.set()
    failing = pub.publish_async(trainer.model)
    with pytest.raises(UnavailableError):
        failing.result(60)
    with pytest.raises(UnavailableError):
        pub.publish_async(trainer.model)
    fail.clear()
    assert pub.publish(trainer.model).version == 5
    pub.close()
    with pytest.raises(PublishError, match="closed"):
        pub.publish_async(trainer.model)
    client.close()


def test_resume_rebuilds_or_starts_an_anchor(bulletin, run, tmp_path):
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run, assets=ASSETS, snapshot_every=4) as pub:
        for _ in range(3):
            pub.publish(trainer.model)
            trainer.step()
    # a restarted trainer: rebuilds version 2 (verified), goes on with small deltas
    with Publisher(bulletin.url, run, assets=ASSETS, snapshot_every=4) as pub:
        assert pub.last_version == 2
        r = pub.publish(trainer.model)
        assert (r.version, r.snapshot) == (3, False)
        trainer.step()
        r = pub.publish(trainer.model)
        assert (r.version, r.snapshot) == (4, True)  # 4 versions after the anchor at 0
    with pytest.raises(AssetsError, match="immutable"):
        Publisher(bulletin.url, run, assets={"config.json": b"{}"})
    # asked for a fresh anchor: no download; changed tensors are sent whole (overwrite)
    trainer.step()
    with Publisher(bulletin.url, run, resume="anchor") as pub:
        r = pub.publish(trainer.model)
        assert (r.version, r.snapshot) == (5, True)
        m = pub.client.manifest(run, 5)
        assert m.encoding == "overwrite" and {f.path for f in m.files_of("asset")} == set(ASSETS)
        trainer.step()
        assert pub.publish(trainer.model).version == 6
    # a holder of version 4 can still take the delta of 5
    with bulletin.client() as client:
        held = rebuild_version(client, run, 4).view
        before = held["1.weight"].bits.copy()
        ref = m.files_of("patch")[0]
        path = client.download_blob(run, ref.sha256, tmp_path / "patch", expected_size=ref.size_bytes)
        apply_patch(held, read_patch(path.read_bytes(), ref.size_bytes))
        assert_same_view(held, rebuild_version(client, run, 5).view)
        assert not np.array_equal(held["1.weight"].bits, before)
