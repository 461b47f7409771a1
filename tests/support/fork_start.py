"""Run vLLM's or SGLang's server with its child processes forked instead of spawned (tests only).

Run as ``python tests/support/fork_start.py vllm|sglang <server args>``:
:class:`tests.support.vllm_server.VllmServer` and :class:`tests.sidecar.sglang_helpers.SglangServer`
start their servers through it on a CPU host. It runs the same server module with the same
arguments (``vllm.entrypoints.openai.api_server``, ``sglang.launch_server``); the one change is
the start method of the processes each server makes: vLLM's CPU platform sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` when it checks its config, and SGLang calls
``multiprocessing.set_start_method("spawn", force=True)`` before it starts its schedulers. A
spawned child starts a new interpreter that imports torch and the engine again (~15 s each on
the 2-core test host); a forked one starts from the parent's already imported modules.

Measured on the 2-core test host (SmolLM2-135M, warm file cache): vLLM TP 1 ready in 22 s
forked vs 48 s spawned, TP 3 in 29 s vs 58 s; SGLang TP 1 in 24 s vs 35 s, TP 2 53 s vs 51 s
(its start is SGLang's TP-only ``torch.compile`` of the vocab mask there). Greedy answers with
top-5 logprobs were bitwise equal both ways at every size tried, as the oracle tests need.

Spawn is the engines' choice for GPU hosts (a forked child cannot use the CUDA its parent
initialised); neither parent touches an accelerator on a CPU host, so there the fork is only a
faster start. The product (``stitchboard demo``, deploy/) starts the engines their own way.

One more difference: OpenMP reads its environment once, when torch loads. vLLM sets each CPU
worker's ``OMP_NUM_THREADS`` and thread binding in the environment just before it starts the
worker (on the 2-core hosts: one thread on core 0, core 1 left to the engine core); a spawned
worker reads them, a forked one keeps its parent's (one thread per core, unbound). Its OpenMP
threads therefore share the cores with the busy-polling engine core, which is where
``OMP_WAIT_POLICY=PASSIVE`` (:data:`stitchboard.sidecar.engines.launch.CPU_ENGINE_ENV`, read
before the fork) matters most; it is right for spawned workers too.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys

#: The server module each engine's command runs (``-m``).
MODULES = {"vllm": "vllm.entrypoints.openai.api_server", "sglang": "sglang.launch_server"}


def _fork_vllm() -> None:
    """Keep vLLM's start method ``fork``."""
    from vllm.platforms import cpu

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    original = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: object) -> None:
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # the CPU platform has just set spawn

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign, assignment]


def _fork_sglang() -> None:
    """Make SGLang's ``set_start_method("spawn", force=True)`` set ``fork``."""
    set_start_method = multiprocessing.set_start_method

    def forked(method: str | None, force: bool = False) -> None:
        set_start_method("fork", force=True)

    multiprocessing.set_start_method = forked  # type: ignore[assignment]


def forked_argv(argv: list[str], engine: str) -> list[str]:
    """``argv`` of an engine server (``python -m <module> ...``) run through this file on a CPU
    host; any other command (another module, e.g. the FP8 server's, or a host with CUDA) unchanged.

    Args:
        argv: the server's command, as :func:`~stitchboard.sidecar.engines.vllm.launch.vllm_command`
            or :func:`~stitchboard.sidecar.engines.sglang.launch.sglang_command` make it.
        engine: ``vllm`` or ``sglang``.
    """
    from stitchboard.sidecar.engines.launch import cpu_host

    if argv[1:3] != ["-m", MODULES[engine]] or not cpu_host():
        return argv
    return [argv[0], __file__, engine, *argv[3:]]


if __name__ == "__main__":
    del sys.path[0]  # this folder (a script's own): its modules must not shadow the engine's imports
    engine = sys.argv.pop(1)
    {"vllm": _fork_vllm, "sglang": _fork_sglang}[engine]()
    runpy.run_module(MODULES[engine], run_name="__main__", alter_sys=True)
