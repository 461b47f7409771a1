"""The vLLM command line: FP8 per-channel checkpoints run through the oneDNN-off server module.

That the flag reaches the spawned engine core and worker of a real server is checked in
``test_vllm_fp8.py`` (the engine log's lines); here the choice of module and the flag itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stitchboard.sidecar.engines.vllm.launch import (
    FP8_FLAG_LINE,
    FP8_SERVER_MODULE,
    VLLM_SERVER_MODULE,
    is_fp8_channel_checkpoint,
    vllm_command,
)
from stitchboard.trainer_client.recipes import get_recipe

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}


def _checkpoint(folder: Path, served: str | None) -> Path:
    folder.mkdir()
    data = json.dumps(CONFIG).encode()
    (folder / "config.json").write_bytes(get_recipe(served).config_json(data) if served else data)
    return folder


@pytest.mark.parametrize(
    ("served", "fp8"), [("fp8", True), ("bf16", False), ("fp8-block", False), ("nvfp4", False), (None, False)]
)
def test_only_the_fp8_channel_view_uses_the_fp8_server_module(tmp_path: Path, served: str | None, fp8: bool):
    model = _checkpoint(tmp_path / "m", served)
    assert is_fp8_channel_checkpoint(model) is fp8
    argv = vllm_command(model, 8000)
    assert argv[1:3] == ["-m", FP8_SERVER_MODULE if fp8 else VLLM_SERVER_MODULE]
    assert argv[argv.index("--model") + 1] == str(model)


def test_missing_or_broken_config_is_not_fp8(tmp_path: Path):
    assert not is_fp8_channel_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert not is_fp8_channel_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    assert not is_fp8_channel_checkpoint(tmp_path)


@pytest.mark.slow  # starts a process (docs/testing.md, the slow tier)
def test_importing_the_server_module_turns_onednn_off():
    code = (
        f"import torch; assert torch.backends.mkldnn.enabled; import {FP8_SERVER_MODULE}; "
        "print(torch.backends.mkldnn.enabled)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
    assert f"{FP8_FLAG_LINE} in MainProcess" in done.stderr


def test_an_adapter_engine_gets_lora_slots_and_runtime_adapter_routes(tmp_path: Path):
    from stitchboard.sidecar.engines.vllm.launch import LORA_ENV, vllm_env

    model = _checkpoint(tmp_path / "m", None)
    plain = vllm_command(model, 8000)
    assert "--enable-lora" not in plain and LORA_ENV.keys().isdisjoint(vllm_env(cpu=True))
    argv = vllm_command(model, 8000, max_loras=3, max_lora_rank=32)
    assert argv[len(plain) :] == [
        "--enable-lora", "--max-loras", "3", "--max-cpu-loras", "3", "--max-lora-rank", "32",
    ]  # fmt: skip
    assert vllm_env(cpu=True, lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
