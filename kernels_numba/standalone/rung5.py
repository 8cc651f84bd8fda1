"""Rung 5, standalone: Q Kᵀ and P V on tensor cores (`mma.sync.m16n8k16`), FlashAttention-2 style.

A warp owns a tile of 16 query rows (heads of one GQA group x query positions, padded to 16) and walks the keys
16 at a time. The block stages each key tile's K, then V, in shared memory once for all its warps (16-byte
loads, packed to float16 pairs); each lane then reads its B fragments from there, while Q's A fragments and the
C fragments of S and O stay in registers. The two 16x8 C tiles of S are, once exponentiated and packed, the A
fragment of P V: P never leaves registers. Warps of one row tile that walked different keys (decode) merge
pairwise at the end. Same cache, grid and accesses per key as `kernels_numba._attention_mma` (the production
rung 5) on a float16 cache.
"""

import math
from functools import cache

import numpy as np
from numba import cuda

from .._attention_mma import plan_mma_rows, stage_shape  # the production rung's plan
from .._mma import mma_m16n8k16, pack_half2, quad_max2, quad_sum2, scratch_shapes  # inline PTX on a GPU
from .._vector import half_from_bits, load16
from .._warp import WARP_SIZE

E = 8                                          # float16 values in a 16-byte chunk


