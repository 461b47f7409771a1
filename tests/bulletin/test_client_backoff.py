"""The client's retry schedule on 503 SlowDown: 1,000 replicas throttled at once do not come back in step.

Each replica's retry instants are the sums of the waits the client itself sleeps (the client's clock is the one
fake: ``time`` in the client module), on a transport that answers 503 SlowDown to the first attempts. Full jitter
spreads each retry uniformly over its window; a fixed wait (the download path before issue #33) sends every replica
back at the same instant, and a half-jittered one (the other calls' before) crowds the window's second half.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from stitchboard.bulletin import client as client_module
from stitchboard.bulletin.client import BACKOFF_CAP_S, BulletinClient, backoff_delay_s

REPLICAS = 1000
THROTTLED = 3  # 503 SlowDown answers before the store takes a replica's request
BASE_S = 0.25
BINS = 20  # a retry window cut in 20: an even spread puts 5 % of the replicas in each


def slowdown_transport(body: bytes) -> httpx.MockTransport:
    """Every replica's request is refused THROTTLED times with S3's 503 SlowDown body, then answered."""
    calls = itertools.count()

    def handle(request: httpx.Request) -> httpx.Response:
        if next(calls) % (THROTTLED + 1) < THROTTLED:
            return httpx.Response(503, json={"error": "unavailable", "detail": "SlowDown: please reduce your rate"})
        return httpx.Response(200, content=body)

    return httpx.MockTransport(handle)


def retry_instants(monkeypatch: pytest.MonkeyPatch, fetch_one: object) -> list[list[float]]:
    """Per replica, the instants (seconds after the first refusal) of its THROTTLED retries."""
    waits: list[float] = []
    monkeypatch.setattr(client_module, "time", SimpleNamespace(sleep=waits.append))
    schedules = []
    for replica in range(REPLICAS):
        del waits[:]
        fetch_one(replica)  # type: ignore[operator]
        assert len(waits) == THROTTLED
        schedules.append(list(itertools.accumulate(waits)))
    return schedules


def assert_spread(schedules: list[list[float]]) -> None:
    """At every attempt, no twentieth of the retry window holds more than 10 % of the replicas (even: 5 %)."""
    for attempt in range(THROTTLED):
        instants = [s[attempt] - (s[attempt - 1] if attempt else 0.0) for s in schedules]
        window = min(BACKOFF_CAP_S, BASE_S * 2**attempt)
        counts = [0] * BINS
        for t in instants:
            assert 0.0 <= t <= window
            counts[min(BINS - 1, int(t / window * BINS))] += 1
        assert max(counts) <= REPLICAS // 10, f"attempt {attempt + 1}: {counts} replicas per 1/{BINS} of the window"


def test_download_retries_of_1000_replicas_do_not_synchronize(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    body = b"patch bytes" * 100
    sha = hashlib.sha256(body).hexdigest()
    with BulletinClient("http://bulletin", backoff_s=BASE_S, transport=slowdown_transport(body)) as client:

        def fetch(replica: int) -> None:
            dest = client.download_blob("r", sha, tmp_path / f"{replica}.bin", expected_size=len(body))
            assert dest.read_bytes() == body
            dest.unlink()

        assert_spread(retry_instants(monkeypatch, fetch))


def test_call_retries_of_1000_replicas_do_not_synchronize(monkeypatch: pytest.MonkeyPatch) -> None:
    with BulletinClient("http://bulletin", backoff_s=BASE_S, transport=slowdown_transport(b"x" * 42)) as client:

        def check(replica: int) -> None:
            assert client.has_blob("r", "ab" * 32) == 42

        assert_spread(retry_instants(monkeypatch, check))


def test_backoff_window_doubles_to_the_cap() -> None:
    assert backoff_delay_s(0, 0.25, rng=lambda: 0.5) == 0.125
    assert backoff_delay_s(3, 0.25, rng=lambda: 0.999) == pytest.approx(0.999 * 2.0)
    assert backoff_delay_s(20, 0.25, rng=lambda: 0.5) == BACKOFF_CAP_S / 2
    assert backoff_delay_s(2, 0.25, rng=lambda: 0.0) == 0.0
