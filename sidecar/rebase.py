"""Anchor routes staged while the engine serves (sidecar process; runs in a worker thread).

An anchor route (a snapshot, then deltas) taken on an engine that still holds a verified version
(after failed staging attempts, say) would otherwise be written whole inside the pause. Instead,
:func:`build_rebase` builds the route's target view in the sidecar from the fetched (already
verified) files, checks it against the target's manifest, and writes one ``overwrite`` patch of
just the tensors whose checksums differ from what the engine holds: each listed tensor's base
checksum is the engine's, its target the built tensor's xxh3-128 (the built view is first checked
against the manifest: ``xxh3_128``, or ``xxh3_128_parts`` over its layout for a tensor published in
parts). The engine then stages that patch like any
delta while it serves, and the pause only writes those tensors (DESIGN.md invariants 1, 2, 5:
new bits, never arithmetic; the engine checks every base before the first write).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from stitchboard.proto.apply import apply_patch
from stitchboard.proto.codec import build_patch, checksum, encode_tensor
from stitchboard.proto.container import RawTensor, read_safetensors
from stitchboard.proto.decode import read_patch
from stitchboard.proto.parts import matches

from .errors import StagingError
from .fetch import FetchedPlan

#: zstd level of a rebase patch: it is written once, read once, on the same host.
_LEVEL = 1


def _target_view(staged: FetchedPlan) -> dict[str, RawTensor]:
    # The plan's steps applied in host memory: each snapshot replaces the view, each delta patches it.
    view: dict[str, RawTensor] = {}
    for step in staged.steps:
        if step.kind == "snapshot":
            view = {}
            for path in step.paths:
                for name, t in read_safetensors(path)[1].items():
                    view[name] = RawTensor(t.dtype, tuple(t.shape), np.array(t.bits, copy=True))
        else:
            for path in step.paths:
                apply_patch(view, read_patch(Path(path).read_bytes()))
    return view


def build_rebase(staged: FetchedPlan, held: Mapping[str, str], out: Path) -> tuple[Path | None, int]:
    """Write the patch that takes an engine holding tensors with checksums ``held`` to the plan's target.

    Args:
        staged: a fetched plan whose first step is a snapshot (the files are verified).
        held: checkpoint name -> xxh3-128 hex of the engine's whole tensors (the target's names).
        out: folder for the patch file (created).

    Returns:
        (the patch file, or None when every tensor already has its target bits; tensors it lists).

    Raises:
        StagingError: the built view is not the target manifest's (tensor set or checksums).
        PatchError: a staged file does not parse or does not apply (the fetcher checked them).
    """
    view = _target_view(staged)
    manifest = staged.steps[-1].manifest
    specs = manifest.tensor_map()
    if set(view) != set(specs):
        raise StagingError(
            f"the anchor route to version {staged.to_version} builds tensors {sorted(set(view) ^ set(specs))[:3]} "
            "that differ from its manifest's"
        )
    parted = manifest.layouts()
    wrong = [n for n in sorted(specs) if not matches(view[n].bits, view[n].shape, specs[n].checksums, parted.get(n))]
    if wrong:
        raise StagingError(
            f"the anchor route to version {staged.to_version} builds {len(wrong)} tensors with other checksums than "
            f"its manifest's (first: {wrong[0]!r})"
        )
    want = {n: checksum(view[n]) for n in sorted(specs)}  # whole: ``held`` is, and the rebase patch checks it
    differ = [n for n in sorted(want) if held.get(n) != want[n]]
    if not differ:
        return None, 0
    encoded = []
    for name in differ:
        target = view[name]
        other = RawTensor(
            target.dtype, tuple(target.shape), ~target.bits
        )  # differs in every element: all positions listed
        enc = encode_tensor(name, other, target, "overwrite", base_checksum=held[name], target_checksum=want[name])
        if enc is not None:
            encoded.append(enc)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rebase.safetensors"
    path.write_bytes(build_patch(encoded, "overwrite", {"stitchboard.rebase_to": str(staged.to_version)}, level=_LEVEL))
    return path, len(encoded)
