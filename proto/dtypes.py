"""Element dtypes of the served view, named as safetensors names them.

The codec never interprets values: it works on the raw element bits, so each dtype only needs
its element size. Packed 4-bit formats (NVFP4, MXFP4) travel as ``U8`` tensors of packed
pairs, with their scale tensors as separate entries. The names and sizes are the ones in the
safetensors format specification (``Dtype`` in safetensors/src/tensor.rs).
"""

from __future__ import annotations

import numpy as np

#: dtype name -> element size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

#: safetensors header name -> the dtype name ``safetensors.TensorSpec`` takes when writing.
SPEC_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}

#: element size in bytes -> numpy unsigned type used for the raw bits.
BITS_TYPES: dict[int, type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}

#: Largest element count we accept for one tensor (numpy and torch index with int64).
MAX_NUMEL = 2**62


def dtype_size(dtype: str) -> int:
    """Element size in bytes of a safetensors dtype name.

    Raises:
        KeyError: ``dtype`` is not a safetensors dtype name.
    """
    return DTYPE_SIZES[dtype]


def bits_type(dtype: str) -> type[np.unsignedinteger]:
    """The numpy unsigned integer type holding one element's bits (e.g. ``BF16`` -> uint16)."""
    return BITS_TYPES[DTYPE_SIZES[dtype]]


def numel_of(shape: tuple[int, ...] | list[int]) -> int:
    """Element count of a shape (1 for a scalar ``[]``)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n
