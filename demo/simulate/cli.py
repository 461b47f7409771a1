"""``stitchboard simulate --out DIR``: one RL step's fan-out to a fleet, simulated, with its validation against a
real run at small scale (runs in the operator's process; needs the ``simulate`` extra: simpy, matplotlib).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .figures import Fleet
from .report import plot, run_all, sources, table
from .validate import sha256_Bps, validate


def simulate(
    out: Annotated[Path, typer.Option(help="folder for simulate.md (tables), simulate.json and the PNG plot")],
    parameters: Annotated[float, typer.Option(min=1, help="model parameters (elements)")] = 1e12,
    trainer_ranks: Annotated[int, typer.Option(min=1, help="trainer ranks, one patch file each")] = 64,
    replicas: Annotated[int, typer.Option(min=1, help="replicas in the fleet")] = 1000,
    regions: Annotated[int, typer.Option(min=1, help="regions (the store and the bulletin in the first)")] = 3,
    fetchers: Annotated[
        int, typer.Option(min=0, help="concurrent fetchers of the validation's real run on loopback (0: skip it)")
    ] = 100,
) -> None:
    """Simulate one step's fan-out (commit -> every replica at version N) for `cond` and `xor`, with and without
    the regional cache tier, print every figure with its source, and validate the model against a real run."""
    fleet = Fleet().with_values(
        parameters=parameters, trainer_ranks=trainer_ranks, replicas=replicas, regions=regions, verify_Bps=sha256_Bps()
    )
    out.mkdir(parents=True, exist_ok=True)
    results = run_all(fleet)
    plot(results, out / "replicas_at_version.png")
    first = results[0][1]
    uploads = f"Before the commit the trainer ranks' {first.store_puts} PUTs take {first.upload_s:.2f} s (cond)."
    body = f"## Scenarios\n\n{table(results)}\n\n{uploads}\n\n## Figures and their sources\n\n{sources(fleet)}\n"
    typer.echo(body)
    check = validate(fetchers=fetchers) if fetchers else None
    ratio = f"{check.ratio:.3f}" if check else "skipped"
    if check is not None:
        line = (
            f"validation: {check.fetchers} fetchers x {check.blobs} blobs of {check.blob_bytes:,} B on loopback: "
            f"measured t50 {check.measured_t50_s:.3f} s, t100 {check.measured_t100_s:.3f} s; simulated t50 "
            f"{check.simulated_t50_s:.3f} s, t100 {check.simulated_t100_s:.3f} s (from the lone fetcher's "
            f"{check.server_s_per_get * 1e3:.2f} ms of bulletin CPU, {check.client_s_per_get * 1e3:.2f} ms of "
            f"fetcher CPU and {check.wall_s_per_get * 1e3:.2f} ms of wall time per blob)"
        )
        typer.echo(line)
        body += f"\n## Validation\n\n{line}\n"
    (out / "simulate.md").write_text(body)
    head, r = results[0]
    (out / "simulate.json").write_text(
        json.dumps(
            {
                "scenarios": [
                    {
                        "label": row.label,
                        "at_version_s": res.at_version_s,
                        "origin_egress_bytes": res.origin_egress_bytes,
                        "store_gets": res.store_gets,
                        "store_slowdowns": res.store_slowdowns,
                        "bulletin_requests": res.bulletin_requests,
                        "failed_syncs": res.failed_syncs,
                    }
                    for row, res in results
                ],
                "figures": {n: vars(f) for n, f in fleet.figures().items()},
                "validation": vars(check) if check else None,
            }
        )
    )
    typer.echo(f"the summary line is the first scenario's: {head.label}")
    typer.echo(
        f"simulate: t50_s={r.time_to(0.5):.1f} t99_s={r.time_to(0.99):.1f} t100_s={r.time_to(1.0):.1f} "
        f"origin_egress_gb={r.origin_egress_bytes / 1e9:.1f} validation_ratio={ratio}"
    )
