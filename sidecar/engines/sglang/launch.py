"""How stitchboard starts an SGLang server with its custom weight loader (demo, tests, benches).

SGLang runs in its own environment (``make venv-sglang`` builds ``.venv-sglang``: SGLang 0.5.23
needs torch 2.14.1, the vLLM environment has 2.13.0): :func:`sglang_python` finds its
interpreter. On a CPU host the server needs ``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``,
``--disable-overlap-schedule``, a bounded KV cache (``--max-total-tokens``), ``--sleep-on-idle``
(else an idle scheduler spins a core), ``SGLANG_NCCL_SO_PATH`` naming a file that does not
exist (else TP = 2 crashes loading the NCCL of the torch wheel) and, at TP = 2, one core per
rank (``SGLANG_CPU_OMP_THREADS_BIND``). Start-up with SmolLM2-135M on 2 cores: ~40 s at TP = 1,
90-110 s at TP = 2.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..launch import cpu_host
from .loader import LOADER_PATH

#: Environment variable naming the SGLang environment's interpreter (default: .venv-sglang of the checkout).
PYTHON_ENV = "STITCH_SGLANG_PYTHON"
#: The stand-in kernel's call log (deploy/sglang_cpu/sgl_kernel): any line in it fails the tests and the demo.
STUB_LOG_ENV = "STITCH_SGL_KERNEL_STUB_LOG"


def sglang_python() -> str:
    """The interpreter of the SGLang environment: ``$STITCH_SGLANG_PYTHON``, else the repository's
    ``.venv-sglang/bin/python`` (built by ``make venv-sglang``)."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        return configured
    return str(Path(__file__).resolve().parents[3] / ".venv-sglang" / "bin" / "python")


def sglang_command(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    tp: int = 1,
    loader: bool = True,
    served_model_name: str | None = None,
    python: str | None = None,
    cpu: bool | None = None,
) -> list[str]:
    """The argv of an SGLang server on ``127.0.0.1:port`` serving ``model_dir``.

    Args:
        model_dir: HF checkpoint folder (weights, config, tokenizer).
        port: TCP port on 127.0.0.1 (control routes must never be reachable from outside the host).
        tp: tensor-parallel ranks.
        loader: register stitchboard's custom weight loader (a plain engine for oracles: False).
        served_model_name: the model name clients send (default: ``model_dir``).
        python: interpreter with SGLang installed (default :func:`sglang_python`).
        cpu: run SGLang's CPU engine with the settings above (default :func:`cpu_host`); False
            leaves device, scheduling and KV cache size to SGLang (a CUDA host).
    """
    cmd = [
        python or sglang_python(), "-m", "sglang.launch_server", "--model-path", str(Path(model_dir)), "--host",
        "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--tp", str(tp),
    ]  # fmt: skip
    if cpu_host() if cpu is None else cpu:
        cmd += ["--device", "cpu", "--disable-overlap-schedule", "--max-total-tokens", "8192", "--sleep-on-idle"]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if loader:
        cmd += ["--custom-weight-loader", LOADER_PATH]
    return cmd


def sglang_env(tp: int = 1, stub_log: str | os.PathLike[str] | None = None, cpu: bool | None = None) -> dict[str, str]:
    """Environment variables for :func:`sglang_command` (to add to the current one); none on a
    CUDA host.

    Args:
        tp: as given to :func:`sglang_command`.
        stub_log: file the ``sgl_kernel`` stand-in records calls in (checked empty by the caller).
        cpu: as given to :func:`sglang_command`.
    """
    if not (cpu_host() if cpu is None else cpu):
        return {}
    env = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_NCCL_SO_PATH": "/nonexistent/stitchboard-no-nccl/libnccl.so.2"}
    if tp > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % max(1, os.cpu_count() or 1)) for r in range(tp))
    if stub_log is not None:
        env[STUB_LOG_ENV] = str(stub_log)
    return env
