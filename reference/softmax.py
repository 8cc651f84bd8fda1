"""Softmax over the key axis, shared by the references."""

from __future__ import annotations

import numpy as np


def masked_softmax(scores: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Softmax along the last axis in the scores' dtype; a row whose every score is -inf gives zeros, not NaN.

    out: the array to write the probabilities into; pass `scores` itself when they are not needed afterwards
    (a large attention then makes no second score-sized array). By default a new array.
    """
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isneginf(row_max), 0, row_max)   # fully masked row: exp(-inf) = 0 everywhere
    e = np.subtract(scores, row_max, out=out)
    np.exp(e, out=e)
    total = e.sum(axis=-1, keepdims=True)
    e /= np.where(total > 0, total, 1)                     # a fully masked row stays 0 / 1 = 0
    return e
