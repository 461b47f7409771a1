"""Relay: origin GETs per blob and aggregate throughput, 200 fetchers through one nginx relay vs to the bulletin.

Run: ``python -m tests.benchmarks.bench_relay [--fetchers 200] [--blobs 8] [--blob-bytes 1048576] [--processes 4]``
(from the repo root, in .venv; needs Debian's nginx: without it, exits 2 saying so). ~1 minute on 2 cores.

A real bulletin (``stitchboard bulletin serve`` in its own process, folder store, one worker, open: no tokens) holds
``--blobs`` random blobs of one run. nginx runs ``deploy/relay/relay.conf.template`` in front of it (cold cache).
``--fetchers`` fetchers, spread over ``--processes`` processes (threads within each), all start at one instant and
download every blob through the sidecar's own path (:class:`~stitchboard.sidecar.relays.Relays` over
:meth:`~stitchboard.bulletin.client.BulletinClient.download_blob`: sha256 and size verified before the file
appears; each file is deleted once verified). Two rounds, same blobs, fresh fetchers: through the relay, then
straight to the bulletin. Origin GETs are counted at the bulletin (its ``stitch_bulletin_request_seconds`` count for
the blob route, read from ``/metrics`` before and after each round); throughput is the bytes every fetcher received
over the round's wall time (start instant to last fetcher done). The read check costs one bulletin request per run
and ``STITCH_RELAY_AUTH_TTL`` (no tokens here: it answers 204 to anyone).

Last line: ``relay: fetchers=<n> blobs=<n> origin_gets_per_blob=<x> verified=<k>/<k>`` (k = fetchers x blobs).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

RUN = "bench-relay"
BLOB_ROUTE = "/v1/runs/{run}/blobs/{sha256}"


def _blob_gets_now(bulletin: str) -> float:
    text = httpx.get(f"{bulletin}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "stitch_bulletin_request_seconds"
        for s in family.samples
        if s.name.endswith("_count") and s.labels.get("method") == "GET" and s.labels.get("route") == BLOB_ROUTE
    )


def origin_blob_gets(bulletin: str) -> float:
    """GETs of the blob route the bulletin has answered (any status), from its ``/metrics``, once no more came for
    0.5 s (the bulletin counts a GET after its last byte is sent: a fetcher may be done before)."""
    while True:
        seen = _blob_gets_now(bulletin)
        time.sleep(0.5)
        if _blob_gets_now(bulletin) == seen:
            return seen


def _fetcher(bulletin: str, relays: list[str], blobs: list[tuple[str, int]], folder: Path, start_at: float) -> int:
    """One fetcher: every blob, verified (relays first, if any); returns how many were verified."""
    from stitchboard.bulletin.client import BulletinClient
    from stitchboard.sidecar.metrics import SidecarMetrics
    from stitchboard.sidecar.relays import Relays

    folder.mkdir(parents=True, exist_ok=True)
    with BulletinClient(bulletin, retries=2, backoff_s=0.05, timeout_s=120) as origin:
        chain = Relays(relays, None, SidecarMetrics(), timeout_s=120)
        try:
            time.sleep(max(0.0, start_at - time.time()))
            verified = 0
            for sha256, size in blobs:
                dest = folder / sha256
                chain.download(origin, RUN, sha256, dest, size)  # raises unless sha256 and size match
                verified += 1
                dest.unlink()
            return verified
        finally:
            chain.close()


def _process(
    bulletin: str, relays: list[str], blobs: list[tuple[str, int]], root: str, first: int, count: int, start_at: float
) -> tuple[int, float]:
    """``count`` fetchers as threads of one process; (verified downloads, seconds from the start to the last)."""
    with ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(_fetcher, bulletin, relays, blobs, Path(root) / f"f{first + i}", start_at) for i in range(count)
        ]
        verified = sum(f.result() for f in futures)
    return verified, time.time() - start_at


def fetch_round(
    bulletin: str, relays: list[str], blobs: list[tuple[str, int]], root: Path, fetchers: int, processes: int
) -> tuple[int, float]:
    """Every fetcher fetches every blob; (verified downloads, wall seconds)."""
    share = [fetchers // processes + (1 if i < fetchers % processes else 0) for i in range(processes)]
    start_at = time.time() + 3.0 + 0.02 * fetchers  # every process and thread is up by then
    firsts = [sum(share[:i]) for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
        results = list(
            pool.map(
                _process,
                [bulletin] * processes,
                [relays] * processes,
                [blobs] * processes,
                [str(root)] * processes,
                firsts,
                share,
                [start_at] * processes,
            )
        )
    return sum(v for v, _ in results), max(s for _, s in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fetchers", type=int, default=200)
    parser.add_argument("--blobs", type=int, default=8)
    parser.add_argument("--blob-bytes", type=int, default=1 << 20)
    parser.add_argument("--processes", type=int, default=4, help="fetcher processes (at most 4)")
    args = parser.parse_args(argv)
    from tests.bulletin.relay_nginx import NGINX, NO_NGINX, Nginx

    if NGINX is None:
        print(f"bench_relay: {NO_NGINX}", file=sys.stderr)
        return 2
    processes = max(1, min(4, args.processes, args.fetchers))

    from stitchboard.bulletin.client import BulletinClient
    from stitchboard.bulletin.settings import BulletinSettings
    from tests.bulletin.bulletin_helpers import ProcessServer

    root = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    server = relay = None
    try:
        settings = BulletinSettings(store=f"file://{root / 'store'}", max_blob_bytes=max(args.blob_bytes, 1 << 20))
        server = ProcessServer(settings)
        blobs = []
        with BulletinClient(server.url) as client:
            for _ in range(args.blobs):
                data = os.urandom(args.blob_bytes)
                sha256 = hashlib.sha256(data).hexdigest()
                client.put_blob(RUN, sha256, data)
                blobs.append((sha256, len(data)))
        relay = Nginx(server.url.removeprefix("http://"), root / "relay", workers=2)
        version = subprocess.run([NGINX, "-v"], capture_output=True, text=True, check=False).stderr.strip()
        k = args.fetchers * args.blobs
        total_mb = k * args.blob_bytes / 1e6
        print(
            f"bench_relay: {args.fetchers} fetchers in {processes} processes, {args.blobs} blobs of "
            f"{args.blob_bytes} bytes ({total_mb:.0f} MB per round), {version}, bulletin: 1 worker, folder store"
        )
        rounds = {}
        for name, relays in (("relay", [relay.url]), ("direct", [])):
            before = origin_blob_gets(server.url)
            verified, seconds = fetch_round(server.url, relays, blobs, root / name, args.fetchers, processes)
            gets = origin_blob_gets(server.url) - before
            rounds[name] = (gets, verified, seconds)
            print(
                f"  {name:6s}: origin GETs {gets:.0f} ({gets / args.blobs:.2f} per blob), verified {verified}/{k}, "
                f"{seconds:.2f} s, {total_mb / seconds:.0f} MB/s aggregate"
            )
        ratio = rounds["direct"][2] / rounds["relay"][2]
        print(f"  throughput relay/direct: {ratio:.2f}x (same machine: nginx, bulletin and fetchers share 2 cores)")
        gets, verified, _ = rounds["relay"]
        print(
            f"relay: fetchers={args.fetchers} blobs={args.blobs} origin_gets_per_blob={gets / args.blobs:.2f} "
            f"verified={verified}/{k}"
        )
        return 0 if verified == k else 1
    finally:
        if relay is not None:
            relay.stop()
        if server is not None:
            server.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
