"""Rung 4, standalone: split-K, rung 3's kernel on a share of the keys per block, and a combine kernel.

Grid z runs over batch x splits: block (b, split) walks its split's share of the keys sequence b's rows can
see and writes, per query row, its unnormalised output o, max m and sum l; a second kernel finishes the softmax,
out = sum e^(m_c - M) o_c / sum e^(m_c - M) l_c with M = max m_c. Same cache, grid and accesses per key as the
production rung 4 (`kernels_numba._attention_vector` with partials, `kernels_numba._split_k`).
"""

import math
from functools import cache

import numpy as np
from numba import cuda

from .._attention_vector import keys_per_step, keys_per_tile, lanes_per_key, plan_vector_rows
from .._split_k import choose_splits  # split only when SMs would idle, to about 2 blocks an SM
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
    def rung4(query, cache, cachestarts, seqstarts, kvstarts, o_part, m_part, l_part, sm_scale, s_t, s_kv, s_h):
        num_splits = o_part.shape[0]
        b, split = cuda.blockIdx.z // num_splits, cuda.blockIdx.z % num_splits
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
        per_split = -(-hi // num_splits)                     # this split's share of the keys [0, hi)
        lo, hi = split * per_split, min(hi, (split + 1) * per_split)
        steps = -(-max(hi - lo, 0) // STEP)
        t0 = lo + (warp * KEYS + key_of_warp) * TILE         # this group's first key
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
                at = seqstarts[b] + i, h0 + r % HPB            # this split's o, m and l, unnormalised
                o_part[split, at[0], at[1], d] = value
                if d == 0:
                    m_part[split, at[0], at[1]], l_part[split, at[0], at[1]] = top, total

    return rung4


@cuda.jit
def combine(o_part, m_part, l_part, seqstarts, out):
    """One thread per output element (i, h, d) of sequence blockIdx.y: the splits' softmax states merged."""
    _, _, num_heads, D = o_part.shape
    b, n = cuda.blockIdx.y, cuda.grid(1)
    i, h, d = n // (num_heads * D), n // D % num_heads, n % D
    if i >= seqstarts[b + 1] - seqstarts[b]:
        return
    row = seqstarts[b] + i
    top = -math.inf
    for c in range(o_part.shape[0]):
        top = max(top, m_part[c, row, h])
    total, value = np.float32(0.0), np.float32(0.0)
    if top != -math.inf:
        for c in range(o_part.shape[0]):
            if m_part[c, row, h] != -math.inf:               # a split that saw no key adds nothing
                weight = math.exp(m_part[c, row, h] - top)
                total += weight * l_part[c, row, h]
                value += weight * o_part[c, row, h, d]
    out[row, h, d] = value / total if total > 0 else 0.0


def attention(query, cache, cachestarts, seqstarts, kvstarts, max_seqlen, num_kv_heads, threads=128,
              num_splits=None):
    """attn_output (seqstarts[B], num_heads, head_dim) of float16 `query` over the cache (head_dim a multiple of
    8 and at most 256; a 16-byte aligned cache). num_splits: None chooses as the production rung 4 does."""
    _, num_heads, head_dim = query.shape
    heads_per_block, q_tile = plan_vector_rows(num_heads, num_kv_heads, max_seqlen, head_dim, E, threads // 32)
    kernel = build(head_dim, heads_per_block, q_tile, num_heads // num_kv_heads, threads // WARP_SIZE)
    out = np.full(query.shape, np.nan, query.dtype)
    batch = len(seqstarts) - 1
    grid = (-(-max_seqlen // q_tile), num_heads // heads_per_block, batch)
    splits = num_splits or choose_splits(grid[0] * grid[1] * grid[2], int(max(np.diff(kvstarts))),
                                         keys_per_step(head_dim, E, threads // WARP_SIZE))
    o_part = np.full((splits,) + query.shape, np.nan, np.float32)
    m_part, l_part = (np.full((splits,) + query.shape[:2], np.nan, np.float32) for _ in range(2))
    s_t, _, s_kv, s_h, _ = (s // cache.itemsize for s in cache.strides)      # (T, 1 layer, KV, H, D) in elements
    kernel[grid[:2] + (batch * splits,), threads](query, cache.reshape(-1), cachestarts, seqstarts, kvstarts, o_part,
                                                  m_part, l_part, np.float32(1 / math.sqrt(head_dim)), s_t, s_kv, s_h)
    combine[(-(-max_seqlen * num_heads * head_dim // threads), batch), threads](o_part, m_part, l_part, seqstarts,
                                                                                out)
    return out
