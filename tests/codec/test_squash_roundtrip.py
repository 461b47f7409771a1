"""Squashes through the real encoder and decoder: squash(A -> A+k) applied to A is A+k, bit for bit.

The trainer's path is exercised as it runs: every step is noted in a :class:`RecentViews`
(reverse records of the step's changed positions and old bits), the view of A is rebuilt from
the latest view and those records, and the squash is encoded with the same encoder as a delta.
Chains are random: shapes, dtypes (every one the codec handles), masks (none, all, one,
clustered, scattered), NaN payloads, -0.0, denormals, sign and exponent changes, and elements
that move away and back again.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stitchboard.proto import parts
from stitchboard.proto.apply import apply_to_copy
from stitchboard.proto.codec import checksum, encode_tensor, encoded_from_parts
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.dtypes import DTYPE_SIZES
from stitchboard.proto.errors import BaseMismatchError, SchemaError
from stitchboard.proto.schema import TensorSpec, VersionManifest, VersionStats
from stitchboard.proto.squash_schema import check_patch_lineage
from stitchboard.trainer_client.squash import RecentViews, encode_squash
from tests.codec.test_cond_codec import stepped, weight_like

from .helpers import copy_view, same_bits

SPECIAL_BF16 = np.array(
    [0x8000, 0x0001, 0x8001, 0x7FC1, 0xFFC3, 0x7F80, 0xFF80, 0x0080], dtype=np.uint16
)  # -0, denormals, NaN payloads, inf, smallest normal


#: Versions of the test chains start here (version 0 would have to be an anchor with a snapshot file).
FIRST = 10


def manifest_of(version: int, view: dict[str, RawTensor]) -> VersionManifest:
    """A manifest for ``view`` as version ``FIRST + version`` (what RecentViews reads: the checksums)."""
    specs = [
        TensorSpec(name=n, dtype=t.dtype, shape=list(t.shape), checksums={"xxh3_128": checksum(t)})
        for n, t in sorted(view.items())
    ]
    return VersionManifest(
        run_id="r",
        version=FIRST + version,
        base_version=FIRST + version - 1,
        snapshot=False,
        tensors=specs,
        files=[],
        stats=VersionStats(changed_elements=0, total_elements=sum(t.numel for t in view.values()), encoded_bytes=0),
    )


def next_view(view: dict[str, RawTensor], rng: np.random.Generator, mask: str) -> dict[str, RawTensor]:
    """One step of a chain: each tensor's elements changed under ``mask``."""
    out = copy_view(view)
    for t in out.values():
        n = t.numel
        if mask == "none" or n == 0:
            continue
        if mask == "all":
            frac, big = 1.0, 0.3
        elif mask == "one":
            frac, big = 1.0 / max(n, 1), 0.5
        else:
            frac, big = (0.05, 0.1) if mask == "scattered" else (0.0, 0.0)
        new = stepped(t.dtype, t.bits, rng, frac, big)
        if mask == "one":
            keep = np.ones(n, dtype=bool)
            keep[rng.integers(n)] = False
            new[keep] = t.bits[keep]
        if mask == "clustered":
            start = int(rng.integers(n))
            new = t.bits.copy()
            seg = slice(start, min(n, start + max(1, n // 8)))
            new[seg] = stepped(t.dtype, t.bits[seg], rng, 1.0, 0.2)
        if t.dtype == "BF16" and n >= SPECIAL_BF16.size and rng.random() < 0.5:
            at = rng.choice(n, SPECIAL_BF16.size, replace=False)
            new[at] = SPECIAL_BF16
        t.bits[:] = new
    return out


def chain(seed: int, dtypes: list[str], shapes: list[tuple[int, ...]], masks: list[str]) -> list[dict[str, RawTensor]]:
    rng = np.random.default_rng(seed)
    first = {
        f"t{i}.{d}": RawTensor(d, s, weight_like(d, int(np.prod(s, dtype=np.int64)), rng))
        for i, (d, s) in enumerate(zip(dtypes, shapes, strict=True))
    }
    views = [first]
    for mask in masks:
        views.append(next_view(views[-1], rng, mask))
    if len(views) > 2 and rng.random() < 0.5:  # one tensor moves away and comes back: the squash must not list it
        name = min(first)
        views[-1][name] = RawTensor(first[name].dtype, first[name].shape, views[-3][name].bits.copy())
    return views


def squash_of(views: list[dict[str, RawTensor]], base: int, encoding: str) -> bytes:
    """Note every step as the publisher does, then encode squash(base -> latest)."""
    recent = RecentViews(len(views))
    recent.start(manifest_of(0, views[0]))
    for v in range(1, len(views)):
        recent.record(manifest_of(v, views[v]), views[v - 1], views[v], manifest_of(v - 1, views[v - 1]).checksums())
    assert recent.bases() == [FIRST + v for v in range(len(views) - 1)]
    latest = manifest_of(len(views) - 1, views[-1])
    data, changed = encode_squash(recent, FIRST + base, views[-1], latest.checksums(), encoding, {"squash": "true"})
    assert changed == sum(int(np.count_nonzero(views[base][n].bits != views[-1][n].bits)) for n in views[-1])
    return data


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    dtypes=st.lists(st.sampled_from(sorted(DTYPE_SIZES)), min_size=1, max_size=4),
    masks=st.lists(st.sampled_from(["none", "all", "one", "clustered", "scattered"]), min_size=2, max_size=6),
    encoding=st.sampled_from(["cond", "cond", "xor", "overwrite"]),
    data=st.data(),
)
def test_squash_applied_to_its_base_is_the_latest_view(seed, dtypes, masks, encoding, data):
    shapes = [data.draw(st.sampled_from([(0,), (1,), (7,), (3, 5), (64, 33), (4099,)])) for _ in dtypes]
    views = chain(seed, dtypes, shapes, masks)
    base = data.draw(st.integers(0, len(views) - 3))
    patch = read_patch(squash_of(views, base, encoding))
    got = apply_to_copy(views[base], patch)
    assert same_bits(got, views[-1])
    for name, entry in patch.entries.items():
        assert entry.base["xxh3_128"] == checksum(views[base][name]) and entry.target["xxh3_128"] == checksum(
            views[-1][name]
        )
        assert checksum(views[base][name]) != checksum(views[-1][name]), "only tensors that differ are listed"


@pytest.mark.parametrize("encoding", ["cond", "xor"])
def test_a_squash_is_refused_on_any_other_base(encoding):
    views = chain(7, ["BF16", "F32"], [(64, 33), (4099,)], ["scattered"] * 4)
    patch = read_patch(squash_of(views, 1, encoding))
    for wrong in (0, 2, 3, 4):  # older, intermediate, and the target itself
        held = copy_view(views[wrong])
        with pytest.raises(BaseMismatchError):
            apply_to_copy(held, patch)
        assert same_bits(held, views[wrong]), "nothing was written"


def _spec(name: str, t: RawTensor, layout: tuple[tuple[int, int, int], ...] | None, both: bool = False) -> TensorSpec:
    """A manifest entry of ``t``: ``xxh3_128`` (and, with ``both``, ``xxh3_128_parts`` too), or in parts."""
    sums = {"xxh3_128_parts": parts.layout_checksum(t.bits, t.shape, layout)} if layout else {}
    if not layout or both:
        sums["xxh3_128"] = checksum(t)
    return TensorSpec(name=name, dtype=t.dtype, shape=list(t.shape), checksums=sums, parts=None if both else layout)


def _lineage_manifest(version: int, specs: list[TensorSpec]) -> VersionManifest:
    return VersionManifest(
        run_id="r", version=FIRST + version, base_version=FIRST + version - 1, snapshot=False, tensors=specs,
        files=[], stats=VersionStats(changed_elements=0, total_elements=sum(int(np.prod(t.shape)) for t in specs),
        encoded_bytes=0),
    )  # fmt: skip


def test_a_squash_lineage_is_checked_by_the_checksum_each_manifest_names():
    """check_patch_lineage takes a tensor in parts by its ``xxh3_128_parts`` and a whole one by its ``xxh3_128``
    only: an entry of the other kind, or of another version, is refused naming the tensor."""
    rng = np.random.default_rng(0)
    a = RawTensor("BF16", (4, 6), weight_like("BF16", 24, rng))
    b = RawTensor("BF16", (4, 6), stepped("BF16", a.bits, rng, 0.5, 0.0))
    c = RawTensor("BF16", (4, 6), stepped("BF16", b.bits, rng, 0.5, 0.0))
    layout = ((0, 0, 2), (0, 2, 4))
    blocks = [
        parts.encode_part(
            RawTensor("BF16", (), parts.block(a.bits, a.shape, *cut)),
            RawTensor("BF16", (), parts.block(c.bits, c.shape, *cut)),
            *cut,
            "xor",
        )
        for cut in layout
    ]
    parted = encoded_from_parts("w", "BF16", a.shape, blocks).entry
    whole = encode_tensor("w", a, c, "xor").entry
    for kind, entry in (("parts", parted), ("whole", whole)):
        lay = layout if kind == "parts" else None
        base, target = _lineage_manifest(0, [_spec("w", a, lay)]), _lineage_manifest(2, [_spec("w", c, lay)])
        check_patch_lineage([("f", {"w": entry})], base, target)  # the right entry of its own kind
        other = _lineage_manifest(1, [_spec("w", b, lay)])  # version 1 is not the base
        with pytest.raises(SchemaError, match="tensor 'w''s base checksum is not version 11's"):
            check_patch_lineage([("f", {"w": entry})], other, target)
        with pytest.raises(SchemaError, match="tensor 'w''s target checksum is not version 11's"):
            check_patch_lineage([("f", {"w": entry})], base, other.model_copy(update={"version": FIRST + 1}))
    cross = [
        (parted, _spec("w", a, None), _spec("w", c, None)),  # in parts, against whole tensors
        (whole, _spec("w", a, layout), _spec("w", c, layout)),  # whole, against tensors in parts
        (parted, _spec("w", a, layout, both=True), _spec("w", c, layout, both=True)),  # whole specs with both sums
    ]
    for entry, base_spec, target_spec in cross:
        with pytest.raises(SchemaError, match="tensor 'w''s base checksum is not version 10's"):
            check_patch_lineage(
                [("f", {"w": entry})], _lineage_manifest(0, [base_spec]), _lineage_manifest(2, [target_spec])
            )
