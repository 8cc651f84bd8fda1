"""Rung 3 of the kernel ladder: 16-byte vector loads, lane groups per key, and the split-K partials of rung 4.

Rung 2 (`_attention_warp.py`) gives each lane of a warp one element of a key row per load instruction: 2 of
the 16 bytes a load can carry for float16, 1 for int8. This rung gives each lane a 16-byte chunk of the row
(8 float16, 4 float32, 16 int8 values) in one `ld.global.nc.v4.u32`, or an 8-byte chunk of 16 int4 values in one
`ld.global.nc.v2.u32` (`_cache.chunk_elements`), and unpacks it in registers (`_cache.make_chunk_load`). A row
is then covered by LANES = its chunks (rounded up to a power of 2, at most 32), so a warp walks 32 / LANES keys at
once, one per group of LANES lanes:

    1. lane l of group k holds chunks l, l + LANES, ... of every query row of the block (registers);
    2. each step the block takes WARPS * 32 / LANES * TILE consecutive keys, a tile of TILE per lane group
       (`keys_per_tile`: 2 on every cache format at head_dim 128); each lane loads its chunks of the tile's keys
       and values (a group reads one row per load: consecutive lanes, consecutive chunks), all of them before it
       unpacks the first when the loader can split the two (`_cache.ChunkPrefetch`: int8 and int4), so a warp
       has the whole step's loads in flight. The place of the group's first key is walked forward (an injected
       walker; `_cache.page_walk` over page tables), never divided out inside the loop;
    3. the partial products of every (row, key) of the tile are summed within the lane group by a transposed
       butterfly (`_warp.transpose_sum`), which leaves lane n of the group with the logit of row slot n // TILE,
       key n % TILE: `score` runs once per lane, not once per row and key in every lane;
    4. the online softmax steps once per row and tile (`_attention_warp.softmax_weights`): the max over the slot's
       lanes, alpha and p in the lane, the sum of p; every lane then takes each row's alpha and each (row, key)'s p
       by shuffles (`_warp.lane_values`) and updates its output slices;
    5. the groups of a warp merge their states with shuffles across groups (`xor_reduce_many`, (LANES, 32)), then
       the warps merge through shared memory (`_attention_warp.make_row_writer`).
Rows whose 16-byte alignment the host cannot promise take the same loop with one element load per value
(`vector=False`), so the lane-group structure and every result stay the same.

partials (rung 4, split-K): grid z = B * num_splits; block z walks split z % num_splits of the keys its rows can
see, [lo, hi) from key_range (ceil((hi - lo) / num_splits) keys each, so a window's keys spread over every split; a
split past the last key is empty) and writes unnormalised acc, M and L per row as
`_attention_core.make_attention_kernel(partials=True)` documents; `_split_k.combine_kernel` finishes.
"""

from __future__ import annotations

import math
from collections import namedtuple
from functools import cache, lru_cache

import numpy as np
from numba import cuda

from ._attention_warp import make_row_starter, make_row_writer, plan_warp_rows, softmax_weights
from ._cache import as_index, as_offset, page_slot, page_walk, slot_rows
from ._launch import ceil_div
from ._warp import SIMULATED, WARP_SIZE, lane_values, transpose_sum, xor_reduce_many

LANE_REGISTERS = 128    # floats of q and output slices one lane holds for all its rows (of 255 registers)
TILE_REGISTERS = 64     # floats of K and V slices one lane holds for the keys of a tile


def lanes_per_key(chunks: int) -> int:
    """Lanes that share one key row of `chunks` 16-byte chunks: a power of 2 (lane groups must tile the warp
    for the butterfly sums), at most a warp."""
    lanes = 1
    while lanes < min(chunks, WARP_SIZE):
        lanes *= 2
    return lanes


def _pow2(n: int) -> int:
    """The least power of 2 >= n."""
    out = 1
    while out < n:
        out *= 2
    return out


