"""vLLM general plugin (runs in every vLLM process: API server, engine core, workers): readers of
vLLM's shared-memory message queues nap between checks instead of spinning on ``sched_yield``.

vLLM's ``MessageQueue`` (``vllm.distributed.device_communicators.shm_broadcast``, 0.32) carries
every call from the engine core to its workers and every answer back. After each message a reader
waits for the next by checking the queue in a loop of ``sched_yield`` calls for ``busy_loop_s``
(1 s, fixed by vLLM); only then does it sleep on a zmq notification, a path vLLM itself calls lossy
(a lost notification is found by a re-check every 5 s). The sidecar checks its engine every
``engine_check_interval_s`` (1 s) with a ``collective_rpc``, so the worker's reader never left
that loop: on the 2-core CPU host, py-spy found the idle worker's main thread in it in 455 of its
546 on-CPU samples over 12 s of publishes, and the engine core's main thread in 115 of 599
(``docs/benchmarks.md``). The loop held a core that the trainer's publish and the engine's staging
threads needed.

With :data:`NAP_ENV` set (:func:`.launch.vllm_env` sets :data:`CPU_NAP_S` on a CPU host), a
reader inside its busy window sleeps that many seconds between checks instead of yielding: the
same checks of the same shared memory for the same second (no notification is relied on
sooner than vLLM relies on one), at a cost of at most one nap of latency per message. Readers
that do not busy-loop (vLLM's writers, idle readers) are unchanged. Unset, the plugin changes
nothing, so installing stitchboard beside vLLM leaves other engines as they are.

Registered as the ``vllm.general_plugins`` entry point ``stitchboard_queue_nap``
(``pyproject.toml``). vLLM loads general plugins in its server and, before either waits on a
queue, in its engine core and each worker; forked from the server, those inherit the nap. Each
process with the nap prints :data:`NAP_FLAG_LINE` once.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from stitchboard.proto.env import env_setting

#: Seconds a vLLM message-queue reader sleeps between checks in its busy window (unset: vLLM's own yields).
NAP_ENV = "STITCH_VLLM_QUEUE_NAP_S"
#: The nap on a CPU host, seconds: a fraction of a CPU decode step (tens of ms for SmolLM2 on 2 cores).
CPU_NAP_S = "0.0005"
#: Start of the stderr line each vLLM process prints once the plugin is in place.
NAP_FLAG_LINE = "stitchboard: vLLM message-queue readers nap"


class QueueNapSettingError(ValueError):
    """:data:`NAP_ENV` is not a number of seconds in (0, 0.1] (the engine does not start)."""


def nap_s(environ: Mapping[str, str] | None = None) -> float | None:
    """The nap :data:`NAP_ENV` asks for, seconds; None when unset or empty.

    Raises:
        QueueNapSettingError: not a number in (0, 0.1]; names the variable and the value.
    """
    value = (env_setting(NAP_ENV, environ) or "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= 0.1:  # also refuses nan
        raise QueueNapSettingError(f"{NAP_ENV}={value!r}: expected seconds in (0, 0.1], e.g. {CPU_NAP_S}")
    return seconds


def set_queue_nap() -> None:
    """The plugin: readers in their busy window sleep :func:`nap_s` seconds between checks (nothing when unset).

    Idempotent (vLLM may load plugins more than once in a process). A vLLM whose ``SpinCondition`` lacks the
    ``wait``, ``last_read`` and ``busy_loop_s`` this relies on is left as it is, with a line on stderr.

    Raises:
        QueueNapSettingError: :data:`NAP_ENV` is malformed.
    """
    seconds = nap_s()
    if seconds is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    cls: Any = getattr(shm_broadcast, "SpinCondition", None)
    if cls is not None and "_stitch_nap_s" in vars(cls):  # patched by an earlier load
        cls._stitch_nap_s = seconds
        return
    source = getattr(getattr(cls, "wait", None), "__code__", None)
    if source is None or not {"last_read", "busy_loop_s"} <= set(source.co_names):
        print(f"stitchboard: {NAP_ENV} ignored: this vLLM's SpinCondition.wait is not the one of 0.32", file=sys.stderr)
        return
    original = cls.wait

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(cls._stitch_nap_s)  # the caller checks the queue again, as after vLLM's sched_yield
            return
        original(self, timeout_ms)

    wait.__doc__ = original.__doc__
    cls._stitch_nap_s = seconds
    cls.wait = wait
    _say_in_place()
    os.register_at_fork(after_in_child=_say_in_place)  # vLLM forks its engine core and workers from here


def _say_in_place() -> None:
    """One line on stderr per process that has the nap (the server, and each process forked from it)."""
    from vllm.distributed.device_communicators import shm_broadcast

    seconds = vars(shm_broadcast.SpinCondition).get("_stitch_nap_s")
    print(f"{NAP_FLAG_LINE} {seconds:g} s between checks (pid {os.getpid()})", file=sys.stderr, flush=True)
