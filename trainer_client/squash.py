"""Squashes the trainer encodes after each commit: one patch from a recent version straight to the latest.

A ``cond`` patch decodes only on its base, so nothing without the views can compose patches;
the trainer holds the latest view and keeps its recent versions as **reverse records**: for
each of the last ``max(depths)`` versions v and each tensor that changed, the changed positions
and their bits in v - 1 (about 1 % of the elements per RL step). The view of a recent version
B is the latest view with the records of L, L-1, ..., B+1 written back; it is built only for
the tensors that changed since B (a copy of them), encoded against the latest view with the
same encoder as a delta (entries carry B's checksums as base, L's as target), and discarded.

:class:`Squasher` does this for one publisher (either kind; each rank encodes and uploads its
part, rank 0 stores the record, :mod:`stitchboard.bulletin.squash_store`). At version L it
encodes squash(L - d -> L) for each depth d it can, and stores it only when it is smaller than
the chain of L - d + 1 .. L. Before a squash is uploaded it is checked against the views it
was made from (:func:`check_squash`: the rebuilt view is version B's by its checksums, and the
patch decoded on it reaches the latest view's checksums): a squash whose index is right but
whose bits are wrong (a bad reverse record, an encoder fault) would pass every check the
bulletin can make, so it is stopped here and logged. Squashes are derived: a failure is logged,
never raised (the version is committed already), and ``stitchboard squash rebuild`` (:mod:`.squash_cli`) makes
them again from the stored anchor and deltas with :class:`RecentViews` too.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stitchboard.bulletin.client import BulletinClient
from stitchboard.bulletin.errors import BulletinError
from stitchboard.proto.apply import apply_patch
from stitchboard.proto.codec import build_patch, checksum, encode_tensor
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.errors import BaseMismatchError, PatchError, TargetMismatchError
from stitchboard.proto.schema import XXH3_128, Encoding, FileRef, VersionManifest, canonical_json
from stitchboard.proto.squash_schema import MIN_SQUASH_SPAN, SquashManifest
from stitchboard.proto.threads import thread_map

from .encode_version import bytes_ref

log = logging.getLogger("stitchboard.trainer_client")

#: Squash depths a publisher emits unless told otherwise: none. Measured on real SmolLM2 steps
#: (``tests/benchmarks/bench_squash.py``, docs/benchmarks.md), depths (4, 8) add ~11x the delta's own encode
#: time to every publish (the reverse record, then two encodes of 2-5x the changed elements and
#: the check of each, :func:`check_squash`; ~4.7x without the checks), which grows with the model and,
#: through ``max_pending``, can stall a trainer; they pay off only for replicas that fall behind
#: (restarts, long stalls). Turn them on per run where that happens.
DEFAULT_SQUASH_DEPTHS: tuple[int, ...] = ()
#: The depths to turn on (and what ``stitchboard squash rebuild`` makes by default): a replica k
#: behind then fetches at most 3 deltas and one squash, or 4 deltas (k < 4).
SUGGESTED_SQUASH_DEPTHS: tuple[int, ...] = (4, 8)


def check_depths(depths: Iterable[int]) -> tuple[int, ...]:
    """Validate squash depths (each >= 2, versions back from the latest); sorted, without repeats.

    Raises:
        ValueError: a depth below 2.
    """
    out = tuple(sorted({int(d) for d in depths}))
    if any(d < MIN_SQUASH_SPAN for d in out):
        raise ValueError(
            f"squash depths must be >= {MIN_SQUASH_SPAN} (one version back is the delta itself), got {list(out)}"
        )
    return out


def manifest_sha256(manifest: VersionManifest) -> str:
    """sha256 of a manifest's canonical JSON (the bulletin's ``manifest_sha256``)."""
    return hashlib.sha256(canonical_json(manifest)).hexdigest()


@dataclass(frozen=True)
class _Record:
    """Version ``version`` as a reverse record: what it changed and the bits those elements had in ``version - 1``."""

    version: int
    base_checksums: dict[str, str]
    base_digest: str
    encoded_bytes: int
    changes: dict[str, tuple[np.ndarray, np.ndarray]]


class RecentViews:
    """The last ``depth`` versions of a view, kept as reverse records from the latest one.

    Args:
        depth: versions kept (>= 1).
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._records: deque[_Record] = deque(maxlen=depth)
        self.latest: int | None = None
        self.latest_digest = ""

    def reset(self) -> None:
        """Forget every record (the tensor set changed, or the previous view is unknown)."""
        self._records.clear()

    def start(self, manifest: VersionManifest) -> None:
        """Take ``manifest``'s version as the latest, with no record yet (a rebuilt or resumed view)."""
        self.reset()
        self.latest, self.latest_digest = manifest.version, manifest_sha256(manifest)

    def record(
        self,
        manifest: VersionManifest,
        old: Mapping[str, RawTensor] | None,
        new: Mapping[str, RawTensor],
        old_checksums: Mapping[str, str],
    ) -> None:
        """Note version ``manifest.version`` (its view ``new``) after version ``manifest.version - 1`` (``old``).

        The records restart here (older versions can no longer be rebuilt) when ``old`` is
        ``None`` (unknown, or the tensor set changed) or the previous version is not the latest noted.

        Args:
            manifest: the new version's manifest (its target checksums and encoded bytes).
            old, new: this process's tensors of the two versions (same names, dtypes, shapes).
            old_checksums: every tensor's xxh3-128 in the old version (all processes' tensors).
        """
        new_sums = manifest.checksums()
        if (
            old is None
            or self.latest != manifest.version - 1
            or set(old) != set(new)
            or set(old_checksums) != set(new_sums)
        ):
            self.start(manifest)
            return
        moved = sorted(n for n in new if new_sums[n] != old_checksums[n])

        def reverse(name: str) -> tuple[np.ndarray, np.ndarray]:
            at = np.flatnonzero(old[name].bits != new[name].bits)
            return at, old[name].bits[at]

        changes = dict(zip(moved, thread_map(reverse, moved), strict=True))
        self._records.append(
            _Record(manifest.version, dict(old_checksums), self.latest_digest, manifest.stats.encoded_bytes, changes)
        )
        self.latest, self.latest_digest = manifest.version, manifest_sha256(manifest)

    def bases(self) -> list[int]:
        """The versions whose view can be rebuilt (at most ``depth`` back), ascending."""
        return [r.version - 1 for r in self._records]

    def chain_bytes(self, base: int) -> int:
        """Bytes of the deltas from ``base + 1`` to the latest version."""
        return sum(r.encoded_bytes for r in self._records if r.version > base)

    def base_of(self, base: int) -> tuple[dict[str, str], str]:
        """(every tensor's checksum, manifest sha256) of version ``base``. Raises KeyError if not kept."""
        for r in self._records:
            if r.version == base + 1:
                return r.base_checksums, r.base_digest
        raise KeyError(f"version {base} is not among the recent versions {self.bases()}")

    def view_at(self, base: int, latest: Mapping[str, RawTensor]) -> dict[str, RawTensor]:
        """Copies of the tensors of ``latest`` that changed since ``base``, with their bits in ``base``.

        Raises:
            KeyError: ``base`` is not among :meth:`bases`.
        """
        self.base_of(base)
        newer = [r for r in reversed(self._records) if r.version > base]  # latest first
        names = sorted({n for r in newer for n in r.changes})

        def rebuild(name: str) -> RawTensor:
            t = latest[name]
            bits = t.bits.copy()
            for r in newer:
                if name in r.changes:
                    at, old = r.changes[name]
                    bits[at] = old
            return RawTensor(t.dtype, tuple(t.shape), bits)

        return dict(zip(names, thread_map(rebuild, names), strict=True))


