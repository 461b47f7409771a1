"""MoE expert tensors patched in place on real vLLM (CPU): the bit-exact oracle through the sidecar.

For each of the tiny presets (``tiny-qwen3-moe`` at TP 1 and TP 2: expert width 80, padded by
vLLM's CPU kernels to 96 / 64 per rank; ``tiny-mixtral`` at TP 1) a run is trained with real
AdamW steps (CPU, fp32 masters) and published by the trainer SDK under the checkpoint's
per-expert names. The engine (stitchboard extension) holds version 0; three versions are
published before its sidecar starts, so the sidecar catches up over several versions in one
plan; then a version from an AdamW step that touches a single expert of a single layer. The
engine's greedy tokens and logprobs then equal those of a fresh vLLM started from
``stitchboard pull``'s folder of the last version (same TP size: TP changes the last bits), and
differ from version 0's; every tensor's checksum, gathered in checkpoint coordinates through the
map derived from the backend's packing, equals the manifest's. At TP 1 the fresh engine carries
the stitchboard extension too, to read its routing: the experts the sidecar returns for a
prompt (routing replay, every position of prompt and output) equal those the fresh engine routes
it to (the TP 2 fresh engine is plain vLLM).

The packing map itself: derived from ``cpu_prepack_moe_weight`` for the ``vec`` ISA it is the
formula measured on a host without AMX; on an AMX host the ``amx`` packing (what vLLM picks
there) is a different permutation, derived the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.sidecar.moe_fixtures import (
    ASK_ROUTING,
    MOE_CONTEXT,
    ROUTING_PROMPT,
    MoeRun,
    complete,
    engine_routing,
    load_version_0,
    moe_engines,  # noqa: F401 - fixture
    routed_rows,
)
from tests.sidecar.vllm_fixtures import SidecarProcess
from tests.support import lease
from tests.support.vllm_server import VllmServer, require_vllm

#: Output tokens of the routing check (the prompt's and these positions are compared).
ROUTING_TOKENS = 12
#: Tensor classes every run's first versions must change (substring of the checkpoint name).
CLASSES = {"experts": ".experts.", "router": ".gate.weight", "attention": ".self_attn.", "embedding": "embed_tokens"}


@pytest.fixture(autouse=True)
def _needs_vllm() -> None:
    require_vllm()


@pytest.fixture
def moe_runs(tmp_path: Path) -> Iterator[Callable[[str], MoeRun]]:
    runs: list[MoeRun] = []

    def make(preset: str) -> MoeRun:
        runs.append(MoeRun(preset, tmp_path / f"run-{len(runs)}"))
        return runs[-1]

    yield make
    for run in runs:
        run.close()


# tiny-qwen3-moe at TP 1 last: its engine, left at version 0's bits, is the routing tests' (test_vllm_routing.py)
@pytest.mark.parametrize(("preset", "tp"), [("tiny-mixtral", 1), ("tiny-qwen3-moe", 2), ("tiny-qwen3-moe", 1)])
def test_moe_patches_through_the_sidecar_equal_a_fresh_engine(
    preset: str,
    tp: int,
    moe_engines,  # noqa: F811
    moe_runs,
    tmp_path: Path,
) -> None:
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
    from stitchboard.sidecar.errors import ApplyRefusedError

    run = moe_runs(preset)
    engine = moe_engines(preset, tp)
    load_version_0(engine, run)
    at_v0 = engine.greedy()
    for _ in range(3):
        run.step()
    touched = run.changed(1) | run.changed(2) | run.changed(3)
    for what, mark in CLASSES.items():
        assert any(mark in n for n in touched), f"no {what} tensor changed in versions 1-3"
    sidecar = SidecarProcess(run, engine.url, tmp_path, {})  # type: ignore[arg-type]  # duck-typed run
    fresh: VllmServer | None = None
    try:
        sidecar.wait_applied(3)  # one plan: 0 -> 3
        single, expert = run.step_one_expert(layer=1)
        names = run.changed(single)
        assert names and all(
            f"layers.1.mlp.experts.{expert}." in n or f"layers.1.block_sparse_moe.experts.{expert}." in n for n in names
        ), names
        if tp == 1:  # the fresh engine starts while this one is checked (each engine process runs one torch thread)
            fresh = _fresh(run, single, tp, tmp_path)
        sidecar.wait_applied(single)
        patched = engine.greedy()
        routed = complete(sidecar.url, engine.model, ROUTING_PROMPT, ROUTING_TOKENS, **ASK_ROUTING) if tp == 1 else {}
        sidecar.stop()  # a clean stop releases the engine's lease: the checks below take it
        adapter = VllmEngine(engine.url, timeout_s=120)
        try:
            with lease.holding(adapter, "moe"):
                assert adapter.checksums(sorted(run.sums(single))) == run.sums(single)
                with pytest.raises(ApplyRefusedError):  # its base is gone: refused, nothing written
                    adapter.apply_patch(run.patch_paths(single), single, single + 1)
                assert adapter.checksums(sorted(run.sums(single))) == run.sums(single)
        finally:
            adapter.close()
        assert patched != at_v0
        if tp > 1:  # two TP = 2 engines at once (8 processes) outgrow a 24 GB host beside the session's others
            moe_engines.release(preset, tp)
            fresh = _fresh(run, single, tp, tmp_path)
        else:
            load_version_0(engine, run)  # leave the shared engine at version 0's weights
            assert engine.greedy() == at_v0
        assert fresh is not None
        fresh.wait_ready()
        assert patched == fresh.greedy()
        if tp == 1:
            ids, rows = engine_routing(fresh, ROUTING_PROMPT, ROUTING_TOKENS)
            ours = routed_rows(routed)
            assert routed["routed_experts_weight_versions"] == [{"version": single, "start": 0, "end": len(ours)}]
            assert ids == routed["choices"][0]["token_ids"] and np.array_equal(rows[: len(ours)], ours), (
                "the sidecar returned other experts than the fresh engine routes to"
            )
    finally:
        sidecar.stop()
        if fresh is not None:
            fresh.stop()


def _fresh(run: MoeRun, version: int, tp: int, folder: Path) -> VllmServer:
    """A vLLM started from ``stitchboard pull``'s folder of ``version`` (not yet ready): at TP 1 with
    the stitchboard extension (its routing is read), plain vLLM otherwise."""
    return VllmServer(run.pull(version), folder / "fresh.log", extension=tp == 1, tp=tp, max_model_len=MOE_CONTEXT)


def test_packing_map_is_derived_from_the_backend() -> None:
    """The map derived from ``cpu_prepack_moe_weight`` for ``vec`` is the formula seen on a host
    without AMX; a packing that is not a permutation is refused (None)."""
    import torch
    from vllm import _custom_ops

    from stitchboard.sidecar.engines.vllm.experts import _derive_perm

    rows, cols = 192, 256
    n, k = torch.arange(rows).view(-1, 1), torch.arange(cols).view(1, -1)
    vec = ((n // 16) * 16 * cols + k * 16 + n % 16).reshape(-1)
    assert torch.equal(_derive_perm(lambda w: _custom_ops.cpu_prepack_moe_weight(w, "vec"), rows, cols), vec)
    assert _derive_perm(lambda w: torch.zeros_like(w), rows, cols) is None
    assert _derive_perm(lambda w: w.flip(-1).clone(), rows, cols) is not None
    if torch.cpu._is_amx_tile_supported():
        amx = _derive_perm(lambda w: _custom_ops.cpu_prepack_moe_weight(w, "amx"), rows, cols)
        assert amx is not None and not torch.equal(amx, vec)


def test_unknown_moe_backends_are_refused_by_name() -> None:
    """A backend other than vLLM's CPU prepacked experts is refused naming its class (and the w31 hazard)."""
    from types import SimpleNamespace

    from stitchboard.sidecar.engines.vllm.experts import _backend
    from stitchboard.sidecar.errors import UnmappedTensorError

    class FlashInferExperts:
        pass

    class CPUUnquantizedExperts:
        isa = "vec"
        _use_zentorch = True

    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    for experts, shown in ((FlashInferExperts(), "FlashInferExperts"), (CPUUnquantizedExperts(), "zentorch")):
        module = SimpleNamespace(
            quant_method=SimpleNamespace(moe_kernel=SimpleNamespace(impl=SimpleNamespace(fused_experts=experts)))
        )
        with pytest.raises(UnmappedTensorError, match=shown) as info:
            _backend(module, name)
        assert "w31" in str(info.value) and info.value.details["name"] == name
