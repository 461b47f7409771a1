"""Reading patch files: parse, validate and decode deltas before anything is written.

:func:`read_patch` checks the container, the index and every entry; the payload frame is
decompressed only after checking that it declares exactly the size the index implies (a frame
claiming a huge content size is refused before any allocation). :meth:`Patch.deltas` then
decodes and checks every tensor's positions (in range, strictly increasing). Every failure
raises :class:`PatchFormatError` naming the tensor.

A ``cond`` patch (:mod:`stitchboard.proto.cond_codec`) decodes only against its base: its
deltas take the base tensors, whose checksums must match, and come out as the new bits, already
checked against the target checksums (so even a corrupt stream that decodes is refused before
any write).

A parted entry (format version 2, :mod:`stitchboard.proto.parts`) decodes block by block on the
process's part threads (:func:`~stitchboard.proto.parts.pool`) and comes out as the same
:class:`TensorDelta`, in the whole tensor's positions: a ``cond`` block is checked against its base
digest (unless the caller verified the whole base) and its decoded bits against its target digest,
before anything is written; an unchanged block's bits against its digest. So every block of a
decoded ``cond`` entry holds its target digest, and the reader checked that those digests make
the entry's ``xxh3_128_parts`` target: the decoded tensor is that target, whatever its base.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import zstandard

from . import _bitdiff, cond_codec, parts
from .codec import (
    ENCODINGS,
    FORMAT,
    FORMAT_VERSIONS,
    INDEX_KEY,
    PAYLOAD_KEY,
    PatchEntry,
    checksum,
    payload_layout,
    payload_size,
)
from .container import RawTensor, load_json, parse_safetensors, parse_safetensors_header
from .dtypes import DTYPE_SIZES, MAX_NUMEL, bits_type, numel_of
from .errors import BaseMismatchError, PatchFormatError, SchemaError, TargetMismatchError, TensorSetMismatchError
from .patched_digest import patched_checksum
from .schema import XXH3_128, check_digest, check_path
from .threads import thread_map

#: Largest decompressed index accepted (about 100 k tensors).
MAX_INDEX_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class TensorDelta:
    """A decoded, validated delta of one tensor.

    Attributes:
        entry: its :class:`~stitchboard.proto.codec.PatchEntry`.
        encoding: ``xor``, ``overwrite`` or ``cond``.
        positions: int64 [count], strictly increasing flat element indices < numel.
        values: ``bits_type(dtype)`` [count]: XOR bits (``xor``) or new bits (``overwrite``,
            ``cond``) per position.
    """

    entry: PatchEntry
    encoding: str
    positions: np.ndarray
    values: np.ndarray


class Patch:
    """A parsed patch file: index validated, payload frame checked but not yet decompressed.

    Attributes:
        encoding: ``xor``, ``overwrite`` or ``cond``.
        entries: tensor name -> :class:`PatchEntry`, in name order.
        metadata: the free metadata strings (run id, versions...).
        size_bytes: size of the patch file in bytes.
    """

    def __init__(
        self,
        encoding: str,
        entries: list[PatchEntry],
        metadata: dict[str, str],
        size_bytes: int,
        frame: memoryview,
        what: str,
    ):
        self.encoding = encoding
        self.entries = {e.name: e for e in entries}
        self.metadata = metadata
        self.size_bytes = size_bytes
        self._frame = frame
        self._what = what
        self._layout = dict(zip(self.entries, payload_layout(entries), strict=True))
        # cond: where each tensor's stream starts (the last running sum, the payload size, pairs with no entry)
        self._stream_at = dict(
            zip(self.entries, itertools.accumulate([0] + [e.gap_bytes for e in entries]), strict=False)
        )
        self._payload_bytes = payload_size(entries, encoding)
        self._payload: np.ndarray | None = None

    @property
    def changed_elements(self) -> int:
        """Changed elements over all tensors."""
        return sum(e.count for e in self.entries.values())

    def _decompressed(self) -> np.ndarray:
        if self._payload is None:
            if self.encoding == "cond":  # stored uncompressed; read_patch checked its size
                self._payload = np.frombuffer(self._frame, dtype=np.uint8)
            else:
                raw = _decompress_exact(self._frame, self._payload_bytes, f"{self._what}: {PAYLOAD_KEY}")
                self._payload = np.frombuffer(raw, dtype=np.uint8)
        return self._payload

    def delta(self, name: str, base: RawTensor | None = None, *, base_verified: bool = False) -> TensorDelta:
        """Decode and validate one tensor's delta (decompresses the payload on first use).

        Args:
            name: a tensor the patch touches.
            base: the tensor's current bits; required by ``cond``, ignored by the others.
            base_verified: the caller has already matched ``base``'s xxh3-128 to the entry's
                base checksum (``cond`` then skips hashing it again).

        Raises:
            KeyError: the patch does not touch ``name``.
            ValueError: a ``cond`` patch without ``base``.
            TensorSetMismatchError: ``base`` has another dtype or shape than the entry.
            BaseMismatchError: ``base`` is not the patch's base (``cond``).
            PatchFormatError: the payload frame or the tensor's positions or values are invalid.
            TargetMismatchError: a ``cond`` stream decodes to bits without the target checksum
                (the decoded bits are checked before anything can be written).
        """
        entry = self.entries[name]
        if entry.parts is not None:
            return self._parted_delta(entry, base, base_verified)
        if self.encoding == "cond":
            return self._cond_delta(entry, base, base_verified)
        payload = self._decompressed()
        gap_at, plane_at = self._layout[name]
        positions = np.empty(entry.count, dtype=np.int64)
        try:
            _bitdiff.positions(payload[gap_at : gap_at + entry.gap_bytes], positions, entry.numel)
        except ValueError as exc:
            raise PatchFormatError(f"{self._what}: tensor {name!r}: {exc}") from None
        planes = np.empty((entry.count, entry.itemsize), dtype=np.uint8)
        for k, at in enumerate(plane_at):
            planes[:, k] = payload[at : at + entry.count]
        return TensorDelta(entry, self.encoding, positions, planes.view(bits_type(entry.dtype)).reshape(entry.count))

    def _parted_delta(self, entry: PatchEntry, base: RawTensor | None, base_verified: bool) -> TensorDelta:
        """:meth:`delta` of a parted entry: every block on the part threads, then merged in position order."""
        assert entry.parts is not None
        name, cond = entry.name, self.encoding == "cond"
        if cond:
            base = self._checked_base(entry, base)
        payload = self._decompressed()
        at = self._stream_at[name] if cond else self._layout[name][0]
        planes = [] if cond else self._layout[name][1]
        jobs, before = [], 0  # (part, offset of its stream, values of the earlier parts)
        for part in entry.parts:
            jobs.append((part, at, before))
            at += part.bytes
            before += part.count

        def one(job: tuple[parts.Part, int, int]) -> tuple[np.ndarray, np.ndarray]:
            part, offset, before = job
            what = f"{self._what}: tensor {name!r} part {part.dim},{part.start},{part.stop}"
            stream = payload[offset : offset + part.bytes]
            if not cond:
                local = np.empty(part.count, dtype=np.int64)
                try:
                    _bitdiff.positions(stream, local, part.numel(entry.shape))
                except ValueError as exc:
                    raise PatchFormatError(f"{what}: {exc}") from None
                values = np.empty((part.count, entry.itemsize), dtype=np.uint8)
                for k, plane in enumerate(planes):
                    values[:, k] = payload[plane + before : plane + before + part.count]
                return parts.to_whole(part, entry.shape, local), values.view(bits_type(entry.dtype)).reshape(-1)
            assert base is not None
            bits = parts.block(base.bits, base.shape, part.dim, part.start, part.stop)
            # An unchanged part is checked even on a verified base: its base digest is its target (check_parts).
            if (part.count == 0 or not base_verified) and parts.digest(bits) != part.base:
                raise BaseMismatchError(
                    f"{what} is not the base of the patch: a cond patch decodes only against its exact base"
                )
            if part.count == 0:
                return np.empty(0, dtype=np.int64), np.empty(0, dtype=bits.dtype)
            held = RawTensor(entry.dtype, (bits.size,), bits)
            local, values = cond_codec.decode(stream, held, part.count, what)
            if patched_checksum(bits, (bits.size,), local, values) != part.target:
                raise TargetMismatchError(
                    f"{what} decodes to bits without its target digest (a corrupt stream); nothing was written"
                )
            return parts.to_whole(part, entry.shape, local), values

        todo = [job for job in jobs if job[0].count or cond]
        decoded = list(parts.pool().map(one, todo))
        positions = np.concatenate([p for p, _ in decoded])
        values = np.concatenate([v for _, v in decoded])
        if entry.parts[0].dim == 1 and len(decoded) > 1:
            order = np.argsort(positions, kind="stable")
            positions, values = positions[order], values[order]
        return TensorDelta(entry, self.encoding, positions, values)

    def _checked_base(self, entry: PatchEntry, base: RawTensor | None) -> RawTensor:
        """``base`` of a ``cond`` entry, with the patch's dtype and shape (ValueError, TensorSetMismatchError)."""
        name = entry.name
        if base is None:
            raise ValueError(
                f"{self._what}: a cond patch decodes against its base: pass tensor {name!r}'s current bits"
            )
        if base.dtype != entry.dtype or tuple(base.shape) != entry.shape:
            raise TensorSetMismatchError(
                f"tensor {name!r} is {base.dtype}{list(base.shape)} but the patch is for "
                f"{entry.dtype}{list(entry.shape)}"
            )
        return base

    def _cond_delta(self, entry: PatchEntry, base: RawTensor | None, base_verified: bool) -> TensorDelta:
        name = entry.name
        base = self._checked_base(entry, base)
        if not base_verified and checksum(base) != entry.base[XXH3_128]:
            raise BaseMismatchError(
                f"tensor {name!r} is not the base of {self._what}: a cond patch decodes only against its exact base"
            )
        at = self._stream_at[name]
        stream = self._decompressed()[at : at + entry.gap_bytes]
        positions, values = cond_codec.decode(stream, base, entry.count, f"{self._what}: tensor {name!r}")
        if patched_checksum(base.bits, base.shape, positions, values) != entry.target[XXH3_128]:
            raise TargetMismatchError(
                f"tensor {name!r} of {self._what} decodes to bits that do not match its target checksum (a corrupt "
                "stream); nothing was written"
            )
        return TensorDelta(entry, self.encoding, positions, values)

    def deltas(
        self, bases: Mapping[str, RawTensor] | None = None, *, bases_verified: bool = False, threads: int | None = None
    ) -> dict[str, TensorDelta]:
        """Decode and validate every tensor's delta (all of them, before any use).

        Args:
            bases: name -> current bits of every touched tensor; required by ``cond``.
            bases_verified: as ``base_verified`` of :meth:`delta`, for every tensor.
            threads: decoding threads for ``cond`` (default: CPU count, at most 8); the range
                decoder releases the GIL, so tensors decode in parallel.

        Raises:
            the errors of :meth:`delta` (``KeyError`` when ``bases`` lacks a touched tensor).
        """
        if self.encoding != "cond":
            return {name: self.delta(name) for name in self.entries}
        if bases is None:
            raise ValueError(
                f"{self._what}: a cond patch decodes against its base: pass the current bits of its tensors"
            )
        order = sorted(self.entries, key=lambda n: -self.entries[n].numel)
        deltas = thread_map(lambda n: self.delta(n, bases[n], base_verified=bases_verified), order, threads)
        decoded = dict(zip(order, deltas, strict=True))
        return {name: decoded[name] for name in self.entries}


