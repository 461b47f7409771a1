"""Change detection where the tensor lives: the served view's bitwise diff on the trainer's device (trainer process,
one rank).

A trainer whose parameters are on a GPU used to copy every served tensor to the host and scan it there with the
codec's C kernel (``proto/_bitdiff.c``). For a tensor on a device other than the CPU, :class:`DeviceDiffer` instead
compares it with the kept tensor on that device, with plain torch ops (both viewed as integers of the element size,
``ne``, ``nonzero``, ``index_select``), and only the changed positions (int64) and their new bits are copied to the
host. What it gives is exactly what the C kernel gives for the same two tensors: the same positions, in increasing
order, and the same bits (NaN payloads, ``-0.0`` and ``+0.0`` are told apart: integers are compared, never floats).

On the host, from the kept tensor (which the publisher holds there anyway) and those changes:

* the target checksum (xxh3-128): :func:`~stitchboard.proto.patched_digest.patched_checksum` hashes the kept tensor
  with the new bits spliced in, chunk by chunk; it is computed here because xxh3 has no torch kernel and the host
  already holds every other bit of the target;
* ``xor`` / ``overwrite``: the varint gaps (:func:`varint_gaps`, byte for byte the C kernel's LEB128) and values
  (``old XOR new`` with ``old`` read from the host's kept tensor, or the new bits); no full-tensor scan at all;
* ``cond``, and a tensor coded in row parts (larger than the publisher's ``part_bytes``): the range coder and the
  per-part checksums read the whole base and target, so the target is rebuilt on the host (a copy of the kept
  tensor with the changes written: one tensor of memory, as the streamed publish already holds) and coded by
  :func:`~stitchboard.proto.codec.encode_tensor` as before; the device then saves the link and the cast, not the
  host's coding. The patch is byte-identical either way.

Where the kept bits come from on the device (``keep_on_device``):

* False (the default): the kept view stays on the host, where the publisher keeps it; each kept tensor is copied to
  the device for its comparison and dropped (device memory: one tensor in the served dtype and its ``ne`` mask of
  one byte per element). The same bytes cross the link as before, but host-to-device, and the host does no scan.
* True: a mirror of the kept view stays on the device (one more copy of the served view in device memory: 2 bytes
  per bf16 parameter, 1/8 of fp32 masters with AdamW's two moments and the gradients), so no whole tensor crosses
  the link; each mirror tensor is tagged with the checksum of its bits and used only when that equals the base
  checksum of the diff (a failed or retried publish falls back to the host copy by itself).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from stitchboard.proto.codec import EncodedTensor, PatchEncoding, PatchEntry, checksum, encode_tensor
from stitchboard.proto.container import RawTensor
from stitchboard.proto.dtypes import bits_type
from stitchboard.proto.parts import row_layout
from stitchboard.proto.patched_digest import patched_checksum
from stitchboard.proto.schema import XXH3_128

#: Element size in bytes -> the signed torch integer dtype the bits are compared as (torch has no wide unsigned ops).
_BITS_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Element size in bytes -> the numpy dtype of those signed bits, to reinterpret them as the codec's unsigned ones.
_BITS_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a device other than the CPU (its change detection then runs there)."""
    return t.device.type != "cpu"


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat contiguous integer tensor of the same element size, on ``t``'s device.

    Returns:
        uint8 / int16 / int32 / int64 [numel]: a view when ``t`` is contiguous, else a contiguous copy.
    """
    return t.detach().contiguous().reshape(-1).view(_BITS_TORCH[t.element_size()])


def changed_on_device(old_bits: torch.Tensor, new_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements whose bits differ, found where the tensors live.

    Args:
        old_bits, new_bits: [numel] integer tensors of one dtype on one device (:func:`flat_bits`).

    Returns:
        (positions int64 [k], strictly increasing; new bits [k], ``new_bits``' dtype), both on that device.
    """
    positions = torch.ne(old_bits, new_bits).nonzero().reshape(-1)
    return positions, new_bits.index_select(0, positions)


