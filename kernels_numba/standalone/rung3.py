"""Rung 3, standalone: 16-byte vector loads, a group of lanes per key, unpacked in registers.

Each lane loads a 16-byte chunk of a key row (8 float16) in one instruction; the LANES lanes that cover a row
form a group, and a warp's groups walk different keys. A group takes a tile of TILE keys a step; a transposed
butterfly sums the tile's partial products so that each lane ends with one finished (row, key) logit, and the
online softmax steps once per row and tile. Same cache, grid and accesses per key as
`kernels_numba._attention_vector` (the production rungs 3 and 4) with 16-byte loads.
"""

import math
from functools import cache

import numpy as np
from numba import cuda

from .._attention_vector import keys_per_tile, lanes_per_key, plan_vector_rows  # the production rung's plan
from .._vector import half_from_bits, load16  # ld.global.nc.v4.u32
from .._warp import WARP_SIZE, lane_values, transpose_sum, xor_reduce_many  # shuffles on a GPU

E = 8                                         # float16 values in a 16-byte chunk


@cache
def build(head_dim, heads_per_block, q_tile, group, warps):
    D, HPB, WARPS = head_dim, heads_per_block, warps
    ROWS = HPB * q_tile
    CHUNKS = D // E                           # chunks of a row; lane c of a group holds chunk c
    LANES = lanes_per_key(CHUNKS)             # lanes a key row (a power of 2)
    KEYS = WARP_SIZE // LANES                 # lane groups of a warp
    TILE = keys_per_tile(D, E)                # keys a group takes a step
    STEP = WARPS * KEYS * TILE                # keys the block takes a step
    assert ROWS * TILE <= LANES, "each lane finishes one (row, key) logit of a tile"

    @cuda.jit
    def rung3(query, cache, cachestarts, seqstarts, kvstarts, out, sm_scale, s_t, s_kv, s_h):
        b = cuda.blockIdx.z
        seqlen = seqstarts[b + 1] - seqstarts[b]
        kvlen = kvstarts[b + 1] - kvstarts[b]
        i0 = cuda.blockIdx.x * q_tile
        if i0 >= seqlen:
            return
        h0 = cuda.blockIdx.y * HPB
        g = h0 // group
        warp, lane = cuda.threadIdx.x // WARP_SIZE, cuda.threadIdx.x % WARP_SIZE
        key_of_warp, c = lane // LANES, lane % LANES     # this lane's group in the warp, its chunk in the row
        first_lane = key_of_warp * LANES

        scratch = cuda.shared.array((WARPS, WARP_SIZE, max(E + 1, LANES)), np.float32)  # simulator shuffles only
        warp_max = cuda.shared.array((WARPS, ROWS), np.float32)
        warp_l = cuda.shared.array((WARPS, ROWS), np.float32)
        warp_out = cuda.shared.array((WARPS, ROWS, D), np.float32)

        q_reg = cuda.local.array((ROWS, E), np.float32)      # chunk c of every query row
        acc = cuda.local.array((ROWS, E), np.float32)        # chunk c of every output row
        k_reg = cuda.local.array(E, np.float32)
        v_reg = cuda.local.array(E, np.float32)
        dots = cuda.local.array(LANES, np.float32)           # partial logits of (row r, key j) at r * TILE + j
        one = cuda.local.array(1, np.float32)
        alphas = cuda.local.array(ROWS, np.float32)
        weights = cuda.local.array(ROWS * TILE, np.float32)
        merged = cuda.local.array(E + 1, np.float32)
        rows = cuda.local.array((TILE, 2), np.int64)        # where the tile's K and V rows start
        for r in range(ROWS):
            i = i0 + r // HPB
            for x in range(E):
                ok = c < CHUNKS and i < seqlen
                q_reg[r, x] = np.float32(query[seqstarts[b] + i, h0 + r % HPB, c * E + x]) if ok else 0.0
                acc[r, x] = 0.0
        for x in range(E):
            k_reg[x] = v_reg[x] = 0.0
        m_lane, l_lane = -math.inf, np.float32(0.0)         # the softmax state of this lane's row

        hi = kvlen - seqlen + min(i0 + q_tile, seqlen)
        steps = -(-hi // STEP)
        t0 = (warp * KEYS + key_of_warp) * TILE              # this group's first key
        for _ in range(steps):
            for j in range(TILE):                            # a key past hi reads key hi - 1, weighed 0
                row = (cachestarts[b] + min(t0 + j, hi - 1)) * s_t + g * s_h
                rows[j, 0], rows[j, 1] = row, row + s_kv
            # partial products of every (row, key) of the tile, summed so that lane n ends with logit n
            for n in range(LANES):
                dots[n] = 0.0
            for j in range(TILE):
                if c < CHUNKS:
                    words = load16(cache, rows[j, 0] + c * E)   # 8 float16 of key t0 + j in one load
                    for x in range(E):
                        k_reg[x] = half_from_bits(words[x // 2] >> (16 * (x % 2)))
                for r in range(ROWS):
                    for x in range(E):
                        dots[r * TILE + j] += q_reg[r, x] * k_reg[x]
            transpose_sum(dots, 1, scratch, warp, lane, LANES)
            r, t = c // TILE, t0 + c % TILE                  # this lane's (row, key)
            i = i0 + r // HPB
            logit = -math.inf
            if r < ROWS and i < seqlen and t < hi and t <= kvlen - seqlen + i:
                logit = dots[0] * sm_scale
            # the online softmax, once per row and tile: the max over the row's TILE lanes, alpha, p, their sum
            one[0] = logit
            xor_reduce_many(one, 1, scratch, warp, lane, 1, TILE, True)
            new_max = max(m_lane, one[0])
            top = max(new_max, -np.finfo(np.float32).max)    # all hidden so far: alpha = p = 0, not NaN
            alpha, p = math.exp(m_lane - top), math.exp(logit - top)
            m_lane = new_max
            one[0] = p
            xor_reduce_many(one, 1, scratch, warp, lane, 1, TILE, False)
            l_lane = l_lane * alpha + one[0]
            lane_values(alphas, ROWS, alpha, scratch, warp, lane, first_lane, TILE)    # from the lanes that hold
            lane_values(weights, ROWS * TILE, p, scratch, warp, lane, first_lane, 1)   # them, into every lane
            for r in range(ROWS):
                for x in range(E):
                    acc[r, x] *= alphas[r]
            for j in range(TILE):
                if c < CHUNKS:
                    words = load16(cache, rows[j, 1] + c * E)
                    for x in range(E):
                        v_reg[x] = half_from_bits(words[x // 2] >> (16 * (x % 2)))
                for r in range(ROWS):
                    for x in range(E):
                        acc[r, x] += weights[r * TILE + j] * v_reg[x]
            t0 += STEP

        row_max, row_sum = cuda.local.array(ROWS, np.float32), cuda.local.array(ROWS, np.float32)
        lane_values(row_max, ROWS, m_lane, scratch, warp, lane, first_lane, TILE)
        lane_values(row_sum, ROWS, l_lane, scratch, warp, lane, first_lane, TILE)
        if KEYS > 1 and steps > 0:                           # merge the groups of the warp: same chunks, other keys
            for r in range(ROWS):
                one[0] = row_max[r]
                xor_reduce_many(one, 1, scratch, warp, lane, LANES, WARP_SIZE, True)
                alpha = math.exp(row_max[r] - one[0]) if one[0] != -math.inf else np.float32(0.0)
                merged[E] = row_sum[r] * alpha
                for x in range(E):
                    merged[x] = acc[r, x] * alpha
                xor_reduce_many(merged, E + 1, scratch, warp, lane, LANES, WARP_SIZE, False)
                row_max[r], row_sum[r] = one[0], merged[E]
                for x in range(E):
                    acc[r, x] = merged[x]
        if key_of_warp == 0:                                 # then the warps, through shared memory
            for r in range(ROWS):
                if c == 0:
                    warp_max[warp, r] = row_max[r]
                    warp_l[warp, r] = row_sum[r]
                for x in range(E):
                    if c < CHUNKS:
                        warp_out[warp, r, c * E + x] = acc[r, x]
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

    return rung3


def attention(query, cache, cachestarts, seqstarts, kvstarts, max_seqlen, num_kv_heads, threads=128):
    """attn_output (seqstarts[B], num_heads, head_dim) of float16 `query` over the cache (head_dim a multiple of
    8 and at most 256; a 16-byte aligned cache)."""
    _, num_heads, head_dim = query.shape
    heads_per_block, q_tile = plan_vector_rows(num_heads, num_kv_heads, max_seqlen, head_dim, E, threads // 32)
    kernel = build(head_dim, heads_per_block, q_tile, num_heads // num_kv_heads, threads // WARP_SIZE)
    out = np.full(query.shape, np.nan, query.dtype)
    grid = (-(-max_seqlen // q_tile), num_heads // heads_per_block, len(seqstarts) - 1)
    s_t, _, s_kv, s_h, _ = (s // cache.itemsize for s in cache.strides)      # (T, 1 layer, KV, H, D) in elements
    kernel[grid, threads](query, cache.reshape(-1), cachestarts, seqstarts, kvstarts, out,
                          np.float32(1 / math.sqrt(head_dim)), s_t, s_kv, s_h)
    return out
