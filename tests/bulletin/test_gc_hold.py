"""The collector hold: nested holds keep the automatic collector off until the last ends, a collector that
was off stays off, a chain of holds past its bound collects, and a publish with waiting long-polls
leaves the collector on again once the answers are out."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import httpx
import pytest

from stitchboard.bulletin.gc_hold import COLLECTOR, CollectorHold
from stitchboard.bulletin.settings import BulletinSettings
from tests.bulletin.bulletin_helpers import ThreadServer, upload_version
from tests.sidecar.sidecar_helpers import wait_for


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_nested_holds(collector_on):
    hold = CollectorHold()
    with hold.held():
        assert not gc.isenabled()
        with hold.held():
            assert hold.holders == 2 and not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() and hold.holders == 0
    with pytest.raises(RuntimeError, match="without a hold"):
        hold.release()


def test_collector_off_before_stays_off(collector_on):
    gc.disable()
    with CollectorHold().held():
        pass
    assert not gc.isenabled()


def test_overlapping_holds_past_the_bound_collect(collector_on):
    full: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(1)

    hold = CollectorHold(max_hold_s=0.0)
    gc.callbacks.append(seen)
    try:
        hold.acquire()
        hold.acquire()
        hold.release()  # a hold is still taken, but the chain is past its bound
        assert full and not gc.isenabled()
        hold.release()
    finally:
        gc.callbacks.remove(seen)
    assert gc.isenabled()


def test_publish_with_waiters_releases_the_collector(tmp_path, collector_on):
    server = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", poll_interval_s=0.05))
    try:
        with server.client() as pub:
            upload_version(pub, "gc-run", 0, snapshot_bytes=10)
            url = f"{server.url}/v1/runs/gc-run/versions/latest"
            watcher = server.app.state.bulletin.watcher

            async def scenario() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=30) as http:
                    polls = [asyncio.create_task(http.get(url, params={"after": 0, "wait_s": 20})) for _ in range(5)]
                    while sum(len(w) for w in watcher._direct.values()) < 5:
                        await asyncio.sleep(0.02)
                    await asyncio.to_thread(upload_version, pub, "gc-run", 1, patch_bytes=10)
                    return await asyncio.gather(*polls)

            answers = asyncio.run(scenario())
        assert [r.json()["version"] for r in answers] == [1] * 5
        wait_for(lambda: COLLECTOR.holders == 0, 5, "the fan-out's hold released")
        assert gc.isenabled()
    finally:
        server.stop()
