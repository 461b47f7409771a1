"""Squash records never block a catch-up: a sidecar quarantines a squash that fails a check and
plans around it (real bulletin over HTTP, the trainer's Publisher, fake engines, real codec).

Two faults the bulletin cannot see, each of which left a replica at its version for good:

* a squash whose index is right but whose bits are wrong (uploaded around the trainer's check):
  the engine decodes it on its base and refuses it, and the anchor route went through it again;
* a squash blob corrupted in the store out of band, same size: its download fails its sha256,
  and every plan (the anchor route's too) kept preferring it.

:class:`DecodingEngine` stages as the real engines do (every patch decoded on the engine's own
bits with the real codec, refused before any write when it misses its target checksums); the
plain :class:`FakeEngine` decodes only when it writes, so its failure comes at apply.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto.apply import apply_patch
from stitchboard.proto.decode import read_patch
from stitchboard.proto.errors import PatchError
from stitchboard.proto.schema import FileRef, VersionManifest
from stitchboard.proto.squash_schema import SquashManifest
from stitchboard.sidecar.errors import ApplyRefusedError
from stitchboard.sidecar.fetch import FetchedPlan, FetchedStep
from stitchboard.sidecar.quarantine import SquashQuarantine
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.squash import manifest_sha256
from tests.sidecar.fake_engine import FakeEngine, copy_view
from tests.sidecar.sidecar_helpers import same_bits
from tests.support.squash_chain import rl_steps, wrong_bits_squash


class DecodingEngine(FakeEngine):
    """The fake engine, staging as vLLM and SGLang do: each step's patches decoded and checked on
    (a copy of) its own bits, a refusal before any write when one fails (``cause``: the codec's)."""

    def stage_patches(self, steps: list[tuple[list[str], int, int]]) -> dict:
        answer = super().stage_patches(steps)
        with self._lock:
            view = copy_view(self.weights)
        try:
            for paths, _, _ in steps:
                for path in paths:
                    apply_patch(view, read_patch(Path(path).read_bytes()))
        except PatchError as exc:
            self.staged = None
            raise ApplyRefusedError(
                f"stitch_stage refused, nothing written: {exc.type}: {exc}", cause=exc.type, held=self.version
            ) from exc
        return answer


def publish(client: BulletinClient, run: str, views, tmp_path: Path, depths=()) -> None:
    with Publisher(client.url, run, client=client, squash_depths=depths, workdir=tmp_path / "pub") as pub:
        for view in views:
            pub.publish_view(view)


def put_wrong_squash(client: BulletinClient, run: str, views, base: int, target: int) -> SquashManifest:
    """Upload a squash with the right index and wrong bits straight to the bulletin (around the trainer's check)."""
    data = wrong_bits_squash(views, base, target)
    sha = hashlib.sha256(data).hexdigest()
    client.put_blob(run, sha, data)
    record = SquashManifest(
        run_id=run, base_version=base, target_version=target, encoding="cond",
        base_manifest_sha256=manifest_sha256(client.manifest(run, base)),
        target_manifest_sha256=manifest_sha256(client.manifest(run, target)),
        files=[FileRef(path=f"squash-v{base}-v{target}.safetensors", sha256=sha, size_bytes=len(data), role="patch")],
        size_bytes=len(data), changed_elements=1,
    )  # fmt: skip
    assert client.put_squash(record) is True, "the bulletin checks indexes only: it takes the squash"
    return record


def quarantines(sidecar, during: str) -> float:
    """``stitch_sidecar_squash_quarantines_total{during=...}`` of a sidecar."""
    text = sidecar.http.get("/metrics").text
    found = re.search(rf'^stitch_sidecar_squash_quarantines_total{{during="{during}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def staged_spans(engine: FakeEngine) -> list[list[tuple[int, int]]]:
    return [[step[1:] for step in args] for name, args in engine.calls if name == "stage_patches"]


def test_a_squash_with_wrong_bits_is_quarantined_at_staging(sc_publisher, sc_client, sc_start, tmp_path):
    run, views = sc_publisher.run, rl_steps(31, 3)
    publish(sc_client, run, views, tmp_path)
    put_wrong_squash(sc_client, run, views, 0, 3)
    assert [s.kind for s in sc_client.plan(run, 0, 3, squash=True).steps] == ["squash"]
    assert [s.kind for s in sc_client.plan(run, None, 3, squash=True).steps] == ["snapshot", "squash"], (
        "the anchor route goes through it too"
    )
    engine = DecodingEngine(copy_view(views[0]))
    sidecar = sc_start(engine, boot_version=0, refused_retry_s=0.2)
    sidecar.wait_applied(3, timeout_s=30)
    assert engine.version == 3 and same_bits(engine.weights, views[3]), "the engine holds version 3's exact bits"
    assert staged_spans(engine) == [[(0, 3)], [(0, 1), (1, 2), (2, 3)]], "the squash, refused; then the chain"
    health = sidecar.http.get("/health").json()
    (quarantined,) = health["squash_quarantine"]
    assert (quarantined["base_version"], quarantined["target_version"], quarantined["during"]) == (0, 3, "stage")
    assert "TargetMismatch" in quarantined["reason"], quarantined
    assert quarantines(sidecar, "stage") == 1.0 and health["status"] == "ok"


def test_a_squash_with_wrong_bits_found_at_apply_is_quarantined(sc_publisher, sc_client, sc_start, tmp_path):
    run, views = sc_publisher.run, rl_steps(32, 3)
    publish(sc_client, run, views, tmp_path)
    put_wrong_squash(sc_client, run, views, 0, 3)
    engine = FakeEngine(copy_view(views[0]))  # decodes only when it writes: refuses inside the pause
    sidecar = sc_start(engine, boot_version=0)
    sidecar.wait_applied(3, timeout_s=30)
    assert engine.version == 3 and same_bits(engine.weights, views[3])
    (quarantined,) = sidecar.http.get("/health").json()["squash_quarantine"]
    assert (quarantined["base_version"], quarantined["target_version"], quarantined["during"]) == (0, 3, "apply")
    assert quarantines(sidecar, "apply") == 1.0
    assert [s.kind for s in sc_client.plan(run, None, 3, squash=True).steps] == ["snapshot", "squash"]
    assert sidecar.app.state.reconciler.quarantine.plan(sc_client, run, None, 3).steps[-1].kind == "delta", (
        "its anchor route avoids the quarantined squash"
    )


def test_a_squash_blob_corrupted_in_the_store_is_quarantined_at_fetch(sc_publisher, sc_client, sc_start, tmp_path):
    run, views = sc_publisher.run, rl_steps(33, 3)
    publish(sc_client, run, views, tmp_path, depths=(3,))
    (squash,) = sc_client.squashes(run)
    (ref,) = squash.files
    blob = tmp_path / "store" / "runs" / run / "blobs" / ref.sha256
    blob.write_bytes(os.urandom(ref.size_bytes))  # out of band, same size
    assert [s.kind for s in sc_client.plan(run, None, 3, squash=True).steps] == ["snapshot", "squash"], (
        "the bulletin still prefers it, on the anchor route too"
    )
    engine = FakeEngine(copy_view(views[0]))
    sidecar = sc_start(engine, boot_version=0)
    sidecar.wait_applied(3, timeout_s=30)
    assert engine.version == 3 and same_bits(engine.weights, views[3])
    assert staged_spans(engine) == [[(0, 1), (1, 2), (2, 3)]], "the corrupt squash never reached the engine"
    (quarantined,) = sidecar.http.get("/health").json()["squash_quarantine"]
    assert (quarantined["base_version"], quarantined["target_version"], quarantined["during"]) == (0, 3, "fetch")
    assert "BlobMismatch" in quarantined["reason"], quarantined
    assert quarantines(sidecar, "fetch") == 1.0 and sidecar.status()["last_sync"]["route"] == "delta"


def test_only_refusals_about_the_patch_content_quarantine_the_plan_s_squashes(tmp_path):
    counter = Counter("q", "quarantines", ["during"], registry=CollectorRegistry())
    manifest = VersionManifest.model_construct(version=5)
    squash = FetchedStep(5, "squash", tmp_path, [tmp_path / "s"], manifest, 1)
    delta = FetchedStep(5, "delta", tmp_path, [tmp_path / "d"], manifest, 4)
    with_squash, chain = FetchedPlan(1, 5, [squash]), FetchedPlan(4, 5, [delta])
    quarantine = SquashQuarantine(counter)

    def refused(cause: str, **details) -> ApplyRefusedError:
        return ApplyRefusedError(f"refused: {cause}", cause=cause, held=1, **details)

    for not_content in (
        refused("BaseMismatch"),
        refused("EngineStateError"),
        refused("UnmappedTensor"),
        RuntimeError(),
    ):
        assert not quarantine.blame_engine(with_squash, not_content, "stage")
    assert not quarantine.blame_engine(chain, refused("TargetMismatch"), "stage"), "a plan without squashes"
    tp = refused("TpRankFailed", failed={"0": "BaseMismatch: moved", "1": "TargetMismatch: tensor 'w' decodes ..."})
    assert quarantine.blame_engine(with_squash, tp, "stage")
    assert quarantine.holds(1, 5) and not quarantine.holds(None, 5) and not quarantine.holds(4, 5)
    assert quarantine.blame_engine(with_squash, refused("PatchFormatError"), "apply"), "set aside already"
    assert [(q["base_version"], q["target_version"], q["during"]) for q in quarantine.body()] == [(1, 5, "stage")]
    assert counter.labels("stage")._value.get() == 1.0 and counter.labels("apply")._value.get() == 0.0
