"""The vLLM engine adapter and worker extension on a real vLLM (CPU build) serving SmolLM2.

The oracle: after applying a real training step's patch in place, greedy completions with
logprobs are bitwise equal to those of a fresh vLLM started from the target's full checkpoint.
Refusals (wrong base or target, corrupt file, unknown tensor, wrong version) leave the engine
serving its version bit for bit. Updates staged while the engine serves commit bit-exact.
Patches are ``cond`` (the publisher's default, decoded on each rank's base bits; at TP = 3 on the
gathered whole tensors) but for one ``xor`` step, the fast encoding.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import httpx
import pytest

from stitchboard.proto.codec import PatchEncoding, build_patch, encode_tensor
from stitchboard.proto.diff import diff_views
from stitchboard.proto.schema import XXH3_128
from tests.sidecar.vllm_fixtures import assert_repacked, view_sums
from tests.support import lease

pytestmark = pytest.mark.slow

FUSED_AND_TIED = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
]


#: The encoding of the patches (the publisher's default).
ENCODING: PatchEncoding = "cond"


def _patch(base: dict, target: dict, encoding: PatchEncoding = ENCODING) -> bytes:
    """The patch file taking view ``base`` to view ``target``."""
    return diff_views(base, target, encoding).patch


def _write(folder: Path, name: str, data: bytes) -> str:
    path = folder / name
    path.write_bytes(data)
    return str(path)


def _bring_to(adapter, snapshot, version: int) -> None:
    """Load ``version``'s snapshot unless the engine already records it."""
    if adapter.state().version != version:
        adapter.pause()
        try:
            adapter.load_snapshot(snapshot(version), version)
            adapter.reset_prefix_cache()
        finally:
            adapter.resume()


def _assert_holds(adapter, views, version: int) -> None:
    """The engine records ``version`` and every tensor, read back, has its checksum."""
    assert (adapter.state().version, adapter.state().phase) == (version, "idle")
    assert adapter.checksums(sorted(views[version])) == view_sums(views[version])


def test_engine_reads_back_the_boot_checkpoint(vllm_adapter, vllm_views):
    """A fresh engine records no version until told; its tensors read back as the checkpoint."""
    if vllm_adapter.state().version is None:
        vllm_adapter.set_version(0)
    if vllm_adapter.state().version == 0:
        _assert_holds(vllm_adapter, vllm_views, 0)
    assert vllm_adapter.health()


def test_patch_in_place_is_bit_exact_with_a_fresh_engine(
    vllm_engine, vllm_adapter, vllm_views, vllm_snapshot, vllm_workdir, vllm_fresh_greedy
):
    _bring_to(vllm_adapter, vllm_snapshot, 0)
    assert vllm_engine.greedy() == vllm_engine.boot_greedy
    diff = diff_views(vllm_views[0], vllm_views[1], ENCODING)
    assert set(FUSED_AND_TIED) <= set(diff.changed_tensors)
    vllm_adapter.pause()
    assert vllm_adapter.state().phase == "paused"
    report = vllm_adapter.apply_patch(_write(vllm_workdir, "v1.patch", diff.patch), 0, 1)
    vllm_adapter.reset_prefix_cache()
    vllm_adapter.resume()
    assert report["tensors"] == len(diff.changed_tensors) and report["elements"] == diff.changed_elements
    assert_repacked(report["repacked_modules"])
    _assert_holds(vllm_adapter, vllm_views, 1)
    patched = vllm_engine.greedy()
    assert patched != vllm_engine.boot_greedy
    assert patched == vllm_fresh_greedy(1)


def test_wrong_base_or_version_is_refused_before_any_write(
    vllm_engine, vllm_adapter, vllm_views, vllm_snapshot, vllm_workdir, vllm_fresh_greedy
):
    from stitchboard.sidecar.errors import ApplyRefusedError, EngineStateError

    _bring_to(vllm_adapter, vllm_snapshot, 1)
    skip_one = _write(vllm_workdir, "v0-v2.patch", _patch(vllm_views[0], vllm_views[2]))
    with pytest.raises(ApplyRefusedError) as refused:
        vllm_adapter.apply_patch(skip_one, 1, 2)
    assert refused.value.details["cause"] == "BaseMismatch" and refused.value.details["held"] == 1
    with pytest.raises(EngineStateError):
        vllm_adapter.apply_patch(skip_one, 0, 2)
    _assert_holds(vllm_adapter, vllm_views, 1)
    assert vllm_engine.greedy() == vllm_fresh_greedy(1)