def encode_squash(
    views: RecentViews,
    base: int,
    latest: Mapping[str, RawTensor],
    target_checksums: Mapping[str, str],
    encoding: Encoding,
    metadata: Mapping[str, str],
    *,
    check: bool = True,
) -> tuple[bytes, int]:
    """The patch taking this process's tensors from version ``base`` to the latest: (file bytes, changed elements).

    Args:
        views: the recent versions (``base`` among them).
        base: the squash's base version.
        latest: this process's tensors of the latest version.
        target_checksums: every tensor's xxh3-128 in the latest version.
        encoding: the patch encoding (the publisher's).
        metadata: patch ``__metadata__`` strings.
        check: verify the patch against the views before returning it (:func:`check_squash`).

    Raises:
        KeyError: ``base`` is not among the recent versions.
        PatchError: (``check``) the squash does not take version ``base``'s view to the latest's.
    """
    base_sums, _ = views.base_of(base)
    old = views.view_at(base, latest)
    names = sorted(n for n in old if base_sums[n] != target_checksums[n])
    encoded = thread_map(
        lambda n: encode_tensor(
            n, old[n], latest[n], encoding, base_checksum=base_sums[n], target_checksum=target_checksums[n]
        ),
        names,
    )
    kept = [e for e in encoded if e is not None]
    data = build_patch(kept, encoding, metadata)
    if check:
        check_squash(data, old, latest, base_sums, target_checksums)
    return data, sum(e.entry.count for e in kept)


