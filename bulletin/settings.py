"""Settings of the bulletin service, read from ``STITCH_BULLETIN_*`` environment variables.

Every field below is also an environment variable: the field name upper-cased with the
``STITCH_BULLETIN_`` prefix (e.g. ``STITCH_BULLETIN_STORE=s3://bucket/prefix``). Complex
values (``TOKENS``) are JSON. Command-line options of ``stitchboard bulletin serve`` override
them.

Tokens example::

    STITCH_BULLETIN_TOKENS='{"trainer-secret": {"scopes": ["publish"], "runs": ["grpo-7b"]},
                             "sidecar-secret": {"scopes": ["replica"]}}'

``publish`` implies ``read``; ``replica`` (a sidecar: reports itself to the fleet view) implies
``read`` but not ``publish``; ``metrics`` (for Prometheus) is needed for ``/metrics`` once tokens
are configured; ``runs`` limits a token to those run ids (absent: every run).
With no tokens the bulletin is open and warns at start-up. It also warns at start-up about
every ``STITCH_BULLETIN_*`` variable that is not one of these fields (:func:`ignored_env_names`),
such as ``STITCH_BULLETIN_URL``, the clients' legacy name for ``STITCH_CLIENT_BULLETIN``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from stitchboard.proto.logs import LogFormat

from .stores.s3 import S3Settings

GiB = 1 << 30
MiB = 1 << 20


class TokenGrant(BaseModel):
    """What one bearer token may do: ``scopes`` among ``read``/``publish``/``replica``/``metrics``; ``runs`` (None:
    all runs).

    ``metrics`` (``GET /metrics``: every run's ids, versions and sizes) is for the monitoring
    side and is implied by no other scope.
    """

    scopes: list[Literal["read", "publish", "metrics", "replica"]]
    runs: list[str] | None = None


class BulletinSettings(BaseSettings, S3Settings):
    """Configuration of one bulletin process (see the module docstring for the env var names).

    The ``s3_*`` fields come from :class:`~stitchboard.bulletin.stores.s3.S3Settings`, so these
    settings open an S3 store as they are (``open_store(settings.store, settings)``).
    """

    model_config = SettingsConfigDict(env_prefix="STITCH_BULLETIN_", extra="ignore")

    store: str = Field(
        "file://./stitchboard-store", description="Object store URL: file:///path or s3://bucket/prefix."
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8700, description="TCP port to listen on.")
    tokens: dict[str, TokenGrant] = Field(default_factory=dict, description="Bearer token -> grant (JSON).")

    max_blob_bytes: int = Field(
        8 * GiB, gt=0, description="Largest blob accepted by PUT .../blobs, bytes (default 8 GiB)."
    )
    max_manifest_bytes: int = Field(
        32 * MiB,
        gt=0,
        description="Largest manifest accepted by POST .../versions, and squash record by PUT .../squashes, "
        "bytes (default 32 MiB).",
    )
    max_report_bytes: int = Field(
        64 * 1024,
        gt=0,
        description="Largest replica report accepted by PUT .../replicas/{replica_id}, bytes (default 64 KiB; "
        "a report is about 1 KiB).",
    )
    max_login_bytes: int = Field(
        4096,
        gt=0,
        description="Largest status-page login form accepted by POST /status/login, bytes (default 4 KiB); "
        "refused before the token is looked at.",
    )
    max_wait_s: float = Field(300.0, ge=0, description="Upper bound on a long-poll's wait_s, seconds.")
    poll_interval_s: float = Field(
        0.5, gt=0, description="How often runs with waiters are re-read from the store, seconds."
    )
    manifest_cache_entries: int = Field(
        1024, ge=0, description="Committed manifests kept in memory (they never change)."
    )
    upload_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A blob upload whose body sends nothing for this long is answered 408 and dropped, seconds.",
    )
    upload_min_bytes_per_s: float = Field(
        16 * 1024,
        ge=0,
        description="A blob upload averaging less than this, once upload_rate_grace_s has passed, "
        "is answered 408 and dropped, bytes per second (0: no minimum).",
    )
    upload_rate_grace_s: float = Field(
        10.0, ge=0, description="Seconds an upload may take before upload_min_bytes_per_s applies."
    )
    upload_tmp_dir: str | None = Field(
        None, description="Folder for blobs being received (default: inside a file store, else the system temp)."
    )
    versions_page_max: int = Field(1000, gt=0, description="Largest page of GET .../versions.")
    max_files_per_version: int = Field(
        10_000,
        gt=0,
        description="Most files (patches, snapshot shards, assets) one manifest may list; "
        "tensors per version are not capped.",
    )

    presign: bool = Field(False, description="S3 only: hand out presigned URLs so blobs bypass the bulletin.")
    presign_expires_s: int = Field(
        3600,
        gt=0,
        le=604800,
        description="Lifetime of presigned URLs, seconds (default 3600; SigV4 allows at most 604800, a week).",
    )

    keep_snapshots: int = Field(
        2, ge=1, description="Retention: keep the last K snapshot versions and every version after the oldest kept one."
    )
    gc_grace_s: float = Field(
        3600.0,
        ge=0,
        description="Retention: wait this long before removing dropped versions or unreferenced uploads, seconds.",
    )

    replica_lease_s: float = Field(
        30.0,
        gt=0,
        description="Fleet: a replica counts as live this long after its last report, "
        "seconds (it renews every third of it).",
    )
    replica_forget_s: float = Field(
        3600.0,
        ge=0,
        description="Fleet: a replica whose lease ran out this long ago is deleted from the fleet view, seconds.",
    )
    max_live_replicas: int = Field(
        1000,
        gt=0,
        description="Fleet: the most replicas of one run whose lease is live at once (default 1,000); "
        "a new replica's report past it is answered 422 TooManyReplicas, "
        "a live replica's renewal never is.",
    )
    fleet_poll_interval_s: float = Field(
        1.0,
        gt=0,
        description="Fleet: the longest a process answers fleet queries from its last read of the replica records, "
        "seconds (also how often fleet long-polls re-read them).",
    )

    log_level: str = Field("info", description="uvicorn log level.")
    log_format: LogFormat = Field(
        LogFormat.text,
        description="Log lines: 'text' (default) or 'json' (one JSON object per line with time, level, logger, "
        "message, run, version and request_id; docs/reference/logging.md), uvicorn's access lines included.",
    )
    workers: int = Field(
        1,
        ge=1,
        description="Bulletin processes serving the one port (uvicorn's workers; default 1), "
        "each its own long-polls: docs/bulletin.md, Long-polls.",
    )


def ignored_env_names(environ: Mapping[str, str]) -> list[str]:
    """The ``STITCH_BULLETIN_*`` names in ``environ`` that are no field of :class:`BulletinSettings`, sorted.

    Matched case-insensitively, as the settings read them. A bulletin ignores these variables.
    """
    prefix = BulletinSettings.model_config["env_prefix"]
    fields = {(prefix + name).upper() for name in BulletinSettings.model_fields}
    return sorted(k for k in environ if k.upper().startswith(prefix) and k.upper() not in fields)
