"""Rung 2 of the kernel ladder: a warp per key, lanes across head_dim, partial softmax states per warp.

Rung 1 (`_attention_core.py`) stages a tile of keys in shared memory and lets each thread compute a whole
q.k dot product with the key index across the warp: at head_dim 128 every lane of a warp reads the same
shared-memory bank (a 32-way conflict), one thread per row runs the softmax, and five barriers pass per
32 keys. This rung reads the cache straight into registers instead:

    1. lane l of a warp holds elements l, l + 32, ... of every query row of the block (registers);
    2. warp w takes keys lo + w, lo + w + WARPS, ...: each lane loads its elements of key t (consecutive
       lanes, consecutive addresses: one coalesced row per warp) and of value t;
    3. per query row, the lanes' partial products are summed across the warp (`_warp.warp_sum`: shuffles on
       a GPU), giving the logit, the same in every lane;
    4. each warp keeps its own online-softmax state per row (m, l and its lanes' slice of the output), so no
       barrier is needed while it walks its keys;
    5. at the end the warps' states are merged through shared memory with the multi-block rule:
       M = max m_w, L = sum e^(m_w - M) l_w, O = sum e^(m_w - M) o_w / L.
It is built from the same device functions as rung 1 (row_offsets, load, score, key_range), so every
operator's cache format, quantization and mask come along unchanged, and it launches on the same grid.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._attention_core import SHARED_BYTES
from ._warp import WARP_SIZE, warp_sum

LOWEST = np.float32(-np.finfo(np.float32).max)


def plan_warp_rows(num_heads: int, num_kv_heads: int, max_seqlen: int, head_dim_v: int, warps: int,
                   elem_bytes: int = 4, max_rows: int = 8):
    """(heads_per_block, q_tile): a whole GQA group when the warps' merge buffers fit, at most max_rows rows a
    block when the group splits evenly (each row costs every lane registers for its slice of q and of the
    output)."""
    heads_per_block = num_heads // num_kv_heads
    while heads_per_block > max_rows and heads_per_block % 2 == 0:
        heads_per_block //= 2
    q_tile = 1 if max_seqlen <= 1 else max(1, min(max_rows // heads_per_block, max_seqlen))

    def fits():
        rows = heads_per_block * q_tile
        return merge_bytes(rows, head_dim_v, warps, elem_bytes) <= SHARED_BYTES

    while q_tile > 1 and not fits():
        q_tile //= 2
    while heads_per_block % 2 == 0 and not fits():
        heads_per_block //= 2
    if not fits():
        raise ValueError(f"head_dim: {head_dim_v} needs more than {SHARED_BYTES} bytes of shared memory per block "
                         f"with {warps} warps in the warp-per-key kernels")
    return heads_per_block, q_tile


def make_warp_attention_kernel(row_offsets, load, score, key_range, *, head_dim_k: int, head_dim_v: int,
                               heads_per_block: int, q_tile: int, group: int, warps: int, acc_dtype=np.float32):
    """Build the kernel. Launch grid (ceil(max_seqlen / q_tile), num_heads / heads_per_block, B), 32 * warps
    threads; arguments as `_attention_core.make_attention_kernel`'s kernel."""
    HPB, DK, DV, WARPS = heads_per_block, head_dim_k, head_dim_v, warps
    ROWS = HPB * q_tile
    K_PER_LANE = -(-DK // WARP_SIZE)
    V_PER_LANE = -(-DV // WARP_SIZE)
    acc_t = np.float64 if np.dtype(acc_dtype) == np.float64 else np.float32
    NEG_INF = acc_t(-math.inf)
    start_rows = make_row_starter(heads_per_block=HPB, q_tile=q_tile, head_dim_k=DK, chunk=1, lanes=WARP_SIZE,
                                  q_per_lane=K_PER_LANE, out_per_lane=V_PER_LANE, acc_dtype=acc_t)
    write_rows = make_row_writer(heads_per_block=HPB, q_tile=q_tile, head_dim_v=DV, warps=WARPS, acc_dtype=acc_t)

    @cuda.jit
    def warp_attention_kernel(q_geom, out_geom, seqlens, kvlens, k_src, v_src, score_args, sm_scale):
        b = cuda.blockIdx.z
        seqlen, kvlen = seqlens[b], kvlens[b]
        i0 = cuda.blockIdx.x * q_tile
        if i0 >= seqlen:
            return                                   # block-uniform exit
        h0 = cuda.blockIdx.y * HPB
        g = h0 // group
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE

        scratch = cuda.shared.array((WARPS, WARP_SIZE), acc_t)     # warp_sum's simulator path only
        warp_max = cuda.shared.array((WARPS, ROWS), acc_t)
        warp_sum_p = cuda.shared.array((WARPS, ROWS), acc_t)
        warp_out = cuda.shared.array((WARPS, ROWS, DV), acc_t)

        # 1. this lane's elements of every query row (elements lane, lane + 32, ...), empty softmax states
        q_reg = cuda.local.array((ROWS, K_PER_LANE), acc_t)
        row_max = cuda.local.array(ROWS, acc_t)
        row_sum = cuda.local.array(ROWS, acc_t)
        acc = cuda.local.array((ROWS, V_PER_LANE), acc_t)
        start_rows(q_geom, b, i0, h0, seqlen, lane, q_reg, row_max, row_sum, acc)
        k_reg = cuda.local.array(K_PER_LANE, acc_t)
        v_reg = cuda.local.array(V_PER_LANE, acc_t)

        i_last = min(i0 + q_tile, seqlen) - 1
        lo, hi = key_range(score_args, b, i0, i_last, seqlen, kvlen)
        steps = -(-max(hi - lo, 0) // WARPS)        # the same count in every warp: warp_sum may hold barriers
        for step in range(steps):
            t = lo + step * WARPS + warp
            valid = t < hi
            tc = min(t, hi - 1)                     # a warp past the end loads a real key and weighs it 0
            # 2. this lane's elements of key t and value t, straight from the cache
            k_row, k_scale_row = row_offsets(k_src, b, tc, g)
            v_row, v_scale_row = row_offsets(v_src, b, tc, g)
            for m in range(K_PER_LANE):
                d = lane + m * WARP_SIZE
                k_reg[m] = load(k_src, k_row, k_scale_row, d) if d < DK else acc_t(0.0)
            for m in range(V_PER_LANE):
                d = lane + m * WARP_SIZE
                v_reg[m] = load(v_src, v_row, v_scale_row, d) if d < DV else acc_t(0.0)
            for r in range(ROWS):
                # 3. the logit of row r for key t, summed across the warp
                part = acc_t(0.0)
                for m in range(K_PER_LANE):
                    part += q_reg[r, m] * k_reg[m]
                dot = warp_sum(part, scratch, warp, lane)
                i = i0 + r // HPB
                s = NEG_INF
                if valid and i < seqlen:
                    s = score(score_args, dot * sm_scale, b, h0 + r % HPB, i, t, seqlen, kvlen)
                # 4. this warp's online softmax for row r (the same values in every lane)
                add_key(row_max, row_sum, acc, r, s, v_reg, V_PER_LANE)

        # 5. merge the warps' states
        for r in range(ROWS):
            if lane == 0:
                warp_max[warp, r] = row_max[r]
                warp_sum_p[warp, r] = row_sum[r]
            for m in range(V_PER_LANE):
                d = lane + m * WARP_SIZE
                if d < DV:
                    warp_out[warp, r, d] = acc[r, m]
        cuda.syncthreads()
        write_rows(warp_max, warp_sum_p, warp_out, out_geom, b, 0, i0, h0, seqlen)

    return warp_attention_kernel


@cuda.jit(device=True, inline="always")
def softmax_weights(old_max, new_max, s):
    """(alpha, p) of the online softmax when a row's max moves from old_max to new_max (>= old_max, >= s):
    alpha = e^(old_max - new_max) rescales what the row holds, p = e^(s - new_max) weighs logit s. While every key
    so far is hidden (new_max = -inf) both are 0, not NaN: the max is floored at the lowest float32, so an empty
    state stays empty without a branch."""
    top = max(new_max, LOWEST)
    return math.exp(old_max - top), math.exp(s - top)


@cuda.jit(device=True, inline="always")
def add_key(row_max, row_sum, acc, r, s, v_reg, count):
    """Row r's online-softmax state (max, sum, this lane's acc[r, :count]) takes one key: logit s, value v_reg."""
    new_max = max(row_max[r], s)
    if new_max != -math.inf:                          # all hidden so far: nothing to rescale or add
        alpha, p = softmax_weights(row_max[r], new_max, s)
        row_sum[r] = row_sum[r] * alpha + p
        for m in range(count):
            acc[r, m] = acc[r, m] * alpha + p * v_reg[m]
        row_max[r] = new_max


@cuda.jit(device=True, inline="always")
def _as_is(x):
    return x


@cuda.jit(device=True, inline="always")
def query_element(q_geom, b, i, h, d):
    """Element d of query i, head h of sequence b in a flat query with geometry (data, starts, s_b, s_i, s_h)."""
    q, q_starts, q_sb, q_si, q_sh = q_geom
    return q[b * q_sb + (q_starts[b] + i) * q_si + h * q_sh + d]


def make_row_starter(*, heads_per_block: int, q_tile: int, head_dim_k: int, chunk: int, lanes: int, q_per_lane: int,
                     out_per_lane: int, acc_dtype=np.float32, query=None):
    """Device function start_rows(q_geom, b, i0, h0, seqlen, group_lane, q_reg, row_max, row_sum, acc): this lane's
    slice of every query row of the block into q_reg (ROWS, q_per_lane) (0 past the row or the sequence) and
    empty online-softmax states. The lane of a group of `lanes` holds chunks group_lane, group_lane + lanes, ...
    of `chunk` consecutive elements (rung 2: chunks of 1 over the 32 lanes of a warp). query(q_geom, b, i, h, d)
    gives element d of query i, head h (None: `query_element`, q_geom a flat query and its geometry)."""
    HPB, DK, ROWS = heads_per_block, head_dim_k, heads_per_block * q_tile
    acc_t = np.float64 if np.dtype(acc_dtype) == np.float64 else np.float32
    query = query or query_element

    @cuda.jit(device=True, inline="always")
    def start_rows(q_geom, b, i0, h0, seqlen, group_lane, q_reg, row_max, row_sum, acc):
        for r in range(ROWS):
            i = i0 + r // HPB
            for x in range(q_per_lane):
                d = (group_lane + (x // chunk) * lanes) * chunk + x % chunk
                q_reg[r, x] = 0.0
                if d < DK and i < seqlen:
                    q_reg[r, x] = acc_t(query(q_geom, b, i, h0 + r % HPB, d))
            row_max[r] = -math.inf
            row_sum[r] = 0.0
            for x in range(out_per_lane):
                acc[r, x] = 0.0

    return start_rows


def make_row_writer(*, heads_per_block: int, q_tile: int, head_dim_v: int, warps: int, acc_dtype=np.float32,
                    partials: bool = False, sum_epsilon: float = 0.0, narrow_out=None):
    """Device function write_rows(warp_max, warp_sum, warp_out, out_geom, b, split, i0, h0, seqlen), called by
    every thread after a barrier: merges the warps' states of each row with the multi-block rule and writes
    acc / (L + sum_epsilon); with partials (out_geom as in `_attention_core.make_attention_kernel`'s docstring)
    the split's unnormalised acc, M and L for a combine kernel. narrow_out(x): a final value as the store writes
    it (`_numerics.element_io`; None: the store's own conversion)."""
    HPB, DV, THREADS = heads_per_block, head_dim_v, warps * WARP_SIZE
    ROWS = heads_per_block * q_tile
    acc_t = np.float64 if np.dtype(acc_dtype) == np.float64 else np.float32
    NEG_INF, EPS = acc_t(-math.inf), acc_t(sum_epsilon)
    narrow_out = narrow_out or _as_is

    @cuda.jit(device=True, inline="always")
    def write_rows(warp_max, warp_sum, warp_out, out_geom, b, split, i0, h0, seqlen):
        out, o_starts, o_sb, o_si, o_sh = out_geom[0], out_geom[1], out_geom[2], out_geom[3], out_geom[4]
        for e in range(cuda.threadIdx.x, ROWS * DV, THREADS):
            r, d = e // DV, e % DV
            i = i0 + r // HPB
            if i < seqlen:
                top = NEG_INF
                for w in range(warps):
                    top = max(top, warp_max[w, r])
                total = acc_t(0.0)
                value = acc_t(0.0)
                if top != NEG_INF:
                    for w in range(warps):
                        weight = math.exp(warp_max[w, r] - top)
                        total += weight * warp_sum[w, r]
                        value += weight * warp_out[w, r, d]
                at = b * o_sb + (o_starts[b] + i) * o_si + (h0 + r % HPB) * o_sh + d
                if partials:
                    split_stride, split_rows, num_heads, m_out, l_out = out_geom[6:]
                    out[split * split_stride + at] = value
                    if d == 0:
                        row = split * split_rows + (o_starts[b] + i) * num_heads + h0 + r % HPB
                        m_out[row] = top
                        l_out[row] = total
                else:
                    out[at] = narrow_out(value / (total + EPS) if total > 0.0 else acc_t(0.0))

    return write_rows


def merge_bytes(rows: int, head_dim_v: int, warps: int, elem_bytes: int = 4) -> int:
    """Shared memory of a block's merge across warps: per warp a reduction scratch, each row's max, sum and
    output."""
    return elem_bytes * warps * (WARP_SIZE + rows * (head_dim_v + 2))


def fit(shape, threads: int):
    """Rung 2's answer for a call (`_fit.RungFit`): `plan_warp_rows`'s block at `threads // 32` warps, its grid as
    the launchers size it, a key a warp a step. fits=False with the launcher's ValueError text for a block size
    that is not whole warps or a head_dim whose merge buffers do not fit the shared memory."""
    from ._fit import RungFit, whole_warps

    refused = whole_warps(2, "warp", threads)
    if refused:
        return refused
    rows, warps = max(shape.max_query_len, 1), threads // WARP_SIZE
    try:
        heads_per_block, q_tile = plan_warp_rows(shape.num_heads, shape.num_kv_heads, rows, shape.head_dim, warps)
    except ValueError as e:
        return RungFit(2, "warp", threads, False, str(e))
    blocks = math.ceil(rows / q_tile) * (shape.num_heads // heads_per_block) * shape.batch
    return RungFit(2, "warp", threads, True, blocks=max(blocks, 1), heads_per_block=heads_per_block,
                   positions=q_tile, keys_per_step=warps,
                   shared_bytes=merge_bytes(heads_per_block * q_tile, shape.head_dim, warps))