def check_squash(
    data: bytes,
    old: MutableMapping[str, RawTensor],
    latest: Mapping[str, RawTensor],
    base_checksums: Mapping[str, str],
    target_checksums: Mapping[str, str],
) -> None:
    """Check a squash against the views it was made from, before it leaves the trainer.

    The bulletin and the sidecar can check a squash's index only (a ``cond`` stream decodes only
    on its base); this is the check of its bits. Every entry must carry the base version's and
    the latest version's checksums; ``old`` must be the base version's view (each tensor the
    patch lists is hashed against its base checksum as the patch is applied, each other one
    here, and must be unchanged between the versions), and every tensor the patch lists must
    decode on ``old`` to bits with the latest version's checksum (the checksums the manifest
    took from ``latest``), as an engine decodes it.

    Args:
        data: the squash's patch file (this process's part).
        old: the rebuilt base view of the tensors changed since the base (:meth:`RecentViews.view_at`);
            patched in place (its own copies: no second copy of the model is made).
        latest: this process's tensors of the latest version.
        base_checksums, target_checksums: every tensor's xxh3-128 in the base and the latest version.

    Raises:
        BaseMismatchError: the rebuilt view is not the base version's, a tensor it lacks changed,
            or an entry names another base checksum.
        TargetMismatchError: the patch decodes on it to other bits than the latest view's, or an
            entry names another target checksum.
        PatchError: the patch does not parse or decode.
    """
    patch = read_patch(data, what="squash")
    for name, entry in patch.entries.items():
        if entry.base.get(XXH3_128) != base_checksums.get(name):
            raise BaseMismatchError(f"the squash's entry for tensor {name!r} names another base checksum")
        if entry.target.get(XXH3_128) != target_checksums.get(name):
            raise TargetMismatchError(f"the squash's entry for tensor {name!r} names another target checksum")
    unlisted = [n for n in old if n not in patch.entries]  # changed since the base, and back
    sums = dict(zip(unlisted, thread_map(lambda n: checksum(old[n]), unlisted), strict=True))
    wrong = sorted(n for n in unlisted if sums[n] != base_checksums[n] or base_checksums[n] != target_checksums[n])
    missed = sorted(n for n in latest if n not in old and base_checksums[n] != target_checksums[n])
    if wrong or missed:
        raise BaseMismatchError(
            f"the rebuilt base view is not the base version's: tensors {(wrong + missed)[:3]} differ from its checksums"
        )
    apply_patch(old, patch)  # bases hashed, decoded, targets hashed: BaseMismatchError, TargetMismatchError


#: ``exchange(what, work)``: run ``work`` on every rank; (this rank's kept value, every rank's shared value).
Exchange = Callable[[str, Callable[[], tuple[Any, Any]]], tuple[Any, list[Any]]]
#: ``on_committer(work)``: run ``work`` on rank 0; every rank gets its value or error.
OnCommitter = Callable[[Callable[[], Any]], Any]


