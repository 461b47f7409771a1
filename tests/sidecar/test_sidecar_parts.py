"""A sidecar follows a run published in parts (what a shard-local publish of several ranks writes: every tensor
checked by ``xxh3_128_parts`` over its ``parts`` layout, no whole-tensor ``xxh3_128`` anywhere): the anchor is
loaded and verified by the parts checksums, deltas apply, a restarted sidecar or a ``--boot-version`` claim is
checked by the parts checksums (and refused when the bits differ), and the anchor route staged while serving
builds its rebase patch from a view checked the same way."""

from __future__ import annotations

from stitchboard.proto.parts import layout_checksum
from stitchboard.proto.schema import XXH3_128, XXH3_128_PARTS
from tests.sidecar.fake_engine import FakeEngine
from tests.sidecar.sidecar_helpers import assert_at, make_view, same_bits


def _calls(engine: FakeEngine, since: int = 0) -> list[str]:
    return [m for m, _ in engine.calls[since:] if m != "health"]


def test_a_run_in_parts_is_loaded_applied_and_claimed_by_its_parts_checksums(sc_publisher, sc_start):
    sc_publisher.ranks = 2
    sc_publisher.publish(make_view(0))
    sc_publisher.step(1)
    sc_publisher.step(2)
    spec = sc_publisher.manifests[2].tensors[0]
    assert XXH3_128 not in spec.checksums and spec.parts == [(0, 0, 32), (0, 32, 64)]
    assert sc_publisher.manifests[2].checksums()[spec.name] == spec.checksums[XXH3_128_PARTS]

    first = sc_start(FakeEngine())
    assert_at(first, sc_publisher, 2)
    assert "load_snapshot" in _calls(first.engine) and "apply_patch" in _calls(first.engine)
    engine = first.engine
    first.stop()
    before = len(engine.calls)
    second = sc_start(engine)  # the engine records version 2: checked by its parts checksums, nothing loaded
    assert_at(second, sc_publisher, 2)
    assert _calls(engine, before) == ["checksums"]
    second.stop()

    booted = sc_start(FakeEngine(sc_publisher.views[1]), boot_version=1)  # booted from version 1's checkpoint
    assert_at(booted, sc_publisher, 2)
    assert booted.engine.count("load_snapshot") == 0
    booted.stop()

    wrong = sc_start(FakeEngine(sc_publisher.views[0]), boot_version=1)  # claims 1, holds 0's bits
    assert_at(wrong, sc_publisher, 2)
    assert wrong.engine.count("load_snapshot") == 1, "a claim whose parts checksums differ loads the anchor"


def test_the_anchor_route_of_a_run_in_parts_is_staged_while_serving(sc_publisher, sc_start):
    """Two refused stagings switch to the anchor route; its rebase patch is built from the anchor and deltas,
    checked against the target's parts checksums, and based on the engine's whole-tensor checksums."""
    sc_publisher.ranks = 2
    sc_publisher.publish(make_view(0))
    engine = FakeEngine()
    sidecar = sc_start(engine, refused_retry_s=0.3)
    sidecar.wait_applied(0)
    engine.refuse_stage = 2
    sc_publisher.step(1)
    status = sidecar.wait_applied(1)
    assert status["last_sync"]["route"] == "staged_anchor"
    assert same_bits(engine.weights, sc_publisher.views[1])
    name, t = next(iter(sorted(engine.weights.items())))
    layout = tuple(sc_publisher.manifests[1].tensor_map()[name].parts or ())
    assert layout_checksum(t.bits, t.shape, layout) == sc_publisher.manifests[1].checksums()[name]
