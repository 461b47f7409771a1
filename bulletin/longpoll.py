"""Long-polling for new versions: wake waiters on local publishes, poll the store for remote ones.

All waiters of a run share one :class:`asyncio.Event`; a publish through this process sets it
at once. Publishes through another bulletin process over the same store are seen by a
background task that re-reads the latest version of every run with waiters each
``poll_interval_s``. The answer for a version (body and headers) is built once and sent as it
is to every waiter (:class:`SharedAnswer`). Waiters that register how to send their answer
(:meth:`Watcher.register`, the fast path of :mod:`.longpoll_asgi`) are answered by one task, in
one pass, as soon as the version is known, before any of the thousands of waiting request
tasks is resumed: the last answer goes out after one send per waiter, and the requests finish
(timers, metrics) afterwards. A waiter whose client hangs up ends at once (:mod:`.hangup`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from anyio import to_thread
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from stitchboard.proto.schema import VersionInfo, canonical_json

from .cache_headers import NO_STORE
from .gc_hold import COLLECTOR
from .hangup import Hangup
from .ledger import Ledger
from .metrics import BulletinMetrics
from .whole_answer import WHOLE_ANSWER, WholeAnswer

log = logging.getLogger("stitchboard.bulletin")


class SharedAnswer(Response):
    """A JSON answer built once and sent to many requests: each send gets its own copy of the header list
    (a middleware may change its message's headers), the body bytes are shared; :attr:`whole` is the
    same answer for a request's whole-answer send (``http_protocol.send_whole``)."""

    def __init__(self, body: bytes) -> None:
        super().__init__(body, media_type="application/json", headers={"cache-control": NO_STORE})
        self.whole = WholeAnswer(self.status_code, self.raw_headers, body)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": list(self.raw_headers)})
        await send({"type": "http.response.body", "body": self.body})


class DirectWaiter:
    """A long-poll whose answer the :class:`Watcher` sends itself when a version newer than ``after`` is noted.

    Attributes:
        send: the request's ASGI ``send``; scope, receive: its scope and receive.
        whole: the request's whole-answer send (``http_protocol.send_whole``), None where the server offers none.
        after: the version the request is past.
        claimed: True once the watcher took over sending the answer (the request then awaits ``sent``).
        sent: done when the answer has been sent (or sending it failed).
    """

    __slots__ = ("after", "claimed", "receive", "scope", "send", "sent", "whole")

    def __init__(self, scope: Scope, receive: Receive, send: Send, after: int) -> None:
        self.scope, self.receive, self.send, self.after = scope, receive, send, after
        self.whole: Callable[[WholeAnswer], bool] | None = scope.get("extensions", {}).get(WHOLE_ANSWER)
        self.claimed = False
        self.sent: asyncio.Future[None] | None = None


class Watcher:
    """Tracks the latest version of watched runs and wakes their long-polls.

    Args:
        ledger: where latest versions are read from.
        poll_interval_s: seconds between store reads for runs that have waiters; also how
            old a cached latest version may be when a new waiter arrives.
        metrics: the ``waiters`` gauge and ``latest_version`` per run are kept here.
    """

    def __init__(self, ledger: Ledger, poll_interval_s: float, metrics: BulletinMetrics) -> None:
        self._ledger = ledger
        self._interval = poll_interval_s
        self._metrics = metrics
        self._latest: dict[str, VersionInfo] = {}
        self._answers: dict[str, SharedAnswer] = {}
        self._checked_at: dict[str, float] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = {}
        self._direct: dict[str, set[DirectWaiter]] = {}
        self._fan_outs: set[asyncio.Task[None]] = set()
        self._reads: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    def register(self, run: str, waiter: DirectWaiter) -> None:
        """Have the watcher send ``waiter``'s answer when a version of ``run`` newer than its ``after`` is noted (see
        :meth:`unregister`)."""
        self._direct.setdefault(run, set()).add(waiter)

    def unregister(self, run: str, waiter: DirectWaiter) -> None:
        """Forget ``waiter`` (its wait ended)."""
        waiters = self._direct.get(run)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._direct[run]

    async def _fan_out(self, answer: SharedAnswer, waiters: list[DirectWaiter]) -> None:
        for waiter in waiters:
            try:
                if waiter.whole is None or not waiter.whole(answer.whole):
                    await answer(waiter.scope, waiter.receive, waiter.send)
            except Exception as exc:  # noqa: BLE001 - a client gone mid-send must not stop the others' answers
                log.debug("sending a long-poll answer failed: %s", exc)
            finally:
                if waiter.sent is not None:
                    waiter.sent.set_result(None)

    def _fan_out_done(self, task: asyncio.Task[None]) -> None:
        self._fan_outs.discard(task)
        COLLECTOR.release()

    def note(self, info: VersionInfo | None) -> None:
        """Record a committed version (from a publish or a read); wakes waiters if it is newer. Loop thread only."""
        if info is None:
            return
        current = self._latest.get(info.run_id)
        if current is not None and current.version >= info.version:
            return
        self._latest[info.run_id] = info
        answer = self._answers[info.run_id] = SharedAnswer(canonical_json(info))
        self._metrics.latest_version.labels(info.run_id).set(info.version)
        ready = [w for w in self._direct.get(info.run_id, ()) if info.version > w.after and not w.claimed]
        if ready:  # one task answers them all; it runs before the woken request tasks resume
            loop = asyncio.get_running_loop()
            for w in ready:
                w.claimed, w.sent = True, loop.create_future()
            # no full collection over every connection's objects before the last answer (gc_hold.py)
            COLLECTOR.acquire()
            task = asyncio.create_task(self._fan_out(answer, ready))
            self._fan_outs.add(task)
            task.add_done_callback(self._fan_out_done)
        event = self._events.pop(info.run_id, None)
        if event is not None:
            event.set()

    def answer(self, run: str) -> SharedAnswer:
        """The answer (JSON body of the latest known version of ``run``) to send (call after :meth:`wait` returned
        it)."""
        return self._answers[run]

    async def _refresh(self, run: str) -> None:
        """Read the latest version of ``run`` from the store, one read per run at a time: waiters
        that arrive while a read is in flight share it (5,000 waiters re-registering after a
        publish made one store read each, as many GETs per publish on S3)."""
        read = self._reads.get(run)
        if read is None:
            read = self._reads[run] = asyncio.ensure_future(self._read(run))
            read.add_done_callback(lambda done: self._read_done(run, done))
        await asyncio.shield(read)  # one waiter leaving (client gone) does not cancel the others' read

    def _read_done(self, run: str, read: asyncio.Task[None]) -> None:
        if self._reads.get(run) is read:
            del self._reads[run]
        if not read.cancelled():
            read.exception()  # raised to every waiter that awaited it; marked seen if none is left

    async def _read(self, run: str) -> None:
        self._checked_at[run] = time.monotonic()
        info = await to_thread.run_sync(self._ledger.latest, run)
        current = self._latest.get(run)
        if (
            current is not None
            and (info is None or info.version < current.version)
            and not await to_thread.run_sync(self._ledger.exists, run, current.version)
        ):
            del (
                self._latest[run],
                self._answers[run],
            )  # the store no longer holds it (run deleted out of band): forget it
        self.note(info)

    @property
    def waiting(self) -> int:
        """The long-polls waiting now (every run)."""
        return sum(self._waiters.values())

    async def wait(self, run: str, after: int, wait_s: float, hangup: Hangup | None = None) -> VersionInfo | None:
        """The latest version of ``run`` once it is greater than ``after``, or ``None`` after ``wait_s`` seconds,
        or at once when ``hangup`` says the request's client hung up (check ``hangup.gone``).

        Raises:
            BulletinError: the store could not be read.
        """
        fresh = self._waiters.get(run, 0) > 0 and time.monotonic() - self._checked_at.get(run, -1e9) < self._interval
        if not fresh:
            await self._refresh(run)
        deadline = time.monotonic() + wait_s
        self._waiters[run] = self._waiters.get(run, 0) + 1
        self._metrics.waiters.inc()
        try:
            while True:
                current = self._latest.get(run)
                if current is not None and current.version > after:
                    return current
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (hangup is not None and hangup.gone):
                    return None
                if self._task is None or self._task.done():
                    self._task = asyncio.create_task(self._poll_forever())
                event = self._events.setdefault(run, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    async with (
                        asyncio.timeout(remaining) if hangup is None else hangup.within(remaining)
                    ):  # no extra task per waiter, unlike wait_for
                        await event.wait()
        finally:
            self._waiters[run] -= 1
            if not self._waiters[run]:
                del self._waiters[run]
            self._metrics.waiters.dec()

    async def _poll_forever(self) -> None:
        while self._waiters:
            await asyncio.sleep(self._interval)
            for run in list(self._waiters):
                try:
                    await self._refresh(run)
                except Exception as exc:  # noqa: BLE001 - a store hiccup must not end polling; the next round retries
                    log.warning("reading the latest version of run %r failed: %s", run, exc)

    async def close(self) -> None:
        """Stop the background poller and any store read in flight."""
        for read in list(self._reads.values()):
            read.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
