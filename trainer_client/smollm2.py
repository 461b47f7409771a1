"""Moved to :mod:`stitchboard.demo.smollm2` (the SmolLM2 test checkpoint is part of the demo, not the trainer SDK)."""

from stitchboard.demo.smollm2 import (
    CHECKPOINT_NAME,
    GGUF_FILENAME,
    build_smollm2_checkpoint,
    default_checkpoint_dir,
    smollm2_gguf_path,
)

__all__ = [
    "CHECKPOINT_NAME",
    "GGUF_FILENAME",
    "build_smollm2_checkpoint",
    "default_checkpoint_dir",
    "smollm2_gguf_path",
]
