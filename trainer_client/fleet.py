"""The trainer's view of the fleet: wait until enough replicas serve a version, and pace publishes on it.

:func:`wait_for_fleet` long-polls the bulletin's fleet route (``GET /v1/runs/{run}/fleet``)
until enough live replicas have applied a version. :class:`FleetPacing` is the publishers'
pacing option for async RL: before publishing version ``v`` it waits until enough replicas are
within ``max_lag`` versions of the newest version ``v - 1`` (applied >= ``v - 1 - max_lag``),
so rollouts are never more than ``max_lag + 1`` versions behind the weights being trained.
Both raise :class:`~.errors.FleetTimeoutError` naming the replicas that lag and why.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.fleet_client import FleetClient
from stitchboard.proto.fleet import FleetCount, describe_laggards

from .errors import FleetTimeoutError

log = logging.getLogger("stitchboard.trainer_client")

#: Longest single long-poll of a wait, seconds (the bulletin caps it at its ``max_wait_s`` too).
POLL_S = 30.0


def wait_for_fleet(
    client: BulletinClient,
    run: str,
    version: int,
    *,
    min_replicas: int | None = None,
    fraction: float | None = None,
    timeout_s: float = 300.0,
    what: str | None = None,
) -> FleetCount:
    """Block until enough live replicas of ``run`` have applied ``version`` or a later one.

    Args:
        client: the bulletin client (a token with ``read``).
        run, version: what to wait for.
        min_replicas: at least this many live replicas.
        fraction: at least this fraction of the live replicas (and at least one). With neither
            given: every live replica (``fraction=1.0``).
        timeout_s: give up after this many seconds.
        what: how the error message names the wait (default: "waiting for ...").

    Returns:
        The fleet's count once the requirement is met.

    Raises:
        FleetTimeoutError: not met within ``timeout_s``; names the replicas below ``version``
            (state and last error) and those whose lease expired.
        BulletinError: the bulletin failed (after the client's retries) or refused the query.
    """
    if min_replicas is None and fraction is None:
        fraction = 1.0
    fleet = FleetClient(client)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        count = fleet.count(
            run, version, min_replicas=min_replicas, fraction=fraction, wait_s=max(0.0, min(remaining, POLL_S))
        )
        if count.met:
            return count
        if time.monotonic() >= deadline:
            wanted = f"{count.needed} replicas" + (
                f" ({fraction:.0%} of {count.live} live)" if fraction is not None else ""
            )
            head = what or f"waiting for {wanted} of run {run!r} at version >= {version}"
            raise FleetTimeoutError(
                f"{head}: only {count.at_or_above} of {count.live} live replicas got there within {timeout_s:g} s; "
                f"lagging: {describe_laggards(count)}",
                run_id=run,
                version=version,
                needed=count.needed,
                at_or_above=count.at_or_above,
                live=count.live,
                laggards=[lag.replica_id for lag in count.laggards],
            )


@dataclass(frozen=True)
class FleetPacing:
    """The publishers' pacing option (``Publisher(..., pacing=FleetPacing(max_lag=1))``).

    Before publishing version ``v`` (> ``max_lag``), the publisher blocks until the required
    replicas have applied ``v - 1 - max_lag`` or later: ``max_lag=0`` waits for the whole
    previous version, ``max_lag=1`` lets one version be in flight while the fleet catches up.

    Attributes:
        max_lag: versions a replica may be behind the newest published version, >= 0.
        min_replicas, fraction: how many replicas must be that close (as :func:`wait_for_fleet`;
            neither: every live replica).
        timeout_s: how long a publish waits before raising :class:`FleetTimeoutError`, seconds.
    """

    max_lag: int = 1
    min_replicas: int | None = None
    fraction: float | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {self.max_lag}")

    def before_publish(self, client: BulletinClient, run: str, version: int) -> FleetCount | None:
        """Block until publishing ``version`` keeps the fleet within ``max_lag``; None when nothing needs waiting for.

        Raises:
            FleetTimeoutError: the fleet did not catch up within ``timeout_s``.
        """
        need = version - 1 - self.max_lag
        if need < 0:
            return None
        start = time.perf_counter()
        what = (
            f"publishing version {version} of run {run!r} with max_lag={self.max_lag} waits for replicas at "
            f"version >= {need}"
        )
        count = wait_for_fleet(
            client,
            run,
            need,
            min_replicas=self.min_replicas,
            fraction=self.fraction,
            timeout_s=self.timeout_s,
            what=what,
        )
        waited = time.perf_counter() - start
        if waited > 0.05:
            log.info(
                "run %s: version %d waited %.2f s for %d replicas at >= %d (max_lag %d)",
                run,
                version,
                waited,
                count.at_or_above,
                need,
                self.max_lag,
            )
        return count
