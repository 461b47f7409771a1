"""Miles' disk-delta version folders: read one, check it, and decode it against the view before it (trainer
host: the process of Miles' rank 0 running the post-write hook, :mod:`.miles`, and ``stitchboard watch
--layout miles``). The one implementation both use.

Miles (radixark/miles, ``update_weight_from_distributed/delta.py``) writes version ``v`` as
``<--update-weight-disk-dir>/weight_v{v:06d}/``: per source rank a ``model-XXXXX-of-YYYYY.safetensors`` of
changed tensors (name -> zstd-compressed delta, uint8; ``__metadata__`` name -> checksum of the tensor's new
bytes), then ``model.safetensors.index.json`` with ``metadata`` (``version``, ``base_version``,
``delta_encoding`` ``xor`` or ``overwrite``, ``compression_format`` ``zstd``, ``checksum_format``
``xxh3-128``, ``blake3`` or ``adler32``) and ``weight_map``. The deltas are byte-level and dtype-blind: a
tensor's dtype and shape are the previous view's. Version 0 (the baseline) is no folder: it is Miles'
``--hf-checkpoint``, which seeds Miles' snapshot.

:func:`read_version` reads and checks the whole folder (index, every shard the index lists, every tensor's
checksum present); :func:`decode` decodes every changed tensor and checks its checksum before returning
the new view, the previous one untouched; so a refused version leaves nothing half applied.
:func:`decode_stream` gives the same view one tensor at a time (a publisher streams it, holding one decoded
tensor at a time; it publishes only after the last tensor passed its check).
:class:`MilesView` keeps the last decoded view and replays the folders from the baseline when asked
for another base (a restarted process). Decompression is capped at the tensor's size.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import zstandard

from stitchboard.proto.container import RawTensor, load_json, parse_safetensors
from stitchboard.proto.errors import PatchFormatError

from .errors import MilesBaseVersionError, MilesChecksumError, MilesDeltaError

#: The index file of a Miles version folder.
INDEX_NAME = "model.safetensors.index.json"
#: A Miles version folder's name; the group is the version.
FOLDER = re.compile(r"weight_v(\d{6,})")
#: Miles' delta encodings (``--update-weight-delta-encoding``).
ENCODINGS = ("xor", "overwrite")
#: Miles' checksum kinds (``--update-weight-delta-checksum``).
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
#: Largest index file read, bytes.
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True)
class MilesTensor:
    """One changed tensor of a Miles version: its compressed delta (1-D uint8), the checksum of its new bytes
    (hex) and the shard file holding it."""

    delta: np.ndarray
    checksum: str
    file: Path


@dataclass(frozen=True)
class MilesVersion:
    """A read and checked Miles version folder (nothing decoded yet).

    Attributes:
        folder: the ``weight_vNNNNNN`` folder. version, base_version: from its index.
        encoding: ``xor`` or ``overwrite``. checksum_format: ``xxh3-128``, ``blake3`` or ``adler32``.
        tensors: changed tensor name -> :class:`MilesTensor`.
    """

    folder: Path
    version: int
    base_version: int
    encoding: str
    checksum_format: str
    tensors: dict[str, MilesTensor]


def _refuse(
    message: str, folder: Path, version: int | None, file: Path, cls: type = MilesDeltaError, **more: Any
) -> NoReturn:
    raise cls(message, folder=str(folder), version=version, file=str(file), **more)


def version_of(folder: Path) -> int | None:
    """The version in a Miles folder's name (``weight_v000003`` -> 3); None for another name."""
    match = FOLDER.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def _number(meta: dict[str, Any], key: str, index: Path, version: int | None) -> int:
    value = meta.get(key)
    if not isinstance(value, str) or not value.isdigit():
        _refuse(f"{index}: metadata {key!r} is {value!r}, not a version number", index.parent, version, index)
    return int(value)


