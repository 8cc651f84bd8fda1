"""Rung 6 of the kernel ladder: prefill in the FlashAttention-2 manner (Dao 2023, "FlashAttention-2").

Rung 5 (`_attention_mma`) gives each warp 16 query rows and stages K and V through float32 registers, 16 keys a
warp a step, four barriers a step. Here a block of `warps` warps owns 16 * warps consecutive query positions of
one query head (64 at 4 warps), each warp its own 16 rows, and all warps share K and V tiles of KEY_TILE keys
(64, FlashAttention-2's tile at head_dim 128), which go global -> shared memory untouched by registers:

    1. Q as mma A fragments, once: head_dim / 16 k-steps x 4 registers of two 16-bit values a lane, read from
       global memory as the bits they are (float16 or bfloat16 alike), kept in registers for the whole loop;
    2. K and V tiles by `cp.async` 16-byte copies (`_async_copy`), each thread the same 16-byte column of rows
       tid // chunks + n * threads / chunks; keys from `hi` on are zeros (the copy zero-fills them), so P·V never
       multiplies a zero by an unwritten value. The copies of one tile overlap the other's math, FlashAttention-2's
       order:

           wait K(j); barrier; issue V(j)    | S = Q K(j)ᵀ
           wait V(j); barrier; issue K(j+1)  | softmax, O += P V(j)

       two barriers a tile: the first also says every warp is done with V(j - 1), the second with K(j);
    3. S = Q K(j)ᵀ on the tensor cores, K's B fragments by `ldmatrix.x4` (two n-tiles of 8 keys a load);
    4. scores through the operator's `score` (bias, softcap, causal mask: its specialisation decides which are
       compiled in); the block's key range (`key_range`, the last row's causal limit) drops the tiles above the
       diagonal, and only the tiles that cross `lo` or `hi` test each key against them;
    5. the online softmax on the C fragments (a row's maximum: 16 values a lane, then the quad, `quad_max2`),
       in base 2 (one FFMA and one ex2.approx a score), P rounded to the input dtype and packed as the A
       fragments of P·V, the row sums kept in float32;
    6. O += P V(j), V's B fragments by `ldmatrix.x4.trans` (two n-tiles of head_dim a load), then O / l.

Shared memory holds one K and one V tile as 16-bit values, rows of head_dim / 8 chunks of 16 bytes. An 8x8
`ldmatrix` reads the same chunk of 8 consecutive rows: unswizzled at head_dim 128 those 8 rows start 256 bytes
apart, all in the same 4 banks. Chunk c of row r is stored at chunk c ^ f(r), f(r) = r % 8 when a row has at least
8 chunks (the 8 rows' chunks land in 8 different 16-byte bank groups: all 32 banks), and for 2 or 4 chunks a row
f(r) = (r // (8 / chunks)) % chunks, which spreads the 8 rows the same way. The copies' stores are spread alike.

Paged caches: the keys a warp copies in a tile (64 / warps) are spread over its lanes, one key a lane (two with
one warp); each lane walks its key's (page, offset) a tile at a time and reads the page table once a tile, and
each copy takes its row's slot from that lane by a shuffle (`_warp.from_lane`). A copy is then a shuffle, a
multiply-add (the source's 32-bit offsets where the host narrowed them) and `cp_async16_at`, whose shared address
is a 32-bit base plus an immediate; the divisions (the first keys' pages) happen once a thread. K and V must share
the page table and the page size (the operators' sources do): one lookup serves both tiles. Caches are
unquantized float16 or bfloat16; a quantized cache stays on rung 5.

The simulator runs every piece through its twins (`_async_copy`, `_mma`), which check that no shared byte is read
before the copy into it was waited for.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._async_copy import (
    SHARED_ALIGNMENT,
    async_target,
    cp_async16_at,
    cp_async_commit,
    cp_async_wait,
    ldmatrix_x4_at,
    ldmatrix_x4_trans_at,
    scratch_shape,
    shared_base,
)
from ._attention_core import SHARED_BYTES
from ._attention_gqa_mma import LOG2_E, exp2
from ._cache import as_offset, page_walk, slot_rows
from ._mma import (
    MMA_K,
    MMA_M,
    MMA_N,
    mma_m16n8k16,
    mma_m16n8k16_bf16,
    pack_bf162,
    pack_half2,
    quad_max2,
    quad_sum2,
    scratch_shapes,
)
from ._warp import SIMULATED, WARP_SIZE, from_lane, publish

CHUNK = 8                       # 16-bit elements in a 16-byte copy
DTYPES = ("float16", "bfloat16")
WARPS = (1, 2, 4, 8)


# head_dims the kernel takes: rows of 2, 4, 8 or 16 chunks, which the swizzle spreads. Past 128 a lane's O and Q
# fragments alone (96 + 48 registers at 192, 128 + 64 at 256) leave too few of its 255: head_dim 256 spilled 224
# bytes at sm_90, so those stay on rung 5.
HEAD_DIMS = (16, 32, 64, 128)


def key_tile(head_dim: int) -> int:
    """Keys a tile: 64, FlashAttention-2's tile at head_dim 128 (one K and one V tile: 32 KiB of shared memory)."""
    return 64


