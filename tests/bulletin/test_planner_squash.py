"""The planner's cheapest route among chain, squash and anchor (pure functions over manifests)."""

from __future__ import annotations

import hashlib

import pytest

from stitchboard.bulletin.errors import NotFoundError
from stitchboard.bulletin.planner import make_plan
from stitchboard.proto.schema import FileRef, Plan, TensorSpec, VersionManifest, canonical_json
from stitchboard.proto.squash_schema import SquashManifest
from tests.bulletin.bulletin_helpers import make_manifest

RUN = "r"


def ref(name: str, size: int, role: str = "patch") -> FileRef:
    return FileRef(
        path=f"{name}.safetensors", sha256=hashlib.sha256(name.encode()).hexdigest(), size_bytes=size, role=role
    )


def run_of(delta_bytes: list[int], anchors: dict[int, int]) -> dict[int, VersionManifest]:
    """Versions 0..len(delta_bytes): version v > 0 has a delta of delta_bytes[v - 1]; anchors:
    version -> snapshot bytes."""
    out = {0: make_manifest(RUN, 0, [ref("snap-0", anchors.get(0, 10_000), "snapshot")])}
    for v, size in enumerate(delta_bytes, start=1):
        files = [ref(f"patch-{v}", size)] + ([ref(f"snap-{v}", anchors[v], "snapshot")] if v in anchors else [])
        out[v] = make_manifest(RUN, v, files)
    return out


def squash(manifests: dict[int, VersionManifest], base: int, target: int, size: int) -> SquashManifest:
    digest = {v: hashlib.sha256(canonical_json(m)).hexdigest() for v, m in manifests.items()}
    return SquashManifest(
        run_id=RUN, base_version=base, target_version=target, encoding="cond", base_manifest_sha256=digest[base],
        target_manifest_sha256=digest[target],
        files=[ref(f"squash-{base}-{target}", size)], size_bytes=size, changed_elements=1,
    )  # fmt: skip


def route(plan: Plan) -> list[tuple[str, int | None, int]]:
    return [(s.kind, s.base_version, s.version) for s in plan.steps]


def plan(manifests: dict[int, VersionManifest], start: int | None, to: int, squashes=()) -> Plan:
    return make_plan(RUN, start, to, manifests.get, squashes)


def test_a_squash_cheaper_than_the_chain_is_taken():
    m = run_of([100] * 6, {})
    s = squash(m, 1, 6, 300)
    p = plan(m, 1, 6, [s])
    assert route(p) == [("squash", 1, 6)] and p.total_bytes == 300
    assert p.steps[0].files == s.files


def test_the_chain_wins_when_the_squash_is_not_cheaper_and_on_a_tie():
    m = run_of([100] * 6, {})
    assert route(plan(m, 1, 6, [squash(m, 1, 6, 600)])) == [("delta", None, v) for v in range(2, 7)]
    assert route(plan(m, 1, 6, [squash(m, 1, 6, 500)])) == [("delta", None, v) for v in range(2, 7)], (
        "on equal bytes the deltas win"
    )


def test_the_anchor_wins_when_it_is_cheapest():
    m = run_of([100] * 6, {4: 150})
    p = plan(m, 1, 6, [squash(m, 1, 6, 400)])
    assert route(p) == [("snapshot", None, 4), ("delta", None, 5), ("delta", None, 6)] and p.total_bytes == 350


def test_deltas_then_a_squash_and_squashes_in_a_row():
    m = run_of([100] * 9, {})
    assert route(plan(m, 0, 6, [squash(m, 2, 6, 150)])) == [("delta", None, 1), ("delta", None, 2), ("squash", 2, 6)]
    both = [squash(m, 0, 4, 150), squash(m, 4, 8, 150), squash(m, 0, 8, 400)]
    assert route(plan(m, 0, 8, both)) == [("squash", 0, 4), ("squash", 4, 8)]
    assert route(plan(m, 0, 9, both)) == [("squash", 0, 4), ("squash", 4, 8), ("delta", None, 9)]


def test_a_squash_past_the_target_or_before_the_holder_is_not_used():
    m = run_of([100] * 6, {})
    assert route(plan(m, 1, 4, [squash(m, 1, 6, 10)])) == [("delta", None, v) for v in (2, 3, 4)]
    assert route(plan(m, 3, 6, [squash(m, 1, 6, 10)])) == [("delta", None, v) for v in (4, 5, 6)]


def test_squashes_are_not_used_unless_the_caller_asks():
    m = run_of([100] * 6, {})
    assert all(s.kind == "delta" for s in plan(m, 1, 6).steps)
    body = plan(m, 1, 6).model_dump(mode="json")
    assert all("base_version" not in s for s in body["steps"]), (
        "plans for older clients carry no field they would refuse"
    )


def test_a_squash_whose_versions_are_gone_or_differ_is_ignored():
    m = run_of([100] * 6, {})
    s = squash(m, 1, 6, 10)
    gone = {v: x for v, x in m.items() if v != 1}
    with pytest.raises(NotFoundError):
        plan(gone, 1, 6, [s])  # the holder's version is gone, and with it the way back to the anchor
    assert route(plan(gone, 2, 6, [s])) == [("delta", None, v) for v in (3, 4, 5, 6)]
    other = dict(m)
    other[6] = make_manifest(RUN, 6, [ref("patch-6-other", 100)])  # the run was published again: other manifest
    assert route(plan(other, 1, 6, [s])) == [("delta", None, v) for v in range(2, 7)]
    changed = dict(m)
    spec = TensorSpec(name="model.other", dtype="BF16", shape=[8], checksums={"xxh3_128": "0" * 32})
    anchor = make_manifest(RUN, 6, [ref("snap-6", 5000, "snapshot")])
    changed[6] = anchor.model_copy(
        update={"tensors": [*anchor.tensors, spec], "stats": anchor.stats.model_copy(update={"total_elements": 16})}
    )
    s6 = squash(changed, 1, 6, 10)
    assert route(plan(changed, 1, 6, [s6])) == [("snapshot", None, 6)], (
        "no squash (nor delta) across a tensor-set change"
    )


def test_a_plan_with_nothing_held_starts_at_an_anchor_and_may_squash_from_it():
    m = run_of([100] * 6, {})
    p = plan(m, None, 6, [squash(m, 0, 6, 50)])
    assert route(p) == [("snapshot", None, 0), ("squash", 0, 6)] and p.total_bytes == 10_050
