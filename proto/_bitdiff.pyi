"""Type stub of the C extension ``_bitdiff`` (proto/_bitdiff.c): change detection and gap decoding."""

from typing import TypeAlias

import numpy as np
from typing_extensions import Buffer

_Bits: TypeAlias = Buffer | np.ndarray

def diff(old: _Bits, new: _Bits, itemsize: int, use_xor: bool, /) -> tuple[int, bytes, bytes]: ...
def positions(gaps: _Bits, out: _Bits, numel: int, /) -> None: ...