@cache
def build(head_dim, heads_per_block, positions, row_tiles, group, warps):
    D, HPB, RT = head_dim, heads_per_block, row_tiles
    SPLITS, ROWS, q_tile = warps // RT, HPB * positions, positions * RT
    K_STEPS, V_TILES = D // 16, D // 8         # k16 steps of Q Kᵀ, n8 tiles of O
    KEYS, WORDS = stage_shape(D, D, warps, RT)  # keys staged a step (a tile of 16 per key split); pairs a K row
    K_ROW, V_ROW = WORDS + 4, 2 * WORDS + 8     # padded stage rows (words): one key of K, two keys of V
    CHUNKS, THREADS = D // E, warps * WARP_SIZE
    MMA_SCRATCH, QUAD_SCRATCH = scratch_shapes(warps)
    MERGE = (RT * (SPLITS // 2), 4 + V_TILES * 4, WARP_SIZE) if SPLITS > 1 else (1, 1, 1)

    @cuda.jit
    def rung5(query, cache, cachestarts, seqstarts, kvstarts, out, sm_scale, s_t, s_kv, s_h):
        b = cuda.blockIdx.z
        seqlen = seqstarts[b + 1] - seqstarts[b]
        kvlen = kvstarts[b + 1] - kvstarts[b]
        i0 = cuda.blockIdx.x * q_tile
        if i0 >= seqlen:
            return
        h0 = cuda.blockIdx.y * HPB
        g = h0 // group
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE
        tile, split = warp % RT, warp // RT            # this warp's row tile and share of the keys
        grp, quad = lane // 4, lane % 4                # this lane holds rows grp and grp + 8 of each fragment

        mma_scratch = cuda.shared.array(MMA_SCRATCH, np.uint32)     # the simulator's mma and shuffles only
        quad_scratch = cuda.shared.array(QUAD_SCRATCH, np.float32)
        merge = cuda.shared.array(MERGE, np.float32)
        kv_s = cuda.shared.array(KEYS * K_ROW, np.uint32)            # the staged K, then V, of a step's keys
        row_i, row_h = cuda.local.array(2, np.int64), cuda.local.array(2, np.int64)
        row_ok = cuda.local.array(2, np.bool_)
        for r in range(2):
            row_i[r] = i0 + tile * positions + (grp + 8 * r) // HPB
            row_h[r] = h0 + (grp + 8 * r) % HPB
            row_ok[r] = grp + 8 * r < ROWS and row_i[r] < seqlen

        # 1. Q as A fragments, in registers: register k holds row grp + 8 (k % 2), columns 2 quad + 8 (k // 2) + {0, 1}
        q_r = cuda.local.array((K_STEPS, 4), np.uint32)
        for ks in range(K_STEPS):
            for k in range(4):
                r, d = k % 2, ks * 16 + 2 * quad + 8 * (k // 2)
                x0 = np.float32(query[seqstarts[b] + row_i[r], row_h[r], d]) if row_ok[r] else 0.0
                x1 = np.float32(query[seqstarts[b] + row_i[r], row_h[r], d + 1]) if row_ok[r] else 0.0
                q_r[ks, k] = pack_half2(x0, x1)
        cuda.syncthreads()
        row_max, row_sum = cuda.local.array(2, np.float32), cuda.local.array(2, np.float32)
        o = cuda.local.array((V_TILES, 4), np.float32)              # C fragments of O
        s = cuda.local.array((2, 4), np.float32)                     # C fragments of S (keys t0.., t0 + 8..), then P
        tile_max = cuda.local.array(2, np.float32)
        for r in range(2):
            row_max[r], row_sum[r] = -math.inf, 0.0
        for vt in range(V_TILES):
            for e in range(4):
                o[vt, e] = 0.0

        hi = kvlen - seqlen + min(i0 + q_tile, seqlen)
        tiles = -(-hi // 16)                                         # key tiles of 16 to walk
        for step in range(-(-tiles // SPLITS)):                      # the same count in every warp
            t_stage = step * KEYS                                    # the block's keys; this warp's start at t0
            t0, kv = t_stage + split * 16, split * 16
            # 2. stage K: thread tid copies chunks tid, tid + THREADS, ... (a warp: whole sectors), as float16 pairs;
            #    a lane starts at word `by` of its chunk, so a warp's stores hit 32 banks
            for at in range(tid, KEYS * CHUNKS, THREADS):
                key, c = at // CHUNKS, at % CHUNKS
                words = load16(cache, (cachestarts[b] + t_stage + key) * s_t + g * s_h + c * E) \
                    if t_stage + key < hi else (np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
                by = lane // 8 % 4
                for j in range(4):
                    kv_s[key * K_ROW + c * 4 + (j + by) % 4] = words[(j + by) % 4]
            cuda.syncthreads()
            for nt in range(2):                                      # S = Q Kᵀ, two 16x8 tiles of keys
                for e in range(4):
                    s[nt, e] = 0.0
                for ks in range(K_STEPS):
                    at = np.uint64((kv + 8 * nt + grp) * K_ROW + ks * 8 + quad)
                    s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3] = mma_m16n8k16(
                        q_r[ks, 0], q_r[ks, 1], q_r[ks, 2], q_r[ks, 3], kv_s[at], kv_s[at + np.uint64(4)],
                        s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3], mma_scratch, warp, lane)
            # 3. the online softmax on the fragments: element e of tile nt is row grp + 8 (e // 2), key 2 quad + e % 2
            for r in range(2):
                tile_max[r] = -math.inf
                for nt in range(2):
                    for c in range(2):
                        t = t0 + 8 * nt + 2 * quad + c
                        ok = row_ok[r] and t < hi and t <= kvlen - seqlen + row_i[r]
                        s[nt, 2 * r + c] = s[nt, 2 * r + c] * sm_scale if ok else -math.inf
                        tile_max[r] = max(tile_max[r], s[nt, 2 * r + c])
            tile_max[0], tile_max[1] = quad_max2(tile_max[0], tile_max[1], quad_scratch, warp, lane)   # a row's 4 lanes
            for r in range(2):
                new_max = max(row_max[r], tile_max[r])
                alpha, part = np.float32(1.0), np.float32(0.0)
                if new_max != -math.inf:
                    alpha = math.exp(row_max[r] - new_max)
                for nt in range(2):
                    for c in range(2):
                        p = math.exp(s[nt, 2 * r + c] - new_max) if new_max != -math.inf else np.float32(0.0)
                        s[nt, 2 * r + c] = p
                        part += p
                row_sum[r] = row_sum[r] * alpha + part              # this lane's columns; the quad adds up at the end
                row_max[r] = new_max
                for vt in range(V_TILES):
                    o[vt, 2 * r] *= alpha
                    o[vt, 2 * r + 1] *= alpha
            # 4. P as the A fragment of P V: the two S tiles side by side are one 16x16 A tile
            p0, p1 = pack_half2(s[0, 0], s[0, 1]), pack_half2(s[0, 2], s[0, 3])
            p2, p3 = pack_half2(s[1, 0], s[1, 1]), pack_half2(s[1, 2], s[1, 3])
            # 5. stage V transposed in pairs of keys (row k, word d: element d of keys 2k and 2k + 1), then O += P V
            cuda.syncthreads()
            for at in range(tid, KEYS // 2 * CHUNKS, THREADS):
                k, c = at // CHUNKS, at % CHUNKS
                pair = cuda.local.array(2 * E, np.float32)
                for u in range(2):
                    t = t_stage + 2 * k + u
                    words = load16(cache, (cachestarts[b] + t) * s_t + s_kv + g * s_h + c * E) \
                        if t < hi else (np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0))
                    for x in range(E):
                        pair[u * E + x] = half_from_bits(words[x // 2] >> (16 * (x % 2)))
                by = lane // 4 % 8
                for j in range(E):
                    d = (j + by) % E
                    kv_s[k * V_ROW + c * E + d] = pack_half2(pair[d], pair[E + d])
            cuda.syncthreads()
            for vt in range(V_TILES):
                at = np.uint64((kv // 2 + quad) * V_ROW + vt * 8 + grp)
                o[vt, 0], o[vt, 1], o[vt, 2], o[vt, 3] = mma_m16n8k16(
                    p0, p1, p2, p3, kv_s[at], kv_s[at + np.uint64(4 * V_ROW)], o[vt, 0], o[vt, 1], o[vt, 2], o[vt, 3],
                    mma_scratch, warp, lane)
            cuda.syncthreads()                                       # V read by all before the next K lands

        # 6. the warps of a row tile merge pairwise (split s + stride into split s), lane by lane
        stride = 1
        while stride < SPLITS:
            cuda.syncthreads()
            slot = tile * (SPLITS // 2) + split // (2 * stride)
            if split % (2 * stride) == stride:
                for r in range(2):
                    merge[slot, r, lane], merge[slot, 2 + r, lane] = row_max[r], row_sum[r]
                for vt in range(V_TILES):
                    for e in range(4):
                        merge[slot, 4 + 4 * vt + e, lane] = o[vt, e]
            cuda.syncthreads()
            if split % (2 * stride) == 0 and split + stride < SPLITS:
                for r in range(2):
                    other = merge[slot, r, lane]
                    top = max(row_max[r], other)
                    if top != -math.inf:
                        mine, theirs = math.exp(row_max[r] - top), math.exp(other - top)
                        row_sum[r] = row_sum[r] * mine + merge[slot, 2 + r, lane] * theirs
                        for vt in range(V_TILES):
                            for c in range(2):
                                e = 2 * r + c
                                o[vt, e] = o[vt, e] * mine + merge[slot, 4 + 4 * vt + e, lane] * theirs
                        row_max[r] = top
            stride *= 2
        total0, total1 = quad_sum2(row_sum[0], row_sum[1], quad_scratch, warp, lane)
        if split == 0:
            for r in range(2):
                total = total0 if r == 0 else total1
                for vt in range(V_TILES):
                    for c in range(2):
                        if row_ok[r]:
                            value = o[vt, 2 * r + c] / total if total > 0 else 0.0
                            out[seqstarts[b] + row_i[r], row_h[r], vt * 8 + 2 * quad + c] = value

    return rung5


def attention(query, cache, cachestarts, seqstarts, kvstarts, max_seqlen, num_kv_heads, threads=128):
    """attn_output (seqstarts[B], num_heads, head_dim) of float16 `query` over the cache (head_dim a multiple of
    16; a 16-byte aligned cache)."""
    _, num_heads, head_dim = query.shape
    warps = threads // WARP_SIZE
    heads_per_block, positions, row_tiles = plan_mma_rows(num_heads, num_kv_heads, min(max_seqlen, 16), warps,
                                                          head_dim)
    kernel = build(head_dim, heads_per_block, positions, row_tiles, num_heads // num_kv_heads, warps)
    out = np.full(query.shape, np.nan, query.dtype)
    grid = (-(-max_seqlen // (positions * row_tiles)), num_heads // heads_per_block, len(seqstarts) - 1)
    s_t, _, s_kv, s_h, _ = (s // cache.itemsize for s in cache.strides)      # (T, 1 layer, KV, H, D) in elements
    kernel[grid, threads](query, cache.reshape(-1), cachestarts, seqstarts, kvstarts, out,
                          np.float32(1 / math.sqrt(head_dim)), s_t, s_kv, s_h)
    return out
