"""Type stub of the C extension ``_condcoder`` (proto/_condcoder.c): the ``cond`` range coder."""

from typing import TypeAlias

import numpy as np
from typing_extensions import Buffer

_Bits: TypeAlias = Buffer | np.ndarray

def encode(
    base: _Bits, target: _Bits, itemsize: int, class_shift: int, class_bits: int, sign_magnitude: bool, /
) -> tuple[int, bytes]: ...
def decode(
    base: _Bits,
    stream: _Bits,
    positions_out: _Bits,
    values_out: _Bits,
    itemsize: int,
    class_shift: int,
    class_bits: int,
    sign_magnitude: bool,
    /,
) -> None: ...