def max_rows(head_dim: int, chunk: int) -> int:
    """Query rows a block of this kernel holds at most (when its GQA group splits evenly): LANE_REGISTERS floats
    of q and output slices per lane (int8 or int4 at head_dim 128: 8 lanes a key, 16 + 16 floats a row, 4 rows;
    float16: 16 lanes, 8 + 8, 8 rows; int4 in 16-byte chunks would give 4 lanes, 32 + 32, 2 rows)."""
    chunks = ceil_div(head_dim, chunk)
    per_lane = ceil_div(chunks, lanes_per_key(chunks)) * chunk
    return max(1, min(8, LANE_REGISTERS // (2 * per_lane)))


def keys_per_tile(head_dim: int, chunk: int) -> int:
    """Keys a lane group takes per step: its LANES lanes finish the (row slot, key) logits of a tile, one each,
    for row slots enough for `max_rows` (the next power of 2), and the tile's K and V slices fit TILE_REGISTERS
    floats a lane: float16 at 128, 16 lanes / 8 slots = 2 keys of 8 + 8 floats; int8 and int4 (8-byte chunks),
    8 lanes / 4 slots = 2 keys of 16 + 16. One key when a group has fewer lanes than slots (its lanes then finish
    several rows). A tile shares one softmax step, one set of shuffles and the page lookups among its keys."""
    chunks = ceil_div(head_dim, chunk)
    per_lane = ceil_div(chunks, lanes_per_key(chunks)) * chunk
    keys = min(lanes_per_key(chunks) // _pow2(max_rows(head_dim, chunk)), TILE_REGISTERS // (2 * per_lane))
    return _pow2(keys + 1) // 2 if keys >= 1 else 1       # a power of 2, at least 1


@cache         # the plan asks it for every new batch size (`fit`); the answer depends on these ints alone
def keys_per_step(head_dim: int, chunk: int, warps: int) -> int:
    """Keys a block takes at once: a tile of keys per lane group of every warp."""
    return warps * (WARP_SIZE // lanes_per_key(ceil_div(head_dim, chunk))) * keys_per_tile(head_dim, chunk)


@lru_cache(maxsize=1024)     # the plan asks it for every new batch size (`fit`); it depends on these ints alone
def plan_vector_rows(num_heads: int, num_kv_heads: int, max_seqlen: int, head_dim: int, chunk: int, warps: int):
    """(heads_per_block, q_tile) as `plan_warp_rows`, with at most `max_rows` rows, so the loop keeps a lane's
    slices of q and the output in registers."""
    return plan_warp_rows(num_heads, num_kv_heads, max_seqlen, head_dim, warps, max_rows=max_rows(head_dim, chunk))


# A walker over K and V together: begin(k_src, v_src, b, h, t0) -> the state of a lane group's first key t0 of kv
# head h, at(k_src, v_src, b, state, j, h) -> (k_row, k_sc_row, v_row, v_sc_row) of key t0 + j,
# advance(k_src, v_src, b, h, state, step, live) -> the state of key t0 + step (live: whether that key is one the loop
# reads; a walk past its last key may leave its state unplaced).
KVWalker = namedtuple("KVWalker", "begin at advance")


def each_source(walker) -> KVWalker:
    """The KVWalker of a walker over one source, (begin(src, b, t0), at(src, b, state, j, h), advance(src, state,
    step)): K and V each walked with their own state, for sources whose keys K and V place apart."""
    begin, at, advance = walker

    @cuda.jit(device=True, inline="always")
    def begin_both(k_src, v_src, b, h, t0):
        return begin(k_src, b, t0), begin(v_src, b, t0)

    @cuda.jit(device=True, inline="always")
    def at_both(k_src, v_src, b, state, j, h):
        k_row, k_sc = at(k_src, b, state[0], j, h)
        v_row, v_sc = at(v_src, b, state[1], j, h)
        return k_row, k_sc, v_row, v_sc

    @cuda.jit(device=True, inline="always")
    def advance_both(k_src, v_src, b, h, state, step, live):
        return advance(k_src, state[0], step), advance(v_src, state[1], step)

    return KVWalker(begin_both, at_both, advance_both)


@cuda.jit(device=True, inline="always")
def _page_rows(k_src, v_src, b, page_index, offset, h):
    """(page index, offset, K row, K scale row, V row, V scale row) of the token at `offset` in page `page_index`:
    one page-table read for both."""
    slot = page_slot(k_src, b, page_index, offset)
    k_row, k_sc = slot_rows(k_src, b, slot, h)
    v_row, v_sc = slot_rows(v_src, b, slot, h)
    return page_index, as_offset(offset, k_src.s_t), k_row, k_sc, v_row, v_sc


@cuda.jit(device=True, inline="always")
def _shifted(x, n, stride):
    """Offset x moved n tokens along a page (stride: the source's token stride), in x's type."""
    return as_offset(x + n * stride, x)


@cuda.jit(device=True, inline="always")
def _page_begin(k_src, v_src, b, h, t0):
    return _page_rows(k_src, v_src, b, as_offset(t0 // k_src.page, k_src.s_t), t0 % k_src.page, h)


@cuda.jit(device=True, inline="always")
def _page_at(k_src, v_src, b, state, j, h):
    page_index, offset, k_row, k_sc, v_row, v_sc = state
    if j > 0 and offset + j >= k_src.page:        # a tile that crosses into the next page (or later ones)
        page_index, offset = page_walk(page_index, offset, j, k_src.page)
        _, _, k_row, k_sc, v_row, v_sc = _page_rows(k_src, v_src, b, page_index, offset, h)
        return as_index(k_row), as_index(k_sc), as_index(v_row), as_index(v_sc)
    return (as_index(_shifted(k_row, j, k_src.s_t)), as_index(_shifted(k_sc, j, k_src.sc_s_t)),
            as_index(_shifted(v_row, j, v_src.s_t)), as_index(_shifted(v_sc, j, v_src.sc_s_t)))


@cuda.jit(device=True, inline="always")
def _page_advance(k_src, v_src, b, h, state, step, live):
    page_index, offset, k_row, k_sc, v_row, v_sc = state
    if offset + step < k_src.page or not live:    # the same page, or past the last key: no lookup
        return (page_index, as_offset(offset + step, offset), _shifted(k_row, step, k_src.s_t),
                _shifted(k_sc, step, k_src.sc_s_t), _shifted(v_row, step, v_src.s_t),
                _shifted(v_sc, step, v_src.sc_s_t))
    page_index, offset = page_walk(page_index, offset, step, k_src.page)
    return _page_rows(k_src, v_src, b, page_index, offset, h)


@cuda.jit(device=True, inline="always")
def _divmod32(x, n):
    """(x // n, x % n) of non-negative 32-bit x and n (thread indices) as int32, by unsigned 32-bit division.
    numba's // and % of integers are signed 64-bit floor divisions: each index would be a register pair with a
    sign correction, and the lane indices stay live through the whole key loop (rung 4's split bookkeeping on top
    of them took int8 and int4 past 255 registers, and their high words were spilled)."""
    x, n = np.uint32(x), np.uint32(n)
    return np.int32(x // n), np.int32(x % n)


@cuda.jit(device=True, inline="always")
def _unscaled(v_src):
    return np.float32(1.0)


# The key walk of `_cache.CacheSource` sources, whose K and V share one page table (`starts` and `page`: OpenPPL's
# cachestarts serves both, and a packed key/value pair has one row_starts): the state is the page index, offset
# and K/V rows (and scale rows) of a lane group's first key. A key further along its page is those rows plus a
# multiple of the token stride; the page table is read once for K and V when a walk enters a page (or a tile
# crosses into the next), never per key; the rows are in 32-bit arithmetic when the host narrowed the sources
# (`_cache.offset_type`).
PAGE_WALKER = KVWalker(_page_begin, _page_at, _page_advance)


def make_vector_attention_kernel(row_offsets, load_chunk, score, key_range, *, head_dim_k: int, head_dim_v: int,
                                 chunk: int, heads_per_block: int, q_tile: int, group: int, warps: int,
                                 partials: bool = False, walker=None, value_scale=None, query=None, sum_epsilon=0.0,
                                 narrow_out=None):
    """Build the kernel. Launch grid (ceil(max_seqlen / q_tile), num_heads / heads_per_block, B, times num_splits
    with partials), 32 * warps threads; arguments as `_attention_core.make_attention_kernel`'s kernel.
    load_chunk(src, row, sc_row, d0, regs, at, dims) fills regs[at:at + chunk] with elements d0.. of a row.

    Where key t lives is a walk, so the loop divides by no page size: walker = a `KVWalker` of K and V together
    (one state for both where they share a page table), or (begin, at, advance) device functions over one source,
    walked for K and V apart (`each_source`): begin(src, b, t0) -> state of a lane group's first key t0,
    at(src, b, state, j, h) -> (row, sc_row) of key t0 + j of kv head h (the row and the second value load_chunk
    takes), advance(src, state, step) -> the state of key t0 + step; row_offsets(src, b, t, h) places one key t as
    `at` would (the last visible one, which keys past the end read instead, weighed 0). None: `PAGE_WALKER`, over
    `_cache.CacheSource` pairs that share one page table.
    value_scale(v_src) -> a factor every output row is multiplied by after the key loop (a per-tensor cache scale
    folded out of the loads: load_chunk then returns the stored codes of V, times 1 / factor for a value kept
    unscaled); None: no factor.
    query(q_geom, b, i, h, d) -> element d of query i, head h (None: q_geom is a flat query and its geometry, as
    `_attention_warp.query_element` reads it). sum_epsilon: rows end as acc / (l + sum_epsilon). narrow_out(x): a
    final value as the store writes it (bfloat16 bits: `_numerics.narrow_bfloat16`; None: the store's conversion)."""
    walk_begin, walk_at, walk_advance = walker if isinstance(walker, KVWalker) else \
        each_source(walker) if walker is not None else PAGE_WALKER
    # A loader that can split its loads from its unpacking (`_cache.ChunkPrefetch`) gets every load of a step (the
    # tile's K and V chunks and their scales) issued before the first is used: a warp then has all of them in
    # flight at once, not one key's, which the latency of HBM needs (`cacheattn.bounds.latency_bound`).
    prefetch = getattr(load_chunk, "prefetch", None)
    PREFETCH = prefetch is not None
    fetch_chunk, unpack_chunk = (prefetch.fetch, prefetch.unpack) if PREFETCH else (None, None)
    WORDS, SCALE_WORDS = (prefetch.words, prefetch.scale_words) if PREFETCH else (1, 1)
    SCALE_V = value_scale is not None
    value_scale = value_scale or _unscaled
    HPB, DK, DV, WARPS, E = heads_per_block, head_dim_k, head_dim_v, warps, chunk
    ROWS = HPB * q_tile
    K_CHUNKS, V_CHUNKS = ceil_div(DK, E), ceil_div(DV, E)
    LANES = lanes_per_key(max(K_CHUNKS, V_CHUNKS))
    KEYS = WARP_SIZE // LANES                          # lane groups of a warp
    TILE = keys_per_tile(max(DK, DV), E)               # keys a lane group takes per step
    SLOTS = max(_pow2(ROWS), LANES // TILE)            # row slots of a tile (rows past ROWS are padding)
    PER = SLOTS * TILE // LANES                        # logits a lane finishes: 1 unless a group cannot split
    SPAN = max(1, TILE // PER)                         # lanes that hold one slot's logits
    LOGITS, WEIGHTS = LANES * PER, ROWS * TILE         # (slot, key) logits of a tile; (row, key) weights
    STEP = WARPS * KEYS * TILE                         # keys a block walks at once
    K_LOADS, V_LOADS = ceil_div(K_CHUNKS, LANES), ceil_div(V_CHUNKS, LANES)    # chunks per lane
    KR, VR = K_LOADS * E, V_LOADS * E                  # registers per lane for one row of q / of the output
    K_FETCHED, V_FETCHED = (TILE * K_LOADS, TILE * V_LOADS) if PREFETCH else (1, 1)    # chunks a step fetches
    acc_t = np.float32
    NEG_INF = acc_t(-math.inf)
    MERGED = VR + 1                                    # a row's output slice and sum, merged across lane groups
    SCRATCH = max(LOGITS, MERGED) if SIMULATED else 1    # values the simulator's warp functions exchange
    start_rows = make_row_starter(heads_per_block=HPB, q_tile=q_tile, head_dim_k=DK, chunk=E, lanes=LANES,
                                  q_per_lane=KR, out_per_lane=VR, query=query)
    write_rows = make_row_writer(heads_per_block=HPB, q_tile=q_tile, head_dim_v=DV, warps=WARPS,
                                 partials=partials, sum_epsilon=sum_epsilon, narrow_out=narrow_out)

    @cuda.jit(device=True, inline="always")
    def from_lanes(out, count, stride, values, gathered, scratch, warp, lane, first_lane):
        """out[r] = entry r * stride of the tile's logit layout (lane n // PER of the group, its values[n % PER]),
        r < count, in every lane."""
        if PER == 1:
            lane_values(out, count, values[0], scratch, warp, lane, first_lane, stride)
            return
        for k in range(PER):
            lane_values(gathered, ((count - 1) * stride) // PER + 1, values[k], scratch, warp, lane, first_lane, 1)
            for r in range(count):
                if (r * stride) % PER == k:
                    out[r] = gathered[(r * stride) // PER]

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
        warp, lane = _divmod32(cuda.threadIdx.x, WARP_SIZE)
        key_of_warp, group_lane = _divmod32(lane, LANES)
        first_lane = key_of_warp * LANES             # of this lane's group, in the warp

        scratch = cuda.shared.array((WARPS, WARP_SIZE, SCRATCH), acc_t)     # the simulator's warp functions only
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
        dots = cuda.local.array(LOGITS, acc_t)     # (row slot, key) partial logits of a tile, slot-major
        logits = cuda.local.array(PER, acc_t)        # this lane's logits, entries group_lane * PER + k
        m_lane = cuda.local.array(PER, acc_t)        # their rows' softmax states (a slot's lanes agree)
        l_lane = cuda.local.array(PER, acc_t)
        alpha = cuda.local.array(PER, acc_t)
        p = cuda.local.array(PER, acc_t)
        combined = cuda.local.array(PER, acc_t)
        gathered = cuda.local.array(LANES, acc_t)
        weights = cuda.local.array(WEIGHTS, acc_t)     # p of every (row, key) of the tile, from the lanes
        alphas = cuda.local.array(ROWS, acc_t)
        k_rows = cuda.local.array((TILE, 2), np.int64)
        # the step's fetched chunks (PREFETCH): words and scale words of key j's m-th chunk at j * LOADS + m
        k_words = cuda.local.array((K_FETCHED, WORDS), np.uint32)
        k_held = cuda.local.array((K_FETCHED, SCALE_WORDS), np.uint32)
        v_words = cuda.local.array((V_FETCHED, WORDS), np.uint32)
        v_held = cuda.local.array((V_FETCHED, SCALE_WORDS), np.uint32)
        v_rows = cuda.local.array((TILE, 2), np.int64)
        merged = cuda.local.array(MERGED, acc_t)
        for x in range(KR):
            k_reg[x] = 0.0                            # elements past the row stay 0 (their q is 0 too)
        for x in range(VR):
            v_reg[x] = 0.0
        for k in range(PER):
            m_lane[k], l_lane[k] = NEG_INF, 0.0

        i_last = min(i0 + q_tile, seqlen) - 1
        lo, hi = key_range(score_args, b, i0, i_last, seqlen, kvlen)
        if partials:                                  # this split's share of the visible keys (a window's too)
            per_split = -(-max(hi - lo, 0) // num_splits)
            lo, hi = lo + split * per_split, min(hi, lo + (split + 1) * per_split)
        steps = -(-max(hi - lo, 0) // STEP)          # the same count in every thread: the warp functions may hold
        t0 = lo + (warp * KEYS + key_of_warp) * TILE  # barriers; t0: this group's first key
        # Keys past hi read the last visible key instead (weighed 0), and t0's place is walked forward a step at a
        # time (the walker's state), so the loop divides by the page size nowhere.
        state = walk_begin(k_src, v_src, b, g, t0)
        last = max(hi - 1, 0)
        k_last, k_last_sc = row_offsets(k_src, b, last, g)
        v_last, v_last_sc = row_offsets(v_src, b, last, g)
        for step in range(steps):
            # 2. where keys t0 .. t0 + TILE - 1 live
            for j in range(TILE):
                k_rows[j, 0], k_rows[j, 1], v_rows[j, 0], v_rows[j, 1] = k_last, k_last_sc, v_last, v_last_sc
                if t0 + j < hi:
                    k_rows[j, 0], k_rows[j, 1], v_rows[j, 0], v_rows[j, 1] = walk_at(k_src, v_src, b, state, j, g)
            if PREFETCH:                              # every load of the step, before any is used
                for j in range(TILE):
                    for m in range(K_LOADS):
                        c = group_lane + m * LANES
                        if c < K_CHUNKS:
                            fetch_chunk(k_src, k_rows[j, 0], k_rows[j, 1], c * E, k_words[j * K_LOADS + m],
                                        k_held[j * K_LOADS + m])
                    for m in range(V_LOADS):
                        c = group_lane + m * LANES
                        if c < V_CHUNKS:
                            fetch_chunk(v_src, v_rows[j, 0], v_rows[j, 1], c * E, v_words[j * V_LOADS + m],
                                        v_held[j * V_LOADS + m])
            # 3. each key's partial logits for every row, then each lane's (slot, key) summed over the lane group
            for n in range(LOGITS):
                dots[n] = 0.0
            for j in range(TILE):
                for m in range(K_LOADS):
                    c = group_lane + m * LANES
                    if c < K_CHUNKS:
                        if PREFETCH:
                            unpack_chunk(k_words[j * K_LOADS + m], k_held[j * K_LOADS + m], k_reg, m * E)
                        else:
                            load_chunk(k_src, k_rows[j, 0], k_rows[j, 1], c * E, k_reg, m * E, DK)
                for r in range(ROWS):
                    for x in range(KR):
                        dots[r * TILE + j] += q_reg[r, x] * k_reg[x]
            transpose_sum(dots, PER, scratch, warp, lane, LANES)
            for k in range(PER):
                n = group_lane * PER + k
                slot, t = n // TILE, t0 + n % TILE
                i = i0 + slot // HPB
                logits[k] = NEG_INF                  # a padding slot, a row past the sequence, a key past hi
                if slot < ROWS and i < seqlen and t < hi:
                    logits[k] = score(score_args, dots[k] * sm_scale, b, h0 + slot % HPB, i, t, seqlen, kvlen)
            # 4. the online softmax, once per row and tile: the slot's max over its TILE keys (in this lane, then
            # over its SPAN lanes), then alpha, p and the slot's sum of p
            for k in range(PER):
                combined[k] = logits[k]
                for k2 in range(PER):
                    if k2 // TILE == k // TILE:
                        combined[k] = max(combined[k], logits[k2])
            xor_reduce_many(combined, PER, scratch, warp, lane, 1, SPAN, True)
            for k in range(PER):
                new_max = max(m_lane[k], combined[k])
                alpha[k], p[k] = softmax_weights(m_lane[k], new_max, logits[k])
                m_lane[k] = new_max
            for k in range(PER):
                combined[k] = 0.0
                for k2 in range(PER):
                    if k2 // TILE == k // TILE:
                        combined[k] += p[k2]
            xor_reduce_many(combined, PER, scratch, warp, lane, 1, SPAN, False)
            for k in range(PER):
                l_lane[k] = l_lane[k] * alpha[k] + combined[k]
            # every lane takes each row's alpha and each (row, key)'s p from the lane that holds it
            from_lanes(alphas, ROWS, TILE, alpha, gathered, scratch, warp, lane, first_lane)
            from_lanes(weights, WEIGHTS, 1, p, gathered, scratch, warp, lane, first_lane)
            for r in range(ROWS):
                for x in range(VR):
                    acc[r, x] *= alphas[r]
            for j in range(TILE):
                for m in range(V_LOADS):
                    c = group_lane + m * LANES
                    if c < V_CHUNKS:
                        if PREFETCH:
                            unpack_chunk(v_words[j * V_LOADS + m], v_held[j * V_LOADS + m], v_reg, m * E)
                        else:
                            load_chunk(v_src, v_rows[j, 0], v_rows[j, 1], c * E, v_reg, m * E, DV)
                for r in range(ROWS):
                    for x in range(VR):
                        acc[r, x] += weights[r * TILE + j] * v_reg[x]
            t0 += STEP
            state = walk_advance(k_src, v_src, b, g, state, STEP, t0 < hi)
        if SCALE_V:                                   # the per-tensor scale the loads left out of V
            factor = value_scale(v_src)
            for r in range(ROWS):
                for x in range(VR):
                    acc[r, x] *= factor
        # every lane takes each row's max and sum from the row's first lane
        from_lanes(row_max, ROWS, TILE, m_lane, gathered, scratch, warp, lane, first_lane)
        from_lanes(row_sum, ROWS, TILE, l_lane, gathered, scratch, warp, lane, first_lane)

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


def fit(shape, threads: int, rung: int = 3):
    """Rung 3's answer for a call (`_fit.RungFit`), rung 4's too (the same grid; the plan splits its blocks' keys
    from it): `plan_vector_rows`'s block in the cache's chunks at `threads // 32` warps, its grid as the launchers
    size it, `keys_per_step`. fits=False with the launcher's ValueError text for a block size that is not whole
    warps (named as `rung`'s) or a head_dim whose rows do not fit the shared memory."""
    from ._attention_warp import merge_bytes
    from ._cache import chunk_elements
    from ._fit import RungFit, whole_warps

    refused = whole_warps(rung, "vector", threads)
    if refused:
        return refused
    rows, warps = max(shape.max_query_len, 1), threads // WARP_SIZE
    chunk = chunk_elements(shape.quant_bit, shape.cache_dtype, rung)
    try:
        heads_per_block, q_tile = plan_vector_rows(shape.num_heads, shape.num_kv_heads, rows, shape.head_dim, chunk,
                                                   warps)
    except ValueError as e:
        return RungFit(rung, "vector", threads, False, str(e))
    blocks = math.ceil(rows / q_tile) * (shape.num_heads // heads_per_block) * shape.batch
    return RungFit(rung, "vector", threads, True, blocks=max(blocks, 1), heads_per_block=heads_per_block,
                   positions=q_tile, keys_per_step=keys_per_step(shape.head_dim, chunk, warps),
                   shared_bytes=merge_bytes(heads_per_block * q_tile, shape.head_dim, warps))
