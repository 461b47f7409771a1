"""The per-part figures of the fleet model, each with its source: measured here by a named benchmark, a cited
public figure, or an assumption named as such (runs in the operator's process).

Every figure is a :class:`Figure`; :class:`Fleet` holds one set of them and derives the workload (a version's
bytes and files for ``cond`` or ``xor``). ``stitchboard simulate`` prints them all with their sources.
"""

# Figure is frozen: one default instance shared by every Fleet is safe (RUF009 is about mutable defaults).
# ruff: noqa: RUF009
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Kind = Literal["measured", "public", "assumption", "input"]

S3_PERF = "https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html"
S3_GUIDELINES = "https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance-guidelines.html"
S3_503 = "https://aws.amazon.com/premiumsupport/knowledge-center/s3-503-within-request-rate-prefix/"
S3_PARTITIONING = "https://aws.amazon.com/premiumsupport/knowledge-center/s3-object-key-naming-pattern/"
EC2_BANDWIDTH = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-instance-network-bandwidth.html"


@dataclass(frozen=True)
class Figure:
    """One per-part figure.

    Attributes:
        value: the figure, in ``unit``.
        unit: e.g. ``requests/s``, ``bytes/s``, ``s``.
        kind: ``measured`` (a benchmark of this repository, named in ``source``), ``public`` (a cited public
            figure, its page in ``source``), ``assumption`` (named as such, with the reason) or ``input`` (the
            scenario asked for).
        source: the benchmark command and its figure, the page, or the assumption's reason.
    """

    value: float
    unit: str
    kind: Kind
    source: str


def _f(value: float, unit: str, kind: Kind, source: str) -> Figure:
    return Figure(value, unit, kind, source)


