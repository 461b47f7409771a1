"""Fixtures of the real-vLLM engine tests (imported by this folder's conftest.py).

One vLLM server with the stitchboard worker extension serves the SmolLM2 checkpoint for the
whole session (start-up 45 s-3 min on 2 cores); tests bring it to the version they need by
loading a snapshot (~1 s) rather than restarting it. Real weight updates come from
:class:`tests.support.training.CpuTrainer` (two AdamW steps, ~10 s).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.vllm_server import VllmServer, require_vllm  # noqa: E402

from stitchboard.proto.checkpoint import save_checkpoint  # noqa: E402
from stitchboard.proto.codec import checksum  # noqa: E402
from stitchboard.proto.container import RawTensor  # noqa: E402

Views = dict[int, dict[str, RawTensor]]


def copy_model_files(model_dir: Path, folder: Path) -> None:
    """Copy a checkpoint folder's config and tokenizer files (everything but the weights)."""
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, folder / f.name)


def view_sums(view: dict[str, RawTensor]) -> dict[str, str]:
    """name -> xxh3-128 of every tensor of a view."""
    return {n: checksum(t) for n, t in view.items()}


@pytest.fixture(scope="session")
def vllm_views(smollm2_dir: Path) -> Views:
    """Served views of versions 0, 1, 2: the checkpoint, then after each of two real AdamW steps."""
    require_vllm()
    import torch
    from support.training import CpuTrainer

    def raw(view: dict) -> dict[str, RawTensor]:
        return {n: RawTensor("BF16", tuple(t.shape), t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)) for n, t in view.items()}

    trainer = CpuTrainer(smollm2_dir)
    views = {0: raw(trainer.served_view())}
    for v in (1, 2):
        trainer.step()
        views[v] = raw(trainer.served_view())
    return views


@pytest.fixture(scope="session")
def vllm_workdir() -> Iterator[Path]:
    """A session folder on memory-backed storage when there is one (the sidecar's hand-off folder)."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    folder = Path(tempfile.mkdtemp(prefix="stitch-vllm-", dir=base))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_engine(smollm2_dir: Path, vllm_workdir: Path) -> Iterator[VllmServer]:
    """The session's vLLM server (extension loaded) booted from the SmolLM2 checkpoint (version 0)."""
    require_vllm()
    server = VllmServer(smollm2_dir, vllm_workdir / "engine.log")
    try:
        server.wait_ready()
        server.boot_greedy = server.greedy()  # answers of a freshly loaded version 0
        yield server
    finally:
        server.stop()


@pytest.fixture
def vllm_adapter(vllm_engine: VllmServer):
    """A :class:`VllmEngine` adapter on the session engine."""
    from stitchboard.sidecar.engine import VllmEngine

    engine = VllmEngine(vllm_engine.url, timeout_s=30)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def vllm_snapshot(vllm_views: Views, vllm_workdir: Path) -> Callable[[int], list[str]]:
    """``snapshot(v)``: shard paths of version ``v``'s full checkpoint in the hand-off folder (written once)."""

    def snapshot(version: int) -> list[str]:
        folder = vllm_workdir / f"snapshot-v{version}"
        if not folder.exists():
            save_checkpoint(folder, vllm_views[version], max_shard_bytes=128 * 1024**2)
        return sorted(str(p) for p in folder.glob("*.safetensors"))

    return snapshot


@pytest.fixture(scope="session")
def vllm_fresh_greedy(smollm2_dir: Path, vllm_views: Views, vllm_workdir: Path) -> Callable[[int], list[dict]]:
    """``fresh(v)``: greedy answers of a fresh plain vLLM started from version ``v``'s full checkpoint (cached)."""
    answers: dict[int, list[dict]] = {}

    def fresh(version: int) -> list[dict]:
        if version not in answers:
            folder = vllm_workdir / f"checkpoint-v{version}"
            save_checkpoint(folder, vllm_views[version])
            copy_model_files(smollm2_dir, folder)
            server = VllmServer(folder, vllm_workdir / f"fresh-v{version}.log", extension=False)
            try:
                server.wait_ready()
                answers[version] = server.greedy()
            finally:
                server.stop()
        return answers[version]

    return fresh
