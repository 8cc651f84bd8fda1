"""assert_close, assert_same_values and assert_bits_equal: the conformance kit's comparison
(`cacheattn.testing._core.mismatch`) as assertions, so a test and the kit agree on how close is close, per
dtype, and report a mismatch the same way (the buffer, how many elements differ, the first bad indices with
got / expected)."""

from __future__ import annotations

import numpy as np

from cacheattn.testing._core import Expect, mismatch


def assert_close(name: str, got, ref, dtype, *, scale: float = 1.0) -> None:
    """got (any float array) against ref (float64 evaluation); tolerance of `dtype`, widened by `scale`. NaN (a
    poisoned, unwritten element) fails; infinities must match."""
    problem = mismatch(name, got, Expect("close", np.asarray(ref), tolerance=np.dtype(dtype).name, scale=scale,
                                                against=None))
    if problem:
        raise AssertionError(problem)


def assert_bits_equal(name: str, got, ref) -> None:
    """Bit-for-bit equality, dtype and shape included (NaN payloads too): for caches, scales and exactly-specified
    results."""
    problem = mismatch(name, got, Expect("bits", np.asarray(ref)))
    if problem:
        raise AssertionError(problem)


def assert_same_values(name: str, got, want) -> None:
    """Two evaluations of the same float result by different routes (another layout, batch or head grouping):
    equal within the tolerance of `want`'s dtype, dtype and shape included. Not bit for bit: BLAS and NumPy's SIMD
    loops may sum in another order for another shape or stride, and on another CPU (AVX-512 or not)."""
    want = np.asarray(want)
    if np.asarray(got).dtype != want.dtype:
        raise AssertionError(f"{name}: dtype {np.asarray(got).dtype.name}, expected {want.dtype.name}")
    assert_close(name, got, want.astype(np.float64), want.dtype)
