"""Rung 1, standalone: tiled online softmax, one block per GQA group, K and V tiles in shared memory.

OpenPPL's MultiHeadCacheAttention on one cache format, written out whole: a float16 offset cache
(cache_mode 0, cache_layout 0: `cache[slot, layer, kv, head, d]`, sequence b's token t in slot
`cachestarts[b] + t`), a float16 query, float32 accumulation, GQA, causal prefill aligned bottom-right.
Same grid, block and memory accesses per key as `kernels_numba._attention_core` (the production rung 1).
"""

import math
from functools import cache

import numpy as np
from numba import cuda

from .._attention_core import plan_tiles  # the production rung's tile plan: the same grid


@cache
def build(head_dim, heads_per_block, q_tile, key_tile, group):
    D, HPB, KT = head_dim, heads_per_block, key_tile
    ROWS = HPB * q_tile                      # query rows of a block: HPB heads of one GQA group x q_tile positions

    @cuda.jit
    def rung1(query, cache, cachestarts, seqstarts, kvstarts, out, sm_scale):
        b = cuda.blockIdx.z
        seqlen = seqstarts[b + 1] - seqstarts[b]
        kvlen = kvstarts[b + 1] - kvstarts[b]
        i0 = cuda.blockIdx.x * q_tile        # first query position of this block
        if i0 >= seqlen:
            return                           # the whole block leaves: no thread waits at a barrier
        h0 = cuda.blockIdx.y * HPB           # first query head of this block
        g = h0 // group                      # the kv head all its rows read
        tid, nthreads = cuda.threadIdx.x, cuda.blockDim.x

        q_s = cuda.shared.array((ROWS, D), np.float32)
        k_s = cuda.shared.array((KT, D), np.float32)
        v_s = cuda.shared.array((KT, D), np.float32)
        p_s = cuda.shared.array((ROWS, KT), np.float32)      # scores, then probabilities
        acc = cuda.shared.array((ROWS, D), np.float32)
        row_max = cuda.shared.array(ROWS, np.float32)
        row_sum = cuda.shared.array(ROWS, np.float32)
        rescale = cuda.shared.array(ROWS, np.float32)
        slot = cuda.shared.array(KT, np.int64)

        for e in range(tid, ROWS * D, nthreads):         # row r: position i0 + r // HPB of head h0 + r % HPB
            r, d = e // D, e % D
            i = i0 + r // HPB
            q_s[r, d] = np.float32(query[seqstarts[b] + i, h0 + r % HPB, d]) if i < seqlen else 0.0
            acc[r, d] = 0.0
        for r in range(tid, ROWS, nthreads):
            row_max[r] = -math.inf
            row_sum[r] = 0.0
        hi = kvlen - seqlen + min(i0 + q_tile, seqlen)   # causal: the last row sees keys [0, hi)
        cuda.syncthreads()

        for t0 in range(0, hi, KT):
            # 1. where this tile's keys live (a key past hi is clamped: loaded, never weighted)
            for j in range(tid, KT, nthreads):
                slot[j] = cachestarts[b] + min(t0 + j, kvlen - 1)
            cuda.syncthreads()
            # 2. K and V tiles into shared memory, as float32
            for e in range(tid, KT * D, nthreads):
                j, d = e // D, e % D
                k_s[j, d] = np.float32(cache[slot[j], 0, 0, g, d])
            for e in range(tid, KT * D, nthreads):
                j, d = e // D, e % D
                v_s[j, d] = np.float32(cache[slot[j], 0, 1, g, d])
            cuda.syncthreads()
            # 3. scores: one thread, one (row, key), the whole dot product
            for e in range(tid, ROWS * KT, nthreads):
                r, j = e // KT, e % KT
                i, t = i0 + r // HPB, t0 + j
                s = -math.inf
                if i < seqlen and t <= kvlen - seqlen + i:
                    dot = np.float32(0.0)
                    for d in range(D):
                        dot += q_s[r, d] * k_s[j, d]
                    s = dot * sm_scale
                p_s[r, j] = s
            cuda.syncthreads()
            # 4. online softmax, one thread per row: new max, rescale what the row holds
            for r in range(tid, ROWS, nthreads):
                new_max = row_max[r]
                for j in range(KT):
                    new_max = max(new_max, p_s[r, j])
                alpha, tile_sum = np.float32(1.0), np.float32(0.0)
                if new_max != -math.inf:
                    alpha = math.exp(row_max[r] - new_max)
                    for j in range(KT):
                        p = math.exp(p_s[r, j] - new_max)
                        p_s[r, j] = p
                        tile_sum += p
                else:
                    for j in range(KT):
                        p_s[r, j] = 0.0
                row_sum[r] = row_sum[r] * alpha + tile_sum
                row_max[r] = new_max
                rescale[r] = alpha
            cuda.syncthreads()
            # 5. acc = alpha acc + P V
            for e in range(tid, ROWS * D, nthreads):
                r, d = e // D, e % D
                total = acc[r, d] * rescale[r]
                for j in range(KT):
                    total += p_s[r, j] * v_s[j, d]
                acc[r, d] = total
            cuda.syncthreads()

        for e in range(tid, ROWS * D, nthreads):
            r, d = e // D, e % D
            i = i0 + r // HPB
            if i < seqlen:
                out[seqstarts[b] + i, h0 + r % HPB, d] = acc[r, d] / row_sum[r] if row_sum[r] > 0 else 0.0

    return rung1


def attention(query, cache, cachestarts, seqstarts, kvstarts, max_seqlen, num_kv_heads, threads=128):
    """attn_output (seqstarts[B], num_heads, head_dim) of float16 `query` over the cache."""
    _, num_heads, head_dim = query.shape
    heads_per_block, q_tile, key_tile = plan_tiles(num_heads, num_kv_heads, max_seqlen, head_dim, head_dim)
    kernel = build(head_dim, heads_per_block, q_tile, key_tile, num_heads // num_kv_heads)
    out = np.full(query.shape, np.nan, query.dtype)          # poisoned: a row the kernel skips shows
    grid = (-(-max_seqlen // q_tile), num_heads // heads_per_block, len(seqstarts) - 1)
    kernel[grid, threads](query, cache, cachestarts, seqstarts, kvstarts, out, np.float32(1 / math.sqrt(head_dim)))
    return out
