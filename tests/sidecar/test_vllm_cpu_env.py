"""A CPU engine's OpenMP threads sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``), and its
message-queue readers nap instead of spinning after a call (``STITCH_VLLM_QUEUE_NAP_S``,
sidecar/engines/vllm/queue_nap.py), in a real vLLM server as the tests, benchmarks and demo
start it (sidecar/engines/launch.py).

Spinning OpenMP threads of vLLM's worker held cores that its own main thread and the engine
core needed on the 2-core hosts: 11 of 40 commit pauses took 0.15-0.49 s against a median of
0.08 s, 74 % of the worker's samples in them in libgomp's spin-wait (docs/benchmarks.md).
"""

from __future__ import annotations

import time

import psutil

from stitchboard.sidecar.engines.launch import CPU_ENGINE_ENV, engine_env
from stitchboard.sidecar.engines.vllm.launch import vllm_env
from stitchboard.sidecar.engines.vllm.queue_nap import NAP_FLAG_LINE
from tests.support.vllm_server import VllmServer


def test_an_engine_on_the_cpu_starts_with_passive_openmp_threads_and_one_on_a_gpu_without():
    assert CPU_ENGINE_ENV == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_env(cpu=True) == CPU_ENGINE_ENV
    assert engine_env(cpu=False) == {}
    for tp in (1, 3):
        assert vllm_env(tp, cpu=True)["OMP_WAIT_POLICY"] == "PASSIVE"
        assert "OMP_WAIT_POLICY" not in vllm_env(tp, cpu=False)


def test_a_real_cpu_vllm_server_loads_openmp_with_passive_threads(vllm_engine: VllmServer):
    """The server process was started with the setting and has libgomp loaded, so libgomp read
    it there; its engine core and worker are forked from it after that (``tests/support/fork_start.py``;
    their ``/proc/<pid>/environ`` is overwritten by vLLM's process titles, so it is not read here)."""
    server = psutil.Process(vllm_engine.proc.pid)
    assert server.environ().get("OMP_WAIT_POLICY") == "PASSIVE"
    assert any("libgomp" in m.path for m in server.memory_maps())
    assert len(server.children(recursive=True)) >= 2, "expected the engine core and the worker"


def test_after_a_call_the_engine_core_and_worker_nap_instead_of_spinning(vllm_engine: VllmServer):
    """vLLM's queue readers would spin on ``sched_yield`` for a second after the call (the worker's and the
    engine core's: about a core each on an idle host); napping, they spend a small part of that second on the
    CPU. Each of the three processes says it has the nap in the engine log."""
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine

    children = psutil.Process(vllm_engine.proc.pid).children(recursive=True)

    def cpu_s() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in children)

    adapter = VllmEngine(vllm_engine.url, timeout_s=120)
    try:
        adapter.state()  # a collective_rpc: the engine core sends it to the worker and reads its answer
        before = cpu_s()
        time.sleep(0.8)
        spent = cpu_s() - before
    finally:
        adapter.close()
    assert spent < 0.3, f"the engine core and worker spent {spent:.2f} CPU-s in the 0.8 s after a call"
    lines = vllm_engine.log_path.read_text(errors="replace").count(NAP_FLAG_LINE)
    assert lines >= 3, f"{lines} processes say they have the nap; expected the server, engine core and worker"
