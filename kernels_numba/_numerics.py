"""Rounding device functions: emulate a narrower dtype while computing in float32.

float32 carries 24 significand bits, at least 2 * 11 + 2 for float16's 11, so
rounding a float32 result of +, -, *, / to float16 equals doing the operation in
float16 (no double-rounding error). That is how the kernels reproduce the
document's "computed in the input dtype" steps bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._mma import pack_bf162
from ._vector import float_from_bits

FLOAT32_MAX = float(np.finfo(np.float32).max)


@cuda.jit(device=True, inline="always")
def keep_float32(x):
    return x


@cuda.jit(device=True, inline="always")
def round_to_float16(x):
    return np.float32(np.float16(x))


@cuda.jit(device=True, inline="always")
def round_to_bfloat16(x):
    """float32 -> the nearest bfloat16 (ties to even), held in float32. numba has no bfloat16 type; bfloat16 is
    float32 with 8 significant bits, so the significand is rounded to 8 bits, in steps of 2^-133 below 2^-126
    (its subnormals). 24 >= 2 * 8 + 2: as for float16, rounding a float32 +, -, *, / result equals the bfloat16
    operation."""
    a = np.float64(x)
    if a == 0 or a != a or abs(a) == math.inf:
        return x
    _, exponent = math.frexp(a)                         # 2^(exponent - 1) <= |a| < 2^exponent
    step = math.ldexp(1.0, max(exponent, -125) - 8)
    y = round(abs(a) / step) * step                     # round() is half to even
    if y > FLOAT32_MAX:                                 # rounded past the largest: inf, as the cast gives
        y = math.inf
    return np.float32(math.copysign(y, a))              # a tiny negative rounds to -0


def rounder(dtype):
    """The device function that rounds a float32 to what `dtype` would hold (float16, bfloat16 or float32)."""
    name = "bfloat16" if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype).name
    return round_to_float16 if name == "float16" else round_to_bfloat16 if name == "bfloat16" else keep_float32


# ---------------------------------------------------------------------------------------------- bfloat16 as bits
# numba has no bfloat16 arithmetic, so the kernels hold a bfloat16 tensor as its bits (uint16) and compute in
# float32: a bfloat16 is the high half of the float32 of the same value, so widening is a shift (exact), and a
# result goes back with one round to nearest even (cvt.rn.bf16x2.f32 on sm_80+, ml_dtypes in the simulator).

@cuda.jit(device=True, inline="always")
def widen_bfloat16(bits):
    """The float32 of a bfloat16's bits (the low 16 of `bits`): exact."""
    return float_from_bits((np.uint32(bits) & 0xFFFF) << 16)


@cuda.jit(device=True, inline="always")
def narrow_bfloat16(x):
    """The bits (uint16) of the bfloat16 nearest x, ties to even; inf and NaN stay inf and NaN."""
    return np.uint16(pack_bf162(np.float32(x), np.float32(0.0)) & 0xFFFF)


@cuda.jit(device=True, inline="always")
def to_float32(x):
    return np.float32(x)


@cuda.jit(device=True, inline="always")
def to_float64(x):
    return np.float64(x)


BFLOAT16_BITS = "bfloat16"      # the kernels' key for a tensor passed as bfloat16 bits


def element_io(dtype):
    """(widen, narrow) for elements of `dtype`: widen(element) -> the float32 (float64 for float64) the kernels
    compute with; narrow(value) -> what a store of a result writes (bfloat16: its bits; others: the value, which
    the store converts). dtype "bfloat16" names a tensor passed as its bits."""
    if _name(dtype) == BFLOAT16_BITS:
        return widen_bfloat16, narrow_bfloat16
    return (to_float64 if _name(dtype) == "float64" else to_float32), keep_float32


def bits_io(dtype):
    """(widen, narrow) for a tensor of bfloat16 bits, (None, None) otherwise: the kernel builders' hooks, which keep
    their own conversions (and so the other dtypes' code as it was) when given None."""
    return element_io(dtype) if _name(dtype) == BFLOAT16_BITS else (None, None)


def _name(dtype) -> str:
    return dtype if isinstance(dtype, str) and dtype == BFLOAT16_BITS else np.dtype(dtype).name
