"""How the bulletin reads squash records and their blobs, over real HTTP on both stores.

* a put's check reads only each patch file's header and index by ranged reads, never the blob
  whole (a stored 256 MiB blob of random bytes is refused with 422 after a few bytes);
* a record this bulletin cannot read (a newer schema) is skipped and logged: plans and the
  listing still answer;
* plans with squashes read each record once per stored etag (one listing per plan after that).

The store is wrapped to count what is read from it (:class:`CountingStore`).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stitchboard.bulletin.errors import InvalidRequestError
from stitchboard.bulletin.ledger import blob_key
from stitchboard.bulletin.retention import collect_garbage
from stitchboard.bulletin.squash_store import squash_key
from stitchboard.bulletin.stores import StreamDigest
from stitchboard.proto.decode import MAX_PATCH_HEADER_BYTES
from stitchboard.proto.schema import FileRef
from stitchboard.trainer_client.publisher import Publisher
from tests.support.squash_chain import rl_steps

BIG_BLOB_BYTES = 256 << 20


class CountingStore:
    """The bulletin's store, counting the bytes read from each key and the whole-object reads (``get``)."""

    def __init__(self, store: Any) -> None:
        self.inner = store
        self.bytes_read: Counter[str] = Counter()
        self.gets: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, key: str) -> tuple[bytes, str]:
        data, etag = self.inner.get(key)
        self.gets[key] += 1
        self.bytes_read[key] += len(data)
        return data, etag

    def iter_range(self, key: str, start: int, end: int) -> Iterator[bytes]:
        for chunk in self.inner.iter_range(key, start, end):
            self.bytes_read[key] += len(chunk)
            yield chunk


@pytest.fixture
def counted(server) -> CountingStore:
    """The ledger's store, wrapped (the squash routes read through the ledger)."""
    ledger = server.app.state.bulletin.ledger
    ledger.store = CountingStore(ledger.store)
    return ledger.store


def publish(server, client, run, views, tmp_path, **options) -> None:
    with Publisher(server.url, run, client=client, workdir=tmp_path / "pub", **options) as pub:
        for view in views:
            pub.publish_view(view)


def store_blob(store: CountingStore, run: str, path: Path, data: bytes | None = None) -> str:
    """Store ``data`` (None: :data:`BIG_BLOB_BYTES` random bytes, written 1 MiB at a time) as a
    blob of ``run`` with its digest record, as an upload would; its sha256."""
    with open(path, "wb") as f:
        if data is not None:
            f.write(data)
        else:
            f.writelines(os.urandom(1 << 20) for _ in range(BIG_BLOB_BYTES >> 20))
    digest = StreamDigest.of_file(path, store.part_bytes)
    store.inner.put_file(blob_key(run, digest.sha256), path, digest)
    path.unlink()
    return digest.sha256


def test_a_squash_put_reads_only_the_header_and_index_of_its_blobs(server, client, run, tmp_path, counted, backend):
    publish(server, client, run, rl_steps(11, 4, numel=4096), tmp_path, squash_depths=(3,))
    _, s14 = client.squashes(run)
    # A 256 MiB blob of random bytes, stored soundly (with its digest record), named by a squash record.
    sha = store_blob(counted, run, tmp_path / "random.bin")
    big = FileRef(path="squash-random.safetensors", sha256=sha, size_bytes=BIG_BLOB_BYTES, role="patch")
    assert client.drop_squash(run, 1, 4)
    before = backend.keys()
    with pytest.raises(InvalidRequestError, match="header length") as refused:
        client.put_squash(s14.model_copy(update={"files": [big], "size_bytes": BIG_BLOB_BYTES}))
    assert refused.value.status == 422
    assert backend.keys() == before, "nothing written"
    read = counted.bytes_read[blob_key(run, sha)]
    assert 0 < read <= 8, f"{read} bytes of the 256 MiB blob read to refuse it (its 8-byte header length says no)"

    # The real squash again: its header and index are read, its payload is not (``cond``: a
    # stream whose size the header gives; ``xor``: the 18-byte zstd frame header too).
    (real,) = s14.files
    counted.bytes_read.clear()
    assert client.put_squash(s14) is True
    read = counted.bytes_read[blob_key(run, real.sha256)]
    assert counted.gets[blob_key(run, real.sha256)] == 0, "never a whole-object read"
    stored, _ = counted.inner.get(blob_key(run, real.sha256))
    hlen = int.from_bytes(stored[:8], "little")
    header = json.loads(stored[8 : 8 + hlen])
    index, payload = header["__index__"]["data_offsets"], header["__payload__"]["data_offsets"]
    frame_head = 0 if s14.encoding == "cond" else 18
    assert payload[1] - payload[0] > 18 and read == 8 + hlen + (index[1] - index[0]) + frame_head, (
        f"{read} bytes read of {real.size_bytes}: the header, the index (and the payload's frame header) only"
    )


