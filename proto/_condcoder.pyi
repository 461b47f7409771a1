"""Type stub of the C extension ``_condcoder`` (proto/_condcoder.c): the ``cond`` range coder."""

from typing import Literal, TypeAlias, overload

import numpy as np
from typing_extensions import Buffer

_Bits: TypeAlias = Buffer | np.ndarray

#: 1 when this host counts classes 64 elements at a time (x86-64 with POPCNT), else 0.
blocks: int

@overload
def encode(
    base: _Bits,
    target: _Bits,
    itemsize: int,
    class_shift: int,
    class_bits: int,
    sign_magnitude: bool,
    one_by_one: bool = False,
    with_change: Literal[False] = False,
    /,
) -> tuple[int, bytes]: ...
@overload
def encode(
    base: _Bits,
    target: _Bits,
    itemsize: int,
    class_shift: int,
    class_bits: int,
    sign_magnitude: bool,
    one_by_one: bool,
    with_change: Literal[True],
    /,
) -> tuple[int, bytes, bytes, bytes]: ...
def decode(
    base: _Bits,
    stream: _Bits,
    positions_out: _Bits,
    values_out: _Bits,
    itemsize: int,
    class_shift: int,
    class_bits: int,
    sign_magnitude: bool,
    one_by_one: bool = False,
    /,
) -> None: ...
