"""ALiBi slopes (Press et al., "Train Short, Test Long"), as OpenPPL and TensorRT-LLM compute them.

With c = 2^floor(log2 H): slopes 2^(-8n/c) for n = 1..c, then, when H is not a
power of two, 2^(-4n/c) for n = 1, 3, 5, ... until there are H slopes.
"""

from __future__ import annotations

import math

import numpy as np


def alibi_slopes(num_heads: int) -> np.ndarray:
    """float32 (num_heads,): the slope of each query head."""
    c = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * n / c) for n in range(1, c + 1)]
    # The heads past the power of two interleave the slopes of a 2c-head model.
    slopes += [2.0 ** (-4.0 * n / c) for n in range(1, 2 * (num_heads - c), 2)]
    return np.asarray(slopes, dtype=np.float32)
