"""This sidecar's hold on the engine's lease (sidecar process, the app's event loop).

An engine has one owner (``docs/reference/engine-lease.md``): the engine's own code keeps a lease
(:mod:`.engines.lease`) that a sidecar takes and renews through its adapter
(:meth:`~.engines.base.EngineAdapter.take_lease`). :class:`LeaseKeeper` is what the claim
(:mod:`.claim`) uses: one take (boot retries it while another sidecar holds the engine), one
renewal (the claim's watch, every ``lease_renew_interval_s``), the release at a clean stop, and
what ``/health`` and the metrics say of it. Lease calls run in a thread of their own, so a
renewal never waits behind a long engine call of the sidecar's own pool.

Held means: the last take or renewal was granted and no refusal came since. A renewal that is
refused loses the lease at once; one the engine does not answer loses it when the lease has
lapsed for sure (:meth:`LeaseKeeper.left_s`, from the time each take was sent), unless the sidecar's
own engine call is under way (the engine renews the holder's lease at the end of each of its calls,
and refuses every state-changing call of a sidecar without one, so nothing is lost by waiting).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .engines.base import EngineAdapter, LeaseGrant
from .errors import LeaseNotHeldError
from .metrics import SidecarMetrics
from .settings import SidecarSettings

log = logging.getLogger("stitchboard.sidecar")


def lease_owner(settings: SidecarSettings) -> str:
    """This sidecar's lease owner id: its replica id (else ``<host name>:<port>``) and a random
    part, so that an operator can tell which sidecar holds an engine and two starts of one
    replica are two owners."""
    return f"{settings.replica_id or f'{socket.gethostname()}:{settings.port}'}-{secrets.token_hex(4)}"


class LeaseKeeper:
    """Takes, renews and releases the engine's lease for this sidecar.

    Args:
        settings: ``lease_ttl_s``, ``lease_renew_interval_s``, ``replica_id``, ``port``.
        engine: the engine adapter.
        metrics: ``stitch_sidecar_lease_held``, ``stitch_sidecar_lease_info``, ``stitch_sidecar_leases_lost_total``.

    Attributes:
        owner: this sidecar's owner id (:func:`lease_owner`).
        held: whether this sidecar holds the lease now.
        holder: the owner the engine named in its last refusal (None: none named yet, or held here).
    """

    def __init__(self, settings: SidecarSettings, engine: EngineAdapter, metrics: SidecarMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.owner = lease_owner(settings)
        self.held = False
        self.holder: str | None = None
        self._holder_until: float | None = None  # Unix seconds when the holder's lease lapses unless renewed
        self._until = 0.0  # time.monotonic() before which the lease is live for sure (own takes)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stitch-lease")
        self._publish()

    # -- bookkeeping -----------------------------------------------------------------------------

    def _publish(self) -> None:
        self.metrics.lease_held.set(1 if self.held else 0)
        self.metrics.lease.info({"owner": self.owner, "holder": (self.owner if self.held else self.holder) or ""})

    def _granted(self, grant: LeaseGrant) -> None:
        if not self.held:
            log.info("took the engine's lease as %s (TTL %g s)", self.owner, self.settings.lease_ttl_s)
        self.held, self.holder, self._holder_until = True, None, None
        self._until = max(self._until, grant.expires_at)
        self._publish()

    def _refused(self, exc: LeaseNotHeldError) -> str:
        # The engine refused this sidecar's take: note who holds it; returns why (a lost lease's reason).
        holder, left = exc.details.get("holder"), exc.details.get("expires_in_s")
        if holder != self.holder or self.held:
            log.warning("the engine's lease is held by %s (%s s left): this sidecar claims no version", holder, left)
        self.holder = holder if isinstance(holder, str) else None
        self._holder_until = time.time() + float(left) if isinstance(left, int | float) and holder else None
        return self._lose(f"the engine refused this sidecar's lease: {exc}")

    def _lose(self, reason: str) -> str:
        if self.held:
            self.held = False
            self.metrics.leases_lost.inc()
            log.warning("lost the engine's lease (%s): this sidecar stops claiming a version", reason)
        self._publish()
        return reason

    def left_s(self) -> float:
        """Seconds the lease is live for sure (negative: it may have lapsed): from this sidecar's
        takes and from any later answer of the engine the adapter saw (``known_lease``)."""
        known = self.engine.known_lease()
        until = max(self._until, known.expires_at if known is not None and known.owner == self.owner else 0.0)
        return until - time.monotonic()

    # -- calls -----------------------------------------------------------------------------------

    def _call(self) -> asyncio.Future[LeaseGrant]:
        call = asyncio.get_running_loop().run_in_executor(
            self._pool, self.engine.take_lease, self.owner, self.settings.lease_ttl_s
        )
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # an answer given up on is not an error
        return call

    async def take(self) -> None:
        """Take the lease (or renew it) once.

        Raises:
            LeaseNotHeldError: another sidecar holds it (noted: :attr:`holder`, ``/health``).
            EngineUnavailableError, EngineRequestError: the engine does not answer.
        """
        try:
            grant = await self._call()
        except LeaseNotHeldError as exc:
            self._refused(exc)
            raise
        self._granted(grant)

    async def renew(self, busy: Callable[[], bool]) -> str | None:
        """Renew the held lease once; returns why it is lost, or None while it is held.

        Lost: the engine refused the renewal (another sidecar took the engine), or the lease has
        lapsed for sure with the renewal unanswered or failed, while ``busy()`` is false (the
        sidecar's own engine call is not under way). A renewal that fails while the lease is live
        is tried again at the next renew interval.
        """
        call = self._call()
        while True:
            waiting = busy()
            try:
                grant = await asyncio.wait_for(
                    asyncio.shield(call),
                    self.settings.lease_renew_interval_s if waiting else max(self.left_s(), 0.0),
                )
            except LeaseNotHeldError as exc:
                return self._refused(exc)
            except TimeoutError:
                if busy() or self.left_s() > 0:
                    continue
                return self._lose(
                    f"the engine did not answer the renewal before the lease lapsed ({self.settings.lease_ttl_s:g} s "
                    "TTL)"
                )
            except Exception as exc:  # noqa: BLE001 - an engine that cannot renew backs no claim once the lease lapsed
                if busy() or self.left_s() > 0:
                    log.warning("renewing the engine's lease failed (%s s left): %r", round(self.left_s(), 3), exc)
                    return None
                return self._lose(f"renewing the lease failed and it lapsed: {type(exc).__name__}: {exc}")
            self._granted(grant)
            return None

    def lost(self, exc: LeaseNotHeldError) -> str:
        """The engine refused a call for want of this sidecar's lease (``exc``): not held any
        more; returns why. Its ``holder`` is noted when it names one."""
        if exc.details.get("holder") is not None:
            return self._refused(exc)
        return self._lose(str(exc))

    def release(self) -> None:
        """At a clean stop: end the lease in the engine, so that another sidecar takes the engine
        at once (a failure is logged: the lease then lapses after its TTL)."""
        if not self.held:
            return
        self.held = False
        self._publish()
        try:
            self.engine.release_lease(self.owner)
            log.info("released the engine's lease (%s)", self.owner)
        except Exception as exc:  # noqa: BLE001 - stopping anyway: the lease lapses after its TTL
            log.warning("could not release the engine's lease (it lapses in %g s): %r", self.settings.lease_ttl_s, exc)

    def close(self) -> None:
        """Release the lease thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- reporting -------------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        """The lease for ``/health``: ``owner`` (this sidecar), ``held``, ``holder`` (the owner the
        engine names, None while unknown) and ``holder_expires_in_s`` (seconds until that lease
        lapses unless renewed, None while unknown)."""
        if self.held:
            return {
                "owner": self.owner,
                "held": True,
                "holder": self.owner,
                "holder_expires_in_s": round(self.left_s(), 3),
            }
        left = None if self._holder_until is None else round(self._holder_until - time.time(), 3)
        return {"owner": self.owner, "held": False, "holder": self.holder, "holder_expires_in_s": left}

    def reason(self) -> str:
        """Why this sidecar claims no version while another sidecar (:attr:`holder`) holds the
        engine's lease (for ``/health``)."""
        left = self.body()["holder_expires_in_s"]
        lapses = f"its lease lapses in {left:g} s unless renewed" if left is not None else "its lease is live"
        return (
            f"the engine is held by {self.holder} ({lapses}): this sidecar claims no version and takes the engine "
            f"over once that lease lapses"
        )