@dataclass(frozen=True)
class Fleet:
    """One scenario's figures (defaults: 1T parameters, 64 trainer ranks, 1,000 replicas in 3 regions).

    Attributes are :class:`Figure` objects; :meth:`with_values` returns a copy with some values replaced (same
    sources), e.g. for a tiny hand-computed case.
    """

    parameters: Figure = _f(1e12, "elements", "input", "issue #33: a 1T-parameter model, bf16 served view")
    changed_fraction: Figure = _f(
        0.01, "of elements", "measured", "bench_codec: 0.57-1.26 % of elements changed per real AdamW step (1 % used)"
    )
    bytes_per_changed_cond: Figure = _f(
        0.53, "bytes/element", "measured", "bench_codec: bytes per changed element, cond (median of real steps)"
    )
    bytes_per_changed_xor: Figure = _f(1.44, "bytes/element", "measured", "bench_codec: bytes per changed element, xor")
    trainer_ranks: Figure = _f(64, "ranks", "input", "issue #33: one patch file per trainer rank")
    replicas: Figure = _f(1000, "replicas", "input", "issue #33")
    regions: Figure = _f(3, "regions", "input", "issue #33 (the store and the bulletin in the first)")
    bulletin_processes: Figure = _f(
        4, "processes", "assumption", "bulletin processes serving the fleet (they share nothing; DESIGN.md inv. 9)"
    )
    poll_answer_s: Figure = _f(
        32e-6, "s of CPU", "measured", "bench_bulletin: 32 us of server CPU per long-poll answer (--http bulletin)"
    )
    bulletin_request_s: Figure = _f(
        1 / 3279, "s", "measured", "bench_bulletin: 3,279 manifest GETs/s per process (plan and manifest asks)"
    )
    control_requests: Figure = _f(
        2, "requests", "input", "a sidecar's asks after its long-poll: the plan, the manifest"
    )
    inter_region_rtt_s: Figure = _f(
        0.08, "s", "assumption", "round trip between regions (no AWS-published figure; typical US-EU distance)"
    )
    store_get_rate: Figure = _f(5500, "GET/s per partition", "public", f"S3, per partitioned prefix: {S3_PERF}")
    store_put_rate: Figure = _f(3500, "PUT/s per partition", "public", f"S3, per partitioned prefix: {S3_PERF}")
    store_partitions: Figure = _f(
        1,
        "partitions",
        "public",
        f"a fresh run's prefix is one partition; S3 answers 503 SlowDown while it splits ({S3_503}); "
        f"splitting takes 30-60 min (an AWS comment on {S3_PARTITIONING})",
    )
    store_stream_Bps: Figure = _f(
        87.5e6, "bytes/s per request", "public", f"S3: one request per 85-90 MB/s of throughput ({S3_GUIDELINES})"
    )
    single_flow_Bps: Figure = _f(
        5e9 / 8, "bytes/s", "public", f"EC2: one flow outside a cluster placement group, 5 Gbps ({EC2_BANDWIDTH})"
    )
    relay_egress_Bps: Figure = _f(
        100e9 / 8,
        "bytes/s per relay",
        "assumption",
        "one nginx relay per region on a 100 Gbps instance, its NIC the limit (bench_relay's 426 MB/s through "
        "one relay is the 2-core test host's CPU, not a cloud NIC)",
    )
    relay_origin_gets_per_blob: Figure = _f(
        1.0,
        "origin GETs per blob per relay",
        "measured",
        "bench_relay: origin_gets_per_blob=1.00 with 200 fetchers at once, cold cache (docs/reference/relay.md)",
    )
    origin_Bps: Figure = _f(
        float("inf"), "bytes/s", "public", f"S3's aggregate throughput scales with parallel requests ({S3_GUIDELINES})"
    )
    replicas_per_host: Figure = _f(
        1, "replicas", "input", "each replica on its own hosts (the validation: all on one, in one fetch process)"
    )
    host_cores: Figure = _f(
        1,
        "cores",
        "assumption",
        "cores a replica host gives its fetch process (one interpreter) and, in the validation, the bulletin; the "
        "validation's 2-core host, shared with other jobs, gives the run about one core (the validation checks it)",
    )
    bulletin_on_replica_host: Figure = _f(
        0, "0 or 1", "input", "1: the bulletin runs on the (one) replica host, sharing its cores (the validation)"
    )
    client_request_s: Figure = _f(
        0.0, "s of CPU", "assumption", "a replica's CPU per request, negligible beside its transfer at scale"
    )
    relays_per_region: Figure = _f(
        1, "relays", "input", "nginx relays per region behind one URL (each fills from the origin on its own)"
    )
    fetch_concurrency: Figure = _f(4, "files at once", "input", "sidecar Fetcher's default concurrency")
    client_retries: Figure = _f(4, "retries", "input", "BulletinClient's default (5 attempts), full jitter")
    client_backoff_s: Figure = _f(0.25, "s", "input", "BulletinClient's default first backoff window")
    sync_backoff_s: Figure = _f(0.5, "s", "input", "sidecar retry_backoff_s (doubles, no jitter, up to 30 s)")
    verify_Bps: Figure = _f(
        1.5e9, "bytes/s", "measured", "hashlib.sha256 over 64 MiB on this host, measured by simulate at each run"
    )
    decode_cond_per_s: Figure = _f(
        4.15e6,
        "changed elements/s per rank",
        "measured",
        "bench_sglang: 1.52 M changed elements decoded (cond) in 0.366 s while serving",
    )
    decode_xor_per_s: Figure = _f(
        12.2e6,
        "changed elements/s per rank",
        "measured",
        "bench_codec: xor decode+apply 2.8x a copy_ vs cond 8.2x: cond's rate x 8.2 / 2.8",
    )
    engine_ranks: Figure = _f(
        32, "ranks", "assumption", "GPUs holding one 1T replica, each decoding its share (e.g. 4 nodes x 8)"
    )
    pause_s_per_element: Figure = _f(
        0.023 / 1.52e6, "s per changed element per rank", "measured", "bench_sglang: the pause's write, 23 ms"
    )
    pause_fixed_s: Figure = _f(0.023, "s", "measured", "bench_sglang: the pause's calls, 46 ms less the write")

    def with_values(self, **values: float) -> Fleet:
        """A copy with the named figures' values replaced (their units and sources kept)."""
        return replace(self, **{k: replace(getattr(self, k), value=v) for k, v in values.items()})

    def figures(self) -> dict[str, Figure]:
        """Every figure by name."""
        return {n: getattr(self, n) for n in self.__dataclass_fields__}

    def changed_elements(self) -> float:
        """Changed elements per version."""
        return self.parameters.value * self.changed_fraction.value

    def version_bytes(self, encoding: str) -> float:
        """Bytes of one version's patch files for ``encoding`` (``cond`` or ``xor``)."""
        per = {"cond": self.bytes_per_changed_cond, "xor": self.bytes_per_changed_xor}[encoding].value
        return self.changed_elements() * per

    def file_bytes(self, encoding: str) -> float:
        """Bytes of one rank's patch file (the version split evenly over the trainer ranks)."""
        return self.version_bytes(encoding) / self.trainer_ranks.value

    def apply_s(self, encoding: str) -> tuple[float, float]:
        """(staging, pause) seconds of one replica: decode on ``engine_ranks`` ranks while serving, then the write."""
        per_rank = self.changed_elements() / self.engine_ranks.value
        rate = {"cond": self.decode_cond_per_s, "xor": self.decode_xor_per_s}[encoding].value
        return per_rank / rate, self.pause_fixed_s.value + per_rank * self.pause_s_per_element.value
