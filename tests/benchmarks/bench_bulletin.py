"""Benchmark of the bulletin's long-poll fan-out on loopback, configurations side by side (prints figures; not a test).

1. 5,000 and 1,000 (``--clients``) concurrent long-polling clients wait for the next version; one
   publish; the time from sending the publish until each client has its answer (p50/p99/max), over
   several rounds, and the bulletin's CPU seconds from the publish to the last answer (what the
   fan-out costs, whatever else the machine runs), with the clients' own CPU over the same span
   (near 1 CPU-second per second: the load generator, not the bulletin, set the pace).
2. Manifest GETs per second (a 300-tensor manifest, keep-alive connections).

Each configuration (``--configs``, default all four) is ``stitchboard bulletin serve --http
PROTOCOL --workers N``: the bulletin's own protocol (``bulletin``: an answer in one write, sent
whole by the fan-out) or uvicorn's stock ``httptools``, with 1 process or N (``--workers``,
default 2 on a 2-core host), each configuration its own fresh bulletin and store. The rounds are
interleaved (round 1 of every configuration, then round 2, the order rotated each round), so a
machine shared with other work disturbs them alike. With N processes a publish reaches the one
that took it at once, the others when they next read the store's latest version (every
``--poll-interval-s``, the bulletin's ``STITCH_BULLETIN_POLL_INTERVAL_S``); the clients'
connections spread over the processes as the kernel hands them out.

Run: ``python -m tests.benchmarks.bench_bulletin [--clients 5000 1000] [--rounds 5]``. Targets:
1,000 clients notified with p99 <= 200 ms, 5,000 with p99 <= 250 ms, in every round. The clients
run in this one process (uvloop; a raw HTTP/1.1 connection per client, an asyncio protocol each, so
an answer costs one read callback) on the same CPUs as the bulletin; an answer's time is when its
last byte was read (checked after the round). The clients' cyclic garbage collector is held off
during a round, since they stand for separate sidecars. The last line gives each configuration's
p99 at the largest client count and the ratio of the bulletin protocol's best to the stock one's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx
import uvloop

from stitchboard.bulletin.client import BulletinClient
from stitchboard.demo.processes import free_port
from stitchboard.proto.schema import FileRef, TensorSpec, VersionManifest, VersionStats, canonical_json
from tests.support.worker_procs import socket_owner, worker_pids

RUN = "bench"
#: p99 targets, ms, by client count: up to the key's clients, that target (beyond the last, the last).
TARGETS_MS = {1000: 200.0, 5000: 250.0}


def target_ms(clients: int) -> float:
    """The p99 target for ``clients`` long-polls, ms."""
    return next((ms for n, ms in sorted(TARGETS_MS.items()) if clients <= n), TARGETS_MS[max(TARGETS_MS)])


def start_bulletin(
    store: str,
    port: int,
    log_level: str = "warning",
    http: str = "bulletin",
    workers: int = 1,
    poll_interval_s: float | None = None,
) -> subprocess.Popen:
    """``stitchboard bulletin serve --http HTTP --workers WORKERS`` on ``port`` over ``store`` as a subprocess,
    once healthy."""
    env = {**os.environ, "STITCH_BULLETIN_STORE": store, "STITCH_BULLETIN_LOG_LEVEL": log_level}
    if poll_interval_s is not None:
        env["STITCH_BULLETIN_POLL_INTERVAL_S"] = str(poll_interval_s)
    cmd = [sys.executable, "-c", "from stitchboard.proto.cli import main; main()", "bulletin", "serve"]
    proc = subprocess.Popen([*cmd, "--port", str(port), "--http", http, "--workers", str(workers)], env=env)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("bulletin did not start")


def _manifest(client: BulletinClient, version: int, tensors: int) -> VersionManifest:
    data = os.urandom(4096)
    digest = hashlib.sha256(data).hexdigest()
    client.put_blob(RUN, digest, data)
    role = "snapshot" if version == 0 else "patch"
    specs = [
        TensorSpec(
            name=f"model.layers.{i // 9}.w{i % 9}.weight",
            dtype="BF16",
            shape=[576, 576],
            checksums={"xxh3_128": f"{version * 1000 + i:032x}"},
        )
        for i in range(tensors)
    ]
    total = sum(t.numel for t in specs)
    return VersionManifest(
        run_id=RUN,
        version=version,
        base_version=None if version == 0 else version - 1,
        snapshot=version == 0,
        tensors=specs,
        files=[FileRef(path=f"{role}-{version}.safetensors", sha256=digest, size_bytes=len(data), role=role)],
        stats=VersionStats(
            changed_elements=0 if version == 0 else 10,
            total_elements=total,
            encoded_bytes=0 if version == 0 else len(data),
        ),
    )


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status, length = _head(head)
    return status, await reader.readexactly(length) if length else b""


def _head(head: bytes) -> tuple[int, int]:
    """``(status, content_length)`` of an HTTP/1.1 response head."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return int(head.split(b" ", 2)[1]), length


