"""Settings of the sidecar, read from ``STITCH_SIDECAR_*`` environment variables.

Every field below is also an environment variable: the field name upper-cased with the
``STITCH_SIDECAR_`` prefix (e.g. ``STITCH_SIDECAR_BULLETIN=http://bulletin:8700``,
``STITCH_SIDECAR_BOOT_VERSION=0``). Options of ``stitchboard sidecar run`` override them.

The sidecar shares a host with its engine: patches are handed over as files under
``<handoff_dir>/sidecar-<port>/<run>/``, in a memory-backed folder (``/dev/shm`` by default)
both processes can read; the port keeps several sidecars of one host apart. The folder must
hold the largest plan (an anchor's snapshot when the sidecar recovers): in containers, size
``/dev/shm`` accordingly (Docker's default is 64 MiB) or point ``handoff_dir`` elsewhere.

The engine's lease (``docs/reference/engine-lease.md``): a sidecar changes its engine only while
it holds the engine's lease, which it takes at boot and renews every ``lease_renew_interval_s``;
another sidecar on the same engine waits, and takes the engine over ``lease_ttl_s`` after the
holder stops renewing (at once when the holder stopped cleanly: it releases the lease).

``STITCH_SIDECAR_FAULT_PHASE=paused`` is for crash tests only: the sidecar process exits at once
(status 86) right after pausing the engine for a commit, leaving it paused. Unset (the default),
it does nothing.
"""

from __future__ import annotations

import os
import tempfile
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stitchboard.proto.fleet import check_replica_id
from stitchboard.proto.logs import LogFormat


