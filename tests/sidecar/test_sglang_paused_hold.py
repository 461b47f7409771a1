"""The stager's hold on SGLang's paused scheduler loop (:mod:`stitchboard.sidecar.engines.sglang.paused_hold`).

A thread calling the hook the way SGLang's paused event loop calls the wrapped method (once per
iteration, again at once) stands in for the scheduler thread; the hold itself is the code under
test. The real server's loop is held in the SGLang engine tests (every commit by the stager).
"""

from __future__ import annotations

import threading
import time

import pytest

from stitchboard.sidecar.engines.sglang import paused_hold


class PausedLoop(threading.Thread):
    """Iterates as SGLang's paused scheduler loop does, counting its iterations and flushes."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.iterations = self.flushes = 0
        self.stop = False

    def flush_cache(self) -> bool:
        self.flushes += 1
        return True

    def run(self) -> None:
        while not self.stop:
            paused_hold._park(self)
            self.iterations += 1


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(paused_hold, "_installed", True)
    running = PausedLoop()
    running.start()
    yield running
    running.stop = True
    paused_hold.release()
    running.join(5)


def test_a_hold_stops_the_paused_loop_until_released(loop: PausedLoop) -> None:
    deadline = time.monotonic() + 5
    while loop.iterations == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.iterations > 0
    assert not paused_hold.flush_cache()  # no hold: nothing is flushed from outside the loop
    assert paused_hold.hold(5.0)
    held_at = loop.iterations
    time.sleep(0.05)
    assert loop.iterations == held_at, "the paused loop ran on during the hold"
    assert paused_hold.flush_cache() and loop.flushes == 1
    paused_hold.release()
    time.sleep(0.05)
    assert loop.iterations > held_at
    assert not paused_hold.flush_cache() and loop.flushes == 1


def test_install_wraps_the_paused_loop_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """install() wraps SGLang's method in place (a stand-in Scheduler class here: the vLLM test
    environment has no SGLang); the wrapped method parks, then runs the original."""
    import sys
    import types

    calls: list[str] = []

    class Scheduler:
        def _record_scheduler_state_for_paused_engine(self) -> None:
            calls.append("original")

    module = types.ModuleType("sglang.srt.managers.scheduler")
    module.Scheduler = Scheduler  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.scheduler", module)
    monkeypatch.setattr(paused_hold, "_installed", False)
    assert paused_hold.install()
    Scheduler()._record_scheduler_state_for_paused_engine()
    assert calls == ["original"]


def test_the_paused_loop_sleeps_between_iterations(loop: PausedLoop) -> None:
    start = loop.iterations
    time.sleep(0.1)
    assert loop.iterations - start <= 0.1 / paused_hold.PAUSED_POLL_S + 1  # a spinning loop runs ~10^5 times


def test_no_hold_without_a_paused_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paused_hold, "_installed", True)
    t = time.perf_counter()
    assert not paused_hold.hold(0.1)  # nothing reaches the paused branch: the engine is not paused
    assert time.perf_counter() - t >= 0.1
    paused_hold.release()


def test_no_hold_where_the_hook_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paused_hold, "_installed", False)
    assert not paused_hold.hold(5.0)
    paused_hold.release()
