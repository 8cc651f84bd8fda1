"""Rung 2, standalone: a warp per key, lanes across head_dim, no shared-memory tiles.

Warp w walks keys w, w + WARPS, ...; lane l loads elements l, l + 32, ... of each key and value straight
from the cache into registers (consecutive lanes, consecutive addresses), and the warp sums its lanes' partial
dot products. Each warp keeps its own online softmax per row; at the end the warps' states merge through shared
memory. Same cache, grid and accesses per key as `kernels_numba._attention_warp` (the production rung 2).
"""

import math
from functools import cache

import numpy as np
from numba import cuda

from .._attention_warp import plan_warp_rows  # the production rung's row plan: the same grid
from .._warp import WARP_SIZE, warp_sum  # shuffles on a GPU, shared memory in the simulator


@cache
def build(head_dim, heads_per_block, q_tile, group, warps):
    D, HPB, WARPS = head_dim, heads_per_block, warps
    ROWS = HPB * q_tile
    PER_LANE = -(-D // WARP_SIZE)                    # elements of a row each lane holds

    @cuda.jit
    def rung2(query, cache, cachestarts, seqstarts, kvstarts, out, sm_scale):
        b = cuda.blockIdx.z
        seqlen = seqstarts[b + 1] - seqstarts[b]
        kvlen = kvstarts[b + 1] - kvstarts[b]
        i0 = cuda.blockIdx.x * q_tile
        if i0 >= seqlen:
            return
        h0 = cuda.blockIdx.y * HPB
        g = h0 // group
        warp, lane = cuda.threadIdx.x // WARP_SIZE, cuda.threadIdx.x % WARP_SIZE

        scratch = cuda.shared.array((WARPS, WARP_SIZE), np.float32)      # warp_sum's simulator path only
        warp_max = cuda.shared.array((WARPS, ROWS), np.float32)
        warp_l = cuda.shared.array((WARPS, ROWS), np.float32)
        warp_out = cuda.shared.array((WARPS, ROWS, D), np.float32)

        # this lane's elements of every query row, and an empty softmax state per row, all in registers
        q_reg = cuda.local.array((ROWS, PER_LANE), np.float32)
        acc = cuda.local.array((ROWS, PER_LANE), np.float32)
        row_max = cuda.local.array(ROWS, np.float32)
        row_sum = cuda.local.array(ROWS, np.float32)
        for r in range(ROWS):
            i = i0 + r // HPB
            for m in range(PER_LANE):
                d = lane + m * WARP_SIZE
                q_reg[r, m] = np.float32(query[seqstarts[b] + i, h0 + r % HPB, d]) if d < D and i < seqlen else 0.0
                acc[r, m] = 0.0
            row_max[r] = -math.inf
            row_sum[r] = 0.0
        k_reg = cuda.local.array(PER_LANE, np.float32)
        v_reg = cuda.local.array(PER_LANE, np.float32)

        hi = kvlen - seqlen + min(i0 + q_tile, seqlen)   # causal: the last row sees keys [0, hi)
        steps = -(-hi // WARPS)                          # the same in every warp: warp_sum may hold barriers
        for step in range(steps):
            t = step * WARPS + warp
            slot = cachestarts[b] + min(t, hi - 1)       # a warp past the end loads a real key, weighs it 0
            for m in range(PER_LANE):                    # this lane's elements of key t and value t
                d = lane + m * WARP_SIZE
                k_reg[m] = np.float32(cache[slot, 0, 0, g, d]) if d < D else 0.0
            for m in range(PER_LANE):
                d = lane + m * WARP_SIZE
                v_reg[m] = np.float32(cache[slot, 0, 1, g, d]) if d < D else 0.0
            for r in range(ROWS):
                part = np.float32(0.0)
                for m in range(PER_LANE):
                    part += q_reg[r, m] * k_reg[m]
                dot = warp_sum(part, scratch, warp, lane)       # the logit, the same in every lane
                i = i0 + r // HPB
                s = dot * sm_scale if t < hi and i < seqlen and t <= kvlen - seqlen + i else -math.inf
                new_max = max(row_max[r], s)             # this warp's online softmax for row r
                if new_max != -math.inf:
                    alpha, p = math.exp(row_max[r] - new_max), math.exp(s - new_max)
                    row_sum[r] = row_sum[r] * alpha + p
                    for m in range(PER_LANE):
                        acc[r, m] = acc[r, m] * alpha + p * v_reg[m]
                    row_max[r] = new_max

        # merge the warps: M = max m_w, L = sum e^(m_w - M) l_w, O = sum e^(m_w - M) o_w / L
        for r in range(ROWS):
            if lane == 0:
                warp_max[warp, r] = row_max[r]
                warp_l[warp, r] = row_sum[r]
            for m in range(PER_LANE):
                d = lane + m * WARP_SIZE
                if d < D:
                    warp_out[warp, r, d] = acc[r, m]
        cuda.syncthreads()
        for e in range(cuda.threadIdx.x, ROWS * D, WARPS * WARP_SIZE):
            r, d = e // D, e % D
            i = i0 + r // HPB
            if i < seqlen:
                top = -math.inf
                for w in range(WARPS):
                    top = max(top, warp_max[w, r])
                total, value = np.float32(0.0), np.float32(0.0)
                if top != -math.inf:
                    for w in range(WARPS):
                        weight = math.exp(warp_max[w, r] - top)
                        total += weight * warp_l[w, r]
                        value += weight * warp_out[w, r, d]
                out[seqstarts[b] + i, h0 + r % HPB, d] = value / total if total > 0 else 0.0

    return rung2


def attention(query, cache, cachestarts, seqstarts, kvstarts, max_seqlen, num_kv_heads, threads=128):
    """attn_output (seqstarts[B], num_heads, head_dim) of float16 `query` over the cache."""
    _, num_heads, head_dim = query.shape
    heads_per_block, q_tile = plan_warp_rows(num_heads, num_kv_heads, max_seqlen, head_dim, threads // WARP_SIZE)
    kernel = build(head_dim, heads_per_block, q_tile, num_heads // num_kv_heads, threads // WARP_SIZE)
    out = np.full(query.shape, np.nan, query.dtype)          # poisoned: a row the kernel skips shows
    grid = (-(-max_seqlen // q_tile), num_heads // heads_per_block, len(seqstarts) - 1)
    kernel[grid, threads](query, cache, cachestarts, seqstarts, kvstarts, out, np.float32(1 / math.sqrt(head_dim)))
    return out
