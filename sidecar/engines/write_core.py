"""The in-engine write core: one checkpoint tensor's TP slice over raw bits, and the bit-exact,
all-or-nothing write. Runs inside the engine's processes (vLLM workers, SGLang schedulers).

Engine-neutral: every engine keeps only its layout (checkpoint name -> :class:`TpSlice` subclass
holding its runtime parameter) and its transport (how bits reach that parameter). What both
engines share lives here:

* :class:`TpSlice`: where one rank's block of a checkpoint tensor lies (spans per TP rank along
  the split dimension), which patch positions it holds (:meth:`TpSlice.select`), its block of a
  whole tensor (:meth:`TpSlice.local_block`), and the whole tensor reassembled from every rank's
  block (:meth:`TpSlice.gather_whole`, an all-gather over the TP group's gloo group) to checksum;
* :func:`agreed`: a rank-local step whose failure every rank learns before its next collective;
* :func:`bit_accessors` and :func:`write_read_back`: scattered writes of raw bits, each chunk read
  back as it is written (the verification of a staged update, see :func:`write_read_back`);
* :func:`write_verified`: write -> fault hook -> verify -> undo -> ``ApplyFailedError``.

Tensors may live on a GPU: every host copy is explicit (``.cpu()`` before ``.numpy()``) and
documented where it is made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import torch
import xxhash

from stitchboard.proto.errors import TargetMismatchError

from ..errors import ApplyFailedError, TpRankError

log = logging.getLogger("stitchboard.sidecar.engines.write_core")

T = TypeVar("T")
#: torch dtype -> safetensors dtype name (the codec's names, see proto/dtypes.py).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
#: element size in bytes -> torch integer dtype used to address raw bits.
BITS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Called at named points of an apply (fault injection): ``staged``, ``half-written``, ``written-unverified``.
PhaseHook = Callable[[str], None]
#: ``agreed(step, what)`` over one rank's TP group (:func:`agreed` bound to the group).
Agreed = Callable[[Callable[[], T], str], T]
#: ``scatter(index, values)``: write raw bits ``values`` at flat ``index`` (int64) of a tensor, in place.
Scatter = Callable[[np.ndarray, np.ndarray], None]
#: ``gather(index)``: a copy of the raw bits at flat ``index`` (int64) of a tensor.
Gather = Callable[[np.ndarray], np.ndarray]
#: Elements written, then read back, per chunk of :func:`write_read_back`: their cache lines
#: (~1 MiB at one changed element per line) are still in the core's L2 cache when read back. Writing
#: and reading back 1.73 M scattered elements of 269 MB on one thread (numpy, AMD EPYC with 2 MiB
#: L2 per core): 33-37 ms with the read-back after all writes, 17.5-20.5 ms in 16 Ki chunks (4 Ki:
#: 18.5-23.7 ms, 64 Ki: 26-32 ms); 14 ms on two threads.
READ_BACK_CHUNK = 16384


@dataclass(frozen=True)
class TpSlice:
    """One checkpoint tensor as one TP rank holds it: the geometry every engine's slot shares.

    Attributes:
        name: checkpoint name; runtime_name: the engine's parameter name.
        dtype: safetensors dtype name of the runtime parameter.
        shape: the full checkpoint shape (1-D or 2-D).
        split_dim: 0 (rows) or 1 (columns): the dimension TP ranks split; a tensor every rank
            holds whole has ``split_dim`` 0 and every span ``(0, shape[0])``.
        spans: per TP rank, ``(start, length)`` along ``split_dim`` in checkpoint coordinates
            (length 0: the rank holds only padding of this tensor).
        tp_rank: this rank.
        row_offset: first row of this rank's block inside the runtime parameter.
    """

    name: str
    runtime_name: str
    dtype: str
    shape: tuple[int, ...]
    split_dim: int
    spans: tuple[tuple[int, int], ...]
    tp_rank: int
    row_offset: int

    @property
    def local_span(self) -> tuple[int, int]:
        """This rank's ``(start, length)`` along ``split_dim``."""
        return self.spans[self.tp_rank]

    @property
    def whole(self) -> bool:
        """Whether every rank holds the whole tensor."""
        return all(span == (0, self.shape[self.split_dim]) for span in self.spans)

    @property
    def grid(self) -> tuple[int, int]:
        """The checkpoint shape as ``(rows, cols)`` (a 1-D tensor is one column)."""
        return (self.shape[0], self.shape[1]) if len(self.shape) == 2 else (self.shape[0], 1)

    def select(self, positions: np.ndarray) -> tuple[slice | np.ndarray, np.ndarray]:
        """The positions this rank holds, mapped into its block.

        Args:
            positions: int64 [k], strictly increasing flat indices in checkpoint coordinates.

        Returns:
            ``(selected, block_index)``: which of ``positions`` this rank holds (a row split: the ``slice`` of
            them, so ``positions[selected]`` is a view; a column split: their int64 indices), and their flat
            row-major indices into this rank's block (int64 [k_local]; a view of ``positions`` when the block
            starts at the tensor's first row, as every tensor held whole does; padding is never among them).
            At TP = 1 that is two views instead of three copies of the positions per tensor staged.
        """
        start, length = self.local_span
        cols = self.grid[1]
        if self.split_dim == 0:
            lo, hi = (int(i) for i in np.searchsorted(positions, [start * cols, (start + length) * cols]))
            return slice(lo, hi), positions[lo:hi] - start * cols if start else positions[lo:hi]
        col = positions % cols
        selected = np.flatnonzero((col >= start) & (col < start + length))
        return selected, (positions[selected] // cols) * length + (col[selected] - start)

    def local_block(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block (``[rows, cols]``, contiguous) of a whole tensor ``full`` (any shape
        holding ``shape``'s elements; any dtype); on ``full``'s device."""
        start, length = self.local_span
        return full.reshape(self.grid).narrow(self.split_dim, start, length).contiguous()

    def gather_whole(self, block: torch.Tensor, group: object | None) -> np.ndarray:
        """The whole checkpoint tensor's raw little-endian bytes (uint8, flat, host memory).

        Args:
            block: this rank's block (rows first: ``[rows]`` or ``[rows, cols]``, any dtype); on
                a GPU it is copied to the host.
            group: the TP group's gloo group; with a group every rank must call this for the
                same tensor, passing its block of the same copy (collective; the blocks are
                gathered as bytes, gloo has no 16-bit integers; padding is never included).
                None: this rank's block is the whole tensor (a view on CPU).
        """
        rows = block if block.ndim == 2 else block.unsqueeze(1)
        mine = rows.contiguous().view(torch.uint8).cpu()  # [rows, cols * itemsize]; a host copy on a GPU
        if group is None:
            return mine.reshape(-1).numpy()
        split, unit = self.split_dim, 1 if self.split_dim == 0 else block.element_size()
        shape = list(mine.shape)
        shape[split] = max(length for _, length in self.spans) * unit
        padded = torch.zeros(shape, dtype=torch.uint8)
        padded.narrow(split, 0, mine.shape[split]).copy_(mine)
        parts = [torch.empty_like(padded) for _ in self.spans]
        torch.distributed.all_gather(parts, padded, group=group)
        seen: dict[int, torch.Tensor] = {}
        for (start, length), part in zip(self.spans, parts, strict=True):
            if length:
                seen.setdefault(start, part.narrow(split, 0, length * unit))
        return torch.cat([seen[s] for s in sorted(seen)], dim=split).contiguous().reshape(-1).numpy()

    def checksum(self, block: torch.Tensor, group: object | None) -> str:
        """xxh3-128 hex digest of the whole tensor (:meth:`gather_whole`'s bytes; collective with a group)."""
        return xxhash.xxh3_128_hexdigest(self.gather_whole(block, group).data)


def bit_accessors(flat: torch.Tensor) -> tuple[Scatter, Gather]:
    """``(scatter, gather)`` over ``flat``, a flat raw-bits view of a live parameter (int16 for
    bf16...): numpy on the parameter's memory on the CPU (no torch call per chunk), else each
    chunk's index and values copied to ``flat``'s device (and gathered bits back to the host)."""
    if flat.device.type == "cpu":
        view = flat.numpy()
        return view.__setitem__, view.take

    def scatter(index: np.ndarray, values: np.ndarray) -> None:
        flat[torch.from_numpy(index).to(flat.device)] = torch.from_numpy(values).to(flat.device)

    def gather(index: np.ndarray) -> np.ndarray:
        return flat[torch.from_numpy(index).to(flat.device)].cpu().numpy()

    return scatter, gather


def write_read_back(name: str, accessors: tuple[Scatter, Gather], index: np.ndarray, new: np.ndarray) -> None:
    """Write ``new`` at ``index`` chunk by chunk (:data:`READ_BACK_CHUNK` elements), reading each
    chunk back at once.

    This is how a staged update is verified (SGLang's and vLLM's commits): staging checked the
    base checksum of the live tensor (or a copy of it) and the target checksum of the bits the
    steps make from it, so once every written element reads back as its new bits the live tensor holds
    the target, provided nothing else wrote it between staging and the commit. Each engine's
    staging states why nothing did (a staged update is dropped by every other write of the
    engine's extension, and the engine's own weight routes are not proxied).

    Args:
        name: the checkpoint tensor, for the error.
        accessors: :func:`bit_accessors` of the tensor's live raw bits.
        index: int64 [k] flat indices; new: the raw bits [k] (the accessors' integer dtype).

    Raises:
        TargetMismatchError: a chunk did not read back as the new bits (the chunks before it are written).
    """
    scatter, gather = accessors
    for lo in range(0, index.size, READ_BACK_CHUNK):
        chunk, bits = index[lo : lo + READ_BACK_CHUNK], new[lo : lo + READ_BACK_CHUNK]
        scatter(chunk, bits)
        if not np.array_equal(gather(chunk), bits):
            raise TargetMismatchError(
                f"tensor {name!r}: the written elements do not read back as the new bits", name=name
            )


def agreed(group: object | None, step: Callable[[], T], what: str) -> T:
    """Run rank-local ``step`` (reading files, mapping names, writing, a lease check) and tell
    every TP rank of ``group`` whether any rank failed it, before anyone's next collective.

    Without this the other ranks would wait in a gather for a rank that gave up, until the
    group's timeout; with it every rank refuses, or restores, at once. No group (TP = 1): runs
    ``step``.

    Raises:
        what ``step`` raised, on its rank; :class:`TpRankError` on every other rank when any failed.
    """
    error: Exception | None = None
    result = None
    try:
        result = step()
    except Exception as exc:  # noqa: BLE001 - every rank's failure is shared with the others
        error = exc
    failed: dict[int, str] = {}
    if group is not None:
        mine = None if error is None else f"{type(error).__name__}: {error}"
        everyone: list[str | None] = [None] * torch.distributed.get_world_size(
            cast("torch.distributed.ProcessGroup", group)
        )
        torch.distributed.all_gather_object(everyone, mine, group=group)
        failed = {rank: message for rank, message in enumerate(everyone) if message is not None}
    if error is not None:
        raise error
    if failed:
        rank, message = next(iter(failed.items()))
        raise TpRankError(f"{what}: TP rank {rank} failed ({message}); this rank did not", failed=failed)
    return result  # type: ignore[return-value]


def write_verified(
    what: str,
    write: Callable[[PhaseHook], None],
    targets: Iterable[tuple[str, Callable[[], str], str]],
    hook: PhaseHook,
    agreed: Agreed,
    undo: Callable[[], None] | None,
) -> dict[str, float]:
    """Write, verify every target checksum on the live weights, or undo: the engine ends holding
    either all the new bits, verified, or (``undo`` given) all the old ones.

    Args:
        what: the update, for messages (``writing versions 3->4``, ``loading the snapshot``).
        write: writes every new bit on this rank; calls its hook with ``half-written`` halfway.
            Run under ``agreed`` (every rank learns whether any rank's write failed).
        targets: per written tensor ``(name, checksum of the live tensor now, target xxh3-128)``;
            each checksum may be collective (every rank checks the same names in order).
        hook: called with ``staged`` (nothing written yet), ``half-written`` (through
            ``write``) and ``written-unverified`` (fault injection).
        agreed: :func:`agreed` over this rank's TP group.
        undo: writes every old bit back; None when the old bits are gone (a snapshot load).

    Returns:
        Seconds ``write_s`` and ``verify_s``.

    Raises:
        ApplyFailedError: a target checksum did not match, a rank failed to write, or any error
            while writing (``cause``); ``restored``: whether ``undo`` put the old bits back
            (False without ``undo``, or when undoing failed too: no verified version held).
    """
    hook("staged")
    timing: dict[str, float] = {}
    try:
        t = time.perf_counter()
        agreed(lambda: write(hook), f"{what}: writing")
        timing["write_s"] = time.perf_counter() - t
        hook("written-unverified")
        t = time.perf_counter()
        for name, live, target in targets:
            if live() != target:
                raise TargetMismatchError(
                    f"tensor {name!r} does not match its target checksum after the write", name=name
                )
        timing["verify_s"] = time.perf_counter() - t
    except Exception as exc:
        restored = undo is not None
        if undo is not None:
            try:
                undo()
            except Exception:
                restored = False
                log.exception("restoring the old bits failed: the engine holds no verified version")
        raise ApplyFailedError.after_write(what, exc, restored=restored) from exc
    return timing
