"""Rung 6, standalone: FlashAttention-2's prefill loop, K and V copied global -> shared by `cp.async`.

A block of 4 warps owns 64 consecutive query positions of one query head, each warp its own 16 rows, with Q's A
fragments in registers for the whole loop. All warps share K and V tiles of 64 keys, which go from the cache to
shared memory by 16-byte `cp.async` copies that never touch a register, stored XOR-swizzled (chunk c of row r at
chunk c ^ (r % 8)) so that an 8x8 `ldmatrix` reads 8 rows from 32 different banks. The copies of one tile
overlap the other's math: V(j) lands while S = Q K(j)ᵀ is computed, K(j + 1) while the softmax and O += P V(j)
are. B fragments come by `ldmatrix.x4` (K) and `ldmatrix.x4.trans` (V). Tiles above the block's last causal key
are never loaded. Same grid, tiles and copies as `kernels_numba._attention_flash` (the production rung 6) on a
float16 cache.
"""

import math
from functools import cache

import numpy as np
from numba import cuda

from .._async_copy import (  # cp.async, ldmatrix: inline PTX on a GPU
    SHARED_ALIGNMENT,
    async_target,
    cp_async16,
    cp_async_commit,
    cp_async_wait,
    ldmatrix_x4_at,
    ldmatrix_x4_trans_at,
    scratch_shape,
)
from .._mma import mma_m16n8k16, pack_half2, quad_max2, quad_sum2, scratch_shapes
from .._warp import WARP_SIZE

E, KT = 8, 64                                  # float16 values in a 16-byte chunk; keys a tile


