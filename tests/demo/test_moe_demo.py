"""The demo's MoE parts (stitchboard.demo.moe_demo): presets on ``--model``, the parity reward, the routing check."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import typer

from stitchboard.demo import moe_demo
from stitchboard.demo.cli import demo
from stitchboard.demo.moe_demo import RoutingShape, parity_reward, resolve_model
from stitchboard.demo.moe_models import moe_config


def _model(tmp_path: Path, arch: str) -> Path:
    folder = tmp_path / arch
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(moe_config(arch)))
    return folder


def _answer(ids: np.ndarray, prompt_tokens: int, completion_tokens: int, spans: list[dict] | None = None) -> dict:
    rows = prompt_tokens + completion_tokens - 1
    return {
        "sglext": {"routed_experts": base64.b64encode(ids.astype(np.int32).tobytes()).decode()},
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        "routed_experts_weight_versions": spans
        if spans is not None
        else [{"version": 0, "start": 0, "end": 2}, {"version": 1, "start": 2, "end": rows}],
    }


def test_parity_reward_has_spread_over_random_ids() -> None:
    assert parity_reward([2, 4, 7, 9]) == 0.5 and parity_reward([1, 3]) == 0.0 and parity_reward([]) == 0.0
    rng = np.random.default_rng(0)
    groups = [[parity_reward(rng.integers(0, 49152, 24).tolist()) for _ in range(4)] for _ in range(50)]
    assert all(len(set(g)) > 1 for g in groups)  # every group of 4 random completions has spread


@pytest.mark.parametrize(("arch", "shape"), [("qwen3_moe", RoutingShape(2, 2, 8)), ("mixtral", RoutingShape(2, 2, 4))])
def test_routing_shape_from_config(arch: str, shape: RoutingShape, tmp_path: Path) -> None:
    assert RoutingShape.of(_model(tmp_path, arch)) == shape


def test_dense_model_has_no_routing_shape(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))
    assert RoutingShape.of(tmp_path) is None
    assert RoutingShape.of(tmp_path / "missing") is None


def test_routing_problem_names_what_is_missing() -> None:
    shape = RoutingShape(layers=2, top_k=2, experts=8)
    good = np.arange(7 * 2 * 2).reshape(7, 2, 2) % 8  # 5 prompt + 3 output tokens: 7 rows
    assert shape.problem(_answer(good, 5, 3)) is None
    assert "no routed_experts (engine said no)" in (
        shape.problem({"sglext": {"routed_experts": None}, "routed_experts_error": "engine said no"}) or ""
    )
    assert "not 7 rows" in (shape.problem(_answer(good[:6], 5, 3)) or "")
    assert "outside 0..7" in (shape.problem(_answer(good + 1, 5, 3)) or "")
    assert "do not cover" in (shape.problem(_answer(good, 5, 3, spans=[{"version": 0, "start": 0, "end": 6}])) or "")


def test_model_option_takes_presets_and_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_demo, "moe_preset_checkpoint", lambda name: tmp_path / f"built-{name}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model(None) == (None, None)
    assert resolve_model("tiny-mixtral") == (tmp_path / "built-tiny-mixtral", "tiny-mixtral")
    assert resolve_model("some/checkpoint") == (Path("some/checkpoint"), None)
    (tmp_path / "tiny-qwen3-moe").mkdir()  # a folder of a preset's name is taken as the folder
    assert resolve_model("tiny-qwen3-moe") == (Path("tiny-qwen3-moe"), None)


@pytest.mark.parametrize(("engine", "served"), [("sglang", "bf16"), ("vllm", "fp8")])
def test_presets_refused_where_they_cannot_run(engine: str, served: str, tmp_path: Path) -> None:
    with pytest.raises(typer.BadParameter, match="--model tiny-qwen3-moe runs on --engine vllm with --served bf16"):
        demo(engine=engine, served=served, model="tiny-qwen3-moe", workdir=tmp_path / "demo")
    assert not (tmp_path / "demo").exists()
