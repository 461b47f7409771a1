"""The trainer checks each squash against its own views before uploading it.

A squash whose index is right but whose bits are wrong passes every check the bulletin can make
(shown below: the bulletin stores one); the trainer decodes it on the base view it rebuilt and
compares with the latest view, and a wrong one is logged and never uploaded. Faults are injected
at the trainer's own seams: the encoder the squasher calls, and the old view handed to
:meth:`RecentViews.record`.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest

from stitchboard.proto.apply import apply_to_copy
from stitchboard.proto.codec import checksum, encode_tensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.errors import BaseMismatchError, TargetMismatchError
from stitchboard.proto.schema import FileRef
from stitchboard.proto.squash_schema import SquashManifest
from stitchboard.trainer_client import squash as squash_module
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.squash import RecentViews, encode_squash, manifest_sha256
from tests.codec.test_squash_roundtrip import FIRST, manifest_of
from tests.sidecar.fake_engine import copy_view
from tests.support.squash_chain import rl_steps, wrong_bits_squash


def test_a_squash_with_wrong_bits_is_never_uploaded(bulletin, run, tmp_path, monkeypatch, caplog):
    views = rl_steps(21, 4, numel=4096)

    def off_by_one_bit(name, base, target, encoding, **checksums):  # an encoder fault: the index stays right
        wrong = copy_view({name: target})[name]
        wrong.bits[0] ^= 1
        return encode_tensor(name, base, wrong, encoding, **checksums)

    monkeypatch.setattr(squash_module, "encode_tensor", off_by_one_bit)
    with bulletin.client() as client:
        with (
            caplog.at_level(logging.ERROR, logger="stitchboard.trainer_client"),
            Publisher(bulletin.url, run, client=client, squash_depths=(3,), workdir=tmp_path / "pub") as pub,
        ):
            for view in views:
                pub.publish_view(view)
        assert client.latest(run) == 4, "the versions are published"
        assert client.squashes(run) == [], "no wrong squash was uploaded"
        refused = [r.getMessage() for r in caplog.records if "failed its check" in r.getMessage()]
        assert len(refused) == 2 and "squash 0 -> 3" in refused[0] and "squash 1 -> 4" in refused[1], refused
        assert all("not uploaded" in m for m in refused), refused

        # What the check stops: the bulletin can check indexes only, and takes such a squash.
        data = wrong_bits_squash(views, 1, 4)
        ref = FileRef(
            path="squash-wrong.safetensors", sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), role="patch"
        )
        client.put_blob(run, ref.sha256, data)
        base, target = client.manifest(run, 1), client.manifest(run, 4)
        record = SquashManifest(
            run_id=run, base_version=1, target_version=4, encoding="cond", base_manifest_sha256=manifest_sha256(base),
            target_manifest_sha256=manifest_sha256(target), files=[ref], size_bytes=len(data), changed_elements=1,
        )  # fmt: skip
        assert client.put_squash(record) is True


def test_a_squash_from_a_wrong_base_view_is_refused():
    views = rl_steps(22, 3, numel=4096)
    name = min(views[0])
    same = np.flatnonzero((views[0][name].bits == views[1][name].bits) & (views[1][name].bits == views[2][name].bits))
    handed = copy_view(views[1])  # the trainer hands a wrong old view for version 2: one element off
    handed[name].bits[same[0]] ^= 1
    recent = RecentViews(3)
    recent.start(manifest_of(0, views[0]))
    for v in (1, 2, 3):
        old = handed if v == 2 else views[v - 1]
        recent.record(manifest_of(v, views[v]), old, views[v], manifest_of(v - 1, views[v - 1]).checksums())
    sums = manifest_of(3, views[3]).checksums()

    unchecked, _ = encode_squash(recent, FIRST, views[3], sums, "cond", {}, check=False)
    with pytest.raises(TargetMismatchError):  # what it would do on the real base
        apply_to_copy(views[0], read_patch(unchecked))
    with pytest.raises(BaseMismatchError, match=name):
        encode_squash(recent, FIRST, views[3], sums, "cond", {})
    assert checksum(views[0][name]) != checksum(recent.view_at(FIRST, views[3])[name])
