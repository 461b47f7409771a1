"""Helpers of the sidecar tests: ASGI apps served on loopback, a trainer-free publisher."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from stitchboard.bulletin.client import BulletinClient
from stitchboard.proto import parts
from stitchboard.proto.checkpoint import save_checkpoint
from stitchboard.proto.codec import build_patch, checksum, encoded_from_parts
from stitchboard.proto.container import RawTensor
from stitchboard.proto.diff import diff_views
from stitchboard.proto.schema import FileRef, TensorSpec, VersionManifest, VersionStats
from tests.sidecar.fake_engine import copy_view
from tests.support.app_server import AppServer  # noqa: F401  (re-exported: the sidecar tests serve apps with it)

#: Sidecar settings for tests before the fake engine: short waits and one retry, so a fault shows in seconds.
FAST_SIDECAR = {
    "poll_wait_s": 5.0,
    "retry_backoff_s": 0.05,
    "max_backoff_s": 0.2,
    "request_wait_s": 5.0,
    "bulletin_retries": 1,
    "retry_after_s": 1,
}


def wait_for(predicate: Callable[[], object], timeout_s: float = 60.0, what: str = "condition") -> object:
    """Poll ``predicate`` until truthy; return its value, or fail after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def make_view(seed: int = 0, tensors: int = 4, numel: int = 4096) -> dict[str, RawTensor]:
    """A small BF16 view: ``tensors`` tensors of ``numel`` elements each."""
    rng = np.random.default_rng(seed)
    return {
        f"model.layers.{i}.w": RawTensor("BF16", (numel // 64, 64), rng.integers(0, 1 << 16, numel, dtype=np.uint16))
        for i in range(tensors)
    }


def mutate(view: dict[str, RawTensor], seed: int, fraction: float = 0.01) -> dict[str, RawTensor]:
    """A copy of ``view`` with about ``fraction`` of each tensor's elements changed in their 2 lowest bits.

    Like an RL step, values move by an ulp or so and stay finite, so a real engine can serve them.
    """
    rng = np.random.default_rng(seed)
    out = copy_view(view)
    for t in out.values():
        idx = rng.choice(t.numel, max(1, int(t.numel * fraction)), replace=False)
        t.bits[idx] ^= rng.integers(1, 4, idx.size).astype(t.bits.dtype)
    return out


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Publisher:
    """Publishes versions of one run from views of RawTensors (no trainer), like the trainer SDK would.

    ``ranks`` > 1 publishes as a shard-local publish of that many ranks writes (our seam: the trainer's side; the
    real one is ``ShardLocalPublisher``, tests/trainer_client/test_shard_local.py): every tensor cut in ``ranks``
    row blocks, each encoded on its own (``encode_part``) and assembled in one entry carrying only
    ``xxh3_128_parts``, and each manifest tensor checked by ``xxh3_128_parts`` over its ``parts`` layout only.
    """

    def __init__(self, client: BulletinClient, run: str, workdir: Path, ranks: int = 1) -> None:
        self.client = client
        self.run = run
        self.workdir = workdir
        self.ranks = ranks
        self.views: list[dict[str, RawTensor]] = []
        self.manifests: list[VersionManifest] = []

    def _layout(self, t: RawTensor) -> parts.Layout:
        return tuple((0, t.shape[0] * k // self.ranks, t.shape[0] * (k + 1) // self.ranks) for k in range(self.ranks))

    def _spec(self, name: str, t: RawTensor) -> TensorSpec:
        if self.ranks == 1:
            return TensorSpec(name=name, dtype=t.dtype, shape=list(t.shape), checksums={"xxh3_128": checksum(t)})
        layout = self._layout(t)
        sums = {parts.XXH3_128_PARTS: parts.layout_checksum(t.bits, t.shape, layout)}
        return TensorSpec(name=name, dtype=t.dtype, shape=list(t.shape), checksums=sums, parts=list(layout))

    def _parted_patch(self, base: dict[str, RawTensor], view: dict[str, RawTensor]) -> tuple[bytes | None, int]:
        encoded, changed = [], 0
        for name, t in sorted(view.items()):
            blocks = [
                parts.encode_part(
                    RawTensor(t.dtype, (), parts.block(base[name].bits, t.shape, d, a, b)),
                    RawTensor(t.dtype, (), parts.block(t.bits, t.shape, d, a, b)),
                    d,
                    a,
                    b,
                    "xor",
                )
                for d, a, b in self._layout(t)
            ]
            if any(blk.part.count for blk in blocks):
                encoded.append(encoded_from_parts(name, t.dtype, tuple(t.shape), blocks))
                changed += sum(blk.part.count for blk in blocks)
        return (build_patch(encoded, "xor") if encoded else None), changed

    def _file(self, role: str, path: str, data: bytes) -> FileRef:
        self.client.put_blob(self.run, _sha(data), data)
        return FileRef(path=path, sha256=_sha(data), size_bytes=len(data), role=role)

    def publish(self, view: dict[str, RawTensor], *, anchor: bool = False, patch_files: int = 1) -> VersionManifest:
        """Publish ``view`` as the next version (version 0 and ``anchor=True`` carry a snapshot).

        ``patch_files`` > 1 splits the delta into that many patch files (like sharded trainers).
        """
        manifest = self.prepare(view, anchor=anchor, patch_files=patch_files)
        self.commit(manifest, view)
        return manifest

    def prepare(self, view: dict[str, RawTensor], *, anchor: bool = False, patch_files: int = 1) -> VersionManifest:
        """Diff and upload the next version's files; returns its manifest, not yet published."""
        version = len(self.views)
        files: list[FileRef] = []
        changed = 0
        if version > 0 and self.ranks > 1:
            data, changed = self._parted_patch(self.views[-1], view)
            if data is not None:
                files.append(self._file("patch", "patch-r0.safetensors", data))
        elif version > 0:
            base = self.views[-1]
            names = sorted(view)
            groups = [names[i::patch_files] for i in range(patch_files)]
            for k, group in enumerate(groups):
                d = diff_views({n: base[n] for n in group}, {n: view[n] for n in group}, threads=1)
                changed += d.changed_elements
                if d.changed_elements:
                    files.append(self._file("patch", f"patch-r{k}.safetensors", d.patch))
        if version == 0 or anchor:
            folder = self.workdir / f"{self.run}-snap-{version}"
            for path in save_checkpoint(folder, view, max_shard_bytes=16 * 1024):
                files.append(self._file("snapshot", path.name, path.read_bytes()))
        manifest = VersionManifest(
            run_id=self.run,
            version=version,
            base_version=None if version == 0 else version - 1,
            snapshot=version == 0 or anchor,
            tensors=[self._spec(n, t) for n, t in sorted(view.items())],
            files=files,
            stats=VersionStats(
                changed_elements=changed,
                total_elements=sum(t.numel for t in view.values()),
                encoded_bytes=sum(f.size_bytes for f in files if f.role == "patch"),
            ),
        )
        return manifest

    def commit(self, manifest: VersionManifest, view: dict[str, RawTensor]) -> None:
        """Publish a prepared manifest (the commit point) and remember its view."""
        self.client.publish(manifest)
        self.views.append(copy_view(view))
        self.manifests.append(manifest)

    def step(self, seed: int, fraction: float = 0.01, **kwargs) -> VersionManifest:
        """Publish a mutation of the latest view."""
        return self.publish(mutate(self.views[-1], seed, fraction), **kwargs)

    def same(self) -> VersionManifest:
        """Publish an empty delta (the same bits again)."""
        return self.publish(self.views[-1])


def same_bits(a: dict[str, RawTensor], b: dict[str, RawTensor]) -> bool:
    """Whether two views hold the same tensors with the same bits."""
    return set(a) == set(b) and all(np.array_equal(a[n].bits, b[n].bits) for n in a)


def assert_at(sidecar, publisher: Publisher, version: int) -> None:
    """Wait until ``sidecar`` reports ``version`` applied; its engine then records it and holds
    exactly that version's published bits (DESIGN.md invariant 1)."""
    sidecar.wait_applied(version)
    assert sidecar.engine.version == version
    assert same_bits(sidecar.engine.weights, publisher.views[version]), f"engine bits are not version {version}'s"


@contextmanager
def corrupted(path: Path) -> Iterator[None]:
    """One byte in the middle of the stored file ``path`` flipped (bit rot under the same name and
    size) inside the block; its original bytes written back when the block ends, failed or not,
    so the tests after it find the store whole."""
    good = path.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    path.write_bytes(bytes(bad))
    try:
        yield
    finally:
        path.write_bytes(good)
