"""Long-poll store reads: waiters arriving together share one read of the latest version."""

from __future__ import annotations

import asyncio
import threading

from stitchboard.bulletin.errors import UnavailableError
from stitchboard.bulletin.longpoll import Watcher
from stitchboard.bulletin.metrics import BulletinMetrics
from stitchboard.proto.schema import VersionInfo


class SlowLedger:
    """A ledger seam whose ``latest`` takes ``delay_s`` and counts its calls (the store read under test)."""

    def __init__(self, info: VersionInfo | None, delay_s: float = 0.05, fail: bool = False) -> None:
        self.info, self.delay_s, self.fail = info, delay_s, fail
        self.calls = 0
        self._lock = threading.Lock()

    def latest(self, run: str) -> VersionInfo | None:
        with self._lock:
            self.calls += 1
        threading.Event().wait(self.delay_s)
        if self.fail:
            raise UnavailableError(f"the store is down (test, run {run!r})")
        return self.info

    def exists(self, run: str, version: int) -> bool:
        return True


#: The watcher's gauges (a store-less registry: only the waiters gauge and latest_version are used).
METRICS = BulletinMetrics(None)  # type: ignore[arg-type]


def info(version: int) -> VersionInfo:
    return VersionInfo(run_id="r", version=version, snapshot=version == 0, manifest_sha256="0" * 64)


def test_waiters_arriving_together_share_one_read():
    ledger = SlowLedger(info(3))

    async def main() -> list[VersionInfo | None]:
        watcher = Watcher(ledger, poll_interval_s=10.0, metrics=METRICS)
        try:
            return await asyncio.gather(*(watcher.wait("r", after=2, wait_s=1.0) for _ in range(200)))
        finally:
            await watcher.close()

    answers = asyncio.run(main())
    assert [a.version if a else None for a in answers] == [3] * 200
    assert ledger.calls == 1


def test_a_failed_shared_read_reaches_every_waiter_and_the_next_wait_reads_again():
    ledger = SlowLedger(None, fail=True)

    async def main() -> tuple[list[object], int]:
        watcher = Watcher(ledger, poll_interval_s=10.0, metrics=METRICS)
        try:
            results = await asyncio.gather(
                *(watcher.wait("r", after=-1, wait_s=0.1) for _ in range(20)), return_exceptions=True
            )
            ledger.fail, ledger.info = False, info(0)
            again = await watcher.wait("r", after=-1, wait_s=0.1)
            return list(results), again.version if again else -1
        finally:
            await watcher.close()

    results, again = asyncio.run(main())
    assert all(isinstance(r, UnavailableError) for r in results) and len(results) == 20
    assert again == 0 and ledger.calls == 2


def test_a_waiter_that_leaves_does_not_cancel_the_others_read():
    ledger = SlowLedger(info(1), delay_s=0.2)

    async def main() -> VersionInfo | None:
        watcher = Watcher(ledger, poll_interval_s=10.0, metrics=METRICS)
        try:
            first = asyncio.create_task(watcher.wait("r", after=0, wait_s=1.0))
            second = asyncio.create_task(watcher.wait("r", after=0, wait_s=1.0))
            await asyncio.sleep(0.05)
            first.cancel()  # its client went away mid-read
            return await second
        finally:
            await watcher.close()

    assert asyncio.run(main()).version == 1
    assert ledger.calls == 1
