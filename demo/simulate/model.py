"""The discrete-event model (simpy) of one RL step's fan-out: trainer ranks -> store -> regional caches ->
replicas -> engine apply (runs in the operator's process).

Time 0 is the commit of version N. Before it the trainer ranks upload their files (:attr:`StepResult.upload_s`).
After it every replica: is answered its long-poll and asks its plan and manifest (the bulletin's processes, a
queue, first come first served; where the bulletin runs on the replicas' host, as in the validation, its work
takes that host's CPU beside the fetchers'); downloads the version's files ``fetch_concurrency`` at once, each
from its region's relay (cache tier) or from the origin (through the bulletin's blob route: one bulletin request
per attempt, then the store); verifies each file (sha256) on its host's CPU (:class:`~.host.Host`: the downloads
of one fetch process progress together, sharing its core); stages (decodes) while serving; pauses and writes.
The store admits GETs at its per-partition rate (a token bucket of one second's burst); a GET over the rate is
answered 503 SlowDown and retried after the client's own :func:`~stitchboard.bulletin.client.backoff_delay_s`;
after the client's last retry the sync fails and the sidecar retries it after its (unjittered, doubling)
``retry_backoff_s``, reusing the files it has. A relay fetches each blob from the origin once (nginx's
``proxy_cache_lock``: the other misses wait for it; the origin GETs and bytes of a fill count
``relay_origin_gets_per_blob``, measured by bench_relay), then serves it over its egress link. Shared links are
pipes: a transfer reserves its bytes at the link's rate after the transfers before it, and takes at least its
size over its own stream rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import simpy

from stitchboard.bulletin.client import backoff_delay_s

from .figures import Fleet
from .host import Host

#: Failed syncs after which the sidecar takes the anchor route (its ``anchor_after_failures`` default).
ANCHOR_AFTER_FAILURES = 2


@dataclass(frozen=True)
class Scenario:
    """One simulated step.

    Attributes:
        fleet: the figures.
        encoding: ``cond`` or ``xor`` (a version's bytes and its decode rate).
        cache: whether replicas fetch through their region's relay.
        seed: the random draws' seed (backoff jitter).
        backoff: the client's wait before retry ``attempt + 1``, seconds (``(attempt, base_s, rng) -> s``).
    """

    fleet: Fleet
    encoding: str = "cond"
    cache: bool = True
    seed: int = 0
    backoff: Callable[[int, float, Callable[[], float]], float] = backoff_delay_s


@dataclass
class StepResult:
    """What one simulated step did.

    Attributes:
        at_version_s: per replica, seconds from the commit to serving version N (sorted).
        upload_s: seconds the trainer ranks' uploads took before the commit.
        origin_egress_bytes: bytes the store sent (to replicas or relays).
        store_gets, store_slowdowns, store_puts: GETs answered, GETs answered 503 SlowDown, PUTs.
        bulletin_requests: requests the bulletin answered (polls, plans, manifests, blob routes).
        failed_syncs: syncs that failed (the client's retries spent), over all replicas.
        anchor_routes: replicas whose failed syncs reached the sidecar's anchor escalation (not modelled further).
        store_retries_s: the instant of every retried GET (after a 503 SlowDown) asked of the store, seconds.
    """

    scenario: Scenario
    at_version_s: list[float] = field(default_factory=list)
    upload_s: float = 0.0
    origin_egress_bytes: float = 0.0
    store_gets: int = 0
    store_slowdowns: int = 0
    store_puts: int = 0
    bulletin_requests: int = 0
    failed_syncs: int = 0
    anchor_routes: int = 0
    store_retries_s: list[float] = field(default_factory=list)

    def peak_retry_rate(self, window_s: float = 0.1) -> float:
        """The most retried GETs in any ``window_s`` window (aligned to the commit), per second: retries that come
        back in step show here as bursts."""
        counts: dict[int, int] = {}
        for t in self.store_retries_s:
            counts[int(t / window_s)] = counts.get(int(t / window_s), 0) + 1
        return max(counts.values(), default=0) / window_s

    def time_to(self, fraction: float) -> float:
        """Seconds from the commit until ``fraction`` (0-1] of the replicas serve version N."""
        times = self.at_version_s
        return times[max(0, math.ceil(fraction * len(times)) - 1)]


class TokenBucket:
    """Admits requests at ``rate`` per second with one second's burst (a store's per-prefix request rate)."""

    def __init__(self, env: simpy.Environment, rate: float) -> None:
        self.env, self.rate = env, rate
        self.tokens, self.at = rate, 0.0

    def take(self) -> bool:
        """True when a request is admitted now."""
        if math.isinf(self.rate):
            return True
        self.tokens = min(self.rate, self.tokens + (self.env.now - self.at) * self.rate)
        self.at = self.env.now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Link:
    """A shared link of ``rate_Bps``: transfers go through it one after another (a pipe)."""

    def __init__(self, env: simpy.Environment, rate_Bps: float) -> None:
        self.env, self.rate_Bps, self.free_at = env, rate_Bps, 0.0

    def reserve(self, size_bytes: float) -> float:
        """The time the link has carried ``size_bytes`` more, queued behind what it carries already."""
        start = max(self.env.now, self.free_at)
        self.free_at = start + size_bytes / self.rate_Bps
        return self.free_at


class StepModel:
    """One step of one :class:`Scenario` in a simpy environment; :meth:`run` returns its :class:`StepResult`."""

    def __init__(self, scenario: Scenario) -> None:
        self.sc, fl = scenario, scenario.fleet
        self.fl = fl
        self.env = simpy.Environment()
        self.rng = random.Random(scenario.seed)
        self.result = StepResult(scenario)
        self.store = TokenBucket(self.env, fl.store_get_rate.value * fl.store_partitions.value)
        self.origin = Link(self.env, fl.origin_Bps.value)
        self.bulletin = simpy.Resource(self.env, capacity=int(fl.bulletin_processes.value))
        relays = int(fl.regions.value * fl.relays_per_region.value)
        self.relays = [Link(self.env, fl.relay_egress_Bps.value) for _ in range(relays)]
        self.cached: list[dict[int, simpy.Event]] = [{} for _ in range(relays)]
        hosts = math.ceil(fl.replicas.value / fl.replicas_per_host.value)
        self.hosts = [Host(self.env, fl.host_cores.value) for _ in range(hosts)]
        self.file_bytes = fl.file_bytes(scenario.encoding)

    def run(self) -> StepResult:
        """Simulate the step to its end (every replica at version N)."""
        fl = self.fl
        ranks = int(fl.trainer_ranks.value)
        self.result.store_puts = ranks
        put_rate = fl.store_put_rate.value * fl.store_partitions.value
        self.result.upload_s = max(ranks / put_rate, self.file_bytes / fl.store_stream_Bps.value)
        for replica in range(int(fl.replicas.value)):
            self.env.process(self.replica(replica))
        self.env.run()
        self.result.at_version_s.sort()
        return self.result

    def ask_bulletin(self, service_s: float, region: int) -> simpy.events.ProcessGenerator:
        """One request to the bulletin's processes (a queue), plus the round trip from another region."""
        self.result.bulletin_requests += 1
        with self.bulletin.request() as turn:
            yield turn
            if self.fl.bulletin_on_replica_host.value:
                yield self.hosts[0].work("bulletin", service_s)
            else:
                yield self.env.timeout(service_s)
        if region:
            yield self.env.timeout(self.fl.inter_region_rtt_s.value)

    def store_get(self, region: int, stream_Bps: float, copies: float = 1.0) -> simpy.events.ProcessGenerator:
        """One blob GET from the origin with the client's retries; returns True when the blob arrived.

        ``copies``: the origin GETs (and bytes) it stands for: a relay's fill counts its measured coalescing.
        """
        fl = self.fl
        retries = int(fl.client_retries.value)
        for attempt in range(retries + 1):
            if not self.sc.cache:  # a replica asks the bulletin's blob route first; a relay's fill too, below
                yield from self.ask_bulletin(fl.bulletin_request_s.value, region)
            if attempt:
                self.result.store_retries_s.append(self.env.now)
            if self.store.take():
                self.result.store_gets += round(copies)
                self.result.origin_egress_bytes += self.file_bytes * copies
                done = max(self.origin.reserve(self.file_bytes), self.env.now + self.file_bytes / stream_Bps)
                yield self.env.timeout(done - self.env.now)
                return True
            self.result.store_slowdowns += 1
            if attempt < retries:
                yield self.env.timeout(self.sc.backoff(attempt, fl.client_backoff_s.value, self.rng.random))
        return False

    def relay_fill(self, region: int, blob: int, filled: simpy.Event) -> simpy.events.ProcessGenerator:
        """The relay's one origin fetch of a blob (retried until it arrives), then every waiting miss proceeds."""
        stream = min(self.fl.store_stream_Bps.value, self.fl.single_flow_Bps.value)
        yield from self.ask_bulletin(self.fl.bulletin_request_s.value, region)
        while not (yield from self.store_get(region, stream, self.fl.relay_origin_gets_per_blob.value)):
            pass
        filled.succeed()

    def fetch_file(self, replica: int, region: int, blob: int) -> simpy.events.ProcessGenerator:
        """One file to one replica, verified; returns False when the origin refused it past the client's retries."""
        fl = self.fl
        if self.sc.cache:
            regions = int(fl.regions.value)
            node = region + regions * (replica // regions % int(fl.relays_per_region.value))
            if blob not in self.cached[node]:
                self.cached[node][blob] = self.env.event()
                self.env.process(self.relay_fill(region, blob, self.cached[node][blob]))
            yield self.cached[node][blob]
            relay = self.relays[node]
            done = max(relay.reserve(self.file_bytes), self.env.now + self.file_bytes / fl.single_flow_Bps.value)
            yield self.env.timeout(done - self.env.now)
        elif not (yield from self.store_get(region, fl.store_stream_Bps.value)):
            return False
        host = self.hosts[int(replica // fl.replicas_per_host.value)]
        yield host.work("replicas", self.file_bytes / fl.verify_Bps.value + fl.client_request_s.value)
        return True

    def replica(self, replica: int) -> simpy.events.ProcessGenerator:
        """One replica from the commit to serving version N."""
        fl, env = self.fl, self.env
        region = replica % int(fl.regions.value)
        if fl.poll_answer_s.value:
            yield from self.ask_bulletin(fl.poll_answer_s.value, region)
        for _ in range(int(fl.control_requests.value)):
            yield from self.ask_bulletin(fl.bulletin_request_s.value, region)
        todo = list(range(int(fl.trainer_ranks.value)))
        failures, delay = 0, fl.sync_backoff_s.value
        while todo:
            failed: list[int] = []

            def worker(failed: list[int] = failed) -> simpy.events.ProcessGenerator:
                while todo and not failed:
                    blob = todo.pop(0)
                    if not (yield from self.fetch_file(replica, region, blob)):
                        failed.append(blob)

            yield env.all_of([env.process(worker()) for _ in range(int(fl.fetch_concurrency.value))])
            if failed:
                todo.extend(failed)
                failures += 1
                self.result.failed_syncs += 1
                yield env.timeout(delay)
                delay = min(delay * 2, 30.0)
        if failures >= ANCHOR_AFTER_FAILURES:
            self.result.anchor_routes += 1
        staging_s, pause_s = fl.apply_s(self.sc.encoding)
        yield env.timeout(staging_s + pause_s)
        self.result.at_version_s.append(env.now)
