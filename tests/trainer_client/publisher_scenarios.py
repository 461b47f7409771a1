"""Publisher tests that run unchanged against both publishers (not collected by pytest).

Each scenario takes a :class:`Side`, which makes its publishers and trainers: with
:data:`ONE_PROCESS` a :class:`Publisher` and a plain :class:`ToyTrainer`, in the pytest process;
with ``SHARDED`` (``sharded_worker.py``) a :class:`ShardedPublisher` and an FSDP2-sharded
trainer, on every rank of a 2-process gloo job. Every rank runs the same steps and assertions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import UnavailableError
from stitchboard.proto.apply import apply_patch
from stitchboard.proto.decode import read_patch
from stitchboard.trainer_client.errors import AssetsError, PublishError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.publisher_core import PublisherCore
from stitchboard.trainer_client.resume import rebuild_version
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of

ASSETS = {"config.json": b'{"model_type": "toy"}', "tokenizer.json": b"{}"}


@dataclass(frozen=True)
class Side:
    """How a scenario makes a publisher (``publisher(url, run, **options)``) and a trainer (``trainer(seed)``)."""

    publisher: Callable[..., PublisherCore]
    trainer: Callable[[int], ToyTrainer]


ONE_PROCESS = Side(Publisher, ToyTrainer)


class FlakyTransport(httpx.BaseTransport):
    """Real HTTP, except requests for which ``mode(request)`` says "down" (connection refused)
    or "lose" (the request reaches the bulletin, the answer is lost)."""

    def __init__(self, mode: Callable[[httpx.Request], str | None]) -> None:
        self.inner: httpx.BaseTransport = httpx.HTTPTransport()
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

    def close(self) -> None:  # httpx.Client.close closes its transport: pass it on to the real one's sockets
        self.inner.close()


def commits(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.endswith("/versions")


def flaky_client(
    url: str, mode: Callable[[httpx.Request], str | None], retries: int = 2
) -> tuple[BulletinClient, FlakyTransport]:
    transport = FlakyTransport(mode)
    return BulletinClient(url, retries=retries, backoff_s=0.01, transport=transport), transport


def lost_commit(side: Side, url: str, run: str, tmp_path: Path) -> None:
    """A commit whose answer is lost: the same weights again are that version, newer ones go on after it."""
    trainer = side.trainer(0)
    lose = {"left": 0}

    def mode(request: httpx.Request) -> str | None:
        if lose["left"] and commits(request):
            lose["left"] -= 1
            return "lose"
        return None

    client, _ = flaky_client(url, mode, retries=0)
    with side.publisher(url, run, client=client) as pub:
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


def publish_async(side: Side, url: str, run: str, tmp_path: Path) -> None:
    """``publish_async`` overlaps, bounds the publishes in flight and surfaces a failure once."""
    trainer = side.trainer(0)
    gate, fail = threading.Event(), threading.Event()
    gate.set()

    def mode(request: httpx.Request) -> str | None:
        gate.wait(60)
        return "down" if fail.is_set() and commits(request) else None

    client, _ = flaky_client(url, mode, retries=0)
    pub = side.publisher(url, run, client=client, max_pending=1)
    futures: list[Any] = []
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


def resume(side: Side, url: str, run: str, tmp_path: Path) -> None:
    """A restarted trainer rebuilds the last version, or starts with an anchor (``resume="anchor"``)."""
    trainer = side.trainer(0)
    with side.publisher(url, run, assets=ASSETS, snapshot_every=4) as pub:
        for _ in range(3):
            pub.publish(trainer.model)
            trainer.step()
    # a restarted trainer: rebuilds version 2 (verified), goes on with small deltas
    with side.publisher(url, run, assets=ASSETS, snapshot_every=4) as pub:
        assert pub.last_version == 2
        r = pub.publish(trainer.model)
        assert (r.version, r.snapshot) == (3, False)
        trainer.step()
        r = pub.publish(trainer.model)
        assert (r.version, r.snapshot) == (4, True)  # 4 versions after the anchor at 0
    with pytest.raises(AssetsError, match="immutable"):
        side.publisher(url, run, assets={"config.json": b"{}"})
    # asked for a fresh anchor: no download; changed tensors are sent whole (overwrite)
    trainer.step()
    with side.publisher(url, run, resume="anchor") as pub:
        r = pub.publish(trainer.model)
        assert (r.version, r.snapshot) == (5, True)
        m = pub.client.manifest(run, 5)
        assert m.encoding == "overwrite" and {f.path for f in m.files_of("asset")} == set(ASSETS)
        trainer.step()
        assert pub.publish(trainer.model).version == 6
    # a holder of version 4 can still take the delta of 5 (one patch file per rank)
    with BulletinClient(url, retries=1, backoff_s=0.01) as client:
        held = rebuild_version(client, run, 4).view
        before = held["1.weight"].bits.copy()
        for ref in m.files_of("patch"):
            path = client.download_blob(run, ref.sha256, tmp_path / ref.path, expected_size=ref.size_bytes)
            apply_patch(held, read_patch(path.read_bytes(), ref.size_bytes))
        assert_same_view(held, rebuild_version(client, run, 5).view)
        assert not np.array_equal(held["1.weight"].bits, before)


#: Scenario name -> function, for ``sharded_worker.py``.
SCENARIOS: dict[str, Callable[[Side, str, str, Path], None]] = {
    f.__name__: f for f in (lost_commit, publish_async, resume)
}
