"""``stitchboard patch``: diff, apply and inspect patches on checkpoint files, for people who
debug weights. Works on single files and on HF sharded checkpoints (index json)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .apply import apply_to_copy
from .checkpoint import checkpoint_files, load_checkpoint, save_checkpoint
from .codec import FORMAT
from .container import read_safetensors, write_safetensors
from .decode import read_patch
from .diff import diff_views
from .errors import StitchError

app = typer.Typer(help="Diff, apply and inspect bit-exact weight patches.", no_args_is_help=True)
# Piped output (logs, scripts) gets wide tables instead of rich's 80-column default.
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
errors = Console(stderr=True, soft_wrap=True)


def _fail(exc: Exception) -> None:
    errors.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(1)


@app.command()
def diff(
    base: Annotated[Path, typer.Argument(help="base checkpoint (.safetensors, index json or folder)")],
    target: Annotated[Path, typer.Argument(help="target checkpoint with the same tensors")],
    output: Annotated[Path, typer.Option("-o", "--output", help="patch file to write")],
    encoding: Annotated[
        str,
        typer.Option(
            help="cond (smallest; valid only on its base), xor (fastest; valid only on its base) "
            "or overwrite (idempotent)"
        ),
    ] = "cond",
) -> None:
    """Write the patch taking BASE to TARGET and print changed elements and bytes per change."""
    try:
        t0 = time.perf_counter()
        result = diff_views(load_checkpoint(base), load_checkpoint(target), encoding)  # type: ignore[arg-type]
        output.write_bytes(result.patch)
    except (StitchError, OSError, ValueError) as exc:
        _fail(exc)
    n, total = result.changed_elements, result.total_elements
    per = f"{len(result.patch) / n:.3f}" if n else "-"
    console.print(
        f"{n:,} of {total:,} elements changed ({100 * n / max(total, 1):.3f} %) "
        f"in {len(result.changed_tensors)} tensors; "
        f"patch {len(result.patch):,} bytes ({per} bytes per changed element, {encoding}); "
        f"{time.perf_counter() - t0:.2f} s"
    )


@app.command()
def apply(
    base: Annotated[Path, typer.Argument(help="base checkpoint the patch was made from")],
    patch: Annotated[Path, typer.Argument(help="patch file")],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="output: a .safetensors file, or a folder for a sharded base")
    ],
) -> None:
    """Apply PATCH to BASE and write OUTPUT; every touched tensor is verified against its target checksum."""
    try:
        view = load_checkpoint(base)
        p = read_patch(patch.read_bytes(), what=str(patch))
        out = apply_to_copy(view, p)
        weight_map, where = checkpoint_files(base)
        if weight_map:
            save_checkpoint(output, out, weight_map)
        else:
            write_safetensors(output, out, read_safetensors(where)[0])
    except (StitchError, OSError, ValueError) as exc:
        _fail(exc)
    console.print(
        f"applied {p.changed_elements:,} element changes in {len(p.entries)} tensors ({p.encoding}); verified; "
        f"wrote {output}"
    )


@app.command()
def inspect(file: Annotated[Path, typer.Argument(help="a patch file or a checkpoint")]) -> None:
    """Print a patch's metadata and per-tensor stats (or a checkpoint's tensors)."""
    try:
        data = file.read_bytes()
        meta, _ = read_safetensors(file)
        if FORMAT not in meta:
            _inspect_checkpoint(file)
            return
        p = read_patch(data, what=str(file))
    except (StitchError, OSError, ValueError) as exc:
        _fail(exc)
    console.print(f"[bold]{file}[/bold]: stitchboard patch, encoding {p.encoding}, {len(data):,} bytes")
    for k, v in p.metadata.items():
        console.print(f"  {k}: {v}")
    table = Table("tensor", "dtype", "shape", "changed", "%", "stream bytes (raw)")
    for e in p.entries.values():
        table.add_row(
            e.name,
            e.dtype,
            json.dumps(list(e.shape)),
            f"{e.count:,}",
            f"{100 * e.count / max(e.numel, 1):.3f}",
            f"{e.gap_bytes:,}",
        )
    console.print(table)
    n = p.changed_elements
    console.print(
        f"total: {n:,} changed elements, {len(data) / n:.3f} bytes per changed element (whole file)"
        if n
        else "empty delta"
    )


def _inspect_checkpoint(path: Path) -> None:
    tensors = load_checkpoint(path)
    table = Table("tensor", "dtype", "shape", "bytes")
    for name, t in sorted(tensors.items()):
        table.add_row(name, t.dtype, json.dumps(list(t.shape)), f"{t.nbytes:,}")
    console.print(
        f"[bold]{path}[/bold]: checkpoint (anchor) with {len(tensors)} tensors, "
        f"{sum(t.nbytes for t in tensors.values()):,} bytes"
    )
    console.print(table)
