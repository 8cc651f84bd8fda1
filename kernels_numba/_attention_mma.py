"""Rung 5 of the kernel ladder: Q·Kᵀ and P·V on tensor cores (`mma.sync.m16n8k16`), FlashAttention-2 style.

A warp owns a tile of 16 query rows (query heads of one GQA group times consecutive query positions, padded
to 16 with empty rows: in decode a group of 4 heads fills 4 of them, TensorRT-LLM's XQA trick) and walks the
keys in tiles of 16. The lane layout of every fragment is `_mma`'s (PTX ISA 9.7.14.5.8); with
grp = lane >> 2 and quad = lane % 4, a lane's C fragment elements are rows grp and grp + 8, columns
2 * quad + {0, 1} of the 16x8 tile:

    1. Q as A fragments, once per row tile: head_dim / 16 k-steps x 4 registers of two float16 each. For float16
       and int8 caches (`q_registers`) they stay in registers, 32 a lane at head_dim 128 beside O's 64; for an
       int4 cache, whose staging unpacks 32 elements a chunk, the launcher keeps them in shared memory (one word
       per lane, no bank conflicts), read again for every key tile;
    2. S = Q Kᵀ in two 16x8 C tiles (keys t0..t0+7, t0+8..t0+15), head_dim / 16 mma each. The block first copies
       the K rows of every warp's key tile into shared memory together (`load_chunk`: 16-byte loads when the
       launcher found the rows aligned, consecutive lanes on consecutive chunks of a row, so every sector a warp
       touches is used whole), dequantized and packed to float16 pairs, so K is read from global memory once per
       block rather than once per warp. Rows are padded by 4 words: K's B fragment, the words
       (key t0 + grp, 2 * quad + {0, 1}) and (.., + {8, 9}) per k-step, then hits 32 different banks. The lanes
       whose chunks start in the same bank store their words in different orders (word j ^ m at the j-th store,
       m the lane's rank among them, `store_masks`), so a warp's stores hit 32 banks too; the permutation is done
       on registers with selects (`swizzle`, one round a bit of m), since indexing by m would move the chunk,
       and an address per word, into local memory;
    3. scores through the operator's `score` (-inf outside [lo, hi) and for empty rows), then the online
       softmax on the fragments: a row's maximum over its 16 keys is the max over the 4 lanes of a quad
       (`quad_max2`); each lane keeps the partial row sum of its own columns (summed over the quad at the end);
    4. P stays in registers: the two C tiles of S *are* the A fragment of P·V (row grp, columns 2 * quad + {0, 1}
       of the first tile, row grp + 8 of it, then the same of the second: registers 0..3), packed to float16;
    5. O += P V over head_dim / 8 C tiles, V staged in the same buffer as K was, transposed in pairs of keys:
       V's B fragment, V[key t0 + 2 * quad + {0, 1}][grp] and V[.. + {8, 9}][grp], is then two shared words;
    6. the block's warps that share a row tile but walked different keys (decode: few rows, many keys) merge
       their (m, l, O) pairwise through shared memory with the multi-block rule; the first writes O / l.

What bounds it is shared memory: per warp and 16-key tile at head_dim 128 there are 16 mma for S and 16 for P·V,
and the shared-memory wavefronts they need are K's B fragments (16 x 2), V's (16 x 2) and the K and V staging
stores (2 x 4 KB / 128 bytes, shared by the 4 warps of a 128-thread prefill block: 16), 80 for 32 mma: 2.5 a mma.
Reading Q's A fragments from shared memory adds 8 x 4 = 32 (3.5 a mma, the int4 kernel). Every fragment read
indexes the stage with an unsigned offset: numba wraps negative signed indices, and that select kept each of the
64 reads' addresses in its own register for the whole key loop.

K and V come through the operator's `row_offsets` / `load_chunk` device functions, dequantized, as float32
values and are rounded to float16 for the mma. For a float16 query (the only dtype this rung takes) the document's
dequantized K/V are float16 tensors already (`load` rounds q * scale to the output dtype), so the rounding is
exact for float16, int8 and int4 caches alike; what the tensor cores do not reproduce is the float32
accumulation order and P, which is rounded to float16 before P·V (as in FlashAttention-2) while its sum l is
kept in float32. head_dim need not be a multiple of 16: fragments past it are zero (wasted tensor-core work
for head_dim 8 or 24, none for 64 or 128).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._attention_core import SHARED_BYTES
from ._mma import MMA_K, MMA_M, MMA_N, mma_m16n8k16, pack_half2, quad_max2, quad_sum2, scratch_shapes
from ._warp import WARP_SIZE

KEY_TILE = 16            # keys per step: one k16 of P·V, two n8 tiles of S


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def plan_mma_rows(num_heads: int, num_kv_heads: int, max_seqlen: int, warps: int, head_dim: int):
    """(heads_per_block, positions_per_tile, row_tiles): a row tile is positions_per_tile query positions of
    heads_per_block heads of one GQA group (<= 16 rows); the block's warps cover row_tiles tiles and split
    the keys warps / row_tiles ways, so decode (one row tile) still keeps every warp busy. The row tiles the
    query positions need, or the nearest count whose shared memory fits: more row tiles hold more Q fragments,
    more key splits stage more keys and merge more (some count always fits: check_fits)."""
    heads_per_block = _largest_divisor_at_most(num_heads // num_kv_heads, MMA_M)
    positions = MMA_M // heads_per_block
    wanted = _largest_divisor_at_most(warps, -(-max(max_seqlen, 1) // positions))
    return heads_per_block, positions, min(_fitting_row_tiles(head_dim, warps), key=lambda d: (abs(d - wanted), d))


def _fitting_row_tiles(head_dim: int, warps: int) -> list:
    """Row-tile counts (divisors of warps) whose block fits the shared memory; extra row tiles past the query
    positions hold empty rows, which the kernel skips."""
    return [d for d in range(1, warps + 1) if warps % d == 0 and shared_bytes(head_dim, head_dim, warps, d)
            <= SHARED_BYTES] or [1]


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def q_shape(head_dim_k: int, row_tiles: int) -> tuple:
    """Shared uint32 array of the Q fragments: per row tile, k-step and register, one word per lane (lane last:
    a warp's 32 reads of one register hit 32 banks). Registers would cost ~40 of the 255 a lane has (int8
    caches spilled)."""
    return row_tiles, _padded(head_dim_k, MMA_K) // MMA_K, 4, WARP_SIZE


def merge_shape(head_dim_v: int, warps: int, row_tiles: int) -> tuple:
    """Shared float32 array for the warps' pairwise merge: per slot (a warp handing its state to its partner),
    each lane's m and l of its two rows and its O fragments, lane last (a warp's 32 words of one value fall in 32
    banks); one element when the keys are not split."""
    splits = warps // row_tiles
    if splits == 1:
        return 1, 1, 1
    return row_tiles * (splits // 2), 4 + _padded(head_dim_v, MMA_N) // 2, WARP_SIZE


def stage_shape(head_dim_k: int, head_dim_v: int, warps: int, row_tiles: int) -> tuple:
    """(keys, words): the shared uint32 buffer that holds the K, then the V, of the block's key tiles (every warp's
    tile) as float16 pairs, keys x (words + 4) of them. K: one row per key, `words` = head_dim / 2 pairs of
    neighbouring elements, padded by 4 words (a row starts 4 banks after the one above, so the 8 rows x 4 words of
    a K fragment read fall in 32 banks). V: one row per two keys, 2 x words pairs (key 2k, key 2k + 1) of one
    element, padded by 8 (a V fragment read, 4 rows x 8 words, likewise in 32 banks): the same size."""
    return (warps // row_tiles) * KEY_TILE, max(_padded(head_dim_k, MMA_K), _padded(head_dim_v, MMA_N)) // 2


def shared_bytes(head_dim_k: int, head_dim_v: int, warps: int, row_tiles: int) -> int:
    """Shared memory of one block: Q fragments, the K/V stage, the merge slots, the simulator's scratch (4-byte
    words)."""
    keys, words = stage_shape(head_dim_k, head_dim_v, warps, row_tiles)
    shapes = (q_shape(head_dim_k, row_tiles), (keys, words + 4),
              merge_shape(head_dim_v, warps, row_tiles), *scratch_shapes(warps))
    return 4 * sum(math.prod(shape) for shape in shapes)


def store_masks(row_words: int, chunk_words: int, chunks: int) -> tuple:
    """(masks, rounds) for the stores of one stage: a warp's lane l first stages chunk l % chunks of row
    l // chunks (rows of row_words words, chunks of chunk_words, a power of two, so j ^ masks[l] stays in the
    chunk), and stores its word j ^ masks[l] at its j-th store. masks[l] is the lane's rank among the lower lanes
    whose chunk starts in the same bank, so the lanes of one start bank store different words at once; at head_dim
    128 every start bank is a multiple of 2 ** rounds, and a warp's stores fall in 32 banks. rounds: the bits of
    the largest mask (the selects `swizzle` needs)."""
    seen, masks = {}, []
    for lane in range(WARP_SIZE):
        bank = (lane // chunks * row_words + lane % chunks * chunk_words) % WARP_SIZE
        masks.append(seen.get(bank, 0) % chunk_words)
        seen[bank] = seen.get(bank, 0) + 1
    return np.array(masks, np.int32), max(masks).bit_length()


def check_fits(head_dim: int, warps: int) -> None:
    """ValueError naming head_dim unless a plan of this many warps fits the shared memory: some split of the warps
    into row tiles (the launchers call this before anything runs)."""
    if shared_bytes(head_dim, head_dim, warps, _fitting_row_tiles(head_dim, warps)[0]) > SHARED_BYTES:
        raise ValueError(f"head_dim: {head_dim} needs more than {SHARED_BYTES} bytes of shared memory per block "
                         f"with {warps} warps in the rung-5 kernel (fewer threads fit)")


def make_mma_attention_kernel(row_offsets, load_chunk, score, key_range, *, head_dim_k: int, head_dim_v: int,
                              chunk: int, heads_per_block: int, positions: int, row_tiles: int, group: int, warps: int,
                              q_registers: bool = False):
    """Build the kernel. Launch grid (ceil(max_seqlen / (positions * row_tiles)), num_heads / heads_per_block, B),
    32 * warps threads; arguments as `_attention_core.make_attention_kernel`'s kernel (float16 query).
    load_chunk: `_cache.make_chunk_load`'s device function for `chunk` elements (one 16-byte piece of a row).
    q_registers: keep Q's A fragments in registers (head_dim / 4 per lane) instead of shared memory, which saves
    4 wavefronts per k-step and key tile; for the caches whose K/V loads leave the registers for it."""
    HPB, DK, DV, WARPS, RT = heads_per_block, head_dim_k, head_dim_v, warps, row_tiles
    SPLITS = WARPS // RT                        # warps per row tile, each on its own share of the key tiles
    K_STEPS = _padded(DK, MMA_K) // MMA_K       # k16 steps of Q·Kᵀ
    V_TILES = _padded(DV, MMA_N) // MMA_N       # n8 tiles of O
    ROWS = HPB * positions                      # real rows of a tile (<= 16)
    q_tile = positions * RT
    if shared_bytes(DK, DV, WARPS, RT) > SHARED_BYTES:
        raise ValueError(f"head_dim: {DK}/{DV} needs more than {SHARED_BYTES} bytes of shared memory per block "
                         f"with {WARPS} warps and {RT} row tiles in the rung-5 kernel")
    MMA_SCRATCH, QUAD_SCRATCH = scratch_shapes(WARPS)
    MERGE = merge_shape(DV, WARPS, RT)
    # Q's fragments in registers (K_STEPS x 4 per lane) or in shared memory; the other holds one dummy element.
    # Registers save 4 wavefronts per k-step and key tile (3.5 -> 2.5 wavefronts per mma at head_dim 128).
    # The plan counts Q's shared memory either way (shared_bytes), so a kernel of either kind fits it.
    Q_IN_REGISTERS = q_registers
    Q_FRAGMENTS = (1, 1, 1, 1) if q_registers else q_shape(DK, RT)
    Q_REGISTERS = K_STEPS if q_registers else 1
    KEYS, WORDS = stage_shape(DK, DV, WARPS, RT)  # keys staged per step (every warp's tile); pairs of a K row
    K_ROW, V_ROW = WORDS + 4, 2 * WORDS + 8        # padded rows of the stage, in words: one key / two keys
    STAGE_WORDS = KEYS * K_ROW                     # = KEYS // 2 * V_ROW
    PIECE = 2 * chunk                              # a thread's chunk of two keys (stage_v), dequantized
    CHUNKS = -(-2 * WORDS // chunk)                # chunks a row is copied in
    THREADS = WARPS * WARP_SIZE
    # Lanes store their chunk's words in lane-dependent orders, or a warp's stores would pile into a few banks;
    # at head_dim 128 these spread the 32 lanes over 32 banks for every format in 2 rounds of selects for K and 3
    # for V (a rotation by the lane took a round a bit of the chunk's words: 5 of 32 for int4's V).
    K_MASKS, K_ROUNDS = store_masks(K_ROW, chunk // 2, CHUNKS)
    V_MASKS, V_ROUNDS = store_masks(V_ROW, chunk, CHUNKS)
    f32 = np.float32
    NEG_INF = f32(-math.inf)

    @cuda.jit(device=True, inline="always")
    def swizzle(words, spare, n, rounds, mask):
        """words[j] <- words[j ^ mask] for j < n (mask < 2 ** rounds <= n): a round of selects at fixed indices
        per bit, which keeps both arrays in registers (reading words[j ^ mask] would put them, and an address
        per j, in local memory). A round swaps words j and j ^ bit or not, pair by pair, so it holds two words
        beyond the chunk; a rotation's words[(j + by) % n] holds up to n / 2 more, which spilled int4's V
        (32 words) in the prefill."""
        for bit in range(rounds):
            take = mask >> bit & 1
            for j in range(n):
                spare[j] = words[j ^ (1 << bit)] if take else words[j]
            for j in range(n):
                words[j] = spare[j]

    @cuda.jit(device=True, inline="always")
    def stage_k(src, kv_s, piece, words, spare, b, t_stage, hi, g, tid):
        """The block copies K of keys t_stage .. t_stage + KEYS - 1 (kv head g) into kv_s, row key, word w = the
        elements 2w, 2w + 1; elements past head_dim and keys from hi on are zeros. Thread tid takes chunks tid,
        tid + THREADS, ...: a warp's 32 chunks lie side by side in a row (or run on into the next), so its loads
        cover whole sectors."""
        for at in range(tid, KEYS * CHUNKS, THREADS):
            key, c = at // CHUNKS, at % CHUNKS
            t = t_stage + key
            for e in range(chunk):
                piece[e] = 0.0
            if t < hi and c * chunk < DK:
                row, sc_row = row_offsets(src, b, t, g)
                load_chunk(src, row, sc_row, c * chunk, piece, 0, DK)
            for j in range(chunk // 2):
                words[j] = pack_half2(piece[2 * j], piece[2 * j + 1])
            mask = K_MASKS[tid % WARP_SIZE]
            swizzle(words, spare, chunk // 2, K_ROUNDS, mask)
            for j in range(chunk // 2):
                w = c * (chunk // 2) + (j ^ mask)
                if w < WORDS:
                    kv_s[key * K_ROW + w] = words[j]

    @cuda.jit(device=True, inline="always")
    def stage_v(src, kv_s, piece, words, spare, b, t_stage, hi, g, tid):
        """The block copies V of the same keys into kv_s transposed in pairs: row k, word d = the elements d of
        keys 2k and 2k + 1, which is what a B fragment register of P·V holds. A thread loads one chunk of both
        keys; a warp's first loads cover 16 chunks of one row and 16 of the row two keys on, whole sectors."""
        for at in range(tid, KEYS // 2 * CHUNKS, THREADS):
            k, c = at // CHUNKS, at % CHUNKS
            for e in range(2 * chunk):
                piece[e] = 0.0
            for u in range(2):
                t = t_stage + 2 * k + u
                if t < hi and c * chunk < DV:
                    row, sc_row = row_offsets(src, b, t, g)
                    load_chunk(src, row, sc_row, c * chunk, piece, u * chunk, DV)
            for j in range(chunk):
                words[j] = pack_half2(piece[j], piece[chunk + j])
            mask = V_MASKS[tid % WARP_SIZE]
            swizzle(words, spare, chunk, V_ROUNDS, mask)
            for j in range(chunk):
                d = c * chunk + (j ^ mask)
                if d < 2 * WORDS:
                    kv_s[k * V_ROW + d] = words[j]

    @cuda.jit
    def mma_attention_kernel(q_geom, out_geom, seqlens, kvlens, k_src, v_src, score_args, sm_scale):
        b = cuda.blockIdx.z
        seqlen, kvlen = seqlens[b], kvlens[b]
        i0 = cuda.blockIdx.x * q_tile
        if i0 >= seqlen:
            return                                   # block-uniform exit: no thread waits at a barrier
        h0 = cuda.blockIdx.y * HPB
        g = h0 // group                              # the kv head of every row of this block
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE
        tile, split = warp % RT, warp // RT          # this warp's row tile and share of the keys
        grp, quad = lane // 4, lane % 4              # PTX's groupID and threadID_in_group

        mma_scratch = cuda.shared.array(MMA_SCRATCH, np.uint32)     # simulator paths only
        quad_scratch = cuda.shared.array(QUAD_SCRATCH, f32)
        merge = cuda.shared.array(MERGE, f32)
        q_s = cuda.shared.array(Q_FRAGMENTS, np.uint32)
        kv_s = cuda.shared.array(STAGE_WORDS, np.uint32)
        piece = cuda.local.array(PIECE, f32)
        words = cuda.local.array(chunk, np.uint32)   # a staged chunk's float16 pairs, permuted (`swizzle`)
        spare = cuda.local.array(chunk, np.uint32)

        # This lane's two rows, grp and grp + 8 of the tile: query position, head, and whether they exist.
        row_i = cuda.local.array(2, np.int64)
        row_h = cuda.local.array(2, np.int64)
        row_ok = cuda.local.array(2, np.bool_)
        for r in range(2):
            rr = grp + 8 * r
            row_i[r] = i0 + tile * positions + rr // HPB
            row_h[r] = h0 + rr % HPB
            row_ok[r] = rr < ROWS and row_i[r] < seqlen

        # 1. Q as A fragments, once per row tile: register k holds row grp + 8 * (k % 2), columns
        #    2 * quad + 8 * (k // 2) + {0, 1}. In registers (q_r) every warp loads its own tile's; in shared
        #    memory the first warp of the tile stores them for the others.
        q, q_starts, q_sb, q_si, q_sh = q_geom
        q_r = cuda.local.array((Q_REGISTERS, 4), np.uint32)
        if Q_IN_REGISTERS or split == 0:
            for ks in range(K_STEPS):
                for k in range(4):
                    r, d = k % 2, ks * MMA_K + 2 * quad + 8 * (k // 2)
                    x0, x1 = f32(0.0), f32(0.0)
                    if row_ok[r]:
                        at = b * q_sb + (q_starts[b] + row_i[r]) * q_si + row_h[r] * q_sh + d
                        if d < DK:
                            x0 = f32(q[at])
                        if d + 1 < DK:
                            x1 = f32(q[at + 1])
                    if Q_IN_REGISTERS:
                        q_r[ks, k] = pack_half2(x0, x1)
                    else:
                        q_s[tile, ks, k, lane] = pack_half2(x0, x1)
        cuda.syncthreads()

        row_max = cuda.local.array(2, f32)
        row_sum = cuda.local.array(2, f32)           # this lane's columns only, until the end
        o = cuda.local.array((V_TILES, 4), f32)      # C fragments of O
        for r in range(2):
            row_max[r] = NEG_INF
            row_sum[r] = 0.0
        for vt in range(V_TILES):
            for e in range(4):
                o[vt, e] = 0.0
        s = cuda.local.array((2, 4), f32)            # C fragments of S (keys t0.., t0+8..), then P
        tile_max = cuda.local.array(2, f32)

        i_last = min(i0 + q_tile, seqlen) - 1
        lo, hi = key_range(score_args, b, i0, i_last, seqlen, kvlen)
        first = lo - lo % KEY_TILE
        tiles = -(-(hi - first) // KEY_TILE) if hi > lo else 0
        for step in range(-(-tiles // SPLITS)):      # the same count in every warp: the simulator's barriers
            t_stage = first + step * KEYS            # the block's keys this step; this warp's tile starts at t0
            t0 = t_stage + split * KEY_TILE
            kv = split * KEY_TILE                    # the stage row of key t0
            # 2. S = Q Kᵀ, K staged first (keys at or past hi are zeros, and masked below)
            stage_k(k_src, kv_s, piece, words, spare, b, t_stage, hi, g, tid)
            cuda.syncthreads()
            for nt in range(2):
                for e in range(4):
                    s[nt, e] = 0.0
            for ks in range(K_STEPS):                # unsigned stage offsets: see the module docstring
                if Q_IN_REGISTERS:
                    a0, a1, a2, a3 = q_r[ks, 0], q_r[ks, 1], q_r[ks, 2], q_r[ks, 3]
                else:
                    a0, a1 = q_s[tile, ks, 0, lane], q_s[tile, ks, 1, lane]
                    a2, a3 = q_s[tile, ks, 2, lane], q_s[tile, ks, 3, lane]
                for nt in range(2):
                    at = np.uint64((kv + 8 * nt + grp) * K_ROW + ks * 8 + quad)
                    s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3] = mma_m16n8k16(
                        a0, a1, a2, a3, kv_s[at], kv_s[at + np.uint64(4)],
                        s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3], mma_scratch, warp, lane)
            # 3. scores and the online softmax; element e of a C tile is row grp + 8 * (e // 2), key 2 * quad + e % 2
            for r in range(2):
                tile_max[r] = NEG_INF
                for nt in range(2):
                    for c in range(2):
                        t = t0 + 8 * nt + 2 * quad + c
                        x = NEG_INF
                        if row_ok[r] and lo <= t < hi:
                            x = score(score_args, s[nt, 2 * r + c] * sm_scale, b, row_h[r], row_i[r], t, seqlen,
                                      kvlen)
                        s[nt, 2 * r + c] = x
                        tile_max[r] = max(tile_max[r], x)
            top0, top1 = quad_max2(tile_max[0], tile_max[1], quad_scratch, warp, lane)
            tile_max[0], tile_max[1] = top0, top1
            for r in range(2):
                new_max = max(row_max[r], tile_max[r])
                alpha = f32(1.0)
                if new_max != NEG_INF:               # all hidden so far: nothing to rescale, p = 0
                    alpha = math.exp(row_max[r] - new_max)
                part = f32(0.0)
                for nt in range(2):
                    for c in range(2):
                        p = f32(0.0)
                        if new_max != NEG_INF:
                            p = math.exp(s[nt, 2 * r + c] - new_max)
                        s[nt, 2 * r + c] = p
                        part += p
                row_sum[r] = row_sum[r] * alpha + part
                row_max[r] = new_max
                for vt in range(V_TILES):
                    o[vt, 2 * r] *= alpha
                    o[vt, 2 * r + 1] *= alpha
            # 4. P as the A fragment of P·V: the two S tiles side by side are a 16x16 tile in the A layout
            p0, p1 = pack_half2(s[0, 0], s[0, 1]), pack_half2(s[0, 2], s[0, 3])
            p2, p3 = pack_half2(s[1, 0], s[1, 1]), pack_half2(s[1, 2], s[1, 3])
            # 5. O += P V, V staged where K was once every warp is done with K; this lane's B registers are keys
            #    2 * quad + {0, 1} and 2 * quad + {8, 9} of the tile, column grp: two words of the V stage
            cuda.syncthreads()
            stage_v(v_src, kv_s, piece, words, spare, b, t_stage, hi, g, tid)
            cuda.syncthreads()
            for vt in range(V_TILES):
                at = np.uint64((kv // 2 + quad) * V_ROW + vt * MMA_N + grp)
                o[vt, 0], o[vt, 1], o[vt, 2], o[vt, 3] = mma_m16n8k16(
                    p0, p1, p2, p3, kv_s[at], kv_s[at + np.uint64(4 * V_ROW)], o[vt, 0], o[vt, 1], o[vt, 2], o[vt, 3],
                    mma_scratch, warp, lane)
            cuda.syncthreads()                       # every warp is done with V before the next K lands

        # 6. warps of one row tile merge pairwise: split s + stride into split s, lane by lane (same layout)
        stride = 1
        while stride < SPLITS:
            cuda.syncthreads()
            slot = tile * (SPLITS // 2) + split // (2 * stride)
            if split % (2 * stride) == stride:
                for r in range(2):
                    merge[slot, r, lane] = row_max[r]
                    merge[slot, 2 + r, lane] = row_sum[r]
                for vt in range(V_TILES):
                    for e in range(4):
                        merge[slot, 4 + 4 * vt + e, lane] = o[vt, e]
            cuda.syncthreads()
            if split % (2 * stride) == 0 and split + stride < SPLITS:
                for r in range(2):
                    other = merge[slot, r, lane]
                    top = max(row_max[r], other)
                    if top != NEG_INF:
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
            out, o_starts, o_sb, o_si, o_sh = out_geom
            for r in range(2):
                total = total0 if r == 0 else total1
                if row_ok[r]:
                    at = b * o_sb + (o_starts[b] + row_i[r]) * o_si + row_h[r] * o_sh
                    for vt in range(V_TILES):
                        for c in range(2):
                            d = vt * MMA_N + 2 * quad + c
                            if d < DV:
                                out[at + d] = o[vt, 2 * r + c] / total if total > 0.0 else f32(0.0)

    return mma_attention_kernel


def fit(shape, threads: int):
    """Rung 5's answer for a call on this kernel (`_fit.RungFit`, variant "staged"): `check_fits` and
    `plan_mma_rows` at `threads // 32` warps, as the launchers call them, the grid they size, KEY_TILE keys a warp
    of a row tile a step. fits=False with the launcher's ValueError text for a block size that is not whole warps,
    a query that is not float16 (mma.sync multiplies float16), or a head_dim whose tiles do not fit the shared
    memory at this many warps."""
    from ._fit import RungFit, whole_warps

    refused = whole_warps(5, "staged", threads)
    if refused:
        return refused
    if np.dtype(shape.query_dtype) != np.float16:
        return RungFit(5, "staged", threads, False, f"rung: 5 (tensor cores, mma.sync on float16) needs a float16 "
                                                    f"query, got {np.dtype(shape.query_dtype).name}")
    rows, warps = max(shape.max_query_len, 1), threads // WARP_SIZE
    try:
        check_fits(shape.head_dim, warps)
    except ValueError as e:
        return RungFit(5, "staged", threads, False, str(e))
    heads_per_block, positions, row_tiles = plan_mma_rows(shape.num_heads, shape.num_kv_heads, rows, warps,
                                                          shape.head_dim)
    blocks = math.ceil(rows / (positions * row_tiles)) * (shape.num_heads // heads_per_block) * shape.batch
    return RungFit(5, "staged", threads, True, blocks=max(blocks, 1), heads_per_block=heads_per_block,
                   positions=positions * row_tiles, row_tiles=row_tiles, keys_per_step=KEY_TILE * (warps // row_tiles),
                   shared_bytes=shared_bytes(shape.head_dim, shape.head_dim, warps, row_tiles))
