"""One checkpoint tensor inside one SGLang TP rank's runtime parameter (:class:`Slot`), and the
dtype tables that address its raw bits. Runs in SGLang's scheduler processes.

:mod:`.layout` (dense tensors) and :mod:`.experts` (fused MoE experts) both build slots; this module
is what they share, so neither imports the other at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

#: torch dtype -> safetensors dtype name (the codec's names, see proto/dtypes.py).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
}
#: element size in bytes -> torch integer dtype used to address raw bits.
BITS: dict[int, torch.dtype] = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Slot:
    """One checkpoint tensor inside this rank's runtime parameter.

    Attributes:
        name: checkpoint name; runtime_name: SGLang's parameter name.
        dtype: safetensors dtype name; shape: the checkpoint shape (1-D or 2-D).
        split_dim: 0 (rows) or 1 (columns) that the ranks split; a tensor every rank holds
            whole has split_dim 0 and every span ``(0, shape[0])``.
        spans: per TP rank, ``(start, length)`` along ``split_dim`` in checkpoint coordinates
            (length 0: the rank holds only padding of this tensor).
        tp_rank: this rank.
        row_offset, col_offset: where this rank's block starts inside the runtime parameter.
        param: the runtime parameter (written in place; never reassigned).
    """

    name: str
    runtime_name: str
    dtype: str
    shape: tuple[int, ...]
    split_dim: int
    spans: tuple[tuple[int, int], ...]
    tp_rank: int
    row_offset: int
    col_offset: int
    param: torch.nn.Parameter = field(repr=False)

    @property
    def whole(self) -> bool:
        """Whether every rank holds the whole tensor (no gather needed to hash it)."""
        return all(span == (0, self.shape[self.split_dim]) for span in self.spans)

    @property
    def block_shape(self) -> tuple[int, int]:
        """This rank's block as [rows, cols] (a 1-D tensor is one column)."""
        rows, cols = (self.shape[0], self.shape[1]) if len(self.shape) == 2 else (self.shape[0], 1)
        length = self.spans[self.tp_rank][1]
        return (length, cols) if self.split_dim == 0 else (rows, length)

    def flat_bits(self) -> torch.Tensor:
        """The whole runtime parameter's raw bits, flat (a view; index it with :meth:`flat_index`)."""
        return self.param.data.view(BITS[self.param.element_size()]).view(-1)

    def flat_index(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Flat indices (int64) into :meth:`flat_bits` of this rank's block elements (``rows``,
        ``cols``: int64 coordinates in the block)."""
        width = self.param.shape[1] if self.param.ndim == 2 else 1
        return (rows + self.row_offset) * width + (cols + self.col_offset)

    def gather(self, index: np.ndarray) -> np.ndarray:
        """The live bits at flat ``index`` (a copy; numpy on the parameter's memory on the CPU)."""
        return self.accessors()[1](index)

    def scatter(self, index: np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` at flat ``index`` of the live parameter, in place."""
        self.accessors()[0](index, values)

    def accessors(self) -> tuple[Callable[[np.ndarray, np.ndarray], None], Callable[[np.ndarray], np.ndarray]]:
        """(scatter, gather) as :meth:`scatter` and :meth:`gather`, bound to one view of the live
        parameter: for many chunks of one tensor (on the CPU, no torch call per chunk)."""
        flat = self.flat_bits()
        if flat.device.type == "cpu":
            view = flat.numpy()
            return view.__setitem__, view.take

        def scatter(index: np.ndarray, values: np.ndarray) -> None:
            flat[torch.from_numpy(index).to(flat.device)] = torch.from_numpy(values).to(flat.device)

        def gather(index: np.ndarray) -> np.ndarray:
            return flat[torch.from_numpy(index).to(flat.device)].cpu().numpy()

        return scatter, gather

    def bits(self) -> torch.Tensor:
        """This rank's block of the live parameter as raw integer bits, [rows, cols]: a view
        (non-contiguous when the rank's columns are a part of the parameter's)."""
        data = self.param.data.view(BITS[self.param.element_size()])
        if data.ndim == 1:
            return data.narrow(0, self.row_offset, self.block_shape[0]).unsqueeze(1)
        rows, cols = self.block_shape
        return data.narrow(0, self.row_offset, rows).narrow(1, self.col_offset, cols)