class LongPoll(asyncio.Protocol):
    """One keep-alive connection standing for one sidecar: :meth:`ask` sends a request; the answer's future
    gets the raw response once its last byte has been read, and :attr:`answered_at` that moment
    (``time.perf_counter``). Nothing is parsed beyond the head's length, so one answer costs the
    client process one read callback."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.answer: asyncio.Future[bytes] | None = None
        self.answered_at = 0.0
        self._total = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def ask(self, request: bytes) -> asyncio.Future[bytes]:
        assert self.transport is not None
        self.buffer.clear()
        self._total = -1
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.answer

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self._total < 0 and (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            self._total = end + 4 + _head(bytes(self.buffer[:end]))[1]
        if 0 <= self._total <= len(self.buffer) and self.answer is not None and not self.answer.done():
            self.answered_at = time.perf_counter()
            self.answer.set_result(bytes(self.buffer))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError(f"the bulletin closed a long-poll before answering ({exc})"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class WaiterCount:
    """The long-polls waiting in every serving process: a keep-alive ``/metrics`` connection to each
    (each process counts only its own waiters; the kernel hands a new connection to any of them)."""

    def __init__(self) -> None:
        self.streams: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self.spare: list[asyncio.StreamWriter] = []

    @classmethod
    async def open(cls, port: int, pids: list[int]) -> WaiterCount:
        count = cls()
        for _ in range(100 * len(pids)):
            if len(count.streams) == len(pids):
                return count
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            owner = socket_owner(port, writer.get_extra_info("sockname")[1], pids)
            if owner is None or owner in count.streams:
                count.spare.append(writer)
            else:
                count.streams[owner] = (reader, writer)
        raise SystemExit(f"no connection reached every bulletin process of {pids}")

    async def waiting(self) -> int:
        total = 0
        for reader, writer in self.streams.values():
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
            status, body = await _read_response(reader)
            assert status == 200, body[:300]
            line = next(x for x in body.decode().splitlines() if x.startswith("stitch_bulletin_waiters "))
            total += int(float(line.split()[1]))
        return total

    async def until(self, n: int) -> None:
        for _ in range(600):
            if await self.waiting() >= n:
                return
            await asyncio.sleep(0.05)
        raise SystemExit(f"only {await self.waiting()} of {n} long-polls waiting after 30 s")

    def close(self) -> None:
        for writer in [*self.spare, *(w for _, w in self.streams.values())]:
            writer.close()


@dataclass(frozen=True)
class Config:
    """One way to serve: uvicorn's HTTP protocol (``bulletin serve --http``) and its process count."""

    http: str
    workers: int

    @property
    def name(self) -> str:
        return f"{self.http} x{self.workers}"

    @classmethod
    def parse(cls, text: str) -> Config:
        http, _, workers = text.partition(":")
        return cls(http, int(workers or 1))


@dataclass
class Round:
    """One publish: seconds from sending it to each client's answer (sorted), the publish's round trip,
    the server's and the clients' CPU seconds from the publish to the last answer, the 1-minute load
    average before and after."""

    latencies_s: list[float]
    publish_s: float
    server_cpu_s: float
    client_cpu_s: float
    load_before: float
    load_after: float


@dataclass
class Served:
    """A configuration's running bulletin, its client, and its rounds so far."""

    config: Config
    proc: subprocess.Popen
    port: int
    pids: list[int]
    client: BulletinClient
    rounds: list[Round] = field(default_factory=list)


async def _connect(port: int, clients: int) -> list[LongPoll]:
    loop, conns = asyncio.get_running_loop(), []
    for i in range(0, clients, 100):  # in batches, to stay under the listen backlog
        made = await asyncio.gather(
            *(loop.create_connection(LongPoll, "127.0.0.1", port) for _ in range(min(100, clients - i)))
        )
        conns += [protocol for _, protocol in made]
    return conns


