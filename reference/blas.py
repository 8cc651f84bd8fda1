"""Matrix products that stay in BLAS, shared by the references.

BLAS takes a matrix whose one axis has unit stride and whose other axis steps at least a whole row (column): its
leading dimension. Transposed views (`k.swapaxes(-1, -2)`) and heads sliced out of a (tokens, heads, dim) array are
such matrices and go to BLAS in place. For any other layout (a step slice, a broadcast row of stride 0) NumPy
releases differ: recent ones copy the matrix into a buffer first, older ones (the project supports NumPy 1.24 on)
multiply it with their own loop, tens of times slower. `matmul` makes that copy itself, so every NumPy calls BLAS:
one pass over the operand, against a product that reads it many times.
"""

from __future__ import annotations

import numpy as np


def _strides_fit(x: np.ndarray) -> bool:
    """Is every matrix (last two axes) of x row-major or column-major with a valid leading dimension?"""
    if x.ndim < 2:
        return x.strides[-1:] in ((x.itemsize,), ())
    rows, cols = x.shape[-2:]
    row_stride, col_stride = x.strides[-2:]
    item = x.itemsize
    row_major = col_stride == item and row_stride % item == 0 and row_stride >= cols * item
    col_major = row_stride == item and col_stride % item == 0 and col_stride >= rows * item
    return row_major or col_major


def blas_ready(x: np.ndarray) -> np.ndarray:
    """x itself when BLAS reads its matrices in place, else a C-contiguous copy."""
    return x if _strides_fit(x) else np.array(x, order="C")     # np.array copies even what claims C order


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.matmul(a, b) (stacks broadcast as np.matmul does) with both operands laid out for BLAS."""
    return np.matmul(blas_ready(a), blas_ready(b))