def shared_bytes(head_dim: int, warps: int) -> int:
    """Shared memory of one block: a K and a V tile of 16-bit values, and the simulator's scratch."""
    mma, quad = scratch_shapes(warps)
    slots = (warps, WARP_SIZE, 2) if SIMULATED else (1, 1, 1)          # the kernel's SLOT_SCRATCH, int64
    scratch = 4 * (math.prod(mma) + math.prod(quad) + math.prod(scratch_shape(warps))) + 8 * math.prod(slots)
    return 2 * key_tile(head_dim) * head_dim * 2 + scratch


def why_not(head_dim: int, threads: int) -> str:
    """Why the kernel cannot take this head_dim at this block size ('' when it can), naming the parameter."""
    chunks = head_dim // CHUNK
    if threads % WARP_SIZE or threads // WARP_SIZE not in WARPS:
        return f"threads: rung 6 takes blocks of {', '.join(str(32 * w) for w in WARPS)} threads, got {threads}"
    if head_dim not in HEAD_DIMS:
        return (f"head_dim: rung 6 takes a head_dim of {', '.join(map(str, HEAD_DIMS))} (a lane's registers hold "
                f"the fragments of at most 128; rung 5 takes the others), got {head_dim}")
    if threads % chunks or key_tile(head_dim) % (threads // chunks):
        return f"threads: {threads} threads do not copy whole rows of head_dim {head_dim} (rung 6)"
    if shared_bytes(head_dim, threads // WARP_SIZE) > SHARED_BYTES:
        return f"head_dim: {head_dim} needs more than {SHARED_BYTES} bytes of shared memory per block (rung 6)"
    return ""


def shared_wavefronts(head_dim: int, warps: int) -> float:
    """Shared-memory wavefronts (128 bytes each) per mma of a key tile: a warp's ldmatrix.x4 (4 wavefronts each:
    head_dim / 16 x KEY_TILE / 16 for K, as many for V) and its share of the block's cp.async stores of the K and
    V tiles, over the warp's mma (head_dim / 16 x KEY_TILE / 8 for S, KEY_TILE / 16 x head_dim / 8 for P·V). 2.5 at
    head_dim 128 and 4 warps, as rung 5's: what rung 6 saves is instructions, not shared-memory traffic."""
    kt = key_tile(head_dim)
    loads = 4 * 2 * (head_dim // MMA_K) * (kt // MMA_K)
    stores = 2 * kt * head_dim * 2 / 128 / warps
    mma = 2 * (head_dim // MMA_K) * (kt // MMA_N)
    return (loads + stores) / mma


def rows_per_block(threads: int) -> int:
    """Query positions a block holds: 16 a warp."""
    return MMA_M * (threads // WARP_SIZE)


def make_flash_attention_kernel(score, key_range, *, head_dim: int, group: int, warps: int, dtype: str):
    """Build the kernel. Launch grid (ceil(max_seqlen / (16 * warps)), num_heads, B), 32 * warps threads.

    Arguments as `_attention_core.make_attention_kernel`'s kernel, (q_geom, out_geom, seqlens, kvlens, k_src,
    v_src, score_args, sm_scale), except that the query and output arrays of the geometries are the 16-bit
    patterns (uint16 views) of float16 or bfloat16 values (`dtype`), and k_src / v_src are `_cache.CacheSource`s
    of unquantized 16-bit caches of that dtype whose rows are 16-byte aligned (`_cache.vector_loads_ok`) and
    which share one page table. score / key_range: the operator's device functions (`_attention_core`)."""
    reason = why_not(head_dim, warps * WARP_SIZE)
    if reason:
        raise ValueError(reason)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: rung 6 multiplies {' or '.join(DTYPES)}, got {dtype}")
    D, KT, THREADS = head_dim, key_tile(head_dim), warps * WARP_SIZE
    K_STEPS, S_TILES, O_TILES = D // MMA_K, KT // MMA_N, D // MMA_N
    CHUNKS = D // CHUNK                      # 16-byte chunks a row
    ROW_WORDS = D // 2                       # a row in 32-bit words
    SW = min(CHUNKS, 8)                      # chunks the swizzle permutes
    SHIFT = (8 // SW).bit_length() - 1       # rows sharing one permutation: 8 / SW
    STRIDE = THREADS // CHUNKS               # rows apart of a thread's copies
    PASSES = KT // STRIDE                    # rows a thread copies a tile
    KW = WARP_SIZE // CHUNKS                 # keys a warp copies a pass (its key0s)
    WARP_KEYS = PASSES * KW                  # keys of a tile a warp copies: 64 / warps
    LOOKUPS = -(-WARP_KEYS // WARP_SIZE)     # page-table lookups a lane makes a tile: 1, 2 with one warp
    PER_LOOKUP = min(WARP_KEYS, WARP_SIZE) // KW   # passes whose slots one lookup of the warp's lanes holds
    SLOT_SCRATCH = (warps, WARP_SIZE, 2) if SIMULATED else (1, 1, 1)   # from_lane's twin
    BF16 = dtype == "bfloat16"
    mma = mma_m16n8k16_bf16 if BF16 else mma_m16n8k16
    pack = pack_bf162 if BF16 else pack_half2
    MMA_SCRATCH, QUAD_SCRATCH = scratch_shapes(warps)
    LDM_SCRATCH = scratch_shape(warps)
    ALIGN = SHARED_ALIGNMENT
    TILE_WORDS = KT * ROW_WORDS
    f32 = np.float32
    NEG_INF = f32(-math.inf)
    LOG2E = f32(LOG2_E)

    @cuda.jit(device=True, inline="always")
    def place(row, chunk):
        """Word index of chunk `chunk` of tile row `row` (the XOR swizzle of the module docstring)."""
        return row * ROW_WORDS + (chunk ^ ((row >> SHIFT) & (SW - 1))) * 4

    @cuda.jit(device=True, inline="always")
    def lane_key(lane, warp, h):
        """The key (from a tile's first) of this lane's lookup h: lookup i = lane + 32 h of the warp's keys holds the
        row of pass i // KW of the threads whose key0 is warp * KW + i % KW (copies_from reads it there)."""
        i = (lane + WARP_SIZE * h) % WARP_KEYS
        return warp * KW + i % KW + (i // KW) * STRIDE

    @cuda.jit(device=True, inline="always")
    def lane_slot(src, b, page, offset):
        """The cache slot at (page, offset) of sequence b (`_cache.page_slot`: clamped to the last page), the page
        index unsigned 32-bit: one compare and one wide multiply-add for the table's entry."""
        last = np.uint32(src.starts.shape[1] - 1)
        return as_offset(src.starts[np.uint32(b), min(np.uint32(page), last)] + offset, src.s_t)

    def copies_from(n, whole):
        """A device function that issues this thread's copies n .. PASSES - 1 of a tile: row key0 + n * STRIDE,
        chunk c, its cache slot read from the lane that looked it up (`lane_key`, `from_lane`: a shuffle), so a
        copy is a shuffle, a multiply-add and the copy, and the page table is read once a lane a tile, not once
        a copy; zeros for keys from hi on (room: the thread's rows before key hi). One function a copy, each
        calling the next (as `scores_from`), so that n is a constant in each: its row's place in the tile, its
        lane and its test against room fold into immediates. whole (a constant): the tile ends at or before hi,
        every row is copied and none tested."""
        if n == PASSES:
            @cuda.jit(device=True, inline="always")
            def done(src, tile_s, tile_at, slot0, slot1, row_c, first, room, key0, c, kofs, slot_s, warp):
                return
            return done
        rest = copies_from(n + 1, whole)
        h = n // PER_LOOKUP                       # the lookup, and the lane's place in it, holding this row
        lane0 = (n - h * PER_LOOKUP) * KW

        @cuda.jit(device=True, inline="always")
        def copy(src, tile_s, tile_at, slot0, slot1, row_c, first, room, key0, c, kofs, slot_s, warp):
            # rows STRIDE apart share the swizzle when STRIDE is a multiple of 8: a constant step in the tile
            at = first + np.uint32(n * STRIDE * ROW_WORDS) if STRIDE % 8 == 0 else np.uint32(
                place(key0 + n * STRIDE, c))
            slot = from_lane(slot0 if h == 0 else slot1, slot_s, warp, lane0 + kofs, h)
            # rows from key hi on: zeros, by the copy itself (it reads nothing), not a branch and stores
            row = as_offset(slot * src.s_t + row_c, src.s_t)
            cp_async16_at(tile_s, tile_at, at, src.data, row, True if whole else n * STRIDE < room)
            rest(src, tile_s, tile_at, slot0, slot1, row_c, first, room, key0, c, kofs, slot_s, warp)
        return copy

    copies, copies_whole = copies_from(0, False), copies_from(0, True)

    @cuda.jit(device=True, inline="always")
    def issue(src, tile_s, tile_at, slot0, slot1, b, g, t_tile, hi, key0, c, slot_s, warp, lane):
        """This thread's copies of one tile (`copies_from`), the rows' slots those of the lanes' lookups slot0 and
        slot1 (`lane_key`) of this tile. K and V share the page table: one lookup serves both tiles."""
        publish(slot0, slot_s, warp, lane, 0)
        if LOOKUPS > 1:
            publish(slot1, slot_s, warp, lane, 1)
        row_c = as_offset(slot_rows(src, b, 0, g)[0] + c * CHUNK, src.s_t)     # slot 0's row: loop-invariant
        room = as_offset(hi - t_tile - key0, row_c)
        if t_tile + KT <= hi:                    # every tile but the last: no copy tests its row
            copies_whole(src, tile_s, tile_at, slot0, slot1, row_c, np.uint32(place(key0, c)), room, key0, c,
                         (lane // CHUNKS) % KW, slot_s, warp)
        else:
            copies(src, tile_s, tile_at, slot0, slot1, row_c, np.uint32(place(key0, c)), room, key0, c,
                   (lane // CHUNKS) % KW, slot_s, warp)

    def scores_from(nt, edge):
        """A device function that scores C tiles nt .. S_TILES - 1 of S in place and returns the rows' maxima
        over them and the maxima passed in (`tile_max0`, `tile_max1`). One function a tile, each calling the
        next, so that every index of `s` is a constant: a loop over the tiles, which the compiler leaves rolled
        (32 inlined `score`s are past its unrolling budget), would put `s` in local memory. edge (a constant: the
        kernel branches once a tile of keys, not once a score): the tile crosses lo or hi, so a key outside them
        is scored as the nearest inside (within the cache) and then hidden; else every key is in [lo, hi). Either
        way each score is unconditional, no branch around it, so what the score reads of its arguments (as
        TensorRT-LLM's past length) is read once a tile, not once a score."""
        if nt == S_TILES:
            @cuda.jit(device=True, inline="always")
            def done(s, tile_max0, tile_max1, args, sm_scale, b, h, row0, row1, t_key, lo, hi, seqlen, kvlen):
                return tile_max0, tile_max1
            return done
        rest = scores_from(nt + 1, edge)

        @cuda.jit(device=True, inline="always")
        def tile(s, tile_max0, tile_max1, args, sm_scale, b, h, row0, row1, t_key, lo, hi, seqlen, kvlen):
            for e in range(4):                   # row grp + 8 * (e // 2), key t_key + 8 * nt + e % 2
                t = np.int32(t_key + (8 * nt + e % 2))
                if edge:                         # a key outside [lo, hi) scores that of one inside, then -inf
                    x = score(args, s[nt, e] * sm_scale, b, h, row0 if e < 2 else row1, min(max(t, lo), hi - 1),
                              seqlen, kvlen)
                    x = x if lo <= t < hi else NEG_INF
                else:
                    x = score(args, s[nt, e] * sm_scale, b, h, row0 if e < 2 else row1, t, seqlen, kvlen)
                s[nt, e] = x
                if e < 2:
                    tile_max0 = max(tile_max0, x)
                else:
                    tile_max1 = max(tile_max1, x)
            return rest(s, tile_max0, tile_max1, args, sm_scale, b, h, row0, row1, t_key, lo, hi, seqlen, kvlen)
        return tile

    score_inside, score_edge = scores_from(0, False), scores_from(0, True)

    @cuda.jit
    def flash_attention_kernel(q_geom, out_geom, seqlens, kvlens, k_src, v_src, score_args, sm_scale):
        b = cuda.blockIdx.z
        seqlen, kvlen = seqlens[b], kvlens[b]
        i0 = cuda.blockIdx.x * (MMA_M * warps)
        if i0 >= seqlen:
            return                                   # block-uniform exit: no thread waits at a barrier
        h = cuda.blockIdx.y
        g = h // group
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE
        grp, quad = lane // 4, lane % 4              # PTX's groupID and threadID_in_group

        mma_scratch = cuda.shared.array(MMA_SCRATCH, np.uint32)    # simulator paths only
        quad_scratch = cuda.shared.array(QUAD_SCRATCH, f32)
        ldm_scratch = cuda.shared.array(LDM_SCRATCH, np.int32)
        k_s = async_target(cuda.shared.array(TILE_WORDS, np.uint32, alignment=ALIGN))
        v_s = async_target(cuda.shared.array(TILE_WORDS, np.uint32, alignment=ALIGN))
        k_at, v_at = shared_base(k_s), shared_base(v_s)   # 32-bit shared addresses: each copy adds a constant
        slot_s = cuda.shared.array(SLOT_SCRATCH, np.int64)  # simulator paths only

        # This lane's rows grp and grp + 8 of the warp's 16 (scalars, as every per-row value below: an array
        # indexed by a row the compiler cannot unroll would live in local memory).
        row_i0 = i0 + warp * MMA_M + grp
        row_i1 = row_i0 + 8
        row_ok0, row_ok1 = row_i0 < seqlen, row_i1 < seqlen
        # The rows the scores are asked for, 32-bit (as keys, lo, hi and the lengths there): a row past the
        # query's end (its Q is zeros, its output never written) asks for the last row's, so every score is of a
        # real (row, key) and none needs a row test.
        score_row0, score_row1 = np.int32(min(row_i0, seqlen - 1)), np.int32(min(row_i1, seqlen - 1))
        seqlen32, kvlen32 = np.int32(seqlen), np.int32(kvlen)

        # 1. Q as A fragments: register k holds row grp + 8 * (k % 2), columns 2 * quad + 8 * (k // 2) + {0, 1}
        q, q_starts, q_sb, q_si, q_sh = q_geom
        q_r = cuda.local.array((K_STEPS, 4), np.uint32)
        for ks in range(K_STEPS):
            for k in range(4):
                r, d = k % 2, ks * MMA_K + 2 * quad + 8 * (k // 2)
                word = np.uint32(0)
                if row_ok0 if r == 0 else row_ok1:
                    at = b * q_sb + (q_starts[b] + (row_i0 if r == 0 else row_i1)) * q_si + h * q_sh + d
                    word = np.uint32(q[at]) | np.uint32(q[at + 1]) << np.uint32(16)
                q_r[ks, k] = word

        max0, max1 = NEG_INF, NEG_INF                # the rows' running maxima
        sum0, sum1 = f32(0.0), f32(0.0)              # and sums, of this lane's columns only until the end
        o = cuda.local.array((O_TILES, 4), f32)      # C fragments of O
        s = cuda.local.array((S_TILES, 4), f32)      # C fragments of S, then P
        for vt in range(O_TILES):
            for e in range(4):
                o[vt, e] = 0.0

        i_last = min(i0 + MMA_M * warps, seqlen) - 1
        lo, hi = key_range(score_args, b, i0, i_last, seqlen, kvlen)
        first = lo - lo % KT
        tiles = (hi - first + KT - 1) // KT if hi > lo else 0
        lo32, hi32 = np.int32(lo), np.int32(hi)

        # 2. this thread's copy column and first row; this lane's lookups (`lane_key`): the (page, offset) of
        #    their keys in the first tile, walked a tile at a time, and their slots (a key from hi on takes the
        #    first key's slot: its copy reads nothing, but its address stays in the cache)
        c, key0 = tid % CHUNKS, tid // CHUNKS
        key_a, key_b = lane_key(lane, warp, 0), lane_key(lane, warp, LOOKUPS - 1)
        t = as_offset(first, k_src.s_t)              # the source's offset type: 32-bit divisions, once
        page_a = as_offset(t // k_src.page, k_src.s_t)
        safe = lane_slot(k_src, b, page_a, as_offset(t - page_a * k_src.page, k_src.s_t))
        t = as_offset(first + key_a, k_src.s_t)
        page_a = as_offset(t // k_src.page, k_src.s_t)
        off_a = as_offset(t - page_a * k_src.page, k_src.s_t)
        t = as_offset(first + key_b, k_src.s_t)
        page_b = as_offset(t // k_src.page, k_src.s_t)
        off_b = as_offset(t - page_b * k_src.page, k_src.s_t)
        slot_a = lane_slot(k_src, b, page_a, off_a) if first + key_a < hi else safe
        slot_b = lane_slot(k_src, b, page_b, off_b) if first + key_b < hi else safe
        if tiles > 0:
            issue(k_src, k_s, k_at, slot_a, slot_b, b, g, first, hi, key0, c, slot_s, warp, lane)
        cp_async_commit()

        for j in range(tiles):
            t_tile = first + j * KT
            cp_async_wait(0)                         # K(j) has landed (this thread's copies) ...
            cuda.syncthreads()                       # ... every thread's, and every warp is done with V(j - 1)
            issue(v_src, v_s, v_at, slot_a, slot_b, b, g, t_tile, hi, key0, c, slot_s, warp, lane)
            cp_async_commit()

            # 3. S = Q K(j)ᵀ: ldmatrix.x4 at tile rows n0 + lane % 8 + 8 * (lane // 16), chunk 2 ks + lane // 8 % 2
            #    gives b0, b1 of keys n0 .. n0 + 7 and of keys n0 + 8 .. n0 + 15 (`_async_copy` docstring). The
            #    swizzle of rows n0 + r is that of rows r (n0 is a multiple of 16) and moves a chunk within its 8:
            #    4 lane-dependent addresses (ks % 4), the rest constant offsets (`at_row`).
            for nt in range(S_TILES):
                for e in range(4):
                    s[nt, e] = 0.0
            k_row, k_chunk = (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1
            for ks in range(K_STEPS):
                for pair in range(S_TILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_at(k_s, place(k_row, 2 * (ks % 4) + k_chunk),
                                                    pair * 16 * ROW_WORDS + ks // 4 * 32, ldm_scratch, warp, lane)
                    n = 2 * pair
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma(
                        q_r[ks, 0], q_r[ks, 1], q_r[ks, 2], q_r[ks, 3], b0, b1, s[n, 0], s[n, 1], s[n, 2], s[n, 3],
                        mma_scratch, warp, lane)
                    s[n + 1, 0], s[n + 1, 1], s[n + 1, 2], s[n + 1, 3] = mma(
                        q_r[ks, 0], q_r[ks, 1], q_r[ks, 2], q_r[ks, 3], b2, b3, s[n + 1, 0], s[n + 1, 1],
                        s[n + 1, 2], s[n + 1, 3], mma_scratch, warp, lane)

            cp_async_wait(0)                         # V(j) has landed ...
            cuda.syncthreads()                       # ... for every thread, and every warp is done with K(j)
            if j + 1 < tiles:                        # K(j + 1) loads during the softmax and P·V
                page_a, off_a = page_walk(page_a, off_a, KT, k_src.page)
                slot_a = lane_slot(k_src, b, page_a, off_a) if t_tile + KT + key_a < hi else safe
                if LOOKUPS > 1:
                    page_b, off_b = page_walk(page_b, off_b, KT, k_src.page)
                    slot_b = lane_slot(k_src, b, page_b, off_b) if t_tile + KT + key_b < hi else safe
                issue(k_src, k_s, k_at, slot_a, slot_b, b, g, t_tile + KT, hi, key0, c, slot_s, warp, lane)
            cp_async_commit()

            # 4. scores; element e of C tile nt is row grp + 8 * (e // 2), key t_tile + 8 nt + 2 quad + e % 2
            t_key = np.int32(t_tile) + np.int32(2 * quad)
            if t_tile < lo or t_tile + KT > hi:
                tile_max0, tile_max1 = score_edge(s, NEG_INF, NEG_INF, score_args, sm_scale, b, h, score_row0,
                                                  score_row1, t_key, lo32, hi32, seqlen32, kvlen32)
            else:
                tile_max0, tile_max1 = score_inside(s, NEG_INF, NEG_INF, score_args, sm_scale, b, h, score_row0,
                                                    score_row1, t_key, lo32, hi32, seqlen32, kvlen32)
            tile_max0, tile_max1 = quad_max2(tile_max0, tile_max1, quad_scratch, warp, lane)

            # 5. online softmax in base 2, FlashAttention-2's: exp(x - m) = 2 ** (x log2 e - m log2 e), one FFMA
            #    and one ex2.approx a score (math.exp adds a range reduction and a branch around each). A row all
            #    hidden so far (maximum -inf) subtracts 0 instead: its -inf scores give p = 0, its alpha 0 scales
            #    zeros, and nothing is inf - inf.
            new0, new1 = max(max0, tile_max0), max(max1, tile_max1)
            top0 = new0 * LOG2E if new0 != NEG_INF else f32(0.0)
            top1 = new1 * LOG2E if new1 != NEG_INF else f32(0.0)
            alpha0, alpha1 = exp2(max0 * LOG2E - top0), exp2(max1 * LOG2E - top1)
            part0, part1 = f32(0.0), f32(0.0)
            for nt in range(S_TILES):
                for e in range(4):
                    p_ = exp2(s[nt, e] * LOG2E - (top0 if e < 2 else top1))
                    s[nt, e] = p_
                    if e < 2:
                        part0 += p_
                    else:
                        part1 += p_
            sum0, sum1 = sum0 * alpha0 + part0, sum1 * alpha1 + part1
            max0, max1 = new0, new1
            for vt in range(O_TILES):
                o[vt, 0] *= alpha0
                o[vt, 1] *= alpha0
                o[vt, 2] *= alpha1
                o[vt, 3] *= alpha1

            # 6. O += P V(j): the C tiles 2kk and 2kk + 1 of P are the A fragment of keys 16kk .. 16kk + 15;
            #    ldmatrix.x4.trans at tile rows 16kk + lane % 16, chunk 2 dp + lane // 16 gives b0, b1 of head_dim
            #    columns 16dp .. 16dp + 7 and of 16dp + 8 .. 16dp + 15
            v_row, v_chunk = lane & 15, lane >> 4
            for kk in range(KT // MMA_K):
                a0, a1 = pack(s[2 * kk, 0], s[2 * kk, 1]), pack(s[2 * kk, 2], s[2 * kk, 3])
                a2, a3 = pack(s[2 * kk + 1, 0], s[2 * kk + 1, 1]), pack(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
                for dp in range(O_TILES // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans_at(v_s, place(v_row, 2 * (dp % 4) + v_chunk),
                                                          kk * 16 * ROW_WORDS + dp // 4 * 32, ldm_scratch, warp, lane)
                    n = 2 * dp
                    o[n, 0], o[n, 1], o[n, 2], o[n, 3] = mma(a0, a1, a2, a3, b0, b1, o[n, 0], o[n, 1], o[n, 2],
                                                             o[n, 3], mma_scratch, warp, lane)
                    o[n + 1, 0], o[n + 1, 1], o[n + 1, 2], o[n + 1, 3] = mma(
                        a0, a1, a2, a3, b2, b3, o[n + 1, 0], o[n + 1, 1], o[n + 1, 2], o[n + 1, 3], mma_scratch,
                        warp, lane)
        cp_async_wait(0)                             # the last (empty) group: nothing left in flight at exit

        total0, total1 = quad_sum2(sum0, sum1, quad_scratch, warp, lane)
        # a row that saw no key writes zeros
        inv0 = f32(1.0) / total0 if total0 > 0.0 else f32(0.0)
        inv1 = f32(1.0) / total1 if total1 > 0.0 else f32(0.0)
        out, o_starts, o_sb, o_si, o_sh = out_geom
        at0 = b * o_sb + (o_starts[b] + row_i0) * o_si + h * o_sh + 2 * quad
        at1 = at0 + 8 * o_si
        for vt in range(O_TILES):
            for r in range(2):
                if row_ok0 if r == 0 else row_ok1:
                    inv = inv0 if r == 0 else inv1
                    word = pack(o[vt, 2 * r] * inv, o[vt, 2 * r + 1] * inv)
                    at = (at0 if r == 0 else at1) + vt * MMA_N
                    out[at] = np.uint16(word & np.uint32(0xFFFF))
                    out[at + 1] = np.uint16(word >> np.uint32(16))

    return flash_attention_kernel


def fit(shape, threads: int):
    """Rung 6's answer for a call (`_fit.RungFit`, variant "flash"): a float16 or bfloat16 query on an unquantized
    cache of the same dtype, a head_dim and block size `why_not` accepts; the grid is ceil(longest query / 16 a
    warp) x query heads x sequences, KEY_TILE keys a block a step."""
    from ._fit import RungFit

    dtype = np.dtype(shape.query_dtype)
    reason = why_not(shape.head_dim, threads)
    if not reason and dtype.name not in DTYPES:
        reason = f"rung: 6 (tensor cores, float16 or bfloat16 mma) needs a float16 or bfloat16 query, got {dtype.name}"
    if not reason and (shape.quant_bit or np.dtype(shape.cache_dtype) != dtype):
        reason = (f"rung: 6 copies 16-bit caches as they are; this cache is "
                  f"{f'int{shape.quant_bit}' if shape.quant_bit else np.dtype(shape.cache_dtype).name} (rung 5 "
                  f"dequantizes)")
    if reason:
        return RungFit(6, "flash", threads, False, reason)
    rows = rows_per_block(threads)
    blocks = math.ceil(max(shape.max_query_len, 1) / rows) * shape.num_heads * shape.batch
    return RungFit(6, "flash", threads, True, blocks=max(blocks, 1), heads_per_block=1, positions=rows,
                   row_tiles=threads // WARP_SIZE, keys_per_step=key_tile(shape.head_dim),
                   shared_bytes=shared_bytes(shape.head_dim, threads // WARP_SIZE))
