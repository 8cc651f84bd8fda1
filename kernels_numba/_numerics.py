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
