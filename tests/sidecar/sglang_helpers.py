"""A real SGLang server (CPU) for the SGLang tests and benchmarks, started from .venv-sglang.

:class:`SglangServer` starts :func:`stitchboard.sidecar.engines.sglang.launch.sglang_command`
(stitchboard's loader registered unless ``loader=False``) on a free loopback port, TP = 1 or 2,
and waits for ``/health`` (its schedulers forked, not spawned, on a CPU host:
:mod:`tests.support.fork_start`). Every server gets its own ``sgl_kernel`` stand-in call log
(deploy/sglang_cpu): :meth:`SglangServer.stop` fails the test when the stand-in was called.
``make test`` builds .venv-sglang (``make venv-sglang``); without it the tests skip, except under
CI (``CI`` set), where they fail. Start-up on 2 cores with SmolLM2-135M: ~25-50 s at TP = 1,
~55-110 s at TP = 2.

Fixtures (import them into a test module): ``sglang_engine`` (the TP = 1 server with the loader
on the SmolLM2 checkpoint that the SGLang test modules share: :class:`SharedSglang`; each module
gets it at version 0's bits) and ``shared_sglang`` (for a module that starts other servers beside it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stitchboard.demo.engines import greedy
from stitchboard.demo.processes import ManagedProcess, free_port
from stitchboard.sidecar.engines.launch import engine_nice
from stitchboard.sidecar.engines.sglang.launch import sglang_command, sglang_env, sglang_python
from tests.support import lease
from tests.support.fork_start import forked_argv
from tests.support.shm import remove_orphaned_shm
from tests.support.vllm_server import PROMPTS


def require_sglang() -> None:
    """Skip the calling test when .venv-sglang is missing, except under CI (``CI`` set): fail there."""
    if os.access(sglang_python(), os.X_OK):
        return
    message = f"no SGLang environment at {sglang_python()}: `make venv-sglang` builds it (`make test` does)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


class SglangServer(ManagedProcess):
    """One SGLang server subprocess (stopped with :meth:`stop`).

    Args:
        model_dir: HF checkpoint folder.
        log_path: file receiving the server's output; the stand-in's call log goes next to it.
        tp: tensor-parallel size (1 or 2 on this host).
        loader: register stitchboard's custom weight loader (a plain server for oracles: False).
        env: extra environment variables (e.g. ``STITCH_ENGINE_FAULT_PHASE``).
        port: the TCP port (default: a free one), e.g. a killed server's to start it again.

    Attributes:
        url, port, model (the served model name: ``model_dir`` as a string), stub_log.
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        tp: int = 1,
        loader: bool = True,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        self.stub_log = log_path.with_suffix(".sgl_kernel_calls")
        argv = forked_argv(sglang_command(model_dir, self.port, tp=tp, loader=loader), "sglang")
        super().__init__(
            f"sglang-tp{tp}",
            argv,
            log_path,
            f"{self.url}/health",
            env={**sglang_env(tp, self.stub_log), **(env or {})},
            nice=engine_nice(),
        )

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait until ``/health`` answers 200 (raises ``DemoError`` with the log's tail otherwise)."""
        self.wait_healthy(timeout_s)

    def greedy(self, max_tokens: int = 8) -> list[dict]:
        """Greedy completions with top-5 logprobs of the oracle prompts, one request at a time."""
        return greedy(self.url, model=self.model, prompts=PROMPTS, max_tokens=max_tokens)

    def stub_calls(self) -> list[str]:
        """Lines the ``sgl_kernel`` stand-in recorded (each one a call that raised)."""
        return self.stub_log.read_text().splitlines() if self.stub_log.exists() else []

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the server (then remove the shared memory that ended engines left: :mod:`tests.support.shm`);
        fail if the ``sgl_kernel`` stand-in was ever called."""
        super().stop(grace_s)
        remove_orphaned_shm()
        calls = self.stub_calls()
        assert not calls, (
            f"SGLang called the sgl_kernel stand-in {len(calls)} times (first: {calls[0]}): a stub stood in for work"
        )


@pytest.fixture(scope="module")
def sglang_workdir() -> Iterator[Path]:
    """A module folder on memory-backed storage when there is one (logs, hand-off, records)."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    folder = Path(tempfile.mkdtemp(prefix="stitch-sglang-", dir=base))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class SharedSglang:
    """The SGLang server (TP = 1, loader registered) on the SmolLM2 checkpoint that the SGLang test
    modules share: a start costs 35-70 s on 2 cores, four modules need one, and it started once
    per module took ~2 minutes of CI.

    :meth:`take` starts it, or hands the running one to the next module at version 0's bits: a
    snapshot load of the checkpoint through the loader, which records version 0 (what a sidecar
    with ``--boot-version 0`` verifies and records on a fresh server), then the prefix cache
    flushed; a test that leaves it paused or holding no verified version is covered, as the load
    runs inside a pause/resume of its own. A server that died (or was killed by a test) is
    started again. :meth:`release` stops it (the ``shared_sglang`` fixture does when a module
    that is not an SGLang one starts, so it never idles beside the vLLM engines).

    Args:
        folder: where its logs and the reset's loader records go.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.server: SglangServer | None = None
        self.starts = 0

    def take(self, model_dir: Path) -> SglangServer:
        """The shared server at version 0's bits of ``model_dir`` (started if none runs)."""
        if self.server is not None and self.server.proc.poll() is not None:
            self.release()
        if self.server is None:
            self.starts += 1
            server = SglangServer(model_dir, self.folder / f"engine-{self.starts}.log")
            try:
                server.wait_ready()
            except BaseException:
                server.stop()
                raise
            self.server = server
            return server
        from stitchboard.sidecar.engines.sglang.adapter import SglangEngine

        adapter = SglangEngine(self.server.url, self.folder / "reset-records", timeout_s=120)
        try:
            with lease.holding(adapter, "sglang-reset"):
                adapter.pause()
                try:
                    adapter.load_snapshot([str(model_dir / "model.safetensors")], 0)
                    adapter.reset_prefix_cache()
                finally:
                    adapter.resume()
        finally:
            adapter.close()
        return self.server

    def release(self) -> None:
        """Stop the server, if one runs (failing if the ``sgl_kernel`` stand-in was called)."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()


@pytest.fixture(scope="session")
def shared_sglang() -> Iterator[SharedSglang]:
    """The session's :class:`SharedSglang` (no server until a module takes it; stopped at the end)."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    shared = SharedSglang(Path(tempfile.mkdtemp(prefix="stitch-sglang-shared-", dir=base)))
    try:
        yield shared
    finally:
        shared.release()
        shutil.rmtree(shared.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def sglang_engine(smollm2_dir: Path, shared_sglang: SharedSglang) -> SglangServer:
    """The shared SGLang server (:class:`SharedSglang`) at version 0's bits of the SmolLM2 checkpoint."""
    require_sglang()
    return shared_sglang.take(smollm2_dir)
