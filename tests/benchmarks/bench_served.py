"""What each served view absorbs of real RL updates: changed elements and patch bytes per recipe.

Run: ``python -m tests.benchmarks.bench_served [--steps N] [--model tiny-qwen3-moe]`` (from the
repo root, in .venv); the default 10 steps of SmolLM2-135M (fp32 masters, AdamW lr 3e-6, batch
1 x 32 tokens, the trainer of ``bench_codec``) take ~10 minutes on 2 cores. ``--model`` takes a
MoE preset (:mod:`stitchboard.demo.moe_models`; its experts are quantized linear weights, its
routers stay bf16) or a checkpoint folder.

Per step and recipe (``bf16``, ``fp8``, ``fp8-block``, ``nvfp4``), each recipe applied to the
same bf16 served view of the step: the % of the quantized linear weights' elements whose code
changed (a packed nvfp4 byte holds two elements; each nibble counts), the % of their scales
that changed, the % of the rest of the view (embedding, norms: bf16 in every recipe) that
changed, the ``cond`` patch's bytes (the publisher's default encoding), its bytes per changed
codec element (a U8 byte for nvfp4 codes), and its ratio to the bf16 patch of the same step.
A final table gives the medians over the steps.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from stitchboard.demo.moe_demo import resolve_model
from stitchboard.demo.moe_models import PRESETS
from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.proto.container import RawTensor
from stitchboard.proto.diff import diff_views
from stitchboard.trainer_client.recipes import RECIPE_NAMES, get_recipe
from tests.benchmarks.bench_codec import raw_view
from tests.support.training import CpuTrainer

#: Suffixes of scale tensors.
SCALES = (".weight_scale", ".weight_scale_inv", ".weight_global_scale")


@dataclass
class Row:
    """One recipe at one step."""

    step: int
    recipe: str
    codes_pct: float
    scales_pct: float
    rest_pct: float
    patch_bytes: int
    changed: int

    @property
    def bytes_per_changed(self) -> float:
        return self.patch_bytes / max(self.changed, 1)


def kind(name: str, t: RawTensor) -> str:
    """``scales``, ``codes`` (a quantized linear weight, or its bf16 original) or ``rest``."""
    if name.endswith(SCALES) and t.dtype in ("F32", "F8_E4M3"):
        return "scales"
    if ".layers." in name and name.endswith((".weight", ".weight_packed")) and len(t.shape) == 2:
        return "codes"
    return "rest"


def changed_elements(old: RawTensor, new: RawTensor) -> tuple[int, int]:
    """(changed, total) elements; a U8 packed tensor counts its nibbles."""
    if new.dtype == "U8":
        x = old.bits ^ new.bits
        return int(np.count_nonzero(x & 0x0F) + np.count_nonzero(x >> 4)), 2 * new.bits.size
    return int(np.count_nonzero(old.bits != new.bits)), new.bits.size


def measure(step: int, recipe: str, old: dict[str, RawTensor], new: dict[str, RawTensor]) -> Row:
    """One row: change shares by kind and the cond patch's size."""
    counts = {k: [0, 0] for k in ("codes", "scales", "rest")}
    for name, t in new.items():
        c, n = changed_elements(old[name], t)
        counts[kind(name, t)][0] += c
        counts[kind(name, t)][1] += n
    diff = diff_views(old, new, "cond")

    def pct(k: str) -> float:
        return 100.0 * counts[k][0] / counts[k][1] if counts[k][1] else 0.0

    return Row(step, recipe, pct("codes"), pct("scales"), pct("rest"), len(diff.patch), diff.changed_elements)


def table(rows: list[Row], bf16: dict[int, int], title: str) -> Table:
    t = Table(title=title)
    for col in (
        "step",
        "recipe",
        "codes changed %",
        "scales changed %",
        "rest (bf16) %",
        "patch bytes",
        "bytes / changed",
        "vs bf16 patch",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        ratio = r.patch_bytes / bf16[r.step] if bf16.get(r.step) else float("nan")
        t.add_row(
            str(r.step),
            r.recipe,
            f"{r.codes_pct:.3f}",
            f"{r.scales_pct:.3f}" if r.recipe != "bf16" else "-",
            f"{r.rest_pct:.3f}",
            f"{r.patch_bytes:,}",
            f"{r.bytes_per_changed:.3f}",
            f"{ratio:.3f}",
        )
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--model", help=f"a MoE preset ({', '.join(PRESETS)}) or a checkpoint folder (default: SmolLM2-135M)"
    )
    args = parser.parse_args()
    console = Console(width=140)
    model_dir, preset = resolve_model(args.model)
    trainer = CpuTrainer(model_dir or build_smollm2_checkpoint(), batch_size=1, seq_len=32)
    model_name = preset or (model_dir.name if model_dir else "SmolLM2-135M")
    recipes = [get_recipe(n) for n in RECIPE_NAMES]
    prev = {
        r.name: r.apply(
            {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in raw_view(trainer.served_view()).items()}
        )
        for r in recipes
    }
    rows: list[Row] = []
    for step in range(1, args.steps + 1):
        trainer.step()
        view = {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in raw_view(trainer.served_view()).items()}
        for r in recipes:
            cur = r.apply(view)
            rows.append(measure(step, r.name, prev[r.name], cur))
            prev[r.name] = cur
        console.print(f"step {step}: " + ", ".join(f"{x.recipe} {x.patch_bytes:,} B" for x in rows[-len(recipes) :]))
    bf16 = {r.step: r.patch_bytes for r in rows if r.recipe == "bf16"}
    console.print(
        table(rows, bf16, f"served views on {args.steps} real AdamW steps of {model_name} (lr 3e-6), cond patches")
    )
    medians = []
    for name in RECIPE_NAMES:
        mine = [r for r in rows if r.recipe == name]
        medians.append(
            Row(
                0,
                name,
                statistics.median(r.codes_pct for r in mine),
                statistics.median(r.scales_pct for r in mine),
                statistics.median(r.rest_pct for r in mine),
                int(statistics.median(r.patch_bytes for r in mine)),
                int(statistics.median(r.changed for r in mine)),
            )
        )
    console.print(table(medians, {0: medians[0].patch_bytes}, "medians over the steps (step 0 = median row)"))


if __name__ == "__main__":
    main()
