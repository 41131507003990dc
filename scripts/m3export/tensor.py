"""Tensors as the exporter holds them: a numpy array in the stored dtype, named.

numpy has no bfloat16, so BF16 data is held as its raw uint16 bits and converted by hand
(round to nearest even, as PyTorch and the C++ loader's readers do).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    """A safetensors dtype: its name, the numpy dtype holding its bits, whether it is a float."""

    name: str
    numpy: np.dtype
    is_float: bool

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


_DTYPES = [
    DType("F64", np.dtype("<f8"), True),
    DType("F32", np.dtype("<f4"), True),
    DType("F16", np.dtype("<f2"), True),
    DType("BF16", np.dtype("<u2"), True),  # raw bits
    DType("I64", np.dtype("<i8"), False),
    DType("I32", np.dtype("<i4"), False),
    DType("I16", np.dtype("<i2"), False),
    DType("I8", np.dtype("i1"), False),
    DType("U8", np.dtype("u1"), False),
    DType("BOOL", np.dtype("?"), False),
]
DTYPES: dict[str, DType] = {d.name: d for d in _DTYPES}

# The dtypes the C++ loader accepts for weights (model/weights.cc).
WEIGHT_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class Tensor:
    """One named tensor. `data` has the tensor's shape and `dtype.numpy` (BF16 as uint16
    bits), C-contiguous. `source` is the file it came from, for messages."""

    name: str
    dtype: DType
    data: np.ndarray
    source: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def contiguous(a: np.ndarray) -> np.ndarray:
    """`a` in C order, copied only if it is not (np.ascontiguousarray would make a scalar 1-D)."""
    return a if a.flags.c_contiguous else np.array(a, order="C")


def shape_str(shape: tuple[int, ...] | list[int]) -> str:
    """[a, b, c], the spelling of the C++ loader's messages."""
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) widened exactly to float32."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


_CHUNK = 1 << 22  # elements converted at a time, to bound the temporaries of a large tensor


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest BF16 (ties to even), as uint16 bits. NaN stays NaN
    (quiet); values past BF16's range round to infinity, which the caller checks for."""
    flat = contiguous(values.astype(np.float32, copy=False)).reshape(-1)
    out = np.empty(flat.shape, dtype=np.uint16)
    for begin in range(0, flat.size, _CHUNK):
        part = flat[begin:begin + _CHUNK]
        bits = part.view(np.uint32)
        rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
        rounded = ((bits + rounding) >> np.uint32(16)).astype(np.uint16)
        nan = np.isnan(part)
        if nan.any():
            rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
        out[begin:begin + _CHUNK] = rounded
    return out.reshape(values.shape)


def to_f32(t: Tensor) -> np.ndarray:
    """The tensor's values as float32 (exact for F32, F16 and BF16)."""
    if not t.dtype.is_float:
        raise ValueError(f"tensor {t.name} has dtype {t.dtype.name}, not a float")
    if t.dtype.name == "BF16":
        return bf16_bits_to_f32(t.data)
    return t.data.astype(np.float32, copy=False)


def non_finite(t: Tensor) -> tuple[int, int, tuple[int, ...] | None]:
    """(NaN count, infinity count, index of the first non-finite value or None)."""
    if not t.dtype.is_float:
        return 0, 0, None
    if t.dtype.name == "BF16":
        exponent_all_ones = (t.data & np.uint16(0x7F80)) == np.uint16(0x7F80)
        mantissa = t.data & np.uint16(0x007F)
        nan = exponent_all_ones & (mantissa != 0)
        inf = exponent_all_ones & (mantissa == 0)
    else:
        nan = np.isnan(t.data)
        inf = np.isinf(t.data)
    n_nan, n_inf = int(nan.sum()), int(inf.sum())
    if n_nan == 0 and n_inf == 0:
        return 0, 0, None
    first = np.argwhere(nan | inf)[0]
    return n_nan, n_inf, tuple(int(i) for i in first)
