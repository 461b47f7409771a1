"""The regional relay for real: nginx running ``deploy/relay/relay.conf.template`` on loopback in front of a real
bulletin (tokens on), and the sidecar's :class:`~stitchboard.sidecar.fetch.Fetcher` asking it before the bulletin
(:mod:`stitchboard.sidecar.relays`). Origin GETs are counted at the bulletin (its request metric).

Skipped, saying why, only where nginx is not installed (``make venv`` installs it).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.proto.schema import VersionManifest
from stitchboard.sidecar.fetch import Fetcher
from stitchboard.sidecar.metrics import SidecarMetrics
from stitchboard.sidecar.relays import Relays
from stitchboard.trainer_client.publisher import Publisher
from tests.bulletin.bulletin_helpers import ThreadServer
from tests.bulletin.relay_nginx import NGINX, NO_NGINX, Nginx
from tests.trainer_client.toy import ToyTrainer

#: Starts nginx and processes of its own (docs/testing.md, the slow tier).
pytestmark = [pytest.mark.skipif(NGINX is None, reason=NO_NGINX), pytest.mark.slow]

RUN, OTHER_RUN = "relay-run", "relay-other"
TOKENS = {
    "t-publish": {"scopes": ["publish"], "runs": [RUN, OTHER_RUN]},
    "t-reader": {"scopes": ["read"], "runs": [RUN]},
    "t-other": {"scopes": ["read"], "runs": [OTHER_RUN]},
}
BLOB_ROUTE = "/v1/runs/{run}/blobs/{sha256}"
READ_CHECK_ROUTE = "/v1/runs/{run}/read-check"


@dataclass
class Setup:
    bulletin: ThreadServer
    relay: Nginx
    manifest: VersionManifest  # version 0: a snapshot in several shards

    def origin_gets(self, route: str = BLOB_ROUTE) -> float:
        """GETs of ``route`` (a path template) the bulletin has answered (any status)."""
        registry = self.bulletin.app.state.bulletin.metrics.registry
        return sum(
            s.value
            for m in registry.collect()
            if m.name == "stitch_bulletin_request_seconds"
            for s in m.samples
            if s.name.endswith("_count") and s.labels["method"] == "GET" and s.labels["route"] == route
        )

    def origin_blob_gets(self, at_least: float = 0, timeout_s: float = 10) -> float:
        """GETs of blobs the bulletin has answered (any status), once at least ``at_least`` are counted and no more
        came for 0.3 s (the bulletin counts a GET after its last byte is sent, so a client may be done first)."""
        deadline = time.monotonic() + timeout_s
        while self.origin_gets() < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        while True:
            seen = self.origin_gets()
            time.sleep(0.3)
            if self.origin_gets() == seen:
                return seen

    def blobs(self) -> dict[str, str]:
        """sha256 -> path of version 0's files."""
        return {f.sha256: f.path for f in self.manifest.files}


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    """A bulletin with tokens, version 0 of :data:`RUN` published (a toy model, 4 KiB shards), nginx in front."""
    bulletin = ThreadServer(BulletinSettings(store=f"file://{tmp_path / 'store'}", tokens=TOKENS))
    relay = None
    try:
        with Publisher(bulletin.url, RUN, token="t-publish", max_shard_bytes=4096, backoff_s=0.01) as pub:
            pub.publish(ToyTrainer().model)
            manifest = pub.client.manifest(RUN, 0)
        relay = Nginx(bulletin.url.removeprefix("http://"), tmp_path / "relay")
        yield Setup(bulletin, relay, manifest)
    finally:
        if relay is not None:
            relay.stop()
        bulletin.stop()


class Replica:
    """One sidecar's fetch side: a bulletin client, its relays and a Fetcher into its own folder."""

    def __init__(
        self, setup: Setup, folder: Path, relays: list[str], token: str = "t-reader", relay_timeout_s: float = 60
    ) -> None:
        self.metrics = SidecarMetrics()
        self.client = BulletinClient(setup.bulletin.url, token, retries=1, backoff_s=0.01)
        self.relays = Relays(relays, token, self.metrics, timeout_s=relay_timeout_s, retry_s=60)
        self.fetcher = Fetcher(self.client, RUN, folder, concurrency=2, relays=self.relays)

    def fetch(self) -> list[Path]:
        """Stage version 0 (a snapshot: every shard verified and checked); the staged files."""
        staged = self.fetcher.fetch(self.client.plan(RUN, None, 0), None)
        return [p for step in staged.steps for p in step.folder.iterdir()]

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def close(self) -> None:
        self.fetcher.close()
        self.relays.close()
        self.client.close()