def test_a_blob_declaring_an_oversized_header_is_refused_before_reading_it(server, client, run, tmp_path, counted):
    publish(server, client, run, rl_steps(12, 3, numel=4096), tmp_path, squash_depths=(3,))
    (s03,) = client.squashes(run)
    data = (MAX_PATCH_HEADER_BYTES + 1).to_bytes(8, "little") + b"{" * (MAX_PATCH_HEADER_BYTES + 1)
    sha = store_blob(counted, run, tmp_path / "hostile.bin", data)
    assert client.drop_squash(run, 0, 3)
    ref = FileRef(path="squash-hostile.safetensors", sha256=sha, size_bytes=len(data), role="patch")
    with pytest.raises(InvalidRequestError, match="exceeds a patch's"):
        client.put_squash(s03.model_copy(update={"files": [ref], "size_bytes": len(data)}))
    assert counted.bytes_read[blob_key(run, sha)] == 8


def test_an_unreadable_squash_record_is_skipped_and_logged(server, client, run, tmp_path, counted, caplog):
    publish(server, client, run, rl_steps(13, 5, numel=4096), tmp_path, squash_depths=(3,))
    assert [(s.base_version, s.target_version) for s in client.squashes(run)] == [(0, 3), (1, 4), (2, 5)]
    # A newer bulletin on the same store wrote a record this one cannot read (schema 99, a new field).
    s25 = client.squashes(run)[2]
    newer = json.loads(client.squashes(run)[1].model_dump_json()) | {"schema_version": 99, "hints": {"tier": "hot"}}
    counted.inner.delete(squash_key(run, 1, 4))
    counted.inner.put_new(squash_key(run, 1, 4), json.dumps(newer).encode())
    damaged = squash_key(run, 2, 5)
    counted.inner.delete(damaged)
    counted.inner.put_new(damaged, b"{not json")
    with caplog.at_level(logging.WARNING, logger="stitchboard.bulletin"):
        assert [(s.base_version, s.target_version) for s in client.squashes(run)] == [(0, 3)]
        plan = client.plan(run, 0, 5, squash=True)
        assert [(s.kind, s.base_version, s.version) for s in plan.steps] == [
            ("squash", 0, 3),
            ("delta", None, 4),
            ("delta", None, 5),
        ]
    skipped = [r.getMessage() for r in caplog.records if "skipping the squash record" in r.getMessage()]
    assert len(skipped) == 2, skipped
    assert any(squash_key(run, 1, 4) in m and "hints" in m for m in skipped), skipped
    assert any(damaged in m for m in skipped), skipped
    # gc reads every record to spare its blobs: it neither stops on these two nor frees the blob
    # the newer record names; the damaged record names none any more, so its blob goes.
    blob_14, blob_25 = newer["files"][0]["sha256"], s25.files[0].sha256
    report = collect_garbage(server.app.state.bulletin.ledger, keep_snapshots=9, grace_s=0.0, runs=[run])
    assert client.has_blob(run, blob_14) is not None, "the newer record's blob was spared"
    assert report.blobs_removed.get(run) == [blob_25], report.blobs_removed


def test_plans_with_squashes_read_each_record_once_per_etag(server, client, run, tmp_path, counted):
    publish(server, client, run, rl_steps(14, 9, numel=2048), tmp_path, squash_depths=(2, 3))
    records = client.squashes(run)  # the first read of every record
    assert len(records) == 15
    keys = [squash_key(run, s.base_version, s.target_version) for s in records]
    counted.gets.clear()
    for start in range(7):
        client.plan(run, start, 9, squash=True)
    client.squashes(run)
    assert sum(counted.gets[k] for k in keys) == 0, "cached records are not read again"
    # One record rewritten out of band (other bytes, so another etag on both stores): read once, again.
    changed = records[4].model_copy(update={"changed_elements": records[4].changed_elements + 1})
    counted.inner.delete(keys[4])
    counted.inner.put_new(keys[4], changed.model_dump_json().encode())
    listed = {(s.base_version, s.target_version): s for s in client.squashes(run)}
    client.plan(run, 1, 9, squash=True)
    assert {k: n for k, n in counted.gets.items() if n} == {keys[4]: 1}
    assert listed[(changed.base_version, changed.target_version)].changed_elements == changed.changed_elements