def test_corrupt_or_unmappable_patch_is_rejected(vllm_adapter, vllm_views, vllm_snapshot, vllm_workdir):
    from stitchboard.sidecar.errors import ApplyRefusedError
    from stitchboard.sidecar.refusals import is_permanent

    _bring_to(vllm_adapter, vllm_snapshot, 1)
    good = _patch(vllm_views[1], vllm_views[2])
    flipped = bytearray(good)
    flipped[-100] ^= 0xFF  # inside the payload (the last tensor's coded stream)
    name = "model.layers.0.mlp.up_proj.weight"
    base, target = vllm_views[1][name], vllm_views[2][name]
    enc = encode_tensor(name, base, target, ENCODING)
    stray = build_patch(
        [
            dataclasses.replace(
                enc, entry=dataclasses.replace(enc.entry, name="model.layers.0.mlp.sideways_proj.weight")
            )
        ],
        ENCODING,
    )
    embed = "model.embed_tokens.weight"  # SmolLM2 ties lm_head to it: the engine holds no lm_head of its own
    head = encode_tensor("lm_head.weight", vllm_views[1][embed], vllm_views[2][embed], ENCODING)
    tied_head = build_patch([head], ENCODING)
    # a flipped byte of a range-coded stream either fails to decode or decodes to bits off the target checksum
    for label, data, causes, permanent in [
        ("flipped", bytes(flipped), {"PatchFormatError", "TargetMismatch"}, False),
        ("truncated", good[: len(good) // 2], {"PatchFormatError"}, False),
        ("stray", stray, {"UnmappedTensor"}, True),
        ("tied-head", tied_head, {"UnmappedTensor"}, True),
    ]:
        with pytest.raises(ApplyRefusedError) as refused:
            vllm_adapter.apply_patch(_write(vllm_workdir, f"{label}.patch", data), 1, 2)
        assert refused.value.details["cause"] in causes, label
        assert is_permanent(refused.value) is permanent, label  # the sidecar waits for another tensor set
    _assert_holds(vllm_adapter, vllm_views, 1)


def test_wrong_target_checksum_is_refused_before_any_write(
    vllm_engine, vllm_adapter, vllm_views, vllm_snapshot, vllm_workdir, vllm_fresh_greedy
):
    """Staging applies the patch to a host copy and checks the targets there: a wrong target
    checksum is refused before the first write. (Restoring after a failed verification in the
    commit, GEMM copies included, is covered by test_vllm_staging.py.)"""
    from stitchboard.sidecar.errors import ApplyRefusedError

    _bring_to(vllm_adapter, vllm_snapshot, 1)
    encoded = []
    for name in FUSED_AND_TIED:
        enc = encode_tensor(name, vllm_views[1][name], vllm_views[2][name], ENCODING)
        if name == "model.embed_tokens.weight":
            enc = dataclasses.replace(enc, entry=dataclasses.replace(enc.entry, target={XXH3_128: "0" * 32}))
        encoded.append(enc)
    with pytest.raises(ApplyRefusedError) as refused:
        vllm_adapter.apply_patch(_write(vllm_workdir, "bad-target.patch", build_patch(encoded, ENCODING)), 1, 2)
    assert refused.value.details["cause"] == "TargetMismatch" and "model.embed_tokens.weight" in str(refused.value)
    _assert_holds(vllm_adapter, vllm_views, 1)
    assert vllm_engine.greedy() == vllm_fresh_greedy(1)


def test_chain_staged_while_serving_commits_bit_exact(
    vllm_engine, vllm_adapter, vllm_views, vllm_snapshot, vllm_workdir
):
    """Versions 0 -> 1 -> 2 are staged as one update while a request generates (nothing written,
    engine not paused), then committed in a pause with the GEMM copies packed while staging. The
    answers equal those after loading version 2's snapshot, which re-packs every linear layer from
    the written weights through vLLM's own dispatch."""
    from stitchboard.sidecar.errors import EngineStateError

    _bring_to(vllm_adapter, vllm_snapshot, 0)
    with pytest.raises(EngineStateError, match="no staged update"):
        vllm_adapter.commit_staged(2)
    steps = [
        ([_write(vllm_workdir, f"chain-v{v}.patch", _patch(vllm_views[v - 1], vllm_views[v]))], v - 1, v)
        for v in (1, 2)
    ]
    answer: dict[str, httpx.Response] = {}
    body = {
        "model": vllm_engine.model,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
    }
    request = threading.Thread(
        target=lambda: answer.update(r=httpx.post(f"{vllm_engine.url}/v1/completions", json=body, timeout=600))
    )
    request.start()
    staged = vllm_adapter.stage_patches(steps)
    assert (vllm_adapter.state().version, vllm_adapter.state().phase) == (0, "idle")
    assert vllm_adapter.checksums(sorted(vllm_views[0])) == view_sums(vllm_views[0]), "staging wrote to the engine"
    request.join(600)
    assert answer["r"].status_code == 200 and answer["r"].json()["usage"]["completion_tokens"] == 200
    touched = set(diff_views(vllm_views[0], vllm_views[1]).changed_tensors) | set(
        diff_views(vllm_views[1], vllm_views[2]).changed_tensors
    )
    assert_repacked(staged["repacked_modules"])
    assert staged["tensors"] == len(touched)
    for wait_s in (-1, 60, "1"):  # a poll may wait in the worker only a bounded number of seconds
        r = httpx.post(
            f"{vllm_engine.url}/collective_rpc",
            json={"method": "stitch_staged", "args": [json.dumps({"wait_s": wait_s})]},
            timeout=120,
        )
        (refused,) = r.json()["results"]
        assert not refused["ok"] and refused["error"]["type"] == "ValueError", refused
        assert "wait_s must be" in refused["error"]["message"], refused
    vllm_adapter.pause()
    try:
        report = vllm_adapter.commit_staged(2)
        vllm_adapter.reset_prefix_cache()
    finally:
        vllm_adapter.resume()
    assert report["rank_elements"] >= diff_views(vllm_views[0], vllm_views[2]).changed_elements
    _assert_holds(vllm_adapter, vllm_views, 2)
    committed = vllm_engine.greedy()
    assert committed != vllm_engine.boot_greedy
    vllm_adapter.pause()
    try:
        vllm_adapter.load_snapshot(vllm_snapshot(2), 2, view_sums(vllm_views[2]))
        vllm_adapter.reset_prefix_cache()
    finally:
        vllm_adapter.resume()
    assert vllm_engine.greedy() == committed


def test_next_step_then_snapshot_back_to_the_anchor(vllm_engine, vllm_adapter, vllm_views, vllm_snapshot, vllm_workdir):
    """The next step as ``xor`` (the fast encoding, still selectable per run), then back by snapshot."""
    _bring_to(vllm_adapter, vllm_snapshot, 1)
    vllm_adapter.pause()
    try:
        vllm_adapter.apply_patch(_write(vllm_workdir, "v2.patch", _patch(vllm_views[1], vllm_views[2], "xor")), 1, 2)
    finally:
        vllm_adapter.resume()
    _assert_holds(vllm_adapter, vllm_views, 2)
    vllm_adapter.pause()
    try:
        report = vllm_adapter.load_snapshot(vllm_snapshot(0), 0, view_sums(vllm_views[0]))
        vllm_adapter.reset_prefix_cache()
    finally:
        vllm_adapter.resume()
    assert report["tensors"] == len(vllm_views[0])
    _assert_holds(vllm_adapter, vllm_views, 0)
    assert vllm_engine.greedy() == vllm_engine.boot_greedy


def test_snapshot_with_a_wrong_checksum_is_refused(vllm_adapter, vllm_views, vllm_snapshot):
    from stitchboard.sidecar.errors import ApplyRefusedError

    _bring_to(vllm_adapter, vllm_snapshot, 0)
    sums = view_sums(vllm_views[1])
    sums["model.norm.weight"] = "0" * 32
    with pytest.raises(ApplyRefusedError) as refused:
        vllm_adapter.load_snapshot(vllm_snapshot(1), 1, sums)
    assert refused.value.details["cause"] == "TargetMismatch"
    _assert_holds(vllm_adapter, vllm_views, 0)


def test_state_changing_worker_calls_are_refused_without_the_lease(
    vllm_engine, vllm_adapter, vllm_views, vllm_snapshot, vllm_workdir
):
    """The worker's state-changing methods, called directly, refuse a caller that holds no live
    lease (no owner, or another's) and change nothing; a take by another owner is refused naming
    the holder and its time left; read-only calls need no lease."""
    _bring_to(vllm_adapter, vllm_snapshot, 0)
    holder = vllm_adapter.known_lease().owner

    def rpc(method: str, args: dict) -> dict:
        r = httpx.post(
            f"{vllm_engine.url}/collective_rpc", json={"method": method, "args": [json.dumps(args)]}, timeout=120
        )
        (answer,) = r.json()["results"]
        return answer

    patch = _write(vllm_workdir, "lease.patch", _patch(vllm_views[0], vllm_views[1]))
    calls = {
        "stitch_set_version": {"version": 1, "base": 0},
        "stitch_apply_patch": {"paths": [patch], "from_version": 0, "to_version": 1},
        "stitch_stage": {"steps": [{"paths": [patch], "from_version": 0, "to_version": 1}]},
        "stitch_commit": {"to_version": 1},
        "stitch_load_snapshot": {"paths": vllm_snapshot(1), "version": 1, "checksums": view_sums(vllm_views[1])},
    }
    for method, args in calls.items():
        refused = rpc(method, {**args, "owner": "intruder"})
        assert not refused["ok"] and refused["error"]["type"] == "LeaseNotHeld", (method, refused)
        assert refused["error"]["holder"] == holder and refused["lease"]["holder"] == holder
        anonymous = rpc(method, args)
        assert not anonymous["ok"] and "owner" in anonymous["error"]["message"], (method, anonymous)
    taken = rpc("stitch_lease", {"owner": "intruder", "ttl_s": 5.0})
    assert taken["error"]["type"] == "LeaseNotHeld" and taken["error"]["holder"] == holder
    assert 0 < taken["error"]["expires_in_s"] <= lease.TEST_TTL_S
    assert rpc("stitch_state", {})["lease"]["holder"] == holder  # read-only: no owner needed
    _assert_holds(vllm_adapter, vllm_views, 0)  # nothing was written or recorded


@pytest.mark.engine
@pytest.mark.parametrize("phase", ["half-written"])
def test_fault_injection_kills_the_engine_mid_apply(phase, smollm2_dir, vllm_views, vllm_workdir):
    """``STITCH_ENGINE_FAULT_PHASE`` makes the engine process exit at that phase of an apply (crash tests)."""
    from stitchboard.sidecar.engines.contract import FAULT_ENV
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
    from stitchboard.sidecar.errors import EngineRequestError, EngineUnavailableError
    from tests.support.vllm_server import VllmServer

    server = VllmServer(smollm2_dir, vllm_workdir / f"fault-{phase}.log", env={FAULT_ENV: phase})
    engine: VllmEngine | None = None
    try:
        server.wait_ready()
        engine = VllmEngine(server.url, timeout_s=30)
        lease.take(engine, "fault")
        engine.set_version(0)
        patch = _write(vllm_workdir, "fault.patch", _patch(vllm_views[0], vllm_views[1]))
        with pytest.raises((EngineUnavailableError, EngineRequestError)):
            engine.apply_patch(patch, 0, 1)
        server.proc.wait(120)
        assert f"exiting at phase {phase}" in server.log_tail(200_000)
        assert not engine.health()
    finally:
        if engine is not None:
            engine.close()  # its HTTP connections to the engine
        server.stop()


@pytest.mark.engine
@pytest.mark.heavy
def test_tensor_parallel_3_patch_is_bit_exact_with_a_fresh_tp3_engine(smollm2_dir, vllm_views, vllm_workdir):
    """TP = 3 (3 KV heads: one per rank; vocab rows split in three): apply in place on every rank,
    verify by gathered whole-tensor checksums, and match a fresh TP = 3 engine of the target."""
    from stitchboard.proto.checkpoint import save_checkpoint
    from stitchboard.sidecar.engines.vllm.adapter import VllmEngine
    from tests.sidecar.vllm_fixtures import copy_model_files
    from tests.support.vllm_server import VllmServer

    folder = vllm_workdir / "checkpoint-v1-tp3"
    save_checkpoint(folder, vllm_views[1])
    copy_model_files(smollm2_dir, folder)
    server = VllmServer(smollm2_dir, vllm_workdir / "tp3.log", tp=3)
    engine: VllmEngine | None = None
    try:
        server.wait_ready()
        engine = VllmEngine(server.url, timeout_s=60)
        lease.take(engine, "tp3")  # every rank's, agreed over vLLM's TP group
        engine.set_version(0)
        assert engine.checksums(sorted(vllm_views[0])) == view_sums(vllm_views[0])
        before = server.greedy()
        staged = engine.stage_patches(
            [([_write(vllm_workdir, "tp3.patch", _patch(vllm_views[0], vllm_views[1]))], 0, 1)]
        )
        engine.pause()  # staged by each rank in a background thread (gathers on stitchboard's own group)
        report = engine.commit_staged(1)
        engine.reset_prefix_cache()
        engine.resume()
        assert 0 < staged["rank_elements"] == report["rank_elements"] < report["elements"]
        assert (engine.state().version, engine.state().phase) == (1, "idle")
        assert engine.checksums(sorted(vllm_views[1])) == view_sums(vllm_views[1])
        patched = server.greedy()
    finally:
        if engine is not None:
            engine.close()  # its HTTP connections to the engine
        server.stop()
    fresh = VllmServer(folder, vllm_workdir / "tp3-fresh.log", extension=False, tp=3)
    try:
        fresh.wait_ready()
        assert patched != before
        assert patched == fresh.greedy()
    finally:
        fresh.stop()


def test_a_plain_engine_serves_no_adapters_and_names_its_base_view(vllm_adapter, vllm_views, vllm_workdir):
    """Without --enable-lora: no adapter slots, a load refused before vLLM is asked; base_names() are
    the served view's names (tests/sidecar/test_vllm_lora.py covers the LoRA engine)."""
    from stitchboard.sidecar.errors import AdapterLoadError

    assert vllm_adapter.adapter_slots() == 0 and vllm_adapter.loaded_adapters() == []
    with pytest.raises(AdapterLoadError) as off:
        vllm_adapter.load_adapter("x@1", str(vllm_workdir), {"base_model.model.lm_head.lora_A.weight": "0" * 32})
    assert off.value.details["cause"] == "LoraDisabled"
    assert sorted(vllm_adapter.base_names()) == sorted(vllm_views[0])


def test_the_pause_route_pauses_at_once_and_refuses_a_bad_query(vllm_engine, vllm_adapter):
    """``POST /stitch/pause`` (the route :func:`vllm_command` loads) pauses the real engine, as the adapter's pause
    does through it; a mode vLLM does not know is answered 400 and pauses nothing."""
    from stitchboard.sidecar.engines.vllm.pause_route import PAUSE_PATH

    bad = httpx.post(f"{vllm_engine.url}{PAUSE_PATH}", params={"mode": "sideways"}, timeout=30)
    assert bad.status_code == 400 and "sideways" in bad.json()["error"]
    assert httpx.get(f"{vllm_engine.url}/is_paused", timeout=30).json() == {"is_paused": False}
    vllm_adapter.pause()
    try:
        assert vllm_adapter.state().phase == "paused"
        assert vllm_adapter.pause_path == PAUSE_PATH  # the route answered: no fallback to vLLM's /pause
    finally:
        vllm_adapter.resume()
    assert vllm_adapter.state().phase == "idle"
    answer = httpx.post(f"{vllm_engine.url}{PAUSE_PATH}", params={"mode": "keep", "clear_cache": "false"}, timeout=30)
    try:
        assert (answer.status_code, answer.json()) == (200, {"status": "paused"})
        assert httpx.get(f"{vllm_engine.url}/is_paused", timeout=30).json() == {"is_paused": True}
    finally:
        vllm_adapter.resume()