def varint_gaps(positions: np.ndarray) -> bytes:
    """The LEB128 varint gap stream of strictly increasing positions (``gap_i = pos_i - pos_{i-1} - 1``,
    ``pos_{-1} = -1``): byte for byte what ``proto/_bitdiff.c`` writes (shortest form, low 7 bits first).

    Args:
        positions: int64 [k], strictly increasing, >= 0.
    """
    if positions.size == 0:
        return b""
    gaps = np.diff(positions, prepend=np.int64(-1)).astype(np.uint64) - np.uint64(1)
    lengths = np.ones(gaps.size, dtype=np.int64)
    rest = gaps >> np.uint64(7)
    while rest.any():
        lengths += rest > 0
        rest >>= np.uint64(7)
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    for k in range(int(lengths.max())):
        has = lengths > k
        byte = (gaps[has] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (lengths[has] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + k] = (byte | more).astype(np.uint8)
    return out.tobytes()


@dataclass(frozen=True)
class DeviceChanges:
    """One tensor's diff against its kept tensor, found on the device and brought to the host.

    Attributes:
        encoded: the codec's delta of the tensor (None: no element changed), as ``encode_tensor`` makes it.
        gaps, new_bits: the changed elements as the ``overwrite`` coder writes them (varint gaps; new bits,
            little-endian), for the stream's :class:`~.stream.TensorChange`.
        count: changed elements.
        target_checksum: xxh3-128 of the new tensor's bits.
    """

    encoded: EncodedTensor | None
    count: int
    gaps: bytes
    new_bits: bytes
    target_checksum: str


class DeviceDiffer:
    """Diffs served tensors that live on a device against the host's kept tensors (see the module docstring).

    Args:
        keep_on_device: keep a mirror of the kept view on the device (fast, one more served view of device
            memory); False: copy each kept tensor to the device for its diff.
    """

    def __init__(self, keep_on_device: bool = False) -> None:
        self.keep_on_device = keep_on_device
        self._mirror: dict[str, tuple[str, torch.Tensor]] = {}

    def base_bits(self, name: str, kept: RawTensor, kept_checksum: str, device: torch.device) -> torch.Tensor:
        """The kept tensor's bits on ``device``: the mirror's when it holds ``kept_checksum``, else a fresh copy.

        Returns:
            [numel] integer tensor (:func:`flat_bits`' dtype for the element size) on ``device``.
        """
        hit = self._mirror.pop(name, None)
        if hit is not None and hit[0] == kept_checksum and hit[1].device == device:
            return hit[1]
        bits = np.ascontiguousarray(kept.bits).reshape(-1).view(_BITS_SIGNED[kept.bits.itemsize])
        with warnings.catch_warnings():  # a read-only kept tensor (a memory-mapped checkpoint) is only read here
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            host = torch.from_numpy(bits)
        return host.to(device)

    def remember(self, name: str, target_checksum: str, bits: torch.Tensor) -> None:
        """Keep ``bits`` (a tensor of the new view, no one else's) as tensor ``name``'s mirror, when mirroring."""
        if self.keep_on_device:
            self._mirror[name] = (target_checksum, bits)

    def retain(self, names: set[str]) -> None:
        """Drop the mirror of every tensor not in ``names`` (gone from the view)."""
        for name in [n for n in self._mirror if n not in names]:
            del self._mirror[name]

    @property
    def mirrored_bytes(self) -> int:
        """Device memory the mirror holds, bytes."""
        return sum(t.numel() * t.element_size() for _, t in self._mirror.values())

    def diff(
        self,
        name: str,
        kept: RawTensor,
        kept_checksum: str,
        new: torch.Tensor,
        encoding: PatchEncoding,
        part_bytes: int | None = None,
    ) -> DeviceChanges:
        """Diff ``new`` (on its device, of ``kept``'s dtype and shape) against ``kept``.

        Args:
            name: the checkpoint name.
            kept: the kept tensor (host bits of the base version).
            kept_checksum: its xxh3-128 (the base version's target checksum).
            new: the served tensor on its device; a fresh tensor the caller hands over (it may become the mirror).
            encoding: the patch encoding.
            part_bytes: code a tensor larger than this in row parts (``encode_tensor``'s ``part_bytes``; the target
                is then rebuilt on the host and coded there, as for ``cond``); None: one stream.

        Returns:
            The tensor's delta, byte-identical to ``encode_tensor(name, kept, host copy of new, encoding,
            part_bytes=part_bytes)``.
        """
        new_bits = flat_bits(new)
        positions_dev, values_dev = changed_on_device(self.base_bits(name, kept, kept_checksum, new.device), new_bits)
        positions = positions_dev.cpu().numpy()
        values = values_dev.cpu().numpy().view(bits_type(kept.dtype))
        flat_kept = kept.bits.reshape(-1)
        count = int(positions.size)
        gaps = varint_gaps(positions)
        parted = part_bytes is not None and len(row_layout(kept.shape, kept.bits.itemsize, part_bytes)) > 1
        if (encoding == "cond" or parted) and count:
            target = RawTensor(kept.dtype, tuple(kept.shape), flat_kept.copy())
            target.bits[positions] = values
            target_sum = checksum(target)
            encoded = encode_tensor(
                name,
                kept,
                target,
                encoding,
                base_checksum=kept_checksum,
                target_checksum=target_sum,
                part_bytes=part_bytes,
            )
        else:
            target_sum = patched_checksum(flat_kept, (flat_kept.size,), positions, values)
            coded = values ^ flat_kept[positions] if encoding == "xor" else values
            entry = PatchEntry(
                name, kept.dtype, tuple(kept.shape), count, len(gaps), {XXH3_128: kept_checksum}, {XXH3_128: target_sum}
            )
            encoded = EncodedTensor(entry, gaps, coded.tobytes()) if count else None
        self.remember(name, target_sum, new_bits)
        return DeviceChanges(encoded, count, gaps, values.tobytes(), target_sum)
