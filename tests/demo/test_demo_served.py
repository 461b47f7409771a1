"""``stitchboard demo --served``: the recipes the demo can serve; the others refused before anything starts."""

from __future__ import annotations

import pytest
import typer

from stitchboard.demo.cli import demo


@pytest.mark.parametrize(
    ("served", "engine"), [("nvfp4", "vllm"), ("fp8-block", "vllm"), ("fp8", "sglang"), ("int3", "vllm")]
)
def test_unservable_views_are_refused_up_front(served: str, engine: str, tmp_path):
    with pytest.raises(typer.BadParameter, match="--served"):
        demo(engine=engine, served=served, workdir=tmp_path / "demo")
    assert not (tmp_path / "demo").exists()  # nothing was started
