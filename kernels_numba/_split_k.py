"""Split-K (multi-block) decode, shared by TensorRT-LLM's multi-block mode and the kernel ladder's rung 4.

When a decode grid has fewer blocks than the GPU has multiprocessors, each block's keys are split over
num_splits blocks; split c leaves, per query row, its running max m_c, sum l_c and unnormalised output o_c
(the `partials` contract of `_attention_core.make_attention_kernel` and `_attention_vector`), and one combine
pass finishes the softmax: M = max m_c, out = sum e^(m_c - M) o_c / sum e^(m_c - M) l_c.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numba import cuda

from ._cache import token_head_item
from ._launch import ceil_div
from ._numerics import element_io, to_float64

MAX_SPLITS = 64


@cache
def combine_kernel(dtype, num_heads, head_size, sum_epsilon=0.0):
    """Kernel: the multi-block reduction of the splits' (m, l, o): M = max m_c, L = sum e^(m_c - M) l_c + sum_epsilon,
    out = sum e^(m_c - M) o_c / L (0 for a row no split saw). One thread per output element; grid
    (x: ceil(max new tokens * H * Dh / threads), y: entries). dtype: out's, or "bfloat16" for an out of bfloat16
    bits (`_numerics.element_io`)."""
    widen, narrow = element_io(dtype)
    acc_t = np.float64 if widen is to_float64 else np.float32
    H, DH = num_heads, head_size
    NEG_INF, EPS = acc_t(-math.inf), acc_t(sum_epsilon)

    @cuda.jit
    def combine_kernel(o_part, m_part, l_part, num_splits, token_starts, new_starts, out):
        b, i, h, d = token_head_item(new_starts, H, DH)
        if i < 0:
            return
        rows = m_part.shape[0] // num_splits
        row = (token_starts[b] + i) * H + h             # (token, head): the index of m, l; o adds d
        big_m = NEG_INF
        for c in range(num_splits):
            big_m = max(big_m, m_part[c * rows + row])
        total, value = EPS, acc_t(0.0)              # EPS: FasterTransformer's 1 / (sum + 1e-6)
        if big_m != NEG_INF:
            for c in range(num_splits):
                m = m_part[c * rows + row]
                if m != NEG_INF:                        # a split that saw no key adds nothing
                    weight = math.exp(m - big_m)
                    total += weight * l_part[c * rows + row]
                    value += weight * o_part[(c * rows + row) * DH + d]
        out[row * DH + d] = narrow(value / total if total > 0 else acc_t(0.0))

    return combine_kernel


def sm_count() -> int:
    """The current GPU's multiprocessor count; 132 (an H100 SXM) when there is none, as in the simulator."""
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # no device, or the simulator's, which has no attributes
        return 132


# Blocks per SM split-K aims for: with one block an SM waits on its own loads; with two, one block's loads are in
# flight while the other reduces (the ladder's decode rungs fit 2-4 blocks per SM by registers).
WAVES = 2


def choose_splits(blocks: int, max_kv_len: int, key_tile: int, num_sms: int | None = None) -> int:
    """Multi-block heuristic: split the keys only when the grid (entries x head groups x query tiles) leaves
    SMs idle; then as many splits as put WAVES blocks on every SM (B = 1 at 8 kv heads on 132 SMs: 33 splits,
    264 blocks), never more than the longest sequence has key tiles, at most 64."""
    num_sms = sm_count() if num_sms is None else num_sms
    if blocks >= num_sms:
        return 1
    return max(1, min(ceil_div(WAVES * num_sms, blocks), ceil_div(max_kv_len, key_tile), MAX_SPLITS))