async def _quiet(pids: list[int], timeout_s: float = 10.0) -> None:
    """Wait until ``pids`` use under 2 % of a CPU over 0.25 s (closed connections cleaned up), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = sum(map(cpu_seconds, pids))
        await asyncio.sleep(0.25)
        if sum(map(cpu_seconds, pids)) - before < 0.005:
            return


async def one_round(served: Served, clients: int, version: int, tensors: int) -> Round:
    """``clients`` fresh connections each long-poll for ``version``, then one publish of it (see :class:`Round`)."""
    conns = await _connect(served.port, clients)
    count = await WaiterCount.open(served.port, served.pids)
    try:
        manifest = await asyncio.to_thread(_manifest, served.client, version, tensors)
        request = f"GET /v1/runs/{RUN}/versions/latest?after={version - 1}&wait_s=120 HTTP/1.1\r\nHost: bench\r\n\r\n"
        answers = [c.ask(request.encode()) for c in conns]
        await count.until(clients)
        load_before, own0 = os.getloadavg()[0], cpu_seconds(os.getpid())
        cpu0 = sum(map(cpu_seconds, served.pids))
        gc.disable()
        try:
            t0 = time.perf_counter()
            await asyncio.to_thread(served.client.publish, manifest)
            publish_s = time.perf_counter() - t0
            bodies = await asyncio.gather(*answers)
        finally:
            gc.enable()
        server_cpu_s = sum(map(cpu_seconds, served.pids)) - cpu0
        client_cpu_s = cpu_seconds(os.getpid()) - own0
    finally:
        count.close()
        for c in conns:
            assert c.transport is not None
            c.transport.close()
    for raw in bodies:
        head, _, body = raw.partition(b"\r\n\r\n")
        assert _head(head)[0] == 200 and json.loads(body)["version"] == version, raw[:300]
    latencies = sorted(c.answered_at - t0 for c in conns)
    await _quiet(served.pids)
    return Round(latencies, publish_s, server_cpu_s, client_cpu_s, load_before, os.getloadavg()[0])


async def interleaved(fleet: list[Served], clients: int, rounds: int, tensors: int) -> None:
    """``rounds`` rounds of every configuration, round by round, the order rotated each round."""
    for r in range(rounds):
        for served in fleet[r % len(fleet) :] + fleet[: r % len(fleet)]:
            served.rounds.append(await one_round(served, clients, r + 1, tensors))


async def manifest_gets(port: int, version: int, connections: int, seconds: float) -> tuple[int, float]:
    request = f"GET /v1/runs/{RUN}/versions/{version} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()
    stop = time.perf_counter() + seconds
    counts = [0] * connections

    async def loop(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < stop:
            writer.write(request)
            status, _ = await _read_response(reader)
            assert status == 200
            counts[i] += 1
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(connections)))
    return sum(counts), time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


@dataclass
class Summary:
    """A configuration's figures at one client count: p50, p99 over all rounds, the worst round's p99 (ms),
    target met."""

    name: str
    p50_ms: float
    p99_ms: float
    worst_round_p99_ms: float
    met: bool


def _summary(served: Served, clients: int) -> Summary:
    everything = sorted(x for r in served.rounds for x in r.latencies_s)
    worst = max(_pct(r.latencies_s, 0.99) for r in served.rounds)
    return Summary(
        served.config.name, _pct(everything, 0.5), _pct(everything, 0.99), worst, worst <= target_ms(clients)
    )


def _report(fleet: list[Served], clients: int, poll_interval_s: float) -> list[Summary]:
    target = target_ms(clients)
    print(
        f"\nlong-poll, {clients} clients: publish -> each client answered, {len(fleet[0].rounds)} rounds per "
        f"configuration, interleaved (poll_interval_s {poll_interval_s}; target p99 <= {target:.0f} ms in every round)"
    )
    for served in fleet:
        for i, r in enumerate(served.rounds, 1):
            xs = r.latencies_s
            print(
                f"  {served.config.name:13} round {i}: p50 {_pct(xs, 0.5):7.1f}  p99 {_pct(xs, 0.99):7.1f}  max "
                f"{xs[-1] * 1000:7.1f}"
                f"  (publish round trip {r.publish_s * 1000:6.1f}; server CPU {r.server_cpu_s * 1000:6.1f}, clients' "
                f"{r.client_cpu_s * 1000:6.1f}; load {r.load_before:.1f} -> {r.load_after:.1f})"
            )
    print(
        "\n| configuration | p50 ms | p99 ms | worst round's p99 ms | target | server CPU us/answer | "
        "clients' CPU / span |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    summaries = []
    for served in fleet:
        s = _summary(served, clients)
        summaries.append(s)
        cpu = statistics.median(r.server_cpu_s for r in served.rounds) / clients * 1e6
        busy = statistics.median(r.client_cpu_s / r.latencies_s[-1] for r in served.rounds)
        print(
            f"| {s.name} | {s.p50_ms:.1f} | {s.p99_ms:.1f} | {s.worst_round_p99_ms:.1f} | "
            f"{'met' if s.met else 'NOT met'} | {cpu:.1f} | {busy:.2f} |"
        )
    return summaries


def _verdict(clients: int, summaries: list[Summary]) -> str:
    """The last line: each configuration's p99 and the ratio of the best bulletin-protocol p99 to the best stock one."""
    each = ", ".join(f"{s.name} {s.p99_ms:.1f} ms{'' if s.met else ' (target NOT met)'}" for s in summaries)
    ours = [s for s in summaries if s.name.startswith("bulletin ")]
    stock = [s for s in summaries if not s.name.startswith("bulletin ")]
    if not ours or not stock:
        return f"p99 at {clients} clients: {each}"
    best_ours, best_stock = min(ours, key=lambda s: s.p99_ms), min(stock, key=lambda s: s.p99_ms)
    ratio = best_ours.p99_ms / best_stock.p99_ms
    return (
        f"p99 at {clients} clients: {each}; ratio {best_ours.name} / {best_stock.name} = {ratio:.2f} "
        f"(the bulletin protocol {100 * (1 - ratio):.0f} % better; worth keeping at <= 0.80 with targets met)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[5000, 1000], help="client counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2, help="N: processes of the multi-process configurations")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="PROTOCOL:WORKERS each (default: bulletin:1 httptools:1 bulletin:N httptools:N)",
    )
    ap.add_argument(
        "--poll-interval-s", type=float, default=0.05, help="the bulletins' STITCH_BULLETIN_POLL_INTERVAL_S"
    )
    ap.add_argument("--tensors", type=int, default=300, help="tensors per manifest (SmolLM2-135M has ~270)")
    ap.add_argument("--get-seconds", type=float, default=3.0)
    ap.add_argument("--get-connections", type=int, default=16)
    args = ap.parse_args()
    texts = args.configs or ["bulletin:1", "httptools:1", f"bulletin:{args.workers}", f"httptools:{args.workers}"]
    configs = [Config.parse(t) for t in texts]

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(args.clients) + 1024
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))

    print(
        f"bulletin benchmark, {time.strftime('%Y-%m-%d %H:%M')}: loopback, local-folder stores, {os.cpu_count()} CPUs "
        f"(clients in one process on the same CPUs); configurations: {', '.join(c.name for c in configs)}"
    )
    last: tuple[int, list[Summary]] | None = None
    gets: dict[str, str] = {}
    for n, clients in enumerate(args.clients):
        with tempfile.TemporaryDirectory() as folder:
            fleet: list[Served] = []
            try:
                for i, config in enumerate(configs):
                    port = free_port()
                    proc = start_bulletin(
                        f"file://{folder}/{i}", port, "error", http=config.http, workers=config.workers,
                        poll_interval_s=args.poll_interval_s,
                    )  # fmt: skip
                    fleet.append(Served(config, proc, port, [], BulletinClient(f"http://127.0.0.1:{port}")))
                    fleet[-1].pids = [proc.pid] if config.workers == 1 else worker_pids(proc, config.workers)
                    fleet[-1].client.publish(_manifest(fleet[-1].client, 0, args.tensors))
                uvloop.run(interleaved(fleet, clients, args.rounds, args.tensors))
                if n == 0:
                    for served in fleet:
                        size = len(canonical_json(served.client.manifest(RUN, 1)))
                        count, elapsed = asyncio.run(
                            manifest_gets(served.port, 1, args.get_connections, args.get_seconds)
                        )
                        gets[served.config.name] = f"{count / elapsed:.0f}/s"
            finally:
                for served in fleet:
                    served.client.close()
                    served.proc.terminate()
                    served.proc.wait(20)
        summaries = _report(fleet, clients, args.poll_interval_s)
        if last is None or clients > last[0]:
            last = (clients, summaries)
    print(
        f"\nmanifest GETs ({args.tensors}-tensor manifest, {size} bytes, {args.get_connections} keep-alive "
        f"connections, {args.get_seconds:.0f} s each): " + ", ".join(f"{k} {v}" for k, v in gets.items())
    )
    assert last is not None
    print(_verdict(*last))


if __name__ == "__main__":
    main()
