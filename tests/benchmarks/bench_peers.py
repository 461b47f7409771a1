"""Peers: stitchboard's encodings against verl's ``delta_sharded`` and Miles' disk-delta, same real steps.

Run: ``python -m tests.benchmarks.bench_peers [--steps N]`` (from the repo root, in .venv); the
default 6 versions of SmolLM2-135M (fp32 masters, AdamW lr 3e-6, batch 1 x 32 tokens: the trainer
of ``bench_codec``), bf16 served view, take ~75 seconds on 2 cores.

Per version and encoding, in one run on the same pair of served views: the bytes a version costs
on the wire or on disk, those bytes per changed bf16 element (elements whose bits changed), and
the best of 3 encode and decode times in seconds (decode writes onto a copy of the base, made
untimed, and each decoded view is checked bit-exact against the target). Then the means over the
versions and a last line ``peers: cond_bpe=<x> verl_bpe=<x> miles_bpe=<x>``.

* ``cond``, ``xor``, ``overwrite``: stitchboard's patch files from :func:`~stitchboard.proto.diff.diff_views`
  (with the previous version's target checksums, as the publisher keeps them) and applied by
  :func:`~stitchboard.proto.apply.apply_patch` with its checksum passes.
* ``verl delta_sharded``: the bytes verl 0.9.1 sends per steady (non-seed) sync, built on the CPU
  as its code builds them on the GPU (its engine needs cupy and NCCL). It follows
  ``verl/checkpoint_engine/delta_sync/sparse_gather.py`` ``shard_delta_indices`` (bytewise
  change mask, flat within-parameter positions, values in the parameter's dtype) and
  ``verl/checkpoint_engine/delta_checkpoint_engine.py`` ``DeltaShardedCheckpointEngine._assemble_flush``
  and ``_publish_flush``: one flush holds an int32 little-endian positions blob (4 bytes per
  changed element), the values verbatim (2 bytes per bf16 element) and, sent before them over
  zmq, the topic string and a pickled manifest (one ``DeltaParam`` per changed tensor and the
  ``torch.hash_tensor`` checksum). verl's default bucket (``update_weights_bucket_megabytes``
  2048) holds a whole version here, so a version is one flush. The decode follows
  ``verl/workers/rollout/sglang_rollout/delta_loader.py`` ``apply_delta``: the checksum check,
  ``_decode_one`` (a NaN-filled dense tensor, positions written by ``index_copy_``) and
  ``_masked_copy`` (``torch.where(isnan)`` onto the live weights), without SGLang's
  ``load_weights``. Its NaN mask cannot carry a NaN value; these steps have none.
* ``miles disk-delta``: the files Miles' ``--update-weight-transfer-mode disk-delta`` writes per
  version with its defaults (``xor`` of each changed tensor's bytes, zstd level 1, xxh3-128 of
  the new bytes), from one source rank: the shard file and the index, made by
  :func:`tests.trainer_client.miles_writer.version_files` (which follows Miles' ``delta.py``
  ``_encode_delta``/``_write_delta_files``), timed as the encode (one thread; Miles spreads the
  tensors over a thread pool). The decode does what Miles' engine side does with the folder
  (its ``/pull_weights``): read the index and the shard, decompress each tensor's xor, apply it
  and check the new bytes against the shard's checksum.

stitchboard's ``diff_views`` uses up to 8 threads (2 here); verl's diff is torch's (2 threads).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import safetensors.numpy
import torch
import zstandard
from rich.console import Console
from rich.table import Table

from stitchboard.demo.smollm2 import build_smollm2_checkpoint
from stitchboard.proto.apply import apply_patch
from stitchboard.proto.codec import PatchEncoding, checksum
from stitchboard.proto.container import RawTensor
from stitchboard.proto.decode import read_patch
from stitchboard.proto.diff import diff_views
from tests.benchmarks.bench_codec import raw_view
from tests.support.training import CpuTrainer
from tests.trainer_client.miles_writer import INDEX_NAME, version_files
from tests.trainer_client.miles_writer import checksum as miles_checksum

View = Mapping[str, RawTensor]
#: The zmq topic verl's NCCL checkpoint engines send before each manifest.
VERL_TOPIC = "bucket_metadata"
#: verl's default ``rollout.checkpoint_engine.update_weights_bucket_megabytes``, in bytes.
VERL_BUCKET_BYTES = 2048 << 20
#: The encodings compared, in table order; the last line names three of them.
STITCH_ENCODINGS: tuple[PatchEncoding, ...] = ("cond", "xor", "overwrite")
VERL, MILES = "verl delta_sharded", "miles disk-delta"


@dataclass(frozen=True)
class Coding:
    """One encoding under comparison.

    Attributes:
        name: the table's label.
        encode: ``(base, target, base_checksums) -> payload``; ``base_checksums`` are the
            xxh3-128 digests of ``base`` (only stitchboard's publisher keeps them).
        decode: ``(view, payload)``: writes the target onto ``view``, a writable copy of the base.
        size_bytes: the payload's bytes on the wire or on disk.
    """

    name: str
    encode: Callable[[View, View, Mapping[str, str]], Any]
    decode: Callable[[View, Any], None]
    size_bytes: Callable[[Any], int]


@dataclass(frozen=True)
class Result:
    """One encoding at one version: ``size_bytes`` of payload, ``encode_s``/``decode_s`` best times."""

    version: int
    coding: str
    size_bytes: int
    changed: int
    encode_s: float
    decode_s: float

    @property
    def bytes_per_changed(self) -> float:
        """Payload bytes per changed element."""
        return self.size_bytes / max(self.changed, 1)


def stitch_coding(encoding: PatchEncoding) -> Coding:
    """stitchboard's ``encoding`` through the real codec (patch bytes; apply with checksum passes)."""

    def encode(base: View, target: View, sums: Mapping[str, str]) -> bytes:
        return diff_views(base, target, encoding, base_checksums=sums).patch

    def decode(view: View, patch: bytes) -> None:
        apply_patch(view, read_patch(patch))

    return Coding(encoding, encode, decode, len)


@dataclass(frozen=True)
class VerlFlush:
    """One verl ``delta_sharded`` flush: pickled manifest, uint8 positions blob, values (bf16)."""

    meta: bytes
    positions: torch.Tensor
    values: torch.Tensor

    @property
    def size_bytes(self) -> int:
        """Topic + manifest + positions + values, as sent."""
        return len(VERL_TOPIC) + len(self.meta) + self.positions.numel() + self.values.numel() * 2


def _bf16(t: RawTensor) -> torch.Tensor:
    """The flat bf16 torch view of a BF16 tensor's bits (shares memory)."""
    return torch.from_numpy(t.bits.view(np.int16)).view(torch.bfloat16)


def _verl_checksum(positions: torch.Tensor, values: torch.Tensor) -> int:
    """verl's ``delta_sync.encode.checksum``."""
    p = int(torch.hash_tensor(positions).item()) if positions.numel() else 0
    v = int(torch.hash_tensor(values).item()) if values.numel() else 0
    return p ^ (v << 1)


def verl_encode(base: View, target: View, _sums: Mapping[str, str]) -> VerlFlush:
    """verl's steady-sync flush from ``base`` to ``target`` (BF16 views), as its sender builds it."""
    idx_pieces, val_pieces, params = [], [], []
    pos_off = val_off = 0
    for name, t in target.items():
        new, old = _bf16(t), _bf16(base[name])
        idx = (new.view(torch.int16) != old.view(torch.int16)).nonzero(as_tuple=False).view(-1)
        if idx.numel() == 0:
            continue
        nnz = int(idx.numel())
        idx_pieces.append(idx.to(torch.int32))
        val_pieces.append(new[idx])
        params.append(
            {
                "name": name,
                "dtype": "bfloat16",
                "shape": list(t.shape),
                "pos_start": pos_off,
                "pos_end": pos_off + nnz * 4,
                "pos_width": 4,
                "val_start": val_off,
                "val_end": val_off + nnz,
            }
        )
        pos_off, val_off = pos_off + nnz * 4, val_off + nnz
    values = torch.cat(val_pieces) if val_pieces else torch.empty(0, dtype=torch.bfloat16)
    positions = torch.cat(idx_pieces).view(torch.uint8) if idx_pieces else torch.empty(0, dtype=torch.uint8)
    if positions.numel() + 2 * values.numel() > VERL_BUCKET_BYTES:
        raise ValueError("a version exceeds verl's default bucket; it would span several flushes")
    meta = {
        "is_full": False,
        "encoding": "indices",
        "is_last": True,
        "terminal_empty": False,
        "pos_numel": int(positions.numel()),
        "val_numel": int(values.numel()),
        "val_dtype": "bfloat16",
        "spec": {"encoding": "indices", "params": params, "checksum": _verl_checksum(positions, values)},
    }
    return VerlFlush(pickle.dumps(meta, pickle.DEFAULT_PROTOCOL), positions, values)  # pyzmq's send_pyobj


def verl_decode(view: View, flush: VerlFlush) -> None:
    """verl's receiver: checksum, then per tensor a NaN-masked dense decode and masked copy."""
    spec = pickle.loads(flush.meta)["spec"]
    if _verl_checksum(flush.positions, flush.values) != spec["checksum"]:
        raise ValueError("verl flush checksum mismatch")
    for p in spec["params"]:
        dst = _bf16(view[p["name"]])
        dense = torch.full((dst.numel(),), float("nan"), dtype=torch.bfloat16)
        idx = flush.positions[p["pos_start"] : p["pos_end"]].view(torch.int32).to(torch.int64)
        dense.index_copy_(0, idx, flush.values[p["val_start"] : p["val_end"]])
        dst.copy_(torch.where(torch.isnan(dense), dst, dense))


def _as_bytes(view: View) -> dict[str, np.ndarray]:
    """name -> the tensor's bytes (uint8, shares memory), as Miles takes them."""
    return {n: t.bits.view(np.uint8) for n, t in view.items()}


def miles_encode(base: View, target: View, _sums: Mapping[str, str]) -> dict[str, bytes]:
    """The files Miles writes for ``base -> target`` (one source rank): file name -> bytes."""
    return version_files(_as_bytes(base), _as_bytes(target), 1, ranks=1)


def miles_decode(view: View, files: Mapping[str, bytes]) -> None:
    """Miles' engine side of one ``xor`` version: per tensor decompress, xor, check the new bytes.

    Raises:
        ValueError: a tensor's new bytes do not match its checksum (the tensor is left unwritten).
    """
    index = json.loads(files[INDEX_NAME])
    algorithm = index["metadata"]["checksum_format"]
    for fname in dict.fromkeys(index["weight_map"].values()):
        blob = files[fname]
        (header_len,) = struct.unpack("<Q", blob[:8])
        sums = json.loads(blob[8 : 8 + header_len])["__metadata__"]
        for name, delta in safetensors.numpy.load(blob).items():
            bits = view[name].bits.view(np.uint8)
            new = bits ^ np.frombuffer(zstandard.ZstdDecompressor().decompress(delta.tobytes()), np.uint8)
            if miles_checksum(algorithm, new) != sums[name]:
                raise ValueError(f"miles version file {fname}: tensor {name!r} fails its {algorithm} checksum")
            bits[:] = new


def codings() -> list[Coding]:
    """Every encoding compared, in table order."""
    return [
        *(stitch_coding(e) for e in STITCH_ENCODINGS),
        Coding(VERL, verl_encode, verl_decode, lambda f: f.size_bytes),
        Coding(MILES, miles_encode, miles_decode, lambda files: sum(len(b) for b in files.values())),
    ]


def _copy(view: View) -> dict[str, RawTensor]:
    return {n: RawTensor(t.dtype, t.shape, t.bits.copy()) for n, t in view.items()}


def roundtrip(coding: Coding, base: View, target: View, sums: Mapping[str, str], repeats: int = 3) -> tuple:
    """Encode ``base -> target`` and decode it onto copies of ``base``, ``repeats`` times each.

    Returns:
        ``(payload, encode_s, decode_s, decoded)``: the last payload, the best times in seconds
        and the last decoded view.
    """
    encode_s = decode_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = coding.encode(base, target, sums)
        encode_s = min(encode_s, time.perf_counter() - t0)
    for _ in range(repeats):
        decoded = _copy(base)
        t0 = time.perf_counter()
        coding.decode(decoded, payload)
        decode_s = min(decode_s, time.perf_counter() - t0)
    return payload, encode_s, decode_s, decoded


def compare(views: Sequence[View], repeats: int = 3) -> list[Result]:
    """Every coding on each consecutive pair of ``views`` (version ``i`` is ``views[i-1] -> views[i]``).

    Raises:
        RuntimeError: a coding did not decode its target bit-exact (names the tensor and version).
    """
    results = []
    sums = {n: checksum(t) for n, t in views[0].items()}
    for version in range(1, len(views)):
        base, target = views[version - 1], views[version]
        changed = sum(int(np.count_nonzero(base[n].bits != t.bits)) for n, t in target.items())
        for coding in codings():
            payload, enc_s, dec_s, decoded = roundtrip(coding, base, target, sums, repeats)
            for n, t in target.items():
                if not np.array_equal(decoded[n].bits, t.bits):
                    raise RuntimeError(f"{coding.name} did not decode tensor {n!r} of version {version} bit-exact")
            results.append(Result(version, coding.name, coding.size_bytes(payload), changed, enc_s, dec_s))
        sums = {n: checksum(t) for n, t in target.items()}
    return results


def mean_bpe(results: Sequence[Result], coding: str) -> float:
    """Bytes per changed element of ``coding``, averaged over the versions."""
    return statistics.fmean(r.bytes_per_changed for r in results if r.coding == coding)


def summary_line(results: Sequence[Result]) -> str:
    """``peers: cond_bpe=<x> verl_bpe=<x> miles_bpe=<x>``."""
    return (
        f"peers: cond_bpe={mean_bpe(results, 'cond'):.3f} verl_bpe={mean_bpe(results, VERL):.3f} "
        f"miles_bpe={mean_bpe(results, MILES):.3f}"
    )


def tables(results: Sequence[Result]) -> tuple[Table, Table]:
    """The per-version table and the table of means over the versions."""
    cols = ("bytes", "B / changed elem", "encode s", "decode s")
    per = Table("version", "encoding", "changed", *cols, title="per version (bf16 served view)")
    for r in results:
        per.add_row(
            str(r.version),
            r.coding,
            f"{r.changed:,}",
            f"{r.size_bytes:,}",
            f"{r.bytes_per_changed:.3f}",
            f"{r.encode_s:.3f}",
            f"{r.decode_s:.3f}",
        )
    means = Table("encoding", *cols, title=f"means over {len({r.version for r in results})} versions")
    for name in dict.fromkeys(r.coding for r in results):
        mine = [r for r in results if r.coding == name]
        means.add_row(
            name,
            f"{statistics.fmean(r.size_bytes for r in mine):,.0f}",
            f"{mean_bpe(results, name):.3f}",
            f"{statistics.fmean(r.encode_s for r in mine):.3f}",
            f"{statistics.fmean(r.decode_s for r in mine):.3f}",
        )
    return per, means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="versions (AdamW steps) to compare")
    args = parser.parse_args()
    console = Console(width=160)
    trainer = CpuTrainer(build_smollm2_checkpoint(), batch_size=1, seq_len=32)
    views = [raw_view(trainer.served_view())]
    for _ in range(args.steps):
        trainer.step()
        views.append(raw_view(trainer.served_view()))
    results = compare(views)
    for table in tables(results):
        console.print(table)
    print(summary_line(results))


if __name__ == "__main__":
    main()
