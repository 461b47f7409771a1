"""The vLLM general plugin whose message-queue readers nap instead of spinning (:mod:`..engines.vllm.queue_nap`).

The setting's parsing and the launcher's environment here; the plugin itself in a fresh interpreter (it
patches a vLLM class), found through vLLM's own plugin loader. That a real server's engine core and
worker nap after a call is checked on their CPU time in ``test_vllm_cpu_env.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from stitchboard.sidecar.engines.vllm.launch import vllm_env
from stitchboard.sidecar.engines.vllm.queue_nap import CPU_NAP_S, NAP_ENV, NAP_FLAG_LINE, QueueNapSettingError, nap_s
from tests.support.vllm_server import vllm_importable


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, None), ("", None), (" ", None), ("0.0005", 0.0005), ("0.1", 0.1)]
)
def test_the_setting_reads_seconds(value: str | None, seconds: float | None):
    assert nap_s({} if value is None else {NAP_ENV: value}) == seconds


@pytest.mark.parametrize("value", ["0", "-1", "0.5", "nan", "inf", "soon"])
def test_a_malformed_setting_is_refused_by_name(value: str):
    with pytest.raises(QueueNapSettingError, match=NAP_ENV):
        nap_s({NAP_ENV: value})


def test_a_cpu_engine_starts_with_readers_that_nap():
    assert vllm_env(cpu=True)[NAP_ENV] == CPU_NAP_S
    assert NAP_ENV not in vllm_env(cpu=False)


PROBE = """
import os, time, zmq
from vllm.plugins import load_general_plugins, load_plugins_by_group
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
assert "stitchboard_queue_nap" in load_plugins_by_group("vllm.general_plugins")
load_general_plugins()
from stitchboard.sidecar.engines.vllm.queue_nap import set_queue_nap
set_queue_nap()  # a second load changes nothing
reader = SpinCondition(True, zmq.Context(), "ipc:///tmp/stitch-queue-nap-probe")
reader.last_read = time.monotonic()  # inside its busy window: 200 waits
naps, sleep = [], time.sleep
time.sleep = lambda s: (naps.append(s), sleep(s))[1]  # counts the naps (the plugin calls time.sleep)
t, c = time.perf_counter(), time.process_time()
for _ in range(200):
    reader.wait()
wall, cpu = time.perf_counter() - t, time.process_time() - c
time.sleep = sleep
print(f"{wall:.4f} {cpu:.4f} {len(naps)}")
pid = os.fork()  # a forked child says it has the nap too
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
"""


@pytest.mark.slow  # starts an interpreter that imports vLLM (docs/testing.md, the slow tier)
@pytest.mark.skipif(not vllm_importable(), reason="vLLM is not importable in this interpreter")
@pytest.mark.parametrize("value", ["0.002", None])
def test_readers_in_their_busy_window_nap_between_checks(monkeypatch: pytest.MonkeyPatch, value: str | None):
    if value is None:
        monkeypatch.delenv(NAP_ENV, raising=False)
    else:
        monkeypatch.setenv(NAP_ENV, value)
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    wall, cpu, naps = map(float, done.stdout.split("\n")[-2].split())
    if value is None:  # vLLM's sched_yield loop: no nap (its wall time is the host's load, not asserted)
        assert naps == 0 and done.stderr.count(NAP_FLAG_LINE) == 0, (naps, done.stderr)
    else:  # 200 naps of 2 ms: at least 0.4 s asleep, a small part of it on the CPU
        assert naps == 200 and wall >= 0.4 and cpu < wall / 4, (naps, wall, cpu)
        assert done.stderr.count(NAP_FLAG_LINE) == 2, done.stderr  # this process once (two loads), its child once
