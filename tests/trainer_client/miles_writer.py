"""A Miles-format disk-delta writer for the tests (the test process): writes the version folders Miles'
``--update-weight-transfer-mode disk-delta`` writes, byte for byte, from real training steps.

It follows radixark/miles at commit ``31f1ca961a94cb860cec3b2dea34ec332bfa8f76``:
``miles/backends/megatron_utils/update_weight/update_weight_from_distributed/delta.py``
(``UpdateWeightFromDiskDelta``: ``_capture_baseline``, ``_encode_delta``, ``_write_delta_files``) and
``miles/utils/disk_delta.py`` (``overwrite_encode``, ``checksum``, ``make_tensor_reader``):

* the baseline: Miles clears ``--update-weight-disk-dir`` and seeds its snapshot (name -> the tensor's
  bytes, uint8) from ``--hf-checkpoint``'s safetensors, by name; it writes no folder for it;
* version ``v`` (1, 2, ...): ``DIR/weight_v{v:06d}/``; each source rank diffs every gathered HF tensor's
  bytes against the snapshot: ``xor`` (``new ^ old``) or ``overwrite`` (changed-position count u4, the
  positions u4, then the new bytes at them); an unchanged tensor is left out; a changed one is
  compressed with ``zstandard.ZstdCompressor(level=1)`` and its checksum is taken over the NEW bytes
  (``xxh3-128``, ``blake3`` or ``adler32`` as 8 hex digits);
* each source rank that changed something writes ``model-{offset:05d}-of-{total:05d}.safetensors``
  (``safetensors.numpy.save`` of name -> compressed uint8, metadata name -> checksum), numbered over
  the ranks with a file only; rank 0 then writes ``model.safetensors.index.json``:
  ``{"metadata": {"version": "000001", "base_version": "000000", "delta_encoding", "compression_format":
  "zstd", "checksum_format"}, "weight_map": {name: file}}``; every file by an atomic rename.

Source ranks are modelled as contiguous slices of the tensors in order (pipeline stages own
consecutive layers). Public names (:func:`version_files`, :class:`MilesWriter`, :func:`tensor_bytes`,
:func:`read_hf_bytes`) are stable: tests/benchmarks/bench_peers.py uses them.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import safetensors.numpy
import torch
import zstandard

#: The Miles commit this writer follows.
MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"
#: Miles' index file name (the HF one).
INDEX_NAME = "model.safetensors.index.json"
#: The encodings and checksums Miles offers (``--update-weight-delta-encoding``, ``--update-weight-delta-checksum``).
ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as Miles takes them: 1-D uint8 numpy, a copy (shape ``[nbytes]``)."""
    return tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy().copy()


def read_hf_bytes(ckpt_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF safetensors folder as uint8 bytes (Miles' ``make_tensor_reader``, read whole)."""
    out: dict[str, np.ndarray] = {}
    for path in sorted(Path(ckpt_dir).glob("*.safetensors")):
        data = path.read_bytes()
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            out[name] = np.frombuffer(data, np.uint8, end - begin, 8 + header_len + begin).copy()
    return out


def overwrite_encode(new: np.ndarray, changed_mask: np.ndarray) -> np.ndarray:
    """Miles' ``overwrite`` delta: count (u4), positions (u4 each), then the new bytes at them."""
    pos = np.flatnonzero(changed_mask).astype("<u4")
    return np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), new[changed_mask]])


def checksum(algorithm: str, buf: np.ndarray) -> str:
    """Miles' per-tensor checksum of ``buf`` as hex: ``xxh3-128``, ``blake3`` or ``adler32`` (8 hex digits)."""
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128(buf).hexdigest()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(buf).hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(buf, 1):08x}"
    raise KeyError(f"unknown checksum algorithm {algorithm!r}")


def encode_tensor(
    old: np.ndarray, new: np.ndarray, encoding: str, checksum_format: str
) -> tuple[np.ndarray, str] | None:
    """One tensor as Miles encodes it: (zstd-compressed delta, uint8; checksum of ``new``), None when unchanged."""
    if encoding == "xor":
        diff = new ^ old
        changed = int(np.count_nonzero(diff))
    elif encoding == "overwrite":
        mask = new != old
        changed = int(np.count_nonzero(mask))
        diff = overwrite_encode(new, mask)
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}")
    if not changed:
        return None
    compressed = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(diff), dtype=np.uint8)
    return compressed, checksum(checksum_format, new)


