"""The Miles post-write hook and ``watch --layout miles`` (no engine): version folders written in Miles' format
(tests/trainer_client/miles_writer.py) from real AdamW steps on SmolLM2, published through a real bulletin over
loopback; every version rebuilt from the bulletin equals the trainer's view; every refusal publishes nothing."""

from __future__ import annotations

import json
import shutil
import struct
from argparse import Namespace
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.steps import recorded_step
from stitchboard.proto.container import RawTensor
from stitchboard.trainer_client import miles
from stitchboard.trainer_client.errors import MilesBaseVersionError, MilesChecksumError, MilesDeltaError
from stitchboard.trainer_client.miles_delta import MilesView
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.served_view import to_raw
from stitchboard.trainer_client.watch import Watcher
from stitchboard.trainer_client.watch_layouts import miles_layout, read_stable
from tests.support.trajectory import Trajectory
from tests.trainer_client.miles_writer import INDEX_NAME, MilesWriter
from tests.trainer_client.toy import assert_same_view

State = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def steps(smollm2_trajectory: Trajectory) -> list[State]:
    """Miles' gathered HF tensors (bf16) after each of 2 real AdamW steps on SmolLM2 (the recorded trajectory)."""
    trainer, out = smollm2_trajectory.replay(), []
    for _ in range(2):
        trainer.step()
        out.append({n: t.detach().clone() for n, t in trainer.served_view().items()})
    return out


def _raw(state: State) -> dict[str, RawTensor]:
    return {n: to_raw(t) for n, t in state.items()}