def _read_index(folder: Path, version: int | None) -> tuple[dict[str, Any], dict[str, str]]:
    index = folder / INDEX_NAME
    try:
        with open(index, "rb") as f:
            data = f.read(MAX_INDEX_BYTES + 1)
    except FileNotFoundError:
        _refuse(f"{index} is missing (Miles writes it last): version {version} is not complete", folder, version, index)
    if len(data) > MAX_INDEX_BYTES:
        _refuse(f"{index}: larger than {MAX_INDEX_BYTES} bytes", folder, version, index)
    try:
        parsed = load_json(data, str(index))
    except PatchFormatError as exc:
        _refuse(exc.message, folder, version, index)
    meta = parsed.get("metadata") if isinstance(parsed, dict) else None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(meta, dict) or not isinstance(weight_map, dict):
        _refuse(f"{index}: not a Miles delta index (no 'metadata' or 'weight_map' object)", folder, version, index)
    if not all(isinstance(v, str) and v == Path(v).name and v.endswith(".safetensors") for v in weight_map.values()):
        _refuse(
            f"{index}: weight_map must map tensor names to .safetensors files in the folder", folder, version, index
        )
    return meta, weight_map


def read_version(folder: Path) -> MilesVersion:
    """Read and check a Miles version folder: its index, then every shard file the index lists, whole.

    Raises:
        MilesDeltaError: the index or a shard file missing, malformed or disagreeing with the other (a
            tensor in no file, in another file, or without a checksum), the index's version not the
            folder's, or an encoding, compression or checksum kind not Miles'; names the file and version.
    """
    folder = Path(folder)
    named = version_of(folder)
    meta, weight_map = _read_index(folder, named)
    index = folder / INDEX_NAME
    version = _number(meta, "version", index, named)
    base = _number(meta, "base_version", index, version)
    if named is not None and named != version:
        _refuse(f"{index}: metadata version {version} in folder {folder.name}", folder, version, index)
    kinds = {"delta_encoding": ENCODINGS, "compression_format": ("zstd",), "checksum_format": CHECKSUMS}
    for key, known in kinds.items():
        if meta.get(key) not in known:
            _refuse(
                f"{index}: version {version} has {key} {meta.get(key)!r}; Miles' format knows {', '.join(known)}",
                folder,
                version,
                index,
            )
    tensors: dict[str, MilesTensor] = {}
    for name in sorted(set(weight_map.values())):
        path = folder / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            _refuse(f"{path}: missing; the index of version {version} lists it", folder, version, path)
        try:
            sums, raw = parse_safetensors(data, what=str(path))
        except PatchFormatError as exc:
            _refuse(f"version {version}: {exc.message}", folder, version, path)
        for tensor, t in raw.items():
            if weight_map.get(tensor) != name:
                _refuse(
                    f"{path}: tensor {tensor!r} of version {version} is not in this file per the index",
                    folder,
                    version,
                    path,
                )
            if t.dtype != "U8" or len(t.shape) != 1:
                _refuse(
                    f"{path}: tensor {tensor!r} is {t.dtype} {list(t.shape)}, not 1-D U8 bytes", folder, version, path
                )
            if tensor not in sums:
                _refuse(f"{path}: tensor {tensor!r} of version {version} has no checksum", folder, version, path)
            tensors[tensor] = MilesTensor(t.bits, sums[tensor], path)
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        _refuse(f"{index}: version {version} lists tensors no shard holds: {absent[:3]}", folder, version, index)
    return MilesVersion(folder, version, base, str(meta["delta_encoding"]), str(meta["checksum_format"]), tensors)


def checksum(kind: str, data: np.ndarray) -> str:
    """Miles' checksum of ``data`` (bytes) as hex: ``xxh3-128``, ``blake3`` or ``adler32`` (8 hex digits).

    Raises:
        ValueError: another kind.
    """
    if kind == "xxh3-128":
        import xxhash

        return str(xxhash.xxh3_128(data.data).hexdigest())
    if kind == "blake3":
        import blake3

        return str(blake3.blake3(data.data).hexdigest())
    if kind == "adler32":
        return f"{zlib.adler32(data.data, 1):08x}"
    raise ValueError(f"unknown checksum kind {kind!r}")


