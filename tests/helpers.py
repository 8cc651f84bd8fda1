"""assert_close and friends: one place that says how close is close, per dtype, and reports where it is not."""

from __future__ import annotations

import numpy as np

from cacheattn.examples import TOLERANCE, within_tolerance


def _where(bad: np.ndarray, got: np.ndarray, ref: np.ndarray, shown: int = 5) -> str:
    idx = np.argwhere(bad)
    pairs = ", ".join(f"{tuple(int(v) for v in i)}: got {got[tuple(i)]!r} want {ref[tuple(i)]!r}"
                      for i in idx[:shown])
    return f"{len(idx)} of {bad.size} elements differ; first at {tuple(int(v) for v in idx[0])}; {pairs}"


def assert_close(name: str, got, ref, dtype, *, scale: float = 1.0) -> None:
    """got (any array of dtype) against ref (float64 evaluation); tolerance of `dtype`, widened by `scale`."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    atol, rtol = (t * scale for t in TOLERANCE[np.dtype(dtype)])
    g, r = got.astype(np.float64), ref.astype(np.float64)
    bad = ~within_tolerance(g, r, dtype, scale)              # NaN (a poisoned, unwritten element) counts as bad
    if bad.any():
        raise AssertionError(f"{name} ({np.dtype(dtype).name}, atol {atol:g}, rtol {rtol:g}): {_where(bad, g, r)}")


def assert_bits_equal(name: str, got, ref) -> None:
    """Bit-for-bit equality (NaN payloads included): for caches, scales and exactly-specified results."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape and got.dtype == ref.dtype, (
        f"{name}: {got.dtype}{got.shape}, expected {ref.dtype}{ref.shape}")
    g = got.view(np.uint8).reshape(*got.shape, -1) if got.ndim else got.view(np.uint8)
    r = ref.view(np.uint8).reshape(*ref.shape, -1) if ref.ndim else ref.view(np.uint8)
    bad = (g != r).any(axis=-1)
    if bad.any():
        raise AssertionError(f"{name}: {_where(bad, got, ref)}")

