"""The SGLang adapter and loader on real SGLang servers (CPU): refusals, and TP = 2 head padding.

Patches are encoded here with the codec (``cond``, the publisher's default, which decodes only
against the whole base tensor: at TP = 2 every rank decodes it on the gathered tensor) from the
served views of real AdamW steps (:class:`tests.support.training.CpuTrainer`) and handed to the
adapter as files, as the sidecar does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor
from stitchboard.proto.diff import diff_views
from stitchboard.sidecar.engines.sglang.adapter import SglangEngine
from stitchboard.sidecar.errors import ApplyRefusedError, EngineStateError
from tests.sidecar.sglang_helpers import SglangServer, require_sglang
from tests.sidecar.vllm_fixtures import copy_model_files
from tests.support import lease

pytestmark = pytest.mark.slow

Views = dict[int, dict[str, RawTensor]]


@pytest.fixture(scope="module")
def views(smollm2_dir: Path) -> Views:
    """Served views of versions 0, 1, 2: the checkpoint, then after each of two real AdamW steps."""
    require_sglang()
    import torch

    from tests.support.training import CpuTrainer

    def raw(view: dict) -> dict[str, RawTensor]:
        return {
            n: RawTensor("BF16", tuple(t.shape), t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1))
            for n, t in view.items()
        }

    trainer = CpuTrainer(smollm2_dir, batch_size=1, seq_len=32)
    out = {0: raw(trainer.served_view())}
    for v in (1, 2):
        trainer.step()
        out[v] = raw(trainer.served_view())
    return out


def write_patch(folder: Path, base: dict[str, RawTensor], target: dict[str, RawTensor], name: str) -> str:
    """Encode ``base`` -> ``target`` (cond) into ``folder/name``; returns the path."""
    path = folder / name
    path.write_bytes(diff_views(base, target, "cond").patch)
    return str(path)


def sums(view: dict[str, RawTensor]) -> dict[str, str]:
    return {n: checksum(t) for n, t in view.items()}


@pytest.fixture
def adapter(sglang_engine: SglangServer, sglang_workdir: Path) -> Iterator[SglangEngine]:
    """An adapter on the shared server, holding the engine's lease (released after)."""
    engine = SglangEngine(sglang_engine.url, sglang_workdir / "records", timeout_s=60)
    with lease.holding(engine, "sglang"):
        yield engine
    engine.close()


def commit(engine: SglangEngine, paths: list[str], start: int, end: int) -> dict:
    """What the sidecar does for one delta: check while serving, pause, write, flush, resume."""
    engine.stage_patches([(paths, start, end)])
    engine.pause()
    try:
        report = engine.commit_staged(end)
        engine.reset_prefix_cache()
    finally:
        engine.resume()
    return report