def default_handoff_dir() -> str:
    """``/dev/shm/stitchboard`` where ``/dev/shm`` exists (memory-backed), else the system temp folder."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "stitchboard")


class SidecarSettings(BaseSettings):
    """Configuration of one sidecar process (see the module docstring for the env var names)."""

    model_config = SettingsConfigDict(env_prefix="STITCH_SIDECAR_", extra="ignore")

    bulletin: str = Field(..., description="Base URL of the bulletin, e.g. http://bulletin:8700.")
    run: str = Field(..., description="Run id to follow.")
    token: str | None = Field(
        None, description="Bearer token with scope replica (read and report; None: open bulletin)."
    )
    engine: str = Field(
        "vllm",
        description="Engine kind behind the sidecar: vllm or sglang (or a kind registered with "
        "stitchboard.sidecar.engines.register).",
    )
    engine_url: str = Field("http://127.0.0.1:8001", description="Base URL of the engine's HTTP server (same host).")
    host: str = Field("127.0.0.1", description="Address the sidecar listens on.")
    port: int = Field(8000, description="TCP port the sidecar listens on (clients use it instead of the engine's).")
    boot_version: int | None = Field(
        None,
        ge=0,
        description="Published version the engine's boot checkpoint is; None: load the nearest anchor into the engine.",
    )
    handoff_dir: str = Field(
        default_factory=default_handoff_dir,
        description="Memory-backed folder where staged patches are handed to the engine.",
    )

    poll_wait_s: float = Field(
        30.0, gt=0, description="Long-poll wait of one 'latest version' request to the bulletin, seconds."
    )
    download_concurrency: int = Field(4, ge=1, description="Files downloaded at once.")
    bulletin_retries: int = Field(
        4, ge=0, description="Extra attempts of a bulletin request after a transport error or 5xx."
    )
    bulletin_timeout_s: float = Field(
        30.0, gt=0, description="Timeout of one bulletin request (a long-poll adds its wait), seconds."
    )
    relays: list[str] = Field(
        default_factory=list,
        description=(
            "Base URLs of regional blob relays (nginx from deploy/relay/, or a CDN) tried in order before the "
            "bulletin for every blob, e.g. '[\"http://relay-eu:8780\"]' (a JSON list); empty (the default): blobs "
            "come from the bulletin. A relay that fails (unreachable, 5xx, or bytes that miss their sha256) is "
            "reported in /health and the metrics and the blob is fetched from the next one, then the bulletin."
        ),
    )
    relay_timeout_s: float = Field(
        600.0,
        gt=0,
        description=(
            "Timeout of one relay request (to connect, and between bytes of an answer), seconds; keep it above the "
            "relay's STITCH_RELAY_FETCH_TIMEOUT (600 s shipped): a coalesced miss gets no byte until the relay's "
            "one fetch from the bulletin ends. A relay that stalls longer (nginx serving a truncated cached file "
            "stops sending) is left for the next source."
        ),
    )
    relay_retry_s: float = Field(
        30.0,
        gt=0,
        description="Seconds an unreachable relay (transport error or 5xx) is skipped before it is tried again.",
    )
    retry_backoff_s: float = Field(
        0.5, gt=0, description="First delay after a failed sync, seconds; doubles per failure up to max_backoff_s."
    )
    max_backoff_s: float = Field(30.0, gt=0, description="Longest delay between failed syncs, seconds.")
    anchor_after_failures: int = Field(
        2,
        ge=1,
        description="Consecutive failed syncs of the delta route after which the sidecar takes the anchor route.",
    )
    refused_retry_s: float = Field(
        30.0,
        ge=0,
        description="Wait before the same plan (from, to version) is tried again after the engine refused it, "
        "seconds; a newer version ends the wait.",
    )
    stage_anchor_routes: bool = Field(
        True,
        description="Stage anchor routes on an engine that holds a verified version while it serves: the target is "
        "built in the sidecar and only the tensors that differ are written in the pause.",
    )

    request_wait_s: float = Field(
        30.0, ge=0, description="How long a request whose version constraint is unmet is held by default, seconds."
    )
    max_request_wait_s: float = Field(600.0, ge=0, description="Upper bound on a request's X-Stitch-Wait-S, seconds.")
    engine_timeout_s: float = Field(
        600.0, gt=0, description="Read timeout of a proxied request to the engine, seconds."
    )
    engine_call_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Timeout of a control call to the engine (health, state, pause, resume, prefix-cache reset), "
        "seconds.",
    )
    engine_stall_timeout_s: float = Field(
        120.0,
        gt=0,
        description=(
            "How long the engine may take to answer a state check it has not refused before the claim is dropped, "
            "seconds (at least engine_call_timeout_s). "
            "Past engine_call_timeout_s new requests are held: a long step or a first-use kernel compile holds the "
            "engine's control calls, while a restarted or killed engine refuses them at once."
        ),
    )
    engine_apply_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Timeout of an engine call that reads or writes weights (stage, commit, apply, snapshot load, "
        "checksums), seconds.",
    )
    engine_check_interval_s: float = Field(
        1.0,
        gt=0,
        description="How often the sidecar checks that the engine is still the instance, at the version, it verified "
        "(also at every /health and before every commit), seconds.",
    )
    lease_ttl_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description=(
            "How long the engine's lease lasts unless renewed, seconds (default 5): how long a replacement sidecar "
            "waits after the holder stopped renewing (killed, frozen or cut off) before it takes the engine over; a "
            "clean stop releases the lease at once. Keep it above the engine's slowest answer to a control call."
        ),
    )
    lease_renew_interval_s: float = Field(
        1.0,
        gt=0,
        description=(
            "How often the sidecar renews the engine's lease, and tries again to take it while another sidecar holds "
            "it, seconds (default 1; at most half of lease_ttl_s)."
        ),
    )
    retry_after_s: int = Field(
        2, ge=1, description="Retry-After of answers a retry can fix (503, 409 WeightVersionNotReady), seconds."
    )
    salt_cache: bool = Field(
        False,
        description="Salt each request's prefix-cache key by the version it is admitted under (cache_salt, vLLM and "
        "SGLang) instead of resetting the cache at every commit (sidecar/salt.py).",
    )
    max_body_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1,
        description="Largest request body the proxy reads, bytes (default 64 MiB); larger ones get 413, reading stops "
        "at the cap.",
    )
    body_budget_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1,
        description=(
            "Most bytes of request bodies the proxy holds at once across all requests in flight, bytes (default 256 "
            "MiB; at least max_body_bytes): a declared body takes its length before it is read, a chunked one as it "
            "arrives, each until its answer ends. The process holds up to about twice this while the bodies are joined "
            "and parsed."
        ),
    )
    body_budget_wait_s: float = Field(
        5.0,
        ge=0,
        description="How long a request body waits for room in body_budget_bytes before it is answered 503 "
        "BodyBudgetExhausted, seconds (default 5).",
    )

    admin_api: Literal["off", "prime-rl"] = Field(
        "off",
        description=(
            "Engine-control routes the sidecar serves itself for an RL framework's orchestrator: off (every control "
            "route answers 403 RouteForbidden) or prime-rl (its /pause, /resume, /update_weights and LoRA routes; "
            "docs/integrations/prime-rl.md). None of them calls the engine's own control routes."
        ),
    )
    adapter_resident: int = Field(
        2,
        ge=1,
        description=(
            "Adapter runs (issue #31, docs/reference/sidecar-adapters.md): how many adapter versions are kept resident "
            "in the engine, K. The newest is loaded before the oldest is unloaded, and an old one only once no "
            "admitted request uses it, so the engine needs at least K + 1 adapter slots (vLLM --max-loras): boot "
            "refuses an engine with fewer, naming both numbers."
        ),
    )
    admin_update_wait_s: float = Field(
        600.0,
        gt=0,
        description=(
            "prime-rl admin API: how long one POST /update_weights waits for its step's version to be published and "
            "applied, seconds (default 600, below prime-rl's 720 s per attempt); then 503 StepNotApplied, which "
            "prime-rl retries."
        ),
    )

    replica_id: str | None = Field(
        None,
        description="Stable id of this replica in the bulletin's fleet view (1-128 of [A-Za-z0-9._-]); None: '<host "
        "name>-<port>'.",
    )
    report: bool = Field(
        True,
        description="Report this replica to the bulletin's fleet view (needs a token with the replica scope once the "
        "bulletin has tokens).",
    )
    report_min_interval_s: float = Field(
        1.0,
        gt=0,
        description="Fleet reports: the least time between two reports that do not change the applied version, "
        "seconds.",
    )
    report_max_backoff_s: float = Field(
        60.0, gt=0, description="Fleet reports: the longest wait after failed reports, seconds."
    )

    log_level: str = Field("info", description="Log level of the sidecar and uvicorn.")
    log_format: LogFormat = Field(
        LogFormat.text,
        description="Log lines: 'text' (default) or 'json' (one JSON object per line with time, level, logger, "
        "message, run, replica, and version and request_id on a request's lines; docs/reference/logging.md).",
    )
    fault_phase: Literal["paused"] | None = Field(
        None,
        description="Crash tests only: exit the process (status 86) at this phase of a commit; 'paused': right after "
        "pausing the engine. None: never.",
    )

    @model_validator(mode="after")
    def _renew_well_before_the_ttl(self) -> SidecarSettings:
        # A renewal must reach the engine well before the lease lapses: at least twice per TTL.
        if self.lease_renew_interval_s * 2 > self.lease_ttl_s:
            raise ValueError(
                f"lease_renew_interval_s ({self.lease_renew_interval_s:g} s) must be at most half of lease_ttl_s "
                f"({self.lease_ttl_s:g} s): the lease would lapse between renewals"
            )
        return self

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> SidecarSettings:
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(
                f"body_budget_bytes ({self.body_budget_bytes}) must be at least max_body_bytes "
                f"({self.max_body_bytes}): a body at the cap could never be read"
            )
        return self

    @field_validator("relays")
    @classmethod
    def _relay_urls(cls, value: list[str]) -> list[str]:
        # A relay is asked for the bulletin's own blob paths under its base URL: refuse a non-HTTP one at start.
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"relay {url!r} is not an http:// or https:// base URL (STITCH_SIDECAR_RELAYS)")
        return [url.rstrip("/") for url in value]

    @field_validator("replica_id")
    @classmethod
    def _valid_replica_id(cls, value: str | None) -> str | None:
        # The id is a path segment of the bulletin's replica routes: refuse a bad one at start, not at every report.
        return None if value is None else check_replica_id(value)
