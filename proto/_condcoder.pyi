"""Type stub of the C extension ``_condcoder`` (proto/_condcoder.c): the ``cond`` range coder."""

from typing import Literal, TypeAlias, overload

import numpy as np
from typing_extensions import Buffer

_Bits: TypeAlias = Buffer | np.ndarray

#: 1 when this host counts classes 64 elements at a time (x86-64 with POPCNT), else 0.
blocks: int
#: 1 when those blocks use AVX2 (32-byte compares), else 0.
avx2: int
#: ``loops`` of encode and decode: the fastest loops this host has, one element at a time, the SSE2 blocks.
Loops: TypeAlias = Literal[0, 1, 2]

@overload
def encode(
    base: _Bits,
    target: _Bits,
    itemsize: int,
    class_shift: int,
    class_bits: int,
    sign_magnitude: bool,
    loops: Loops | bool = 0,
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
    loops: Loops | bool,
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
    loops: Loops | bool = 0,
    /,
) -> None: ...
