"""A CPU engine's OpenMP threads sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``), in a real
vLLM server as the tests, benchmarks and demo start it (sidecar/engines/launch.py).

Spinning OpenMP threads of vLLM's worker held cores that its own main thread and the engine
core needed on the 2-core hosts: 11 of 40 commit pauses took 0.15-0.49 s against a median of
0.08 s, 74 % of the worker's samples in them in libgomp's spin-wait (docs/benchmarks.md).
"""

from __future__ import annotations

import psutil

from stitchboard.sidecar.engines.launch import CPU_ENGINE_ENV, engine_env
from stitchboard.sidecar.engines.vllm.launch import vllm_env
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
