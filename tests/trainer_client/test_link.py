"""The encoding chosen by the link (trainer_client/link.py) and the publisher's row parts: versions coded
``xor`` on a fast link and ``cond`` on a slow one, in parts, that pull bit-exact."""

from __future__ import annotations

import json

import pytest

from stitchboard.proto.codec import FORMAT, PARTS_FORMAT_VERSION
from stitchboard.proto.container import parse_safetensors
from stitchboard.proto.decode import read_patch
from stitchboard.trainer_client import link
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.resume import rebuild_version
from tests.trainer_client.toy import ToyTrainer, assert_same_view, view_of


def test_the_choice_follows_the_break_even_scaled_to_cores_and_density() -> None:
    even = link.BREAK_EVEN_BYTES_PER_S
    assert link.choose_encoding(None, "cond", 2, None) == "cond"
    assert link.choose_encoding(even * 1.1, "cond", 2, None) == "xor"
    assert link.choose_encoding(even * 0.9, "cond", 2, None) == "cond"
    assert link.choose_encoding(even * 1.1, "cond", 4, None) == "cond"  # twice the cores decode cond twice as fast
    assert link.choose_encoding(even * 1.1, "cond", 2, 0.005) == "xor"
    assert link.choose_encoding(even * 0.9, "cond", 2, 0.005) == "xor"  # half the changes: half the bytes saved
    assert link.choose_encoding(even * 100, "overwrite", 2, None) == "overwrite"
    with pytest.raises(ValueError):
        link.choose_encoding(0, "cond", 2, None)


@pytest.mark.parametrize(("link_bytes_per_s", "want"), [(1e3, "cond"), (1e12, "xor")])
def test_versions_are_coded_for_the_link_in_parts_and_pull_bit_exact(
    bulletin, run, tmp_path, link_bytes_per_s: float, want: str
) -> None:
    trainer = ToyTrainer()
    with Publisher(bulletin.url, run, part_bytes=256, link_bytes_per_s=link_bytes_per_s, snapshot_every=100) as pub:
        pub.publish(trainer.model, step=0)
        for step in (1, 2):
            trainer.step()
            result = pub.publish(trainer.model, step=step)
            manifest = pub.client.manifest(run, result.version)
            assert manifest.encoding == want
            (ref,) = manifest.files_of("patch")
            data = pub.client.download_blob(run, ref.sha256, tmp_path / ref.sha256).read_bytes()
            assert json.loads(parse_safetensors(data)[0][FORMAT])["format_version"] == PARTS_FORMAT_VERSION
            assert any(e.parts for e in read_patch(data).entries.values())
            assert_same_view(rebuild_version(pub.client, run, step, workdir=tmp_path).view, view_of(trainer.model))


def test_bad_link_settings_are_refused(bulletin, run) -> None:
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        Publisher(bulletin.url, run, link_bytes_per_s=0)
    with pytest.raises(ValueError, match="part_bytes"):
        Publisher(bulletin.url, run, part_bytes=0)