class Squasher:
    """Encodes and stores a publisher's squashes after each commit (see the module docstring).

    Args:
        client: the bulletin client.
        run: the run id.
        rank: this process's rank (0 stores the records).
        depths: squash depths (versions back from the latest), see :func:`check_depths`.
        encoding: the patch encoding.
    """

    def __init__(self, client: BulletinClient, run: str, rank: int, depths: Iterable[int], encoding: Encoding) -> None:
        self.client, self.run, self.rank, self.encoding = client, run, rank, encoding
        self.depths = check_depths(depths)
        self.views = RecentViews(max(self.depths, default=1))
        self.stored: list[tuple[int, int]] = []

    def after_commit(
        self,
        manifest: VersionManifest,
        old: Mapping[str, RawTensor] | None,
        new: Mapping[str, RawTensor],
        old_checksums: Mapping[str, str],
        exchange: Exchange,
        on_committer: OnCommitter,
    ) -> list[SquashManifest]:
        """Record version ``manifest.version`` and store its squashes; the records stored (on every rank).

        Every rank calls this after the same commit with its own tensors. Failures are logged
        (the version is committed already; plans fall back to the chain).
        """
        if not self.depths:
            return []
        if (
            old is not None and manifest.version > 0 and self.views.latest != manifest.version - 1
        ):  # a resumed publisher: learn the base's manifest
            try:
                self.views.start(on_committer(lambda: self.client.manifest(self.run, manifest.version - 1)))
            except BulletinError as exc:
                log.warning(
                    "run %s: reading version %d for its squashes failed (%s)", self.run, manifest.version - 1, exc
                )
        self.views.record(manifest, old, new, old_checksums)
        out = []
        for base in [manifest.version - d for d in self.depths if manifest.version - d in self.views.bases()]:
            try:
                stored = self._squash(manifest, base, new, exchange, on_committer)
            except Exception:  # the ranks' exchange failed: the version stands, the chain serves
                log.exception("run %s: squash %d -> %d failed", self.run, base, manifest.version)
                continue
            if stored is not None:
                out.append(stored)
        return out

    def _squash(
        self,
        manifest: VersionManifest,
        base: int,
        new: Mapping[str, RawTensor],
        exchange: Exchange,
        on_committer: OnCommitter,
    ) -> SquashManifest | None:
        target = manifest.version
        what = f"squash {base} -> {target} of run {self.run!r}"
        meta = {"run": self.run, "version": str(target), "base_version": str(base), "squash": "true"}
        data, every = self._encode(what, base, manifest, new, meta, exchange)
        sizes = [s for s in every if s is not None]
        if data is None or len(sizes) < len(every):
            return None
        total, changed = sum(s[0] for s in sizes), sum(s[1] for s in sizes)
        chain = self.views.chain_bytes(base)
        if total >= chain:
            log.info("%s: %d bytes, not smaller than the chain's %d: not stored", what, total, chain)
            return None

        def upload() -> tuple[None, FileRef | None]:
            ref = bytes_ref(f"squash-v{base}-v{target}-r{self.rank}.safetensors", data, "patch")
            try:
                self.client.put_blob(self.run, ref.sha256, data, ref.size_bytes)
            except BulletinError as exc:
                log.warning("%s: upload failed (%s); the chain serves instead", what, exc)
                return None, None
            return None, ref

        _, refs = exchange(f"uploading {what}", upload)
        if any(r is None for r in refs):
            return None
        _, base_digest = self.views.base_of(base)
        squash = SquashManifest(
            run_id=self.run, base_version=base, target_version=target, encoding=self.encoding,
            base_manifest_sha256=base_digest, target_manifest_sha256=self.views.latest_digest, files=refs,
            size_bytes=total, changed_elements=changed,
        )  # fmt: skip
        try:
            on_committer(lambda: self.client.put_squash(squash))
        except BulletinError as exc:
            log.warning("%s: storing the record failed (%s); the chain serves instead", what, exc)
            return None
        self.stored.append((base, target))
        log.info("run %s: squash %d -> %d stored (%d bytes, chain %d)", self.run, base, target, total, chain)
        return squash

    def _encode(
        self,
        what: str,
        base: int,
        manifest: VersionManifest,
        new: Mapping[str, RawTensor],
        metadata: Mapping[str, str],
        exchange: Exchange,
    ) -> tuple[bytes | None, list[tuple[int, int] | None]]:
        """This rank's squash file from ``base`` to ``manifest``'s version (None: skipped), and every rank's
        (file bytes, changed elements), None for a rank that skipped it (logged there); every rank calls it."""

        def encode() -> tuple[bytes | None, tuple[int, int] | None]:
            try:
                data, changed = encode_squash(self.views, base, new, manifest.checksums(), self.encoding, metadata)
            except PatchError as exc:  # wrong bits: never uploaded, every rank skips it
                log.error(
                    "%s failed its check against this trainer's views (%s): not uploaded; the chain serves", what, exc
                )
                return None, None
            except Exception:  # a derived object: log, and every rank skips it
                log.exception("%s: encoding failed; the chain serves instead", what)
                return None, None
            return data, (len(data), changed)

        return exchange(f"encoding {what}", encode)