def _decompress(mv: MilesVersion, name: str, t: MilesTensor, cap: int) -> np.ndarray:
    try:
        out = zstandard.ZstdDecompressor().decompress(t.delta.tobytes(), max_output_size=cap)
    except zstandard.ZstdError as exc:
        _refuse(
            f"{t.file}: tensor {name!r} of version {mv.version}: zstd: {exc} (at most {cap} bytes)",
            mv.folder,
            mv.version,
            t.file,
        )
    if len(out) > cap:
        _refuse(
            f"{t.file}: tensor {name!r} of version {mv.version} decompresses past {cap} bytes",
            mv.folder,
            mv.version,
            t.file,
        )
    return np.frombuffer(out, dtype=np.uint8)


def _new_bytes(mv: MilesVersion, name: str, t: MilesTensor, old: np.ndarray) -> np.ndarray:
    n = old.size
    if mv.encoding == "xor":
        diff = _decompress(mv, name, t, n)
        if diff.size != n:
            _refuse(
                f"{t.file}: tensor {name!r} of version {mv.version}: xor delta of {diff.size} bytes, not {n}",
                mv.folder,
                mv.version,
                t.file,
            )
        out: np.ndarray = old ^ diff
        return out
    raw = _decompress(mv, name, t, 4 + 5 * n)
    count = int(raw[:4].view("<u4")[0]) if raw.size >= 4 else -1
    if count < 0 or raw.size != 4 + 5 * count:
        _refuse(
            f"{t.file}: tensor {name!r} of version {mv.version}: malformed overwrite delta ({raw.size} bytes)",
            mv.folder,
            mv.version,
            t.file,
        )
    pos = raw[4 : 4 + 4 * count].view("<u4")
    if count and int(pos.max()) >= n:
        _refuse(
            f"{t.file}: tensor {name!r} of version {mv.version}: overwrite position past its {n} bytes",
            mv.folder,
            mv.version,
            t.file,
        )
    new = old.copy()
    new[pos] = raw[4 + 4 * count :]
    return new


def decode(base: Mapping[str, RawTensor], mv: MilesVersion) -> dict[str, RawTensor]:
    """The view of version ``mv``: ``base`` (the view of ``mv.base_version``) with every changed tensor decoded.

    Every tensor's checksum is checked before the view is returned; ``base`` is not changed, and the new
    view shares its unchanged tensors.

    Raises:
        MilesDeltaError: a tensor ``base`` lacks, a delta that does not decompress or fit the tensor.
        MilesChecksumError: a decoded tensor whose checksum is not the recorded one.
    """
    _check_names(base, mv)
    out = dict(base)
    for name in sorted(mv.tensors):
        out[name] = decode_tensor(base, mv, name)
    return out


def _check_names(base: Mapping[str, RawTensor], mv: MilesVersion) -> None:
    for name, t in sorted(mv.tensors.items()):
        if name not in base:
            _refuse(
                f"{t.file}: version {mv.version} changes tensor {name!r}, which version {mv.base_version} lacks",
                mv.folder,
                mv.version,
                t.file,
            )


def decode_tensor(base: Mapping[str, RawTensor], mv: MilesVersion, name: str) -> RawTensor:
    """Tensor ``name`` (one ``mv`` changes, which ``base`` holds) of version ``mv``, decoded and its checksum checked.

    Raises:
        MilesDeltaError: a delta that does not decompress or fit the tensor.
        MilesChecksumError: the decoded tensor's checksum is not the recorded one.
    """
    t, old = mv.tensors[name], base[name]
    new = _new_bytes(mv, name, t, old.bits.view(np.uint8))
    got = checksum(mv.checksum_format, new)
    if got != t.checksum:
        _refuse(
            f"{t.file}: tensor {name!r} of version {mv.version} decodes to {mv.checksum_format} {got}, the file "
            f"records {t.checksum} (a corrupted file, or decoded on another base than {mv.base_version})",
            mv.folder,
            mv.version,
            t.file,
            MilesChecksumError,
            tensor=name,
            checksum_format=mv.checksum_format,
        )
    return RawTensor.from_bytes(old.dtype, old.shape, new.data)


