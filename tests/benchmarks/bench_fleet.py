"""Benchmark of the fleet view (prints figures; not a test).

1. publish -> N of N replicas current: a bulletin process and ``--sidecars`` sidecars over fake
   engines on loopback; per published version, the seconds from sending the publish until the
   bulletin's fleet long-poll answers that every replica has applied it (p50/p99 over
   ``--versions`` versions): sync, report and fleet query together.
2. The store requests the fleet's reports cost: ``--replicas`` simulated replicas (the sidecar's
   own :class:`~stitchboard.sidecar.report.Reporter`, each with a state that moves at every
   version as a syncing sidecar's does) report to one bulletin over a store that counts its
   calls, with one trainer long-polling the fleet, for ``--seconds`` seconds at the default
   lease (30 s, renewed every 10 s) and a version every ``--version-every-s`` seconds, over S3
   (moto's server on loopback; ``--store file``: a local folder).

Run: ``python -m tests.benchmarks.bench_fleet [--sidecars 4] [--replicas 1000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import boto3
import httpx
import uvicorn
from botocore.exceptions import EndpointConnectionError
from moto.server import ThreadedMotoServer

from stitchboard.bulletin.app import create_app
from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.fleet_client import FleetClient
from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.bulletin.stores import Store, open_store
from stitchboard.demo.processes import free_port
from stitchboard.proto.fleet import ReplicaReport
from stitchboard.sidecar.report import Reporter
from tests.benchmarks.bench_bulletin import start_bulletin
from tests.bulletin.bulletin_helpers import S3_ENV
from tests.bulletin.fleet_helpers import start_sidecar
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import Publisher, make_view, mutate


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def converge_latency(sidecars: int, versions: int) -> list[float]:
    """Seconds from sending each publish to the fleet long-poll saying every sidecar applied it."""
    with tempfile.TemporaryDirectory() as folder:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_bulletin(f"file://{folder}/store", port)
        started = []
        try:
            with BulletinClient(url, retries=1) as client:
                run = f"bench-{uuid.uuid4().hex[:6]}"
                pub = Publisher(client, run, Path(folder))
                pub.publish(make_view(0, tensors=8, numel=1 << 16))
                started = [
                    start_sidecar(
                        url,
                        run,
                        f"replica-{i}",
                        FakeEngine(token_delay_s=0.01),
                        Path(folder) / "handoff",
                        report_min_interval_s=1.0,
                    )
                    for i in range(sidecars)
                ]
                fleet = FleetClient(client)
                fleet.count(run, 0, min_replicas=sidecars, wait_s=120)
                out = []
                for v in range(1, versions + 1):
                    view = mutate(pub.views[-1], v)
                    manifest = pub.prepare(view)
                    t0 = time.perf_counter()
                    pub.commit(manifest, view)
                    count = fleet.count(run, v, min_replicas=sidecars, wait_s=60)
                    assert count.met, count
                    out.append(time.perf_counter() - t0)
                return out
        finally:
            for s in started:
                s.stop(engine_too=True)
            proc.terminate()
            proc.wait(10)


class CountingStore:
    """A store that counts the calls made to it, by method (thread-safe)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[name] += 1
            return attr(*args, **kwargs)

        return counted


class SimulatedReplica:
    """The report of a replica that follows versions as a sidecar does: staging, then applied, idle."""

    def __init__(self, replica_id: str, clock: dict[str, float]) -> None:
        self.replica_id = replica_id
        self.clock = clock
        self.offset = hash(replica_id) % 1000 / 1000  # each replica syncs at its own pace
        self.started_at = time.time()

    def __call__(self) -> ReplicaReport:
        latest, published_at = int(self.clock["version"]), self.clock["at"]
        since = time.monotonic() - published_at
        applied = latest if since > 0.5 + self.offset else latest - 1
        state = "idle" if applied == latest else ("staging" if since > 0.2 else "idle")
        return ReplicaReport(
            replica_id=self.replica_id, engine="vllm", applied_version=max(applied, 0),
            target_version=latest if since > 0.2 else latest - 1,
            state=state, lag_versions=0, healthy=True, started_at=self.started_at,
        )  # fmt: skip


async def _simulate(
    url: str, replicas: int, seconds: float, version_every_s: float, counts: Callable[[str], dict[str, int]]
) -> tuple[dict[str, int], float, int]:
    clock = {"version": 1.0, "at": time.monotonic() - 10}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
        # a check every second: the cadence differs from a sidecar's 0.1 s, what is sent does not
        reporters = [
            Reporter(url, None, "fleet-bench", SimulatedReplica(f"sim-{i:04d}", clock), http=http, check_s=1.0)
            for i in range(replicas)
        ]
        tasks = [asyncio.create_task(r.run_forever()) for r in reporters]
        while sum(r.sent > 0 for r in reporters) < replicas:  # every replica has its first report in
            await asyncio.sleep(0.2)

        async def trainer() -> None:  # a trainer long-polling the fleet the whole time
            while True:
                await http.get(
                    "/v1/runs/fleet-bench/fleet", params={"version": 10**6, "min_replicas": replicas, "wait_s": 30}
                )

        waiter = asyncio.create_task(trainer())
        await asyncio.sleep(2.0)
        await asyncio.to_thread(counts, "reset")
        sent_before = sum(r.sent for r in reporters)
        t0 = time.monotonic()
        next_version = t0
        while (now := time.monotonic()) - t0 < seconds:
            if now >= next_version:
                clock["version"], clock["at"] = clock["version"] + 1, now
                next_version += version_every_s
            await asyncio.sleep(0.1)
        measured = await asyncio.to_thread(counts, "read")
        elapsed = time.monotonic() - t0
        sent = sum(r.sent for r in reporters) - sent_before
        for t in [*tasks, waiter]:
            t.cancel()
        await asyncio.gather(*tasks, waiter, return_exceptions=True)
        return measured, elapsed, sent


