"""Regional blob relays (sidecar process): each blob is asked of the relays in order, then of the bulletin.

A relay (``deploy/relay/``: nginx's ``proxy_cache`` in front of the bulletin, or a CDN) serves the bulletin's own
blob paths under its base URL (``STITCH_SIDECAR_RELAYS``), so one download path does it all:
:meth:`BulletinClient.download_blob <stitchboard.bulletin.client.BulletinClient.download_blob>` on a client of the
relay's URL (the sidecar's token, no retries: the fallback is the retry), which verifies sha256 and size before the
file appears. What a relay does wrong is reported, never used:

* unreachable or 5xx (:class:`~stitchboard.bulletin.errors.UnavailableError`, a 5xx ``BulletinError``): the relay
  is skipped for ``relay_retry_s`` (``up`` false in ``/health``, ``stitch_sidecar_relay_up`` 0), then tried again;
* bytes that miss their sha256 or size (:class:`~stitchboard.bulletin.errors.BlobMismatchError`: a truncated or
  corrupted cached object): the blob is fetched again from the next source; the relay stays in use for other blobs
  and ``/health`` names the blob (``last_error``);
* another 4xx (it refused the token, or has no such blob): the next source is asked, whose answer counts (the
  bulletin's 401/403/404 are raised as they are).

A failed attempt's partial file is removed before the next source starts, so no bytes of a relay mix with the
bulletin's. Outcomes are counted in ``stitch_sidecar_relay_fetches{relay,outcome}`` and blobs the bulletin served
after every relay failed in ``stitch_sidecar_relay_fallbacks``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import BlobMismatchError, BulletinError

from .metrics import SidecarMetrics

log = logging.getLogger("stitchboard.sidecar.relays")


@dataclass
class _Relay:
    url: str
    client: BulletinClient
    skip_until: float = 0.0  # monotonic seconds; 0: in use
    fetched: int = 0
    failed: int = 0
    last_error: str | None = None


class Relays:
    """The relays of one sidecar, asked in order for each blob before the bulletin (thread-safe).

    Args:
        urls: the relays' base URLs, in order (``STITCH_SIDECAR_RELAYS``).
        token: the bearer token sent to them (the sidecar's; the relay checks it with the bulletin).
        metrics: where outcomes go.
        timeout_s: connect/read timeout of one relay request, seconds.
        retry_s: seconds an unreachable relay is skipped (``relay_retry_s``).
        transport: an httpx transport instead of the network (tests).
    """

    def __init__(
        self,
        urls: list[str],
        token: str | None,
        metrics: SidecarMetrics,
        *,
        timeout_s: float = 30.0,
        retry_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._relays = [
            _Relay(url, BulletinClient(url, token, timeout_s=timeout_s, retries=0, transport=transport)) for url in urls
        ]
        self._metrics = metrics
        self._retry_s = retry_s
        self._lock = threading.Lock()
        for relay in self._relays:
            metrics.relay_up.labels(relay.url).set(1)

    def close(self) -> None:
        """Close the relays' connection pools."""
        for relay in self._relays:
            relay.client.close()

    def download(self, origin: BulletinClient, run: str, sha256: str, dest: Path, size_bytes: int) -> str:
        """Download blob ``sha256`` of ``run`` to ``dest``, verified: from the first relay that serves it right, else
        from ``origin``.

        Args:
            origin: the bulletin's client (the last source, whose errors are raised).
            run: run id.
            sha256: the blob's lowercase hex sha256.
            dest: the file to write (appears only once verified).
            size_bytes: the blob's size in bytes.

        Returns:
            The base URL of the source that served it (a relay's, or ``origin.url``).

        Raises:
            BulletinError: as :meth:`BulletinClient.download_blob` from the bulletin (``BlobMismatchError``,
                ``NotFoundError``, ``AuthError``, ``UnavailableError``).
        """
        part = dest.with_name(dest.name + ".part")  # download_blob's partial file
        for relay in self._ready():
            try:
                relay.client.download_blob(run, sha256, dest, size_bytes)
            except BlobMismatchError as exc:
                self._failed(relay, "corrupt", f"blob {sha256} of run {run!r} missed its sha256: {exc.message}")
            except BulletinError as exc:
                outcome = "unavailable" if exc.status >= 500 else "refused"
                self._failed(relay, outcome, f"{type(exc).__name__}: {exc.message}")
            else:
                with self._lock:
                    relay.fetched += 1
                self._metrics.relay_fetches.labels(relay.url, "ok").inc()
                return relay.url
            part.unlink(missing_ok=True)
        if self._relays:
            self._metrics.relay_fallbacks.inc()
        origin.download_blob(run, sha256, dest, size_bytes)
        return origin.url

    def _ready(self) -> list[_Relay]:
        now = time.monotonic()
        with self._lock:
            ready = [r for r in self._relays if r.skip_until <= now]
        for relay in ready:
            self._metrics.relay_up.labels(relay.url).set(1)
        return ready

    def _failed(self, relay: _Relay, outcome: str, error: str) -> None:
        with self._lock:
            relay.failed += 1
            relay.last_error = error
            if outcome == "unavailable":
                relay.skip_until = time.monotonic() + self._retry_s
        self._metrics.relay_fetches.labels(relay.url, outcome).inc()
        if outcome == "unavailable":
            self._metrics.relay_up.labels(relay.url).set(0)
        log.warning("relay %s: %s (%s); asking the next source", relay.url, error, outcome)

    def body(self) -> list[dict[str, Any]] | None:
        """The relays for ``/health``: per relay ``url``, ``up`` (false while skipped), ``fetched`` and ``failed``
        (blob downloads since start) and ``last_error``; None when no relay is configured."""
        if not self._relays:
            return None
        now = time.monotonic()
        with self._lock:
            return [
                {
                    "url": r.url,
                    "up": r.skip_until <= now,
                    "fetched": r.fetched,
                    "failed": r.failed,
                    "last_error": r.last_error,
                }
                for r in self._relays
            ]