def decode_stream(base: Mapping[str, RawTensor], mv: MilesVersion) -> Iterator[tuple[str, RawTensor]]:
    """The view of version ``mv`` one tensor at a time, names sorted: ``base``'s tensors that ``mv`` leaves alone,
    and each changed one decoded and checked (:func:`decode_tensor`) only when its turn comes, so a consumer holds
    one decoded tensor at a time. ``base`` is not changed. A tensor ``base`` lacks is refused before the first.

    Raises:
        MilesDeltaError, MilesChecksumError: see :func:`decode` (while iterating: a consumer that publishes only
            once the stream ends publishes nothing).
    """
    _check_names(base, mv)
    for name in sorted(base):
        yield name, decode_tensor(base, mv, name) if name in mv.tensors else base[name]


class MilesView:
    """Miles' view on this host, version by version: the base a version folder decodes against.

    Args:
        read_base: returns the view of version 0, Miles' ``--hf-checkpoint`` (name -> raw tensor).

    Attributes:
        version: the version of :attr:`view` (None: none read yet). view: its tensors.
    """

    def __init__(self, read_base: Callable[[], Mapping[str, RawTensor]]) -> None:
        self.read_base = read_base
        self.version: int | None = None
        self.view: dict[str, RawTensor] = {}

    def commit(self, version: int, view: dict[str, RawTensor]) -> None:
        """Keep ``view`` as version ``version`` (the next version's base)."""
        self.version, self.view = version, view

    def at(self, delta_dir: Path, version: int) -> dict[str, RawTensor]:
        """The view of ``version``: the kept one, else the baseline with ``delta_dir``'s folders 1..version replayed.

        Raises:
            MilesDeltaError, MilesChecksumError: a folder on the way refused (see :func:`read_version`).
            MilesBaseVersionError: a folder on the way based on another version than the one before it.
        """
        if self.version != version:
            if self.version is None or self.version > version:
                self.commit(0, dict(self.read_base()))
            while self.version is not None and self.version < version:
                folder = Path(delta_dir) / f"weight_v{self.version + 1:06d}"
                self.commit(self.version + 1, self.decode_next(read_version(folder)))
        return self.view

    def decode_next(self, mv: MilesVersion) -> dict[str, RawTensor]:
        """Decode ``mv`` on the kept view, which must be its base version (the kept view is unchanged).

        Raises:
            MilesBaseVersionError: the kept view is another version.
            MilesDeltaError, MilesChecksumError: see :func:`decode`.
        """
        return decode(self.check_base(mv), mv)

    def check_base(self, mv: MilesVersion) -> dict[str, RawTensor]:
        """The kept view, checked to be ``mv``'s base version (to decode ``mv`` on, e.g. with :func:`decode_stream`).

        Raises:
            MilesBaseVersionError: the kept view is another version.
        """
        if self.version != mv.base_version:
            index = mv.folder / INDEX_NAME
            _refuse(
                f"{index}: version {mv.version} is based on version {mv.base_version}; the view here is version "
                f"{self.version}",
                mv.folder,
                mv.version,
                index,
                MilesBaseVersionError,
                base_version=mv.base_version,
                latest_step=self.version,
            )
        return self.view

    def read(self, folder: Path) -> dict[str, RawTensor]:
        """Read, check and decode a version folder on its base (replayed from the folder's parent when needed);
        keep and return its view (``stitchboard watch --layout miles`` reads each folder so)."""
        mv = read_version(folder)
        self.at(Path(folder).parent, mv.base_version)
        view = self.decode_next(mv)
        self.commit(mv.version, view)
        return view