def swizzled(row, chunk, chunks):
    """The 16-byte slot where tile row `row` keeps its chunk `chunk` (of `chunks` a row): chunk ^ (row % 8) at 8
    chunks a row or more, so the 8 rows an 8x8 ldmatrix reads land in 8 different 16-byte bank groups (all 32
    banks); at 2 or 4 chunks a row, 8 / chunks consecutive rows share a permutation, which spreads them alike."""
    sw = min(chunks, 8)
    return chunk ^ (row // (8 // sw) % sw)


@cache
def build(head_dim, group, warps):
    D, THREADS, ROWS = head_dim, warps * WARP_SIZE, 16 * warps
    K_STEPS, S_TILES, O_TILES = D // 16, KT // 8, D // 8     # k16 steps of Q Kᵀ, n8 tiles of S and of O
    CHUNKS, ROW_WORDS = D // E, D // 2                       # a tile row: 16-byte chunks, 32-bit words
    TILE_WORDS = KT * ROW_WORDS                              # a constant here: numba computes expressions at run time
    STRIDE = THREADS // CHUNKS                               # rows apart of a thread's copies
    MMA_SCRATCH, QUAD_SCRATCH = scratch_shapes(warps)
    LDM_SCRATCH, ALIGN = scratch_shape(warps), SHARED_ALIGNMENT

    swizzle = cuda.jit(device=True, inline="always")(swizzled)

    @cuda.jit(device=True, inline="always")
    def place(row, chunk):
        """Word index of chunk `chunk` of tile row `row` in a stage."""
        return row * ROW_WORDS + swizzle(row, chunk, CHUNKS) * 4

    @cuda.jit(device=True, inline="always")
    def issue(tile_s, cache, row0, s_t, t_tile, hi, key0, c):
        """This thread's copies of the tile of keys t_tile..: chunk c of rows key0, key0 + STRIDE, ... (row0: chunk c
        of key 0 in the cache); zeros past hi, so that P·V never multiplies a zero weight by an unwritten value."""
        for r in range(key0, KT, STRIDE):
            at = place(r, c)
            if t_tile + r < hi:
                cp_async16(tile_s, at, cache, row0 + (t_tile + r) * s_t)     # 16 bytes, past the registers
            else:
                for w in range(4):
                    tile_s[at + w] = np.uint32(0)

    @cuda.jit
    def rung6(query, cache, cachestarts, seqstarts, kvstarts, out, sm_scale, s_t, s_kv, s_h):
        b = cuda.blockIdx.z
        seqlen = seqstarts[b + 1] - seqstarts[b]
        kvlen = kvstarts[b + 1] - kvstarts[b]
        i0 = cuda.blockIdx.x * ROWS
        if i0 >= seqlen:
            return                                           # the whole block: no thread waits at a barrier
        h = cuda.blockIdx.y
        g = h // group
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE
        grp, quad = lane // 4, lane % 4                      # this lane holds rows grp and grp + 8 of a fragment

        mma_scratch = cuda.shared.array(MMA_SCRATCH, np.uint32)    # the simulator's mma, shuffles, ldmatrix only
        quad_scratch = cuda.shared.array(QUAD_SCRATCH, np.float32)
        ldm_scratch = cuda.shared.array(LDM_SCRATCH, np.int32)
        k_s = async_target(cuda.shared.array(TILE_WORDS, np.uint32, alignment=ALIGN))   # one K tile
        v_s = async_target(cuda.shared.array(TILE_WORDS, np.uint32, alignment=ALIGN))   # one V tile
        row_i0 = i0 + warp * 16 + grp
        row_i1 = row_i0 + 8
        row_ok0, row_ok1 = row_i0 < seqlen, row_i1 < seqlen

        # 1. Q as A fragments, once: register k holds row grp + 8 (k % 2), columns 2 quad + 8 (k // 2) + {0, 1}
        q_r = cuda.local.array((K_STEPS, 4), np.uint32)
        for ks in range(K_STEPS):
            for k in range(4):
                r, d = k % 2, ks * 16 + 2 * quad + 8 * (k // 2)
                ok, i = (row_ok0, row_i0) if r == 0 else (row_ok1, row_i1)
                x0 = np.float32(query[seqstarts[b] + i, h, d]) if ok else 0.0
                x1 = np.float32(query[seqstarts[b] + i, h, d + 1]) if ok else 0.0
                q_r[ks, k] = pack_half2(x0, x1)
        max0, max1 = np.float32(-math.inf), np.float32(-math.inf)   # the rows' running maxima and sums
        sum0, sum1 = np.float32(0.0), np.float32(0.0)
        o = cuda.local.array((O_TILES, 4), np.float32)               # C fragments of O
        s = cuda.local.array((S_TILES, 4), np.float32)               # C fragments of S, then P
        for vt in range(O_TILES):
            for e in range(4):
                o[vt, e] = 0.0

        # the block's keys: up to its last row's causal limit; the tiles above it are never loaded
        hi = kvlen - seqlen + min(i0 + ROWS, seqlen)
        tiles = -(-hi // KT)
        c, key0 = tid % CHUNKS, tid // CHUNKS                        # this thread's copy column and first row
        k_row0 = cachestarts[b] * s_t + g * s_h + c * E              # its column of key 0 in the cache
        v_row0 = k_row0 + s_kv
        if tiles > 0:
            issue(k_s, cache, k_row0, s_t, 0, hi, key0, c)
        cp_async_commit()

        for j in range(tiles):
            t_tile = j * KT
            # 2. double buffer: wait for K(j), then issue V(j) to land while S is computed
            cp_async_wait(0)                                 # K(j) has landed (this thread's copies) ...
            cuda.syncthreads()                               # ... every thread's, and every warp is done with V(j-1)
            issue(v_s, cache, v_row0, s_t, t_tile, hi, key0, c)
            cp_async_commit()

            # 3. S = Q K(j)ᵀ: one ldmatrix.x4 gives the B fragments of two n-tiles of 8 keys (lanes 0-7, 8-15: a
            #    k-step's two halves of keys n0..n0+7; lanes 16-31 the same of keys n0+8..n0+15). Rows 16p + r
            #    share row r's swizzle, which moves a chunk only within its 8: so the address is one of 4 per
            #    lane plus a constant (`_at`), not one per load (each a register pair the compiler would hoist)
            for nt in range(S_TILES):
                for e in range(4):
                    s[nt, e] = 0.0
            k_row, k_chunk = lane % 8 + 8 * (lane // 16), lane // 8 % 2
            for ks in range(K_STEPS):
                for pair in range(S_TILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_at(k_s, place(k_row, 2 * (ks % 4) + k_chunk),
                                                    16 * pair * ROW_WORDS + ks // 4 * 32, ldm_scratch, warp, lane)
                    for u in range(2):
                        n, b_lo, b_hi = 2 * pair + u, (b0, b2)[u], (b1, b3)[u]
                        s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma_m16n8k16(
                            q_r[ks, 0], q_r[ks, 1], q_r[ks, 2], q_r[ks, 3], b_lo, b_hi, s[n, 0], s[n, 1], s[n, 2],
                            s[n, 3], mma_scratch, warp, lane)

            cp_async_wait(0)                                 # V(j) has landed ...
            cuda.syncthreads()                               # ... for every thread, and every warp is done with K(j)
            if j + 1 < tiles:                                # K(j + 1) lands during the softmax and P·V
                issue(k_s, cache, k_row0, s_t, t_tile + KT, hi, key0, c)
            cp_async_commit()

            # 4. scores, causal mask: element e of tile nt is row grp + 8 (e // 2), key t_tile + 8 nt + 2 quad + e % 2
            tile_max0, tile_max1 = np.float32(-math.inf), np.float32(-math.inf)
            for nt in range(S_TILES):
                for e in range(4):
                    t = t_tile + 8 * nt + 2 * quad + e % 2
                    ok, i = (row_ok0, row_i0) if e < 2 else (row_ok1, row_i1)
                    x = s[nt, e] * sm_scale if ok and t < hi and t <= kvlen - seqlen + i else np.float32(-math.inf)
                    s[nt, e] = x
                    if e < 2:
                        tile_max0 = max(tile_max0, x)
                    else:
                        tile_max1 = max(tile_max1, x)
            tile_max0, tile_max1 = quad_max2(tile_max0, tile_max1, quad_scratch, warp, lane)   # a row's 4 lanes

            # 5. online softmax: rescale what the rows hold, exponentiate the tile (a row all hidden so far: p = 0)
            new0, new1 = max(max0, tile_max0), max(max1, tile_max1)
            alpha0 = math.exp(max0 - new0) if new0 != -math.inf else np.float32(1.0)
            alpha1 = math.exp(max1 - new1) if new1 != -math.inf else np.float32(1.0)
            part0, part1 = np.float32(0.0), np.float32(0.0)
            for nt in range(S_TILES):
                for e in range(4):
                    top = new0 if e < 2 else new1
                    p = math.exp(s[nt, e] - top) if top != -math.inf else np.float32(0.0)
                    s[nt, e] = p
                    if e < 2:
                        part0 += p
                    else:
                        part1 += p
            sum0, sum1 = sum0 * alpha0 + part0, sum1 * alpha1 + part1   # this lane's columns; the quad adds at the end
            max0, max1 = new0, new1
            for vt in range(O_TILES):
                o[vt, 0] *= alpha0
                o[vt, 1] *= alpha0
                o[vt, 2] *= alpha1
                o[vt, 3] *= alpha1

            # 6. O += P V(j): S's tiles 2kk, 2kk + 1 packed are P's A fragment of keys 16kk..16kk+15; one
            #    ldmatrix.x4.trans gives V's B fragments of two n-tiles of 8 head_dim columns (addresses as in 3.)
            v_row, v_chunk = lane % 16, lane // 16
            for kk in range(KT // 16):
                a0, a1 = pack_half2(s[2 * kk, 0], s[2 * kk, 1]), pack_half2(s[2 * kk, 2], s[2 * kk, 3])
                a2, a3 = pack_half2(s[2 * kk + 1, 0], s[2 * kk + 1, 1]), pack_half2(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
                for dp in range(O_TILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans_at(v_s, place(v_row, 2 * (dp % 4) + v_chunk),
                                                          16 * kk * ROW_WORDS + dp // 4 * 32, ldm_scratch, warp, lane)
                    for u in range(2):
                        n, b_lo, b_hi = 2 * dp + u, (b0, b2)[u], (b1, b3)[u]
                        o[n, 0], o[n, 1], o[n, 2], o[n, 3] = mma_m16n8k16(
                            a0, a1, a2, a3, b_lo, b_hi, o[n, 0], o[n, 1], o[n, 2], o[n, 3], mma_scratch, warp, lane)
        cp_async_wait(0)                                     # the last (empty) group: nothing in flight at exit

        total0, total1 = quad_sum2(sum0, sum1, quad_scratch, warp, lane)
        inv0 = np.float32(1.0) / total0 if total0 > 0.0 else np.float32(0.0)   # a row that saw no key writes zeros
        inv1 = np.float32(1.0) / total1 if total1 > 0.0 else np.float32(0.0)
        for vt in range(O_TILES):
            for e in range(4):
                ok, i, inv = (row_ok0, row_i0, inv0) if e < 2 else (row_ok1, row_i1, inv1)
                if ok:
                    out[seqstarts[b] + i, h, vt * 8 + 2 * quad + e % 2] = o[vt, e] * inv

    return rung6


def attention(query, cache, cachestarts, seqstarts, kvstarts, max_seqlen, num_kv_heads, threads=128):
    """attn_output (seqstarts[B], num_heads, head_dim) of float16 `query` over the cache (head_dim 16, 32, 64 or
    128; a 16-byte aligned cache)."""
    _, num_heads, head_dim = query.shape
    warps = threads // WARP_SIZE
    kernel = build(head_dim, num_heads // num_kv_heads, warps)
    out = np.full(query.shape, np.nan, query.dtype)
    grid = (-(-max_seqlen // (16 * warps)), num_heads, len(seqstarts) - 1)
    s_t, _, s_kv, s_h, _ = (s // cache.itemsize for s in cache.strides)      # (T, 1 layer, KV, H, D) in elements
    kernel[grid, threads](query, cache.reshape(-1), cachestarts, seqstarts, kvstarts, out,
                          np.float32(1 / math.sqrt(head_dim)), s_t, s_kv, s_h)
    return out
