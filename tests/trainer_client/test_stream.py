"""A delta publish taken tensor by tensor (trainer_client/stream.py): the same files as the whole-view path,
versions that pull bit-exact, and the kept view written only after a commit, never a caller's memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stitchboard.bulletin.errors import UnavailableError
from stitchboard.proto.checkpoint import plan_shards, write_shards, write_shards_streaming
from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor
from stitchboard.proto.dtypes import DTYPE_SIZES, bits_type
from stitchboard.trainer_client.encode_version import BaseTensor, encode_part
from stitchboard.trainer_client.errors import CheckpointNameError, PublishError, TiedWeightsError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from stitchboard.trainer_client.stream import StreamedView, ViewStreamer
from stitchboard.trainer_client.version_parts import PublishedVersion
from tests.trainer_client.publisher_scenarios import commits, flaky_client
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of

META = {"run": "r", "version": "1", "base_version": "0"}


def _published(view: dict[str, RawTensor], version: int = 0) -> PublishedVersion:
    tensors = {n: BaseTensor(t.dtype, tuple(t.shape), checksum(t)) for n, t in view.items()}
    return PublishedVersion(version, view, tensors, 0)


def _streamed(base: dict[str, RawTensor], new: dict[str, RawTensor], encoding: str, tied: bool = False) -> StreamedView:
    streamer = ViewStreamer(_published(base), encoding, tied)  # type: ignore[arg-type]
    for name, t in new.items():
        streamer.add(name, t)
    return streamer.finish()


def _views() -> tuple[dict[str, RawTensor], dict[str, RawTensor]]:
    trainer = ToyTrainer()
    base = view_of(trainer.model)
    trainer.step()
    return base, view_of(trainer.model)


@pytest.mark.parametrize("encoding", ["cond", "xor", "overwrite"])
def test_the_streamed_patch_is_byte_identical_to_the_whole_view_patch(encoding: str) -> None:
    base, new = _views()
    streamed = _streamed(base, new, encoding)
    whole = encode_part(new, _published(base).tensors, base, encoding, META)  # type: ignore[arg-type]
    got = streamed.part(META)
    assert got == whole
    assert got.changed_elements > 0 and not got.tensor_set_changed


def test_a_changed_tensor_set_streams_the_common_tensors_and_keeps_the_new_ones_whole() -> None:
    base, new = _views()
    new = dict(new)
    new["added.weight"] = RawTensor("F32", (3,), np.arange(3, dtype=np.uint32))
    new["3.bias"] = RawTensor("F32", (32,), np.zeros(32, dtype=np.uint32))  # dtype changed
    del new["3.weight"]
    streamed = _streamed(base, new, "cond")
    whole = encode_part(new, _published(base).tensors, base, "cond", META)
    assert streamed.part(META) == whole
    assert streamed.tensor_set_changed and set(streamed.whole) == {"added.weight", "3.bias"}
    kept = dict(base)
    got, owned = streamed.commit_into(kept, frozenset(kept))
    assert_same_view(got, new)
    assert owned == frozenset(new)


def test_commit_writes_owned_tensors_in_place_and_copies_a_callers_tensors() -> None:
    base, new = _views()
    streamed = _streamed(base, new, "cond")
    changed = sorted(streamed.changes)
    frozen = {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in base.items()}
    for t in frozen.values():
        t.bits.flags.writeable = False  # e.g. a memory-mapped checkpoint given to publish_view
    before = {n: t.bits.copy() for n, t in frozen.items()}
    got, owned = streamed.commit_into(dict(frozen), frozenset(frozen))
    assert_same_view(got, new)
    assert all(np.array_equal(frozen[n].bits, before[n]) for n in frozen)  # read-only: copied, never written
    kept = {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in base.items()}
    shared = dict(kept)
    got, owned = streamed.commit_into(kept, frozenset())  # not owned: the caller's
    assert_same_view(got, new)
    assert all(np.array_equal(shared[n].bits, base[n].bits) for n in shared)
    assert owned == frozenset(changed)
    tensors = dict(shared)
    got, owned = streamed.commit_into(shared, frozenset(shared))  # owned: written in place, no copy
    assert all(got[n] is tensors[n] for n in tensors)
    assert_same_view(tensors, new)


def test_a_tied_head_is_folded_when_equal_to_its_embedding_and_refused_when_not() -> None:
    base, new = _views()
    embedding = "model.embed_tokens.weight"
    base = {embedding if n == "0.weight" else n: t for n, t in base.items()}
    new = {embedding if n == "0.weight" else n: t for n, t in new.items()}
    folded = _streamed(base, {"lm_head.weight": new[embedding], **new}, "cond", tied=True)
    assert "lm_head.weight" not in folded.layout and folded.part(META) == _streamed(base, new, "cond").part(META)
    other = RawTensor("BF16", new[embedding].shape, new[embedding].bits.copy())
    other.bits[7] ^= 1
    for head_first in (True, False):
        streamer = ViewStreamer(_published(base), "cond", True)
        pairs = [("lm_head.weight", other), *new.items()] if head_first else [*new.items(), ("lm_head.weight", other)]
        for name, t in pairs:
            streamer.add(name, t)
        with pytest.raises(TiedWeightsError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
            streamer.finish()
    untied = _streamed(base, {"lm_head.weight": new[embedding], **new}, "cond", tied=False)
    assert "lm_head.weight" in untied.layout and "lm_head.weight" in untied.whole


def test_the_streaming_shard_writer_writes_the_files_write_shards_writes(tmp_path) -> None:
    rng = np.random.default_rng(0)
    view = {}
    for i, dtype in enumerate(list(DTYPE_SIZES) * 2):
        shape = (int(rng.integers(0, 4)), int(rng.integers(1, 6)))
        size = shape[0] * shape[1] * DTYPE_SIZES[dtype]
        view[f"layers.{i}.{dtype.lower()}"] = RawTensor(
            dtype, shape, rng.integers(0, 256, size=size, dtype=np.uint8).view(bits_type(dtype))
        )
    weight_map = plan_shards(view, 120)
    asked = []

    def one(name: str) -> RawTensor:
        asked.append(name)
        return view[name]

    whole = write_shards(tmp_path / "whole", view, weight_map)
    streamed = write_shards_streaming(tmp_path / "streamed", view, weight_map, one)
    assert len(whole) > 2 and [p.name for p in whole] == [p.name for p in streamed]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(whole, streamed, strict=True))
    assert sorted(asked) == sorted(view)  # each tensor asked for once
    with pytest.raises(ValueError, match="layout says"):
        write_shards_streaming(tmp_path / "bad", view, weight_map, lambda n: view["layers.0.bool"])


def _blob(pub: Publisher, run: str, ref, tmp_path) -> bytes:
    return pub.client.download_blob(run, ref.sha256, tmp_path / ref.sha256).read_bytes()


@pytest.mark.parametrize("encoding", ["cond", "xor"])
def test_streamed_publishes_write_the_whole_view_paths_files_and_pull_bit_exact(
    bulletin, run, tmp_path, encoding: str
) -> None:
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run, encoding=encoding, snapshot_every=3, max_shard_bytes=8 << 10) as pub:
        before = view_of(trainer.model)
        pub.publish(trainer.model, step=0)
        for step in range(1, 5):
            trainer.step()
            streamed = pub._stream_of(trainer.model)  # what publish takes
            assert isinstance(streamed, StreamedView) and streamed.base_version == step - 1
            after = view_of(trainer.model)
            result = pub.publish(trainer.model, step=step)
            manifest = pub.client.manifest(run, result.version)
            assert result.version == step and manifest.snapshot == (step == 3)
            meta = {"run": run, "version": str(step), "base_version": str(step - 1)}
            base = {n: BaseTensor(t.dtype, tuple(t.shape), checksum(t)) for n, t in before.items()}
            want = encode_part(after, base, before, encoding, meta)  # type: ignore[arg-type]
            (patch,) = manifest.files_of("patch")
            assert _blob(pub, run, patch, tmp_path) == want.patch
            if manifest.snapshot:
                shards = write_shards(tmp_path / f"want-{step}", after, plan_shards(after, 8 << 10))
                got = {f.path: _blob(pub, run, f, tmp_path) for f in manifest.files_of("snapshot")}
                assert len(shards) > 1 and all(got[p.name] == p.read_bytes() for p in shards)
            assert_same_view(rebuild_version(pub.client, run, step, workdir=tmp_path).view, after)
            assert_same_view(dict(pub.kept_view()), after)
            before = after


def test_a_failed_commit_leaves_the_kept_view_and_the_next_publish_goes_on(bulletin, run, tmp_path) -> None:
    trainer = ToyTrainer()
    down = {"on": False}
    client, _ = flaky_client(bulletin.url, lambda r: "down" if down["on"] and commits(r) else None, retries=0)
    with Publisher(bulletin.url, run, client=client) as pub:
        pub.publish(trainer.model)
        kept = view_of(trainer.model)
        trainer.step()
        down["on"] = True
        with pytest.raises(UnavailableError):
            pub.publish(trainer.model)
        assert_same_view(dict(pub.kept_view()), kept)  # nothing written before a commit
        down["on"] = False
        trainer.step()
        assert pub.publish(trainer.model).version == 1
        assert_same_view(rebuild_version(pub.client, run, 1, workdir=tmp_path).view, view_of(trainer.model))
    client.close()


def test_a_lost_commit_answer_is_settled_before_a_stream_is_diffed(bulletin, run, tmp_path) -> None:
    trainer = ToyTrainer()
    lose = {"left": 0}

    def mode(request) -> str | None:
        if lose["left"] and commits(request):
            lose["left"] -= 1
            return "lose"
        return None

    client, _ = flaky_client(bulletin.url, mode, retries=0)
    with Publisher(bulletin.url, run, client=client) as pub:
        pub.publish(trainer.model)
        trainer.step()
        lose["left"] = 1
        with pytest.raises(UnavailableError):
            pub.publish(trainer.model)  # version 1 committed, the answer lost
        trainer.step()
        streamed = pub.stream_view(trainer.model.state_dict().items())  # adopts version 1 first
        assert streamed.base_version == 1 and pub.last_version == 1
        assert pub.publish_view(streamed, step=2).version == 2
        assert_same_view(rebuild_version(pub.client, run, 2, workdir=tmp_path).view, view_of(trainer.model))
    client.close()


def test_a_stale_streamed_view_is_refused(bulletin, run) -> None:
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run) as pub:
        pub.publish(trainer.model)
        trainer.step()
        stale = pub.stream_view(trainer.model.state_dict().items())
        pub.publish(trainer.model)
        with pytest.raises(PublishError, match="diffed against version 0, but the last published version is 1"):
            pub.publish_view(stale)


def test_a_view_given_to_publish_view_is_never_written(bulletin, run, tmp_path) -> None:
    trainer = ToyTrainer()
    given = view_of(trainer.model)
    copy = {n: t.bits.copy() for n, t in given.items()}
    with Publisher(bulletin.url, run) as pub:
        pub.publish_view(given)
        for _ in range(2):
            trainer.step()
            pub.publish(trainer.model)
        assert all(np.array_equal(given[n].bits, copy[n]) for n in given)
        assert_same_view(rebuild_version(pub.client, run, 2, workdir=tmp_path).view, view_of(trainer.model))


def test_without_a_kept_view_stream_view_holds_the_whole_view(bulletin, run) -> None:
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run) as pub:
        first = pub.stream_view(trainer.model.state_dict().items())
        assert first.base_version is None and set(first.whole) == set(view_of(trainer.model))
        assert pub.publish_view(first).version == 0
        trainer.step()
        with torch.no_grad():
            second = pub.stream_view(trainer.model.state_dict().items())
        assert second.base_version == 0 and not second.whole


def test_stream_view_of_a_stream_is_the_delta_publish_takes_of_the_model(bulletin, run) -> None:
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run) as pub:
        pub.publish(trainer.model)
        trainer.step()
        wrapped = ((f"module._orig_mod.{n}", t) for n, t in trainer.model.state_dict().items())  # verl's stream
        streamed = pub.stream_view(wrapped)
        taken = pub._stream_of(trainer.model)
        assert taken is not None and streamed.part(META) == taken.part(META) and streamed.checksums == taken.checksums
        weight = trainer.model.state_dict()["1.weight"]
        with pytest.raises(CheckpointNameError, match="both map to checkpoint name '1.weight'"):
            pub.stream_view([("module.1.weight", weight), ("1.weight", weight)])


def test_stream_view_casts_each_tensor_before_reading_the_next(bulletin, run) -> None:
    """A weight generator may hand every tensor of a shape in one reused buffer (refilled for the next): the stream
    copies each one before it asks for the next, so the delta is the model's."""
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run) as pub:
        pub.publish(trainer.model)
        trainer.step()
        buffers: dict[tuple[int, ...], torch.Tensor] = {}

        def reusing():
            for name, t in trainer.model.state_dict().items():
                buf = buffers.setdefault(tuple(t.shape), torch.empty_like(t))
                buf.copy_(t)
                yield name, buf

        streamed = pub.stream_view(reusing())
        taken = pub._stream_of(trainer.model)
        assert taken is not None and streamed.part(META) == taken.part(META) and streamed.checksums == taken.checksums
        assert len(buffers) < len(trainer.model.state_dict())  # some buffers were reused