def verified(paths: list[Path], blobs: dict[str, str]) -> int:
    """How many of ``paths`` hold exactly the bytes of the blob their name says."""
    want = {name: sha for sha, name in blobs.items()}
    return sum(hashlib.sha256(p.read_bytes()).hexdigest() == want.get(p.name) for p in paths)


def test_200_concurrent_fetchers_cause_one_origin_get_per_blob(setup: Setup, tmp_path: Path) -> None:
    """200 replicas stage one version's blobs at once through one relay: the bulletin serves each blob exactly once
    (nginx's proxy_cache_lock holds the other misses), every replica gets every blob verified, and no relay failure
    is reported."""
    fetchers, blobs = 200, setup.blobs()
    assert len(blobs) >= 4  # shards and their index
    before, checks_before = setup.origin_blob_gets(), setup.origin_gets(READ_CHECK_ROUTE)
    replicas = [Replica(setup, tmp_path / f"r{i}", [setup.relay.url]) for i in range(fetchers)]
    start = threading.Barrier(fetchers)

    def one(replica: Replica) -> list[Path]:
        start.wait(timeout=60)
        return replica.fetch()

    try:
        started = time.monotonic()
        with ThreadPoolExecutor(fetchers) as pool:
            staged = list(pool.map(one, replicas))
        elapsed_s = time.monotonic() - started
        assert sum(verified(paths, blobs) for paths in staged) == fetchers * len(blobs)
        fallbacks = sum(r.count("stitch_sidecar_relay_fallbacks_total") for r in replicas)
        gets = setup.origin_blob_gets(at_least=before + len(blobs)) - before
        assert gets == len(blobs), (gets, fallbacks)
        # one token, one run: the bulletin's read check about once per AUTH_TTL (5 s), not once per request (over
        # 1,000 with the auth cache off). The check's cache lock waits STITCH_RELAY_FETCH_TIMEOUT, not nginx's 5 s
        # default, which let every waiting miss through once a check outlived it (320 checks in 19 s on a loaded
        # 2-core machine): the bound is a tenth of the fetchers, far below one per request.
        checks = setup.origin_gets(READ_CHECK_ROUTE) - checks_before
        assert 1 <= checks < fetchers // 10, (checks, elapsed_s)
        assert len(setup.relay.cached_files()) == len(blobs)
        for replica in replicas:
            assert replica.count("stitch_sidecar_relay_fetches_total", relay=setup.relay.url, outcome="ok") == len(
                blobs
            )
            assert replica.count("stitch_sidecar_relay_fallbacks_total") == 0
    finally:
        for replica in replicas:
            replica.close()


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_cached_object_is_refused_and_fetched_from_the_bulletin(
    setup: Setup, tmp_path: Path, damage: str
) -> None:
    """A cached object whose bytes were flipped in nginx's cache folder fails its sha256 at the replica; one cut short
    stalls (nginx stops sending) until the replica's relay timeout: either way the blob is fetched again from the
    bulletin, verified, and the relay is reported in the metrics and the health body."""
    blobs = setup.blobs()
    first = Replica(setup, tmp_path / "first", [setup.relay.url])
    try:
        assert verified(first.fetch(), blobs) == len(blobs)
    finally:
        first.close()
    victim = max(setup.relay.cached_files(), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    if damage == "corrupt":
        raw[-100] ^= 0xFF
        victim.write_bytes(bytes(raw))
    else:
        victim.write_bytes(bytes(raw[: len(raw) - 1000]))
    before = setup.origin_blob_gets(at_least=len(blobs))  # the first replica's, through the relay
    replica = Replica(setup, tmp_path / "second", [setup.relay.url], relay_timeout_s=2 if damage == "truncate" else 60)
    try:
        assert verified(replica.fetch(), blobs) == len(blobs)
        # nginx serving a cut file stops sending: the replica's relay_timeout_s ends it, as an unreachable relay
        outcome = "corrupt" if damage == "corrupt" else "unavailable"
        assert replica.count("stitch_sidecar_relay_fetches_total", relay=setup.relay.url, outcome=outcome) == 1
        ok = replica.count("stitch_sidecar_relay_fetches_total", relay=setup.relay.url, outcome="ok")
        fallbacks = replica.count("stitch_sidecar_relay_fallbacks_total")
        (health,) = replica.relays.body() or []
        assert health["failed"] == 1 and health["fetched"] == ok and health["last_error"]
        assert (
            ok + fallbacks == len(blobs) and setup.origin_blob_gets(at_least=before + fallbacks) - before == fallbacks
        )
        if damage == "corrupt":  # a corrupt object costs that blob only; the relay stays in use
            assert fallbacks == 1 and health["up"] is True
        else:  # a stalled relay is skipped for relay_retry_s: blobs not yet fetched then come from the bulletin
            assert fallbacks >= 1 and health["up"] is False
    finally:
        replica.close()


def test_a_relay_down_sends_every_blob_to_the_bulletin_and_says_so(setup: Setup, tmp_path: Path) -> None:
    """With the first relay down, blobs come from the next relay; with every relay down, from the bulletin; the
    down relay is skipped once it failed, reported ``up: false`` and counted."""
    blobs = setup.blobs()
    setup.relay.stop()
    dead = setup.relay.url
    replica = Replica(setup, tmp_path / "down", [dead])
    try:
        assert verified(replica.fetch(), blobs) == len(blobs)
        # skipped once it failed: at most the downloads already under way when it did (the Fetcher's 2 at once)
        failures = replica.count("stitch_sidecar_relay_fetches_total", relay=dead, outcome="unavailable")
        assert 1 <= failures <= 2 < len(blobs)
        assert replica.count("stitch_sidecar_relay_up", relay=dead) == 0
        assert replica.count("stitch_sidecar_relay_fallbacks_total") == len(blobs)
        (health,) = replica.relays.body() or []
        assert health["up"] is False and "Unavailable" in health["last_error"]
    finally:
        replica.close()
    relay = Nginx(setup.bulletin.url.removeprefix("http://"), tmp_path / "relay2")
    replica = Replica(setup, tmp_path / "next", [dead, relay.url])
    try:
        assert verified(replica.fetch(), blobs) == len(blobs)
        assert replica.count("stitch_sidecar_relay_fetches_total", relay=relay.url, outcome="ok") == len(blobs)
        assert replica.count("stitch_sidecar_relay_fallbacks_total") == 0
    finally:
        replica.close()
        relay.stop()


def test_a_caller_the_bulletin_refuses_gets_nothing_from_the_cache(setup: Setup, tmp_path: Path) -> None:
    """Once a blob is cached, a caller without a token, with an unknown one or with a token of another run is refused
    by the relay (the bulletin's read check), and a cached blob asked under another run's path is that run's
    question (the cache key is the path): not found, no bytes."""
    blobs = setup.blobs()
    first = Replica(setup, tmp_path / "first", [setup.relay.url])
    try:
        first.fetch()
    finally:
        first.close()
    sha = next(iter(blobs))
    url = f"{setup.relay.url}/v1/runs/{RUN}/blobs/{sha}"
    with httpx.Client() as http:
        hit = http.get(url, headers={"authorization": "Bearer t-reader"})
        assert hit.status_code == 200 and hit.headers["x-stitch-relay-cache"] == "HIT"
        for headers, status in (
            ({}, 401),
            ({"authorization": "Bearer t-unknown"}, 401),
            ({"authorization": "Bearer t-other"}, 403),
        ):
            for method in ("GET", "HEAD"):
                refused = http.request(method, url, headers={**headers, "range": "bytes=0-99"})
                assert refused.status_code == status, (headers, method)
                assert hashlib.sha256(refused.content).hexdigest() != sha and len(refused.content) < 1000
        elsewhere = http.get(
            f"{setup.relay.url}/v1/runs/{OTHER_RUN}/blobs/{sha}", headers={"authorization": "Bearer t-other"}
        )
        assert elsewhere.status_code == 404 and sha not in elsewhere.headers.get("etag", "")
        upload = http.put(url, content=b"x", headers={"authorization": "Bearer t-publish"})
        assert upload.status_code == 403  # the relay serves reads only
