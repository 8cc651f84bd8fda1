"""Planted mistakes, one wrong and one slow or unsafe kernel per exercise (exercises 8, 9, 11 and 12: one of each;
exercise 10, a plain function: only a wrong one): what the checks say about them is what the exercises pages show
and what the tests hold `check` to."""

import math

from numba import cuda, float32

from kernels_numba._vector import half_from_bits, load16

from .skeletons import GROUP


# --- exercise 1
@cuda.jit
def copy_head_wrong(k_cache, head, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = out.shape
    for i in range(lane, tokens * head_dim, 32):
        t, d = i // head_dim, i % head_dim
        out[t, d] = k_cache[t, 0, d]                    # always the first head


@cuda.jit
def copy_head_slow(k_cache, head, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = out.shape
    for i in range(lane, tokens * head_dim, 32):
        d, t = i // tokens, i % tokens                  # t follows the lane: a whole token row apart
        out[t, d] = k_cache[t, head, d]


# --- exercise 2
@cuda.jit
def tile_scores_wrong(q, k, scores):
    lane = cuda.threadIdx.x
    keys = k.shape[0]
    tile = cuda.shared.array((32, 33), float32)
    for j in range(keys):
        tile[j, lane] = k[j, lane]
    cuda.syncthreads()
    if lane < keys:
        s = float32(0)
        for d in range(keys):                           # the head dimension is 32, not the number of keys
            s += q[d] * tile[lane, d]
        scores[lane] = s


@cuda.jit
def tile_scores_slow(q, k, scores):
    lane = cuda.threadIdx.x
    keys = k.shape[0]
    tile = cuda.shared.array((32, 32), float32)         # rows of 32 words: a column is all in one bank
    for j in range(keys):
        tile[j, lane] = k[j, lane]
    cuda.syncthreads()
    if lane < keys:
        s = float32(0)
        for d in range(32):
            s += q[d] * tile[lane, d]
        scores[lane] = s


@cuda.jit
def tile_scores_unsafe(q, k, scores):
    lane = cuda.threadIdx.x
    keys = k.shape[0]
    tile = cuda.shared.array((32, 33), float32)
    for j in range(keys):
        tile[j, lane] = k[j, lane]
    if lane < keys:                                     # no barrier: lane j reads words other lanes write
        s = float32(0)
        for d in range(32):
            s += q[d] * tile[lane, d]
        scores[lane] = s


# --- exercise 3
@cuda.jit
def online_softmax_wrong(scores, values, out):
    r = cuda.threadIdx.x
    keys, rows = scores.shape
    if r < rows:
        m = float32(-math.inf)
        total = float32(0)
        acc = float32(0)
        for t in range(keys):
            s = scores[t, r]
            m = max(m, s)                               # a new maximum, but the sums are not rescaled
            p = math.exp(s - m)
            total += p
            acc += p * values[t, r]
        out[r] = acc / total


@cuda.jit
def online_softmax_slow(scores, values, out):
    r = cuda.threadIdx.x
    keys, rows = scores.shape
    if r < rows:
        m = float32(-math.inf)
        for t in range(keys):                           # a first pass for the maximum
            m = max(m, scores[t, r])
        total = float32(0)
        acc = float32(0)
        for t in range(keys):                           # and a second for the sums: every score read twice
            p = math.exp(scores[t, r] - m)
            total += p
            acc += p * values[t, r]
        out[r] = acc / total


# --- exercise 4
@cuda.jit
def gather_pages_wrong(k_cache, cachestarts, kvlens, page_size, out):
    b = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    for t in range(out.shape[1]):
        if t < kvlens[b]:
            slot = cachestarts[b, t // page_size] + t   # the offset within the page is t % page_size
            out[b, t, lane] = k_cache[slot % k_cache.shape[0], lane]
        else:
            out[b, t, lane] = 0


@cuda.jit
def gather_pages_unsafe(k_cache, cachestarts, kvlens, page_size, out):
    b = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    for t in range(out.shape[1]):
        slot = cachestarts[b, t // page_size] + t % page_size   # looked up also past kvlens[b], in -1 pages
        x = k_cache[slot, lane]
        out[b, t, lane] = x if t < kvlens[b] else 0


# --- exercise 5
@cuda.jit
def dequantize_int8_wrong(k, scale, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = k.shape
    for i in range(lane, tokens * head_dim, 32):
        t, d = i // head_dim, i % head_dim
        out[t, d] = float32(k[t, d]) * float32(scale[t, d % scale.shape[1]])   # groups are d // 8


@cuda.jit
def dequantize_int8_slow(k, scale, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = k.shape
    for i in range(lane, tokens * head_dim, 32):
        d, t = i // tokens, i % tokens                  # t follows the lane
        out[t, d] = float32(k[t, d]) * float32(scale[t, d // 8])


# --- exercise 6
@cuda.jit
def gqa_values_wrong(probs, v, out):
    g = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    num_kv_heads = v.shape[1]
    acc = cuda.local.array(GROUP, float32)
    for j in range(GROUP):
        acc[j] = 0
    for t in range(v.shape[0]):
        x = v[t, g, lane]
        for j in range(GROUP):
            acc[j] += probs[g + j * num_kv_heads, t] * x   # heads g, g + Hkv, ...: interleaved, not grouped
    for j in range(GROUP):
        out[g + j * num_kv_heads, lane] = acc[j]


@cuda.jit
def gqa_values_slow(probs, v, out):
    g = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    for j in range(GROUP):                              # each query head walks the values on its own
        acc = float32(0)
        for t in range(v.shape[0]):
            acc += probs[g * GROUP + j, t] * v[t, g, lane]
        out[g * GROUP + j, lane] = acc


# --- exercise 7
@cuda.jit
def combine_splits_wrong(partial_out, partial_max, partial_sum, out):
    h = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    acc = float32(0)
    total = float32(0)
    for s in range(partial_out.shape[0]):
        weight = partial_sum[s, h]                      # each sum counts against its own split's maximum
        acc += weight * partial_out[s, h, lane]
        total += weight
    out[h, lane] = acc / total


@cuda.jit
def combine_splits_slow(partial_out, partial_max, partial_sum, out):
    h = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    m = float32(-math.inf)
    for s in range(partial_out.shape[0]):               # a first pass for the largest maximum
        m = max(m, partial_max[s, h])
    acc = float32(0)
    total = float32(0)
    for s in range(partial_out.shape[0]):
        weight = partial_sum[s, h] * math.exp(partial_max[s, h] - m)
        acc += weight * partial_out[s, h, lane]
        total += weight
    out[h, lane] = acc / total


# --- exercise 8
@cuda.jit
def warp_sum_wrong(x, out):
    r = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    v = x[r, lane]
    offset = 8                                      # starts at 8: each half of the warp sums only itself
    while offset >= 1:
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
        offset //= 2
    out[r, lane] = v


@cuda.jit
def warp_sum_slow(x, out):
    r = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    buf = cuda.shared.array(32, float32)            # a tree through shared memory: a barrier a step
    buf[lane] = x[r, lane]
    cuda.syncthreads()
    half = 16
    while half >= 1:
        if lane < half:
            buf[lane] += buf[lane + half]
        cuda.syncthreads()
        half //= 2
    out[r, lane] = buf[0]


@cuda.jit
def warp_sum_unsafe(x, out):
    r = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    buf = cuda.shared.array(32, float32)
    buf[lane] = x[r, lane]
    s = float32(0)
    for d in range(32):                             # no barrier: lane d's word may not be written yet
        s += buf[d]
    out[r, lane] = s


# --- exercise 9
@cuda.jit
def unpack_halves_wrong(k, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = k.shape
    chunks = head_dim // 8
    for c in range(lane, tokens * chunks, 32):
        t, j = c // chunks, c % chunks
        words = load16(k[t], 8 * j)
        for w in range(4):
            out[t, 8 * j + 2 * w] = half_from_bits(words[w] >> 16)     # the high half is the second element
            out[t, 8 * j + 2 * w + 1] = half_from_bits(words[w])


@cuda.jit
def unpack_halves_slow(k, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = k.shape
    chunks = head_dim // 8
    for c in range(lane, tokens * chunks, 32):
        t, j = c // chunks, c % chunks
        for e in range(8):                          # 8 two-byte loads: 8 requests where one would do
            out[t, 8 * j + e] = float32(k[t, 8 * j + e])


@cuda.jit
def unpack_halves_unsafe(k, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = k.shape
    chunks = head_dim // 8
    for c0 in range(0, tokens * chunks, 32):        # whole warps of chunks: the last may run past the rows
        c = c0 + lane
        t, j = c // chunks, c % chunks
        words = load16(k[t], 8 * j)
        if t < tokens:
            for w in range(4):
                out[t, 8 * j + 2 * w] = half_from_bits(words[w])
                out[t, 8 * j + 2 * w + 1] = half_from_bits(words[w] >> 16)


# --- exercise 10
def c_position_wrong(lane, e):
    group, thread = lane // 4, lane % 4
    return group + 8 * (e % 2), 2 * thread + e // 2     # c1 is the next column, not eight rows down


# --- exercise 11
@cuda.jit
def warp_scores_wrong(q, k, scores):
    lane = cuda.threadIdx.x
    for j in range(k.shape[0]):
        v = q[lane] * k[j, lane]
        offset = 16
        while offset > 1:                           # stops before the neighbours: pairs of lanes left unsummed
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
            offset //= 2
        if lane == 0:
            scores[j] = v


@cuda.jit
def warp_scores_slow(q, k, scores):
    lane = cuda.threadIdx.x
    keys = k.shape[0]
    for j in range(lane, keys, 32):                 # a thread per key: a request's lanes read 32 rows, 128 bytes apart
        s = float32(0)
        for d in range(32):
            s += q[d] * k[j, d]
        scores[j] = s


@cuda.jit
def warp_scores_unsafe(q, k, scores):
    lane = cuda.threadIdx.x
    buf = cuda.shared.array(32, float32)
    for j in range(k.shape[0]):
        buf[lane] = q[lane] * k[j, lane]
        if lane == 0:                               # no barrier: lane 0 sums words other lanes may not have written
            s = float32(0)
            for d in range(32):
                s += buf[d]
            scores[j] = s


# --- exercise 12
@cuda.jit
def split_partials_wrong(scores, values, partial_out, partial_max, partial_sum):
    c, h = cuda.blockIdx.x, cuda.blockIdx.y
    lane = cuda.threadIdx.x
    splits, keys = partial_max.shape[0], scores.shape[1]
    per = keys // splits                            # rounded down: the keys past splits x per belong to no split
    lo, hi = c * per, (c + 1) * per
    m = float32(-math.inf)
    total = float32(0)
    acc = float32(0)
    for t in range(lo, hi):
        s = scores[h, t]
        if s > m:
            rescale = math.exp(m - s)
            total *= rescale
            acc *= rescale
            m = s
        p = math.exp(s - m)
        total += p
        acc += p * values[t, lane]
    partial_out[c, h, lane] = acc
    if lane == 0:
        partial_max[c, h] = m
        partial_sum[c, h] = total


@cuda.jit
def split_partials_slow(scores, values, partial_out, partial_max, partial_sum):
    c, h = cuda.blockIdx.x, cuda.blockIdx.y
    lane = cuda.threadIdx.x
    splits, keys = partial_max.shape[0], scores.shape[1]
    per = (keys + splits - 1) // splits
    lo, hi = c * per, min(keys, (c + 1) * per)
    m = float32(-math.inf)
    for t in range(lo, hi):                         # a first pass for the maximum: every score read twice
        m = max(m, scores[h, t])
    total = float32(0)
    acc = float32(0)
    for t in range(lo, hi):
        p = math.exp(scores[h, t] - m)
        total += p
        acc += p * values[t, lane]
    partial_out[c, h, lane] = acc
    if lane == 0:
        partial_max[c, h] = m
        partial_sum[c, h] = total


@cuda.jit
def split_partials_unsafe(scores, values, partial_out, partial_max, partial_sum):
    c, h = cuda.blockIdx.x, cuda.blockIdx.y
    lane = cuda.threadIdx.x
    splits, keys = partial_max.shape[0], scores.shape[1]
    per = (keys + splits - 1) // splits
    lo, hi = c * per, (c + 1) * per                 # not clipped to the keys: the last splits read past the row
    m = float32(-math.inf)
    total = float32(0)
    acc = float32(0)
    for t in range(lo, hi):
        s = scores[h, t]
        if s > m:
            rescale = math.exp(m - s)
            total *= rescale
            acc *= rescale
            m = s
        p = math.exp(s - m)
        total += p
        acc += p * values[t, lane]
    partial_out[c, h, lane] = acc
    if lane == 0:
        partial_max[c, h] = m
        partial_sum[c, h] = total
