"""Matrix products that stay in BLAS, shared by the references.

BLAS takes a matrix whose one axis has unit stride and whose other axis steps at least a whole row (column): its
leading dimension. Transposed views (`k.swapaxes(-1, -2)`) and heads sliced out of a (tokens, heads, dim) array are
such matrices and go to BLAS in place. For any other layout (a step slice, a broadcast row of stride 0) NumPy
releases differ: recent ones copy the matrix into a buffer first, older ones (the project supports NumPy 1.24 on)
multiply it with their own loop, tens of times slower. `matmul` makes that copy itself, so every NumPy calls BLAS:
one pass over the operand, against a product that reads it many times.

Small products run on one BLAS thread. A reference multiplies a stack of per-head matrices, each a fraction of a
millisecond of work; a multi-threaded OpenBLAS hands every one of them to its threads and waits until all of them
hold a core, so on a machine whose cores are busy with anything else each product can stall for a scheduler tick
(hundreds of times its work, measured on a 2-core machine under load). One thread costs nothing on such sizes:
the split would not pay for its synchronisation.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cache

import numpy as np

# Products of [ONE_THREAD_FROM, ONE_THREAD_BELOW) multiply-adds a matrix run on one BLAS thread: below 2**18
# OpenBLAS keeps one thread by itself (and a limit would cost more than the product), and 2**24 is a
# 512 x 512 x 64 product, where threads start to pay on an idle machine.
ONE_THREAD_FROM, ONE_THREAD_BELOW = 2**18, 2**24


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


@cache
def _blas_threads():
    """threadpoolctl's controller of the BLAS libraries NumPy loaded (found once), or None without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController()


def _threads_for(a: np.ndarray, b: np.ndarray):
    """A context that holds BLAS to one thread while a product of a's and b's matrices is small."""
    controller = _blas_threads()
    rows, inner = (1, *a.shape[-1:]) if a.ndim == 1 else a.shape[-2:]
    cols = 1 if b.ndim == 1 else b.shape[-1]
    if controller is None or not ONE_THREAD_FROM <= rows * inner * cols < ONE_THREAD_BELOW:
        return nullcontext()
    return controller.limit(limits=1, user_api="blas")


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.matmul(a, b) (stacks broadcast as np.matmul does) with both operands laid out for BLAS, small products
    on one BLAS thread."""
    with _threads_for(a, b):
        return np.matmul(blas_ready(a), blas_ready(b))