def _declared_size(frame: memoryview | bytes) -> int:
    """Content size a zstd frame header declares; -1 when absent or not a zstd frame."""
    try:
        return zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        return -1


def _decompress_exact(frame: memoryview | bytes, want: int, what: str) -> bytes:
    """Decompress one zstd frame that must declare and hold exactly ``want`` bytes.

    The declared content size is checked before decompressing, so a frame claiming a huge size
    is refused without allocating.
    """
    declared = _declared_size(frame)
    if declared != want:
        raise PatchFormatError(
            f"{what}: zstd frame declares {declared} bytes, the index implies {want}; refusing to decompress"
        )
    dobj = zstandard.ZstdDecompressor().decompressobj()
    try:
        raw = dobj.decompress(frame)
    except zstandard.ZstdError as exc:
        raise PatchFormatError(f"{what}: corrupt zstd frame ({exc})") from None
    if len(raw) != want or not dobj.eof or dobj.unused_data:
        raise PatchFormatError(f"{what}: zstd frame is truncated, longer than declared or followed by extra bytes")
    return raw


def _entry_from_json(obj: object, encoding: str, what: str, version: str) -> PatchEntry:
    if not isinstance(obj, dict):
        raise PatchFormatError(f"{what}: tensor entry is not an object")
    want = {"name", "dtype", "shape", "count", "gap_bytes", "base", "target"}
    if version != FORMAT_VERSIONS[0] and "parts" in obj:
        want.add("parts")
    if set(obj) != want:
        raise PatchFormatError(f"{what}: tensor entry keys {sorted(obj)} != {sorted(want)}")
    name = obj["name"]
    try:
        check_path(name if isinstance(name, str) else "", "tensor name")
    except SchemaError as exc:
        raise PatchFormatError(f"{what}: {exc}") from None
    dtype, shape, count, gap_bytes = obj["dtype"], obj["shape"], obj["count"], obj["gap_bytes"]
    if dtype not in DTYPE_SIZES:
        raise PatchFormatError(f"{what}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in [*shape, count, gap_bytes]):
        raise PatchFormatError(f"{what}: tensor {name!r} has a bad shape, count or gap_bytes")
    numel = numel_of(shape)
    if numel > MAX_NUMEL:
        raise PatchFormatError(f"{what}: tensor {name!r} shape {shape} overflows")
    if not 1 <= count <= numel:
        raise PatchFormatError(f"{what}: tensor {name!r} claims {count} changed elements of {numel}")
    if encoding == "cond" and gap_bytes < cond_codec.MIN_STREAM_BYTES:
        raise PatchFormatError(
            f"{what}: tensor {name!r} has a {gap_bytes}-byte coded stream; "
            f"one with changes has at least {cond_codec.MIN_STREAM_BYTES}"
        )
    if encoding != "cond" and not count <= gap_bytes <= 10 * count:
        raise PatchFormatError(f"{what}: tensor {name!r} has {gap_bytes} gap bytes for {count} varints")
    blocks = parts.check_parts(obj["parts"], shape, encoding, f"{what}: tensor {name!r}") if "parts" in obj else None
    if blocks is not None and (sum(p.count for p in blocks), sum(p.bytes for p in blocks)) != (count, gap_bytes):
        raise PatchFormatError(f"{what}: tensor {name!r}: its parts' counts and bytes do not add up to the entry's")
    for key in ("base", "target"):
        sums = obj[key]
        must = XXH3_128 if blocks is None else parts.XXH3_128_PARTS
        if not isinstance(sums, dict) or not isinstance(sums.get(must), str):
            raise PatchFormatError(f"{what}: tensor {name!r} lacks a {key} {must} checksum")
        try:
            for alg, digest in sums.items():
                check_digest(alg, digest if isinstance(digest, str) else "")
        except SchemaError as exc:
            raise PatchFormatError(f"{what}: tensor {name!r} {key}: {exc}") from None
        if blocks is not None and sums[must] != parts.checksums_of(blocks, key)[must]:
            raise PatchFormatError(f"{what}: tensor {name!r}: its {key} {must} is not that of its parts' digests")
    return PatchEntry(name, dtype, tuple(shape), count, gap_bytes, dict(obj["base"]), dict(obj["target"]), blocks)


def _check_container(
    meta: dict[str, str], slots: Mapping[str, tuple[str, int]], what: str
) -> tuple[str, dict[str, str], str]:
    """The patch's (encoding, free metadata, format version) from its container: ``meta`` and name -> (dtype,
    bytes) of its tensors."""
    if set(meta) != {FORMAT}:
        raise PatchFormatError(
            f"{what}: not a stitchboard patch (no {FORMAT!r} metadata); an anchor is a plain checkpoint, "
            "load it instead"
        )
    header = load_json(meta[FORMAT], f"{what}: {FORMAT!r} metadata")
    if not isinstance(header, dict) or set(header) != {"format_version", "encoding", "metadata"}:
        raise PatchFormatError(f"{what}: {FORMAT!r} metadata must have format_version, encoding, metadata")
    if header["format_version"] not in FORMAT_VERSIONS:
        raise PatchFormatError(
            f"{what}: patch format version {header['format_version']!r} is not supported (this reader knows "
            f"{', '.join(FORMAT_VERSIONS)}); upgrade stitchboard"
        )
    encoding, extra = header["encoding"], header["metadata"]
    if encoding not in ENCODINGS:
        raise PatchFormatError(f"{what}: unknown encoding {encoding!r}")
    if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise PatchFormatError(f"{what}: 'metadata' must map strings to strings")
    if set(slots) != {INDEX_KEY, PAYLOAD_KEY} or any(dtype != "U8" for dtype, _ in slots.values()):
        found = {k: dtype for k, (dtype, _) in slots.items()}
        raise PatchFormatError(f"{what}: expected U8 tensors {INDEX_KEY!r} and {PAYLOAD_KEY!r}, found {found}")
    return encoding, extra, header["format_version"]


def _read_index(index: bytes | memoryview, encoding: str, what: str, version: str) -> list[PatchEntry]:
    """The entries of an ``__index__`` frame, checked (declared size within :data:`MAX_INDEX_BYTES`, name order)."""
    declared = _declared_size(index)
    if not 0 <= declared <= MAX_INDEX_BYTES:
        raise PatchFormatError(
            f"{what}: {INDEX_KEY} declares {declared} bytes (limit {MAX_INDEX_BYTES}); refusing to decompress"
        )
    items = load_json(_decompress_exact(index, declared, f"{what}: {INDEX_KEY}"), f"{what}: {INDEX_KEY}")
    if not isinstance(items, list):
        raise PatchFormatError(f"{what}: {INDEX_KEY} is not a list")
    entries = [_entry_from_json(obj, encoding, what, version) for obj in items]
    names = [e.name for e in entries]
    if any(a >= b for a, b in itertools.pairwise(names)):
        raise PatchFormatError(f"{what}: {INDEX_KEY} entries must be unique and in name order")
    return entries


def _check_payload(
    entries: list[PatchEntry], encoding: str, payload_len: int, frame_head: bytes | memoryview, what: str
) -> None:
    """The payload holds (``cond``) or declares in its zstd frame header (``frame_head``: its first bytes) the size the
    index implies."""
    want = payload_size(entries, encoding)
    if encoding == "cond" and payload_len != want:
        raise PatchFormatError(f"{what}: {PAYLOAD_KEY} holds {payload_len} bytes, the index implies {want}")
    if encoding != "cond" and _declared_size(frame_head) != want:
        raise PatchFormatError(
            f"{what}: {PAYLOAD_KEY} declares {_declared_size(frame_head)} bytes, the index implies {want}; "
            "refusing to decompress"
        )


def read_patch(data: bytes | bytearray | memoryview, expected_size: int | None = None, what: str = "patch") -> Patch:
    """Parse and validate a patch file's container and index.

    Args:
        data: the whole file.
        expected_size: size in bytes the manifest states, if known.
        what: name used in error messages (e.g. the file path or sha256).

    Raises:
        PatchFormatError: size differs from ``expected_size``; not safetensors; not a stitchboard
            patch or an unknown format version or encoding; index or payload missing, not
            ``U8``, declaring (``cond``: holding) another size than the entries imply, or not
            valid; an entry is invalid or listed twice.
    """
    if expected_size is not None and len(data) != expected_size:
        raise PatchFormatError(f"{what}: {len(data)} bytes, the manifest says {expected_size}")
    meta, tensors = parse_safetensors(data, what)
    encoding, extra, version = _check_container(meta, {k: (t.dtype, t.nbytes) for k, t in tensors.items()}, what)
    entries = _read_index(tensors[INDEX_KEY].bits.data, encoding, what, version)
    frame = tensors[PAYLOAD_KEY].bits.data
    _check_payload(entries, encoding, len(frame), frame, what)
    return Patch(encoding, entries, dict(extra), len(data), frame, what)


#: Largest safetensors header :func:`read_patch_index` reads, bytes (a patch's holds two tensors
#: and its ``stitchboard.patch`` metadata: well under a kilobyte as the codec writes it).
MAX_PATCH_HEADER_BYTES = 1 << 20
#: Largest zstd frame header (RFC 8878: 4-byte magic, up to 14 bytes of descriptor, window and sizes).
_FRAME_HEADER_BYTES = 18


@dataclass(frozen=True)
class PatchIndex:
    """A patch file's validated container and index, read without its payload (:func:`read_patch_index`).

    Attributes:
        encoding: ``xor``, ``overwrite`` or ``cond``.
        entries: tensor name -> :class:`PatchEntry`, in name order.
        metadata: the free metadata strings.
        size_bytes: size of the patch file, bytes.
        bytes_read: bytes of the file read to check it.
    """

    encoding: str
    entries: dict[str, PatchEntry]
    metadata: dict[str, str]
    size_bytes: int
    bytes_read: int


def read_patch_index(read: Callable[[int, int], bytes], size_bytes: int, what: str = "patch") -> PatchIndex:
    """Check a patch file's container, index and payload size as :func:`read_patch` does, reading only
    the 8-byte header length, the header (at most :data:`MAX_PATCH_HEADER_BYTES`), the ``__index__``
    bytes (at most :data:`MAX_INDEX_BYTES`) and the payload's zstd frame header (18 bytes): never
    the payload itself, so a huge or hostile file costs a bounded read.

    Args:
        read: ``read(offset, length)`` -> exactly ``length`` bytes of the file from ``offset``
            (a ranged read of a stored object).
        size_bytes: the file's size, bytes.
        what: name used in error messages.

    Raises:
        PatchFormatError: as :func:`read_patch`, and a header or index over its cap (before reading it).
    """
    if size_bytes < 8:
        raise PatchFormatError(
            f"{what}: truncated ({size_bytes} bytes; a safetensors file starts with an 8-byte header length)"
        )
    (hlen,) = struct.unpack("<Q", read(0, 8))
    if hlen > size_bytes - 8:
        raise PatchFormatError(
            f"{what}: header length {hlen} is larger than the file ({size_bytes} bytes): truncated or not safetensors"
        )
    if hlen > MAX_PATCH_HEADER_BYTES:
        raise PatchFormatError(
            f"{what}: header of {hlen} bytes exceeds a patch's {MAX_PATCH_HEADER_BYTES}: not a stitchboard patch"
        )
    data_start = 8 + hlen
    meta, slots = parse_safetensors_header(read(8, hlen), size_bytes - data_start, what)
    encoding, extra, version = _check_container(meta, {k: (s.dtype, s.end - s.begin) for k, s in slots.items()}, what)
    index, payload = slots[INDEX_KEY], slots[PAYLOAD_KEY]
    if index.end - index.begin > MAX_INDEX_BYTES:
        raise PatchFormatError(
            f"{what}: {INDEX_KEY} of {index.end - index.begin} bytes exceeds {MAX_INDEX_BYTES}; refusing to read it"
        )
    entries = _read_index(read(data_start + index.begin, index.end - index.begin), encoding, what, version)
    payload_len = payload.end - payload.begin
    head = min(payload_len, _FRAME_HEADER_BYTES) if encoding != "cond" else 0
    _check_payload(entries, encoding, payload_len, read(data_start + payload.begin, head) if head else b"", what)
    return PatchIndex(
        encoding, {e.name: e for e in entries}, dict(extra), size_bytes, 8 + hlen + index.end - index.begin + head
    )