def test_patches_the_engine_cannot_place_or_whose_base_differs_are_refused_and_the_server_keeps_serving(
    sglang_engine, adapter, views, sglang_workdir, smollm2_dir
):
    """A patch naming a tensor SGLang has no place for, one of the wrong shape and one on another
    base are refused before any write (the loader never raises: the server stays up, holding its
    bits and its answers); a snapshot load then a real step commit verified."""
    adapter.pause()
    try:
        adapter.load_snapshot([str(smollm2_dir / "model.safetensors")], 0, sums(views[0]))
        adapter.reset_prefix_cache()
    finally:
        adapter.resume()
    before = sglang_engine.greedy()
    name = "model.layers.0.self_attn.q_proj.weight"
    q = views[0][name]
    stray = {"model.layers.0.self_attn.q_proj.bias": RawTensor("BF16", (576,), np.arange(576, dtype=np.uint16))}
    moved = {k: RawTensor(t.dtype, t.shape, t.bits ^ np.uint16(1)) for k, t in stray.items()}
    wrong_shape = {name: RawTensor("BF16", (q.shape[0] // 2, q.shape[1] * 2), q.bits)}
    cases = {
        "UnmappedTensor": write_patch(sglang_workdir, stray, moved, "unmapped.patch"),
        "TensorSetMismatch": write_patch(
            sglang_workdir,
            wrong_shape,
            {name: RawTensor("BF16", wrong_shape[name].shape, views[1][name].bits)},
            "shape.patch",
        ),
        "BaseMismatch": write_patch(sglang_workdir, {name: views[1][name]}, {name: views[2][name]}, "base.patch"),
    }
    for cause, path in cases.items():
        with pytest.raises(ApplyRefusedError) as refused:
            commit(adapter, [path], 0, 1)
        assert refused.value.details["cause"] == cause, refused.value
        assert sglang_engine.proc.poll() is None, "the server died"
    with pytest.raises(EngineStateError):
        commit(adapter, [cases["BaseMismatch"]], 1, 2)  # the engine holds version 0, not 1
    state = adapter.state()
    assert (state.version, state.phase) == (0, "idle")
    assert adapter.checksums(sorted(views[0])) == sums(views[0])
    assert sglang_engine.greedy() == before
    report = commit(adapter, [write_patch(sglang_workdir, views[0], views[1], "v1.patch")], 0, 1)
    assert report["tensors"] > 0 and report["verify_s"] >= 0
    assert adapter.state().version == 1 and adapter.checksums(sorted(views[1])) == sums(views[1])


@pytest.mark.engine
@pytest.mark.heavy
def test_tp2_head_padding_patched_equals_a_fresh_tp2_server(views, smollm2_dir, tmp_path):
    """TP = 2 pads SmolLM2's 9 query / 3 KV heads to 12 / 4 (per rank qkv_proj [640, 576], o_proj
    [576, 384]): two real steps applied through the loader on both ranks give, bit for bit, the
    greedy answers of a fresh TP = 2 server started from version 2's checkpoint; the padding is
    never addressed (every tensor's checksum is the target's, gathered over the ranks)."""
    require_sglang()
    engine = SglangServer(smollm2_dir, tmp_path / "tp2.log", tp=2)
    try:
        engine.wait_ready()
        adapter = SglangEngine(engine.url, tmp_path / "records", timeout_s=120)
        try:
            lease.take(adapter, "tp2")  # every rank's, through the loader's first call, then the ranks' sockets
            adapter.set_version(0, None)
            assert adapter.checksums(sorted(views[0])) == sums(views[0])
            for v in (1, 2):
                commit(adapter, [write_patch(tmp_path, views[v - 1], views[v], f"v{v}.patch")], v - 1, v)
            assert adapter.state().version == 2 and adapter.checksums(sorted(views[2])) == sums(views[2])
            patched = engine.greedy()
        finally:
            adapter.close()
    finally:
        engine.stop()
    folder = tmp_path / "checkpoint-v2"
    save_checkpoint(folder, views[2])
    copy_model_files(smollm2_dir, folder)
    fresh = SglangServer(folder, tmp_path / "fresh-tp2.log", tp=2, loader=False)
    try:
        fresh.wait_ready()
        assert patched == fresh.greedy(), "the patched TP = 2 engine differs from a fresh TP = 2 engine at version 2"
    finally:
        fresh.stop()


def test_a_plan_staged_before_another_write_is_staged_again_in_the_pause(
    sglang_engine, adapter, views, sglang_workdir, smollm2_dir
):
    """At TP = 1 the loader's stager decodes and checks a patch while the engine serves and, the
    engine paused, writes it itself (the scheduler thread held in its paused loop); a loader
    write between the staging and the commit (here a snapshot load of the same bits) makes the
    plan stale: the stager writes nothing, an update call stages again in the pause and ends
    verified all the same, and the next plan staged while serving is written by the stager."""

    def snapshot() -> None:
        adapter.pause()
        try:
            adapter.load_snapshot([str(smollm2_dir / "model.safetensors")], 0, sums(views[0]))
            adapter.reset_prefix_cache()
        finally:
            adapter.resume()

    snapshot()
    staged = adapter.stage_patches([([write_patch(sglang_workdir, views[0], views[1], "stale.patch")], 0, 1)])
    assert staged["in_engine"] and staged["decode_s"] > 0
    adapter.pause()
    try:
        adapter.load_snapshot([str(smollm2_dir / "model.safetensors")], 0, sums(views[0]))
        report = adapter.commit_staged(1)
    finally:
        adapter.resume()
    assert report["staged_while_serving"] is False and report["committed"] is False
    assert adapter.state().version == 1 and adapter.checksums(sorted(views[1])) == sums(views[1])
    report = commit(adapter, [write_patch(sglang_workdir, views[1], views[2], "fresh.patch")], 1, 2)
    assert report["staged_while_serving"] is True
    assert report["committed"] is True, "not written by the stager (the scheduler's paused loop not held?)"
    assert report["flushed"] is True  # commit() paused with pause(): the sidecar resets the cache
    assert adapter.state().version == 2 and adapter.checksums(sorted(views[2])) == sums(views[2])


def test_the_loader_and_its_control_socket_refuse_changes_without_the_lease(
    sglang_engine, adapter, views, sglang_workdir, smollm2_dir
):
    """Called directly, past any adapter: the loader's state-changing ops (an update call) and the
    control socket's staging and commit refuse an owner without the live lease, by its records and
    never by raising (the server stays up), and change nothing; another owner's take is refused
    naming the holder through the socket, without an update call; read-only ops need no lease."""
    import hashlib
    import json
    import uuid

    import httpx

    from stitchboard.sidecar.engines.sglang.adapter import _request_tensor
    from stitchboard.sidecar.engines.sglang.loader import LOADER_PATH
    from stitchboard.sidecar.engines.sglang.stager import ask, control_address
    from stitchboard.sidecar.errors import LeaseNotHeldError

    holder = adapter.known_lease().owner
    records = sglang_workdir / "intruder-records"
    before = adapter.state()
    held = adapter.checksums(sorted(views[0]))

    def loader(req: dict) -> dict:
        req = {"id": uuid.uuid4().hex, "record_dir": str(records), **req}
        body = {"serialized_named_tensors": [_request_tensor(req)], "load_format": LOADER_PATH, "flush_cache": False}
        httpx.post(f"{sglang_engine.url}/begin_weight_update", json={}, timeout=120).raise_for_status()
        try:
            httpx.post(f"{sglang_engine.url}/update_weights_from_tensor", json=body, timeout=300).raise_for_status()
        finally:
            httpx.post(f"{sglang_engine.url}/end_weight_update", json={}, timeout=120).raise_for_status()
        record = json.loads((records / "rank0.json").read_text())
        assert record["request"] == req["id"]
        return record["answer"]

    path = write_patch(sglang_workdir, views[0], views[1], "lease.patch")
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    snapshot = str(smollm2_dir / "model.safetensors")
    changes = {
        "apply": {"steps": [{"paths": [path], "digests": [digest]}], "what": "0->1"},
        "load_snapshot": {"paths": [snapshot], "digests": ["0" * 64], "checksums": sums(views[0]), "what": "s->0"},
        "label": {},
    }
    for op, args in changes.items():
        refused = loader({"op": op, "owner": "intruder", **args})
        assert not refused["ok"] and refused["error"]["type"] == "LeaseNotHeld", (op, refused)
        assert refused["error"]["holder"] == holder and refused["lease"]["holder"] == holder
        anonymous = loader({"op": op, **args})
        assert not anonymous["ok"] and "owner" in anonymous["error"]["message"], (op, anonymous)
    address = control_address(int(sglang_engine.url.rsplit(":", 1)[1]), 0)
    staged = ask(address, {"op": "stage", "id": "x", "owner": "intruder", "steps": changes["apply"]["steps"]}, 60)
    committed = ask(address, {"op": "commit", "id": "y", "owner": "intruder", "plan": "x", "what": "0->1"}, 60)
    taken = ask(address, {"op": "lease", "owner": "intruder", "ttl_s": 5.0}, 60)
    for refused in (staged, committed, taken):
        assert refused["error"]["type"] == "LeaseNotHeld" and refused["error"]["holder"] == holder, refused
    intruder = SglangEngine(sglang_engine.url, sglang_workdir / "intruder-adapter", timeout_s=60)
    try:
        with pytest.raises(LeaseNotHeldError) as raised:
            intruder.take_lease("intruder", 5.0)
        assert raised.value.details["holder"] == holder and 0 < raised.value.details["expires_in_s"] <= 10.0
        assert not (sglang_workdir / "intruder-adapter").exists(), "the take went through an update call"
    finally:
        intruder.close()
    # An adapter whose lease was ended behind its back (its grant not run out: no renewal first) is
    # refused by the loader; the version label its call made SGLang set goes back as it was.
    label = httpx.get(f"{sglang_engine.url}/model_info", timeout=60).json()["weight_version"]
    adapter.release_lease(holder)
    stale = SglangEngine(sglang_engine.url, sglang_workdir / "stale-records", timeout_s=60)
    try:
        stale.take_lease("stale", 60.0)
        assert ask(address, {"op": "lease", "owner": "stale", "release": True}, 60)["lease"]["holder"] is None
        adapter.take_lease(holder, lease.TEST_TTL_S)
        with pytest.raises(LeaseNotHeldError):
            stale.set_version(before.version + 7, before.version)
        with pytest.raises(LeaseNotHeldError):
            stale.apply_patch(path, before.version, before.version + 1)
    finally:
        stale.close()
    assert httpx.get(f"{sglang_engine.url}/model_info", timeout=60).json()["weight_version"] == label
    assert sglang_engine.proc.poll() is None, "the server died"
    assert loader({"op": "state"})["ok"] and loader({"op": "checksums", "names": sorted(views[0])})["ok"]
    assert adapter.state() == before and before.phase == "idle"
    assert adapter.checksums(sorted(views[0])) == held, "a refused op changed the weights"