def _serve_moto(port: int) -> None:
    """Child process: moto's S3 server on ``port`` until terminated (its own process: in the
    simulator's, its request handling shared one interpreter lock with 1,000 reporters and the
    measured rate was the harness's, ~11 reports/s)."""
    os.environ.update(S3_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    threading.Event().wait()


@contextlib.contextmanager
def _s3_settings() -> Iterator[BulletinSettings]:
    """Bulletin settings over a fresh bucket of a moto S3 server (a child process) on loopback."""
    os.environ.update(S3_ENV)
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve_moto, args=(port,), daemon=True)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for _ in range(300):
            try:
                s3.create_bucket(Bucket="fleet-bench")
                break
            except EndpointConnectionError:  # the server is still starting
                time.sleep(0.1)
        yield BulletinSettings(
            store="s3://fleet-bench/stitch", s3_endpoint_url=endpoint, s3_region="us-east-1", s3_addressing_style="path"
        )
    finally:
        server.terminate()
        server.join(10)


def _serve_counting(settings_json: str, port: int, conn: Connection) -> None:
    """Child process: a bulletin on ``port`` over a :class:`CountingStore`; answers "reset"/"read" on ``conn``."""
    os.environ.update(S3_ENV)
    settings = BulletinSettings.model_validate_json(settings_json)
    store = CountingStore(open_store(settings.store, settings))

    def commands() -> None:
        while True:
            try:
                what = conn.recv()
            except EOFError:  # the benchmark ended
                return
            if what == "reset":
                store.reset()
            conn.send(dict(store.counts))

    threading.Thread(target=commands, daemon=True).start()
    uvicorn.run(create_app(settings, store=store), host="127.0.0.1", port=port, log_level="warning")  # type: ignore[arg-type]


def store_rate(kind: str, replicas: int, seconds: float, version_every_s: float) -> tuple[dict[str, int], float, int]:
    """Store calls by method, seconds measured, and reports sent, with ``replicas`` simulated replicas over a ``kind``
    ("file", "s3") store.

    The bulletin runs in a child process (its store counts the calls); the replicas in this one.
    """
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        settings = (
            stack.enter_context(_s3_settings()) if kind == "s3" else BulletinSettings(store=f"file://{folder}/store")
        )
        port = free_port()
        ours, theirs = multiprocessing.Pipe()
        lock = threading.Lock()

        def counts(what: str) -> dict[str, int]:
            with lock:
                ours.send(what)
                answer: dict[str, int] = ours.recv()
                return answer

        child = multiprocessing.get_context("spawn").Process(
            target=_serve_counting, args=(settings.model_dump_json(), port, theirs), daemon=True
        )
        child.start()
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            return asyncio.run(_simulate(f"http://127.0.0.1:{port}", replicas, seconds, version_every_s, counts))
        finally:
            child.terminate()
            child.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sidecars", type=int, default=4)
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--replicas", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--version-every-s", type=float, default=10.0)
    ap.add_argument(
        "--store",
        choices=["s3", "file"],
        default="s3",
        help="store of the request count: S3 (moto on loopback) or a local folder",
    )
    args = ap.parse_args()

    latencies = converge_latency(args.sidecars, args.versions)
    print(
        f"fleet benchmark: {args.sidecars} sidecars over fake engines, 1 bulletin process, local-folder store, loopback"
    )
    print(
        f"  publish -> {args.sidecars} of {args.sidecars} replicas current (fleet long-poll answered), "
        f"{len(latencies)} versions: p50 {_pct(latencies, 0.5):.0f} ms, p99 {_pct(latencies, 0.99):.0f} ms, "
        f"mean {statistics.mean(latencies) * 1000:.0f} ms"
    )
    counts, elapsed, sent = store_rate(args.store, args.replicas, args.seconds, args.version_every_s)
    total = sum(counts.values())
    by_op = ", ".join(f"{op} {n / elapsed:.1f}/s" for op, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    print(
        f"  {args.replicas} simulated replicas over a {args.store} store (lease 30 s, renewed every 10 s; "
        f"a version every {args.version_every_s:g} s; 1 trainer long-polling the fleet), {elapsed:.0f} s:"
    )
    print(f"    reports accepted {sent / elapsed:.1f}/s; store requests {total / elapsed:.1f}/s ({by_op})")


if __name__ == "__main__":
    main()
