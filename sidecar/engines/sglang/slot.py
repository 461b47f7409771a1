"""One checkpoint tensor inside one SGLang TP rank's runtime parameter (:class:`Slot`: the write
core's :class:`~..write_core.TpSlice` plus SGLang's transport), and the dtypes it addresses. Runs
in SGLang's scheduler processes.

:mod:`.layout` (dense tensors) and :mod:`.experts` (fused MoE experts) both build slots; this module
is what they share, so neither imports the other at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..write_core import BITS, Gather, Scatter, TpSlice, bit_accessors
from ..write_core import DTYPE_NAMES as DTYPE_NAMES_ALL

#: torch dtype -> safetensors dtype name of the dtypes SGLang's slots address (floating point).
DTYPE_NAMES: dict[torch.dtype, str] = {
    t: DTYPE_NAMES_ALL[t] for t in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
}


@dataclass(frozen=True)
class Slot(TpSlice):
    """One checkpoint tensor inside this rank's runtime parameter: a :class:`TpSlice` (name,
    runtime name, dtype, checkpoint shape, split dim, spans, rank, ``row_offset``) plus SGLang's
    transport.

    Attributes:
        col_offset: where this rank's block starts among the runtime parameter's columns.
        param: the runtime parameter (written in place; never reassigned).
    """

    col_offset: int
    param: torch.nn.Parameter = field(repr=False)

    @property
    def block_shape(self) -> tuple[int, int]:
        """This rank's block as [rows, cols] (a 1-D tensor is one column)."""
        rows, cols = self.grid
        length = self.local_span[1]
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

    def accessors(self) -> tuple[Scatter, Gather]:
        """(scatter, gather) as :meth:`scatter` and :meth:`gather`, bound to one view of the live
        parameter: for many chunks of one tensor (:func:`~..write_core.bit_accessors`)."""
        return bit_accessors(self.flat_bits())

    def bits(self) -> torch.Tensor:
        """This rank's block of the live parameter as raw integer bits, [rows, cols]: a view
        (non-contiguous when the rank's columns are a part of the parameter's)."""
        data = self.param.data.view(BITS[self.param.element_size()])
        if data.ndim == 1:
            return data.narrow(0, self.row_offset, self.block_shape[0]).unsqueeze(1)
        rows, cols = self.block_shape
        return data.narrow(0, self.row_offset, rows).narrow(1, self.col_offset, cols)
