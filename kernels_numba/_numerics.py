"""Rounding device functions: emulate a narrower dtype while computing in float32.

float32 carries 24 significand bits, at least 2 * 11 + 2 for float16's 11, so
rounding a float32 result of +, -, *, / to float16 equals doing the operation in
float16 (no double-rounding error). That is how the kernels reproduce the
document's "computed in the input dtype" steps bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import cuda


@cuda.jit(device=True, inline="always")
def keep_float32(x):
    return x


@cuda.jit(device=True, inline="always")
def round_to_float16(x):
    return np.float32(np.float16(x))


def rounder(dtype):
    """The device function that rounds a float32 to what `dtype` would hold (dtype ⊆ {float16, float32})."""
    return round_to_float16 if np.dtype(dtype) == np.float16 else keep_float32
