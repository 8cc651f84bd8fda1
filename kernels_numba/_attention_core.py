"""The one online-softmax attention loop that every decode/prefill kernel is made from.

A block owns ROWS query rows that share one kv head: `heads_per_block` query heads
of one GQA group times `q_tile` consecutive query positions. It walks the keys in
tiles of KEY_TILE:

    1. slot offsets of the tile's keys           (one page-table lookup per key, not per element)
    2. K and V tile -> shared memory, float32     (dequantized on the fly; each element read once
                                                   per block, so once per GQA group: the XQA idea)
    3. scores S[r, j] = q_r . k_j * scale (+ bias) for all rows r, keys j of the tile
    4. online softmax, one thread per row: m' = max(m, max_j S), alpha = e^(m - m'),
       p_j = e^(S[r, j] - m'), l = alpha * l + sum_j p_j
    5. acc[r, :] = alpha * acc[r, :] + sum_j p_j v_j   (acc_rows)
and finally writes acc / l (0 for a row that saw no key). No seqlen x kvlen score
matrix and no gathered copy of K/V ever exists in global memory.

What differs between operators is passed in as device functions:
    row_offsets(src, b, t, h) -> (row, scale_row)   where key t of sequence b, kv head h lives
    load(src, row, scale_row, d) -> float           element d of that row, dequantized
    score(args, qk, b, h, i, j, seqlen, kvlen)      the logit of query i (head h) for key j, given
                                                    qk = scale * q.k: softcap, bias, -inf for hidden
    key_range(args, b, i_first, i_last, seqlen, kvlen) -> (lo, hi)   keys any of these rows can see
Everything block-uniform (head dims, tile sizes, group, the accumulation dtype: float32, or float64
for float64 inputs) is a compile-time constant of the factory.

Query and output are flat arrays with geometry (data, starts, s_b, s_i, s_h): element d of
query i, head h, sequence b is at b*s_b + (starts[b] + i)*s_i + h*s_h + d.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

SHARED_BYTES = 48 * 1024   # static shared memory a block may declare


def shared_bytes(rows: int, key_tile: int, head_dim_k: int, head_dim_v: int, elem_bytes: int = 4) -> int:
    """Shared memory of one block: K, V tiles, Q rows, scores, accumulators, row stats, slot offsets."""
    floats = key_tile * (head_dim_k + head_dim_v) + rows * (head_dim_k + key_tile + head_dim_v + 3)
    return elem_bytes * floats + 8 * 4 * key_tile


def plan_tiles(num_heads: int, num_kv_heads: int, max_seqlen: int, head_dim_k: int, head_dim_v: int,
               elem_bytes: int = 4):
    """(heads_per_block, q_tile, key_tile) that fit the shared-memory budget.

    A whole GQA group per block when it fits, so each K/V element is read once per group;
    prefill adds query positions until a block has about 16 rows.
    """
    group = num_heads // num_kv_heads
    heads_per_block = group
    while heads_per_block > 16 and heads_per_block % 2 == 0:
        heads_per_block //= 2
    q_tile = 1 if max_seqlen <= 1 else max(1, min(16 // heads_per_block, max_seqlen))
    key_tile = 32
    def fits():
        return shared_bytes(heads_per_block * q_tile, key_tile, head_dim_k, head_dim_v, elem_bytes) <= SHARED_BYTES

    while key_tile > 8 and not fits():
        key_tile //= 2
    while q_tile > 1 and not fits():
        q_tile //= 2
    while heads_per_block % 2 == 0 and not fits():     # large head_dim with a wide group: split the group
        heads_per_block //= 2
    if not fits():
        raise ValueError(f"head_dim: {head_dim_k}/{head_dim_v} needs more than {SHARED_BYTES} bytes of shared "
                         "memory per block in this kernel")
    return heads_per_block, q_tile, key_tile


def split_keys(split, num_splits, kvlen, key_tile):
    """Keys [lo, hi) that multi-block split `split` of `num_splits` walks: whole key tiles, ceil(tiles / num_splits)
    of them per split, so no tile is loaded by two blocks. Splits past the last key get lo = hi = kvlen (no keys).
    Plain integer code: the host (the docs drawing, the tests) calls it as it is, kernels as split_keys_device."""
    tiles = (kvlen + key_tile - 1) // key_tile
    chunk = (tiles + num_splits - 1) // num_splits * key_tile      # keys per split, a multiple of key_tile
    lo = min(split * chunk, kvlen)
    return lo, min(lo + chunk, kvlen)


split_keys_device = cuda.jit(device=True, inline="always")(split_keys)


@cuda.jit(device=True, inline="always")
def _as_is(x):
    return x


def make_attention_kernel(row_offsets, load, score, key_range, *, head_dim_k: int, head_dim_v: int,
                          heads_per_block: int, q_tile: int, key_tile: int, group: int, acc_dtype=np.float32,
                          sum_epsilon: float = 0.0, partials: bool = False, widen_q=None, narrow_out=None):
    """Build the kernel. Launch grid (ceil(max_seqlen / q_tile), num_heads / heads_per_block, B).

    sum_epsilon: the final division is acc / (l + sum_epsilon) (FasterTransformer's 1 / (sum + 1e-6));
    0.0 leaves acc / l exactly.
    partials (multi-block): out_geom is (out, starts, s_b, s_i, s_h, num_splits, split_stride, split_rows,
    num_heads, m_out, l_out) and grid z = B * num_splits. Block z walks only split z % num_splits of sequence
    z // num_splits's keys (`split_keys`: whole key tiles, so no two blocks load one) and writes each row's
    unnormalised acc at element offset split * split_stride of out, its max m and sum l at split * split_rows +
    (starts[b] + i) * num_heads + h of m_out / l_out (a split with no visible key writes m = -inf, l = 0, o = 0);
    a combine kernel finishes the softmax.
    widen_q(x) / narrow_out(x): a query element as acc_dtype, an output value as the store writes it
    (`_numerics.element_io`; None: a plain conversion, the store's own)."""
    HPB, DK, DV, KT = heads_per_block, head_dim_k, head_dim_v, key_tile
    ROWS = HPB * q_tile
    acc_t = np.float64 if np.dtype(acc_dtype) == np.float64 else np.float32
    NEG_INF = acc_t(-math.inf)
    EPS = acc_t(sum_epsilon)
    widen_q = widen_q or acc_t
    narrow_out = narrow_out or _as_is

    @cuda.jit
    def attention_kernel(q_geom, out_geom, seqlens, kvlens, k_src, v_src, score_args, sm_scale):
        b = cuda.blockIdx.z
        if partials:
            num_splits = out_geom[5]
            b, split = b // num_splits, b % num_splits
        seqlen, kvlen = seqlens[b], kvlens[b]
        i0 = cuda.blockIdx.x * q_tile
        if i0 >= seqlen:
            return                                   # block-uniform exit: no thread waits at a barrier
        h0 = cuda.blockIdx.y * HPB                   # first query head of this block
        # spec: ppl-mhca/gqa, onnx/gqa
        g = h0 // group                              # the kv head every row of this block reads
        tid, nthreads = cuda.threadIdx.x, cuda.blockDim.x

        q_s = cuda.shared.array((ROWS, DK), acc_t)
        k_s = cuda.shared.array((KT, DK), acc_t)
        v_s = cuda.shared.array((KT, DV), acc_t)
        p_s = cuda.shared.array((ROWS, KT), acc_t)      # scores, then probabilities
        acc_rows = cuda.shared.array((ROWS, DV), acc_t)
        row_max = cuda.shared.array(ROWS, acc_t)
        row_sum = cuda.shared.array(ROWS, acc_t)
        rescale = cuda.shared.array(ROWS, acc_t)
        k_rows = cuda.shared.array((KT, 2), np.int64)
        v_rows = cuda.shared.array((KT, 2), np.int64)

        q, q_starts, q_sb, q_si, q_sh = q_geom
        # Row r is query position i0 + r // HPB of head h0 + r % HPB.
        for e in range(tid, ROWS * DK, nthreads):
            r, d = e // DK, e % DK
            i = i0 + r // HPB
            q_s[r, d] = 0.0
            if i < seqlen:
                q_s[r, d] = widen_q(q[b * q_sb + (q_starts[b] + i) * q_si + (h0 + r % HPB) * q_sh + d])
        for e in range(tid, ROWS * DV, nthreads):
            acc_rows[e // DV, e % DV] = 0.0
        for r in range(tid, ROWS, nthreads):
            row_max[r] = NEG_INF
            row_sum[r] = 0.0
        i_last = min(i0 + q_tile, seqlen) - 1
        lo, hi = key_range(score_args, b, i0, i_last, seqlen, kvlen)
        if partials:                                 # tile-aligned: the walk below starts at lo's tile
            split_lo, split_hi = split_keys_device(split, num_splits, kvlen, KT)
            lo, hi = max(lo, split_lo), min(hi, split_hi)
        cuda.syncthreads()

        first_tile = lo - lo % KT if lo < hi else hi     # no visible key: no tile (an empty split loads nothing)
        for t0 in range(first_tile, hi, KT):
            # 1. slot offsets of this tile's keys
            for j in range(tid, KT, nthreads):
                t = min(t0 + j, kvlen - 1)            # clamp: rows past hi are loaded but never weighted
                k_rows[j, 0], k_rows[j, 1] = row_offsets(k_src, b, t, g)
                v_rows[j, 0], v_rows[j, 1] = row_offsets(v_src, b, t, g)
            cuda.syncthreads()
            # 2. K and V tiles, dequantized to float32
            for e in range(tid, KT * DK, nthreads):
                j, d = e // DK, e % DK
                k_s[j, d] = load(k_src, k_rows[j, 0], k_rows[j, 1], d)
            for e in range(tid, KT * DV, nthreads):
                j, d = e // DV, e % DV
                v_s[j, d] = load(v_src, v_rows[j, 0], v_rows[j, 1], d)
            cuda.syncthreads()
            # 3. scores
            for e in range(tid, ROWS * KT, nthreads):
                r, j = e // KT, e % KT
                i, t = i0 + r // HPB, t0 + j
                s = NEG_INF
                if i < seqlen and lo <= t < hi:
                    dot = acc_t(0.0)
                    for d in range(DK):
                        dot += q_s[r, d] * k_s[j, d]
                    s = score(score_args, dot * sm_scale, b, h0 + r % HPB, i, t, seqlen, kvlen)
                p_s[r, j] = s
            cuda.syncthreads()
            # 4. online softmax, one thread per row
            for r in range(tid, ROWS, nthreads):
                new_max = row_max[r]
                for j in range(KT):
                    new_max = max(new_max, p_s[r, j])
                alpha = acc_t(1.0)
                tile_sum = acc_t(0.0)
                if new_max != NEG_INF:                # all hidden so far: nothing to rescale or add
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
            # 5. accumulate P V
            for e in range(tid, ROWS * DV, nthreads):
                r, d = e // DV, e % DV
                total = acc_rows[r, d] * rescale[r]
                for j in range(KT):
                    total += p_s[r, j] * v_s[j, d]
                acc_rows[r, d] = total
            cuda.syncthreads()

        if partials:
            out, o_starts, o_sb, o_si, o_sh, _, split_stride, split_rows, num_heads, m_out, l_out = out_geom
            for e in range(tid, ROWS * DV, nthreads):
                r, d = e // DV, e % DV
                i = i0 + r // HPB
                if i < seqlen:
                    out[split * split_stride + b * o_sb + (o_starts[b] + i) * o_si + (h0 + r % HPB) * o_sh + d] = \
                        acc_rows[r, d]
            for r in range(tid, ROWS, nthreads):
                i = i0 + r // HPB
                if i < seqlen:
                    row = split * split_rows + (o_starts[b] + i) * num_heads + h0 + r % HPB
                    m_out[row] = row_max[r]
                    l_out[row] = row_sum[r]
            return
        out, o_starts, o_sb, o_si, o_sh = out_geom
        for e in range(tid, ROWS * DV, nthreads):
            r, d = e // DV, e % DV
            i = i0 + r // HPB
            if i < seqlen:
                total = row_sum[r] + EPS
                value = acc_rows[r, d] / total if total > 0.0 else acc_t(0.0)
                out[b * o_sb + (o_starts[b] + i) * o_si + (h0 + r % HPB) * o_sh + d] = narrow_out(value)

    return attention_kernel


def fit(shape, threads: int):
    """Rung 1's answer for a call (`_fit.RungFit`): `plan_tiles`'s block, its grid as the launchers size it, its
    key tile a step. Any block size runs (the loops stride by it); a head_dim whose tiles do not fit the shared
    memory gives fits=False and the planner's ValueError text."""
    from ._fit import RungFit  # here, not above: the pages quote the kernel modules by line

    rows = max(shape.max_query_len, 1)
    try:
        heads_per_block, q_tile, key_tile = plan_tiles(shape.num_heads, shape.num_kv_heads, rows, shape.head_dim,
                                                       shape.head_dim)
    except ValueError as e:
        return RungFit(1, "tiles", threads, False, str(e))
    blocks = math.ceil(rows / q_tile) * (shape.num_heads // heads_per_block) * shape.batch
    return RungFit(1, "tiles", threads, True, blocks=max(blocks, 1), heads_per_block=heads_per_block,
                   positions=q_tile, keys_per_step=key_tile,
                   shared_bytes=shared_bytes(heads_per_block * q_tile, key_tile, shape.head_dim, shape.head_dim))
