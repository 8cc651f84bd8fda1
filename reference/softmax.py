"""Softmax over the key axis, shared by the references."""

from __future__ import annotations

import numpy as np


def masked_softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax along the last axis in the scores' dtype; a row whose every score is -inf gives zeros, not NaN."""
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isneginf(row_max), 0, row_max)   # fully masked row: exp(-inf) = 0 everywhere
    e = np.exp(scores - row_max)
    total = e.sum(axis=-1, keepdims=True)
    e /= np.where(total > 0, total, 1)                     # a fully masked row stays 0 / 1 = 0
    return e