def version_files(
    old: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    version: int,
    *,
    encoding: str = "xor",
    checksum_format: str = "xxh3-128",
    ranks: int = 2,
) -> dict[str, bytes]:
    """The files Miles writes for ``version`` (file name -> bytes, the index last), ``new`` diffed against ``old``.

    Args:
        old, new: tensor name -> bytes (1-D uint8), the same names; ``new`` in the order the ranks gather.
        version: the version (>= 1); its base is ``version - 1``.
        encoding, checksum_format: Miles' ``--update-weight-delta-encoding`` / ``--update-weight-delta-checksum``.
        ranks: source ranks (contiguous slices of ``new``'s names), each writing its own shard file.
    """
    names = list(new)
    bounds = np.linspace(0, len(names), ranks + 1).astype(int)
    per_rank: list[tuple[dict[str, np.ndarray], dict[str, str]]] = []
    for r in range(ranks):
        delta: dict[str, np.ndarray] = {}
        sums: dict[str, str] = {}
        for name in names[bounds[r] : bounds[r + 1]]:
            encoded = encode_tensor(old[name], new[name], encoding, checksum_format)
            if encoded is not None:
                delta[name], sums[name] = encoded
        per_rank.append((delta, sums))
    counts = [int(bool(delta)) for delta, _ in per_rank]
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for r, (delta, sums) in enumerate(per_rank):
        if not delta:
            continue
        fname = f"model-{sum(counts[:r]):05d}-of-{sum(counts):05d}.safetensors"
        files[fname] = safetensors.numpy.save(delta, metadata=sums)
        weight_map.update({name: fname for name in delta})
    index = {
        "metadata": {
            "version": f"{version:06d}",
            "base_version": f"{version - 1:06d}",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": checksum_format,
        },
        "weight_map": weight_map,
    }
    files[INDEX_NAME] = json.dumps(index).encode()
    return files


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MilesWriter:
    """Miles' trainer side of disk-delta: the baseline, then one version folder per :meth:`write`.

    Args:
        delta_dir: Miles' ``--update-weight-disk-dir`` (cleared, as Miles clears it at the baseline).
        hf_checkpoint: Miles' ``--hf-checkpoint`` (bf16 safetensors), the snapshot's seed.
        encoding, checksum_format, ranks: as :func:`version_files`.

    Attributes:
        version: the last version written (0: the baseline only).
        snapshot: tensor name -> bytes of the last version (Miles' ``_snapshot``).
    """

    def __init__(
        self,
        delta_dir: Path,
        hf_checkpoint: Path,
        *,
        encoding: str = "xor",
        checksum_format: str = "xxh3-128",
        ranks: int = 2,
    ) -> None:
        self.delta_dir = Path(delta_dir)
        shutil.rmtree(self.delta_dir, ignore_errors=True)
        self.delta_dir.mkdir(parents=True)
        self.encoding, self.checksum_format, self.ranks = encoding, checksum_format, ranks
        self.snapshot = read_hf_bytes(hf_checkpoint)
        self.version = 0

    def write(self, state: Mapping[str, torch.Tensor]) -> Path:
        """Write the next version from ``state`` (HF name -> tensor, Miles' gathered HF tensors); returns its folder.

        Every name of ``state`` must be in the snapshot (Miles falls back to the gathered value otherwise).
        """
        new = {name: tensor_bytes(t) for name, t in state.items()}
        self.version += 1
        folder = self.delta_dir / f"weight_v{self.version:06d}"
        folder.mkdir()
        files = version_files(
            self.snapshot,
            new,
            self.version,
            encoding=self.encoding,
            checksum_format=self.checksum_format,
            ranks=self.ranks,
        )
        for name, data in files.items():  # the shards, then the index (rank 0, after the gather)
            _atomic_write(folder / name, data)
        self.snapshot.update(new)
        return folder