@pytest.fixture
def hook_env(bulletin, run: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The hook's ``STITCH_CLIENT_*`` settings for a fresh run (no replicas waited for); its bridges closed after."""
    monkeypatch.setenv("STITCH_CLIENT_BULLETIN", bulletin.url)
    monkeypatch.setenv("STITCH_CLIENT_RUN", run)
    monkeypatch.setenv("STITCH_CLIENT_MILES_MIN_REPLICAS", "0")
    monkeypatch.delenv("RANK", raising=False)
    yield run
    miles.close_bridges()


def _miles(delta_dir: Path, smollm2_dir: Path) -> Callable[[str | Path], None]:
    """Miles calling the hook: ``args`` as Miles' parser makes them, no engine handles."""
    args = Namespace(update_weight_disk_dir=str(delta_dir), hf_checkpoint=str(smollm2_dir))
    return lambda folder: miles.post_write(args, str(folder), [])


def _latest(client: BulletinClient, run: str) -> tuple[int, int | None] | None:
    info = client.latest_info(run)
    return None if info is None else (info.version, recorded_step(client.manifest(run, info.version)))


@pytest.mark.parametrize("encoding,checksum", [("xor", "xxh3-128"), ("overwrite", "blake3")])
def test_hook_publishes_each_miles_version_bit_exact(
    smollm2_dir, steps, bulletin, hook_env, tmp_path, encoding, checksum
):
    delta_dir = tmp_path / "delta"
    writer = MilesWriter(delta_dir, smollm2_dir, encoding=encoding, checksum_format=checksum, ranks=2)
    hook = _miles(delta_dir, smollm2_dir)
    hook(delta_dir)  # Miles' baseline: the hf checkpoint becomes version 0 at step 0
    folders = [writer.write(state) for state in steps]
    assert len({p.name for p in folders[0].iterdir()}) == 3  # two ranks' shards and the index
    for folder in folders:
        hook(folder)
    hook(folders[-1])  # a retried hook: nothing more
    with BulletinClient(bulletin.url) as client:
        assert _latest(client, hook_env) == (2, 2)
        assert_same_view(rebuild_version(client, hook_env, 0).view, dict(read_stable(smollm2_dir)))
        for version, state in enumerate(steps, start=1):
            assert recorded_step(client.manifest(hook_env, version)) == version
            assert_same_view(rebuild_version(client, hook_env, version).view, _raw(state))


def test_other_ranks_return_at_once(smollm2_dir, bulletin, hook_env, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    _miles(tmp_path, smollm2_dir)(tmp_path)
    with BulletinClient(bulletin.url) as client:
        assert client.latest_info(hook_env) is None


def _rewrite_shard_metadata(path: Path, edit: Callable[[dict[str, str]], None]) -> None:
    """Rewrite a safetensors file's ``__metadata__`` in place (the tensor bytes kept)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header["__metadata__"])
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n :])


def _edit_index(folder: Path, key: str, value: str) -> None:
    index = json.loads((folder / INDEX_NAME).read_text())
    index["metadata"][key] = value
    (folder / INDEX_NAME).write_text(json.dumps(index))


def _flip_delta_byte(folder: Path) -> None:
    shard = min(folder.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x10  # inside the last tensor's compressed delta
    shard.write_bytes(bytes(data))


def _wrong_checksum(folder: Path) -> None:
    shard = max(folder.glob("model-*.safetensors"))

    def edit(meta: dict[str, str]) -> None:
        name = min(meta)
        meta[name] = "0" * len(meta[name])

    _rewrite_shard_metadata(shard, edit)


#: Each fault: (what it does to weight_v000002, the error, the file the message names).
FAULTS: dict[str, tuple[Callable[[Path], None], type, str]] = {
    "wrong checksum": (_wrong_checksum, MilesChecksumError, "model-00001-of-00002.safetensors"),
    "corrupted delta": (_flip_delta_byte, MilesDeltaError, "model-00000-of-00002.safetensors"),
    "missing shard": (lambda f: (f / "model-00001-of-00002.safetensors").unlink(), MilesDeltaError, "model-00001"),
    "missing index": (lambda f: (f / INDEX_NAME).unlink(), MilesDeltaError, INDEX_NAME),
    "unknown encoding": (lambda f: _edit_index(f, "delta_encoding", "bitplane"), MilesDeltaError, INDEX_NAME),
    "unknown checksum kind": (lambda f: _edit_index(f, "checksum_format", "md5"), MilesDeltaError, INDEX_NAME),
    "unknown compression": (lambda f: _edit_index(f, "compression_format", "lz4"), MilesDeltaError, INDEX_NAME),
    "base not the latest": (lambda f: _edit_index(f, "base_version", "000000"), MilesBaseVersionError, INDEX_NAME),
}


def test_refused_versions_publish_nothing_and_the_intact_one_publishes(
    smollm2_dir, steps, bulletin, hook_env, tmp_path
):
    delta_dir = tmp_path / "delta"
    writer = MilesWriter(delta_dir, smollm2_dir, encoding="xor", checksum_format="adler32", ranks=2)
    hook = _miles(delta_dir, smollm2_dir)
    hook(delta_dir)
    hook(writer.write(steps[0]))
    folder = writer.write(steps[1])
    pristine = tmp_path / "pristine"
    shutil.copytree(folder, pristine)
    with BulletinClient(bulletin.url) as client:
        for fault, (apply, error, file) in FAULTS.items():
            apply(folder)
            with pytest.raises(error) as raised:
                hook(folder)
            assert file in raised.value.message and "version 2" in raised.value.message, fault
            assert raised.value.details["version"] == 2, fault
            assert _latest(client, hook_env) == (1, 1), f"{fault}: something was published"
            shutil.rmtree(folder)
            shutil.copytree(pristine, folder)
        hook(folder)
        assert _latest(client, hook_env) == (2, 2)
        assert_same_view(rebuild_version(client, hook_env, 2).view, _raw(steps[1]))


def test_a_version_ahead_of_the_bulletin_is_refused(smollm2_dir, steps, bulletin, hook_env, tmp_path):
    delta_dir = tmp_path / "delta"
    writer = MilesWriter(delta_dir, smollm2_dir)
    hook = _miles(delta_dir, smollm2_dir)
    hook(delta_dir)
    writer.write(steps[0])  # version 1 never reaches the hook
    with pytest.raises(MilesBaseVersionError, match="version 2 is based on version 1.*latest version is at step 0"):
        hook(writer.write(steps[1]))
    with BulletinClient(bulletin.url) as client:
        assert _latest(client, hook_env) == (0, 0)


def test_a_restarted_miles_over_a_later_run_is_refused(smollm2_dir, steps, bulletin, hook_env, tmp_path):
    delta_dir = tmp_path / "delta"
    writer = MilesWriter(delta_dir, smollm2_dir)
    hook = _miles(delta_dir, smollm2_dir)
    hook(delta_dir)
    hook(writer.write(steps[0]))
    miles.close_bridges()  # a new Miles process
    MilesWriter(delta_dir, smollm2_dir)
    with pytest.raises(MilesBaseVersionError, match="starts its versions over.*at step 1"):
        hook(delta_dir)


def test_a_restarted_hook_replays_the_folders_to_its_base(smollm2_dir, steps, bulletin, hook_env, tmp_path):
    delta_dir = tmp_path / "delta"
    writer = MilesWriter(delta_dir, smollm2_dir, encoding="overwrite", checksum_format="xxh3-128")
    hook = _miles(delta_dir, smollm2_dir)
    hook(delta_dir)
    hook(writer.write(steps[0]))
    miles.close_bridges()  # the hook's process restarted: its view is gone
    hook(writer.write(steps[1]))
    with BulletinClient(bulletin.url) as client:
        assert_same_view(rebuild_version(client, hook_env, 2).view, _raw(steps[1]))


def test_view_decodes_the_pairs_the_hook_tests_leave_out(smollm2_dir, steps, tmp_path):
    """(The hook tests publish xor + xxh3-128, overwrite + blake3, xor + adler32, overwrite + xxh3-128.)"""
    base = dict(read_stable(smollm2_dir))
    for encoding, kind in (("xor", "blake3"), ("overwrite", "adler32")):
        delta_dir = tmp_path / f"{encoding}-{kind}"
        writer = MilesWriter(delta_dir, smollm2_dir, encoding=encoding, checksum_format=kind, ranks=3)
        folders = [writer.write(state) for state in steps]
        view = MilesView(lambda: base)
        assert_same_view(view.read(folders[1]), _raw(steps[1]))  # replays version 1 first
        assert view.version == 2
        shutil.rmtree(delta_dir)


def test_watch_layout_miles_publishes_the_folders_bit_exact(smollm2_dir, steps, bulletin, run, tmp_path):
    delta_dir = tmp_path / "delta"
    writer = MilesWriter(delta_dir, smollm2_dir, encoding="xor", checksum_format="blake3")
    with BulletinClient(bulletin.url) as client:
        watcher = Watcher(delta_dir, run, client, layout=miles_layout(smollm2_dir), assets=smollm2_dir, say=print)
        try:
            watcher.resume()
            for step, state in enumerate(steps, start=1):
                writer.write(state)
                assert [(o.step, o.version, o.status) for o in watcher.poll()] == [(step, step - 1, "published")]
                assert_same_view(rebuild_version(client, run, step - 1).view, _raw(state))
        finally:
            watcher.close()
