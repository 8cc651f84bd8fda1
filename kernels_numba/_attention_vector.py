"""Rung 3 of the kernel ladder: 16-byte vector loads, lane groups per key, and the split-K partials of rung 4.

Rung 2 (`_attention_warp.py`) gives each lane of a warp one element of a key row per load instruction: 2 of
the 16 bytes a load can carry for float16, 1 for int8. This rung gives each lane a 16-byte chunk of the row
(8 float16, 4 float32, 16 int8, 32 int4 values) in one `ld.global.nc.v4.u32` and unpacks it in registers
(`_cache.make_chunk_load`). A row of Dh * bytes is then covered by LANES = Dh * bytes / 16 lanes (rounded up to
a power of 2, at most 32), so a warp walks 32 / LANES keys at once, one per group of LANES lanes:

    1. lane l of group k holds chunks l, l + LANES, ... of every query row of the block (registers);
    2. each step the block takes WARPS * 32 / LANES consecutive keys, one per lane group; each lane loads its
       chunks of key t and value t (a group reads one row: consecutive lanes, consecutive 16 bytes);
    3. per query row, the partial products are summed within the lane group (`_warp.xor_reduce_many`,
       (1, LANES)), giving the logit in every lane of the group;
    4. each group keeps its own online-softmax state per row (`_attention_warp.add_key`);
    5. the groups of a warp merge their states with shuffles across groups (`xor_reduce_many`, (LANES, 32)), then
       the warps merge through shared memory (`_attention_warp.make_row_writer`).
Rows whose 16-byte alignment the host cannot promise take the same loop with one element load per value
(`vector=False`), so the lane-group structure and every result stay the same.

partials (rung 4, split-K): grid z = B * num_splits; block z walks split z % num_splits of its sequence's keys
(ceil(kvlen / num_splits) keys each; a split past the last key is empty) and writes unnormalised acc, M and L
per row as `_attention_core.make_attention_kernel(partials=True)` documents; `_split_k.combine_kernel` finishes.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ._attention_warp import add_key, make_row_starter, make_row_writer, plan_warp_rows
from ._launch import ceil_div
from ._warp import SIMULATED, WARP_SIZE, xor_reduce_many

LANE_REGISTERS = 128    # floats of q and output slices one lane holds for all its rows (of 255 registers)


def lanes_per_key(chunks: int) -> int:
    """Lanes that share one key row of `chunks` 16-byte chunks: a power of 2 (lane groups must tile the warp
    for the butterfly sums), at most a warp."""
    lanes = 1
    while lanes < min(chunks, WARP_SIZE):
        lanes *= 2
    return lanes


def keys_per_step(head_dim: int, chunk: int, warps: int) -> int:
    """Keys a block takes at once: one per lane group of every warp."""
    return warps * (WARP_SIZE // lanes_per_key(ceil_div(head_dim, chunk)))


def plan_vector_rows(num_heads: int, num_kv_heads: int, max_seqlen: int, head_dim: int, chunk: int, warps: int):
    """(heads_per_block, q_tile) as `plan_warp_rows`, with fewer rows when a lane's slice of a row is wide: a lane
    holds LANE_REGISTERS floats of q and output slices in all (int4 at head_dim 128: 4 lanes a key, 32 + 32
    floats a row, 2 rows; float16: 16 lanes, 8 + 8, 8 rows), so the loop can keep them in registers."""
    chunks = ceil_div(head_dim, chunk)
    per_lane = ceil_div(chunks, lanes_per_key(chunks)) * chunk
    return plan_warp_rows(num_heads, num_kv_heads, max_seqlen, head_dim, warps,
                          max_rows=max(1, min(8, LANE_REGISTERS // (2 * per_lane))))


def make_vector_attention_kernel(row_offsets, load_chunk, score, key_range, *, head_dim_k: int, head_dim_v: int,
                                 chunk: int, heads_per_block: int, q_tile: int, group: int, warps: int,
                                 partials: bool = False):
    """Build the kernel. Launch grid (ceil(max_seqlen / q_tile), num_heads / heads_per_block, B, times num_splits
    with partials), 32 * warps threads; arguments as `_attention_core.make_attention_kernel`'s kernel.
    load_chunk(src, row, sc_row, d0, regs, at, dims) fills regs[at:at + chunk] with elements d0.. of a row."""
    HPB, DK, DV, WARPS, E = heads_per_block, head_dim_k, head_dim_v, warps, chunk
    ROWS = HPB * q_tile
    K_CHUNKS, V_CHUNKS = ceil_div(DK, E), ceil_div(DV, E)
    LANES = lanes_per_key(max(K_CHUNKS, V_CHUNKS))
    KEYS = WARP_SIZE // LANES                          # keys a warp walks at once
    STEP = WARPS * KEYS                                # keys a block walks at once
    K_LOADS, V_LOADS = ceil_div(K_CHUNKS, LANES), ceil_div(V_CHUNKS, LANES)    # chunks per lane
    KR, VR = K_LOADS * E, V_LOADS * E                  # registers per lane for one row of q / of the output
    acc_t = np.float32
    NEG_INF = acc_t(-math.inf)
    MERGED = VR + 1                                    # a row's output slice and sum, merged across lane groups
    SCRATCH = max(ROWS, MERGED) if SIMULATED else 1    # values xor_reduce_many combines at once in the simulator
    start_rows = make_row_starter(heads_per_block=HPB, q_tile=q_tile, head_dim_k=DK, chunk=E, lanes=LANES,
                                  q_per_lane=KR, out_per_lane=VR)
    write_rows = make_row_writer(heads_per_block=HPB, q_tile=q_tile, head_dim_v=DV, warps=WARPS,
                                 partials=partials)

    @cuda.jit
    def vector_attention_kernel(q_geom, out_geom, seqlens, kvlens, k_src, v_src, score_args, sm_scale):
        b, split = cuda.blockIdx.z, 0
        if partials:
            num_splits = out_geom[5]
            b, split = b // num_splits, b % num_splits
        seqlen, kvlen = seqlens[b], kvlens[b]
        i0 = cuda.blockIdx.x * q_tile
        if i0 >= seqlen:
            return                                   # block-uniform exit
        h0 = cuda.blockIdx.y * HPB
        g = h0 // group
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE
        key_of_warp, group_lane = lane // LANES, lane % LANES

        scratch = cuda.shared.array((WARPS, WARP_SIZE, SCRATCH), acc_t)     # the simulator's reductions only
        warp_max = cuda.shared.array((WARPS, ROWS), acc_t)
        warp_sum = cuda.shared.array((WARPS, ROWS), acc_t)
        warp_out = cuda.shared.array((WARPS, ROWS, DV), acc_t)

        # 1. this lane's chunks of every query row (chunk c holds elements c * E ...), empty softmax states
        q_reg = cuda.local.array((ROWS, KR), acc_t)
        row_max = cuda.local.array(ROWS, acc_t)
        row_sum = cuda.local.array(ROWS, acc_t)
        acc = cuda.local.array((ROWS, VR), acc_t)
        start_rows(q_geom, b, i0, h0, seqlen, group_lane, q_reg, row_max, row_sum, acc)
        k_reg = cuda.local.array(KR, acc_t)
        v_reg = cuda.local.array(VR, acc_t)
        dots = cuda.local.array(ROWS, acc_t)
        merged = cuda.local.array(MERGED, acc_t)
        for x in range(KR):
            k_reg[x] = 0.0                            # elements past the row stay 0 (their q is 0 too)
        for x in range(VR):
            v_reg[x] = 0.0

        i_last = min(i0 + q_tile, seqlen) - 1
        lo, hi = key_range(score_args, b, i0, i_last, seqlen, kvlen)
        if partials:                                  # this split's keys
            per_split = -(-kvlen // num_splits)
            lo, hi = max(lo, split * per_split), min(hi, (split + 1) * per_split)
        steps = -(-max(hi - lo, 0) // STEP)          # the same count in every thread: xor_reduce may hold barriers
        for step in range(steps):
            t = lo + step * STEP + warp * KEYS + key_of_warp
            valid = t < hi
            tc = min(t, hi - 1)                      # a group past the end loads a real key and weighs it 0
            # 2. this lane's chunks of key t and value t
            k_row, k_scale_row = row_offsets(k_src, b, tc, g)
            v_row, v_scale_row = row_offsets(v_src, b, tc, g)
            for m in range(K_LOADS):
                c = group_lane + m * LANES
                if c < K_CHUNKS:
                    load_chunk(k_src, k_row, k_scale_row, c * E, k_reg, m * E, DK)
            for m in range(V_LOADS):
                c = group_lane + m * LANES
                if c < V_CHUNKS:
                    load_chunk(v_src, v_row, v_scale_row, c * E, v_reg, m * E, DV)
            # 3. the logits of key t, each row's partial products summed over the key's lane group
            for r in range(ROWS):
                dots[r] = 0.0
                for x in range(KR):
                    dots[r] += q_reg[r, x] * k_reg[x]
            xor_reduce_many(dots, ROWS, scratch, warp, lane, 1, LANES, False)
            for r in range(ROWS):
                i = i0 + r // HPB
                s = NEG_INF
                if valid and i < seqlen:
                    s = score(score_args, dots[r] * sm_scale, b, h0 + r % HPB, i, t, seqlen, kvlen)
                # 4. this group's online softmax for row r
                add_key(row_max, row_sum, acc, r, s, v_reg, VR)

        # 5. merge the lane groups of each warp (the same chunk positions, different keys), then the warps
        if KEYS > 1 and steps > 0:                   # (an empty split has nothing to merge)
            for r in range(ROWS):
                dots[r] = row_max[r]
            xor_reduce_many(dots, ROWS, scratch, warp, lane, LANES, WARP_SIZE, True)     # the warp's max per row
            for r in range(ROWS):
                top = dots[r]
                alpha = math.exp(row_max[r] - top) if top != NEG_INF else acc_t(0.0)
                merged[VR] = row_sum[r] * alpha
                for x in range(VR):
                    merged[x] = acc[r, x] * alpha
                xor_reduce_many(merged, MERGED, scratch, warp, lane, LANES, WARP_SIZE, False)
                row_sum[r] = merged[VR]
                for x in range(VR):
                    acc[r, x] = merged[x]
                row_max[r] = top
        if key_of_warp == 0:
            for r in range(ROWS):
                if group_lane == 0:
                    warp_max[warp, r] = row_max[r]
                    warp_sum[warp, r] = row_sum[r]
                for x in range(VR):
                    d = (group_lane + (x // E) * LANES) * E + x % E
                    if d < DV:
                        warp_out[warp, r, d] = acc[r, x]
        cuda.syncthreads()
        write_rows(warp_max, warp_sum, warp_out, out_geom, b, split, i0, h0, seqlen)

    return vector_attention_kernel
