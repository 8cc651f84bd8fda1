"""The exercises' solutions: each passes its check (right, fast and safe). Try the exercise before reading one."""

import math

from numba import cuda, float32

from kernels_numba._vector import half_from_bits, load16

from .skeletons import GROUP


@cuda.jit
def copy_head(k_cache, head, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = out.shape
    for i in range(lane, tokens * head_dim, 32):
        t, d = i // head_dim, i % head_dim              # d follows the lane: 32 neighbouring floats a request
        out[t, d] = k_cache[t, head, d]


@cuda.jit
def tile_scores(q, k, scores):
    lane = cuda.threadIdx.x
    keys = k.shape[0]
    tile = cuda.shared.array((32, 33), float32)         # rows of 33 words: row j, column d is in bank (j + d) % 32
    for j in range(keys):
        tile[j, lane] = k[j, lane]
    cuda.syncthreads()
    if lane < keys:
        s = float32(0)
        for d in range(32):
            s += q[d] * tile[lane, d]
        scores[lane] = s


@cuda.jit
def online_softmax(scores, values, out):
    r = cuda.threadIdx.x
    keys, rows = scores.shape
    if r < rows:
        m = float32(-math.inf)
        total = float32(0)
        acc = float32(0)
        for t in range(keys):
            s = scores[t, r]
            if s > m:                                   # everything so far was weighted against the old maximum
                rescale = math.exp(m - s)
                total *= rescale
                acc *= rescale
                m = s
            p = math.exp(s - m)
            total += p
            acc += p * values[t, r]
        out[r] = acc / total


@cuda.jit
def gather_pages(k_cache, cachestarts, kvlens, page_size, out):
    b = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    for t in range(out.shape[1]):
        if t < kvlens[b]:                               # pages past the sequence's end are -1: never look them up
            slot = cachestarts[b, t // page_size] + t % page_size
            out[b, t, lane] = k_cache[slot, lane]
        else:
            out[b, t, lane] = 0


@cuda.jit
def dequantize_int8(k, scale, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = k.shape
    for i in range(lane, tokens * head_dim, 32):
        t, d = i // head_dim, i % head_dim
        out[t, d] = float32(k[t, d]) * float32(scale[t, d // 8])


@cuda.jit
def gqa_values(probs, v, out):
    g = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    acc = cuda.local.array(GROUP, float32)
    for j in range(GROUP):
        acc[j] = 0
    for t in range(v.shape[0]):
        x = v[t, g, lane]                               # one load serves the group's GROUP query heads
        for j in range(GROUP):
            acc[j] += probs[g * GROUP + j, t] * x
    for j in range(GROUP):
        out[g * GROUP + j, lane] = acc[j]


@cuda.jit
def combine_splits(partial_out, partial_max, partial_sum, out):
    h = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    m = float32(-math.inf)
    acc = float32(0)
    total = float32(0)
    for s in range(partial_out.shape[0]):               # one pass, with a running maximum (exercise 3)
        m_s = partial_max[s, h]
        if m_s > m:
            rescale = math.exp(m - m_s)
            acc *= rescale
            total *= rescale
            m = m_s
        weight = partial_sum[s, h] * math.exp(m_s - m)  # split s's sum, counted against the common maximum
        acc += weight * partial_out[s, h, lane]
        total += weight
    out[h, lane] = acc / total


@cuda.jit
def warp_sum(x, out):
    r = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    v = x[r, lane]
    offset = 16
    while offset >= 1:                              # a butterfly: lanes 16 apart, then 8, ..., then neighbours
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
        offset //= 2
    out[r, lane] = v                                # both partners add the same two numbers: one sum everywhere


@cuda.jit
def unpack_halves(k, out):
    lane = cuda.threadIdx.x
    tokens, head_dim = k.shape
    chunks = head_dim // 8
    for c in range(lane, tokens * chunks, 32):
        t, j = c // chunks, c % chunks
        words = load16(k[t], 8 * j)                 # one 16-byte load: 32 lanes ask for 512 neighbouring bytes
        for w in range(4):
            out[t, 8 * j + 2 * w] = half_from_bits(words[w])           # the low half is the first element
            out[t, 8 * j + 2 * w + 1] = half_from_bits(words[w] >> 16)


def c_position(lane, e):
    group, thread = lane // 4, lane % 4
    return group + 8 * (e // 2), 2 * thread + e % 2     # c0, c1 in row group; c2, c3 eight rows down


@cuda.jit
def warp_scores(q, k, scores):
    lane = cuda.threadIdx.x
    for j in range(k.shape[0]):
        v = q[lane] * k[j, lane]                    # lane d reads dimension d: key j's 128 bytes in one request
        offset = 16
        while offset >= 1:                          # exercise 8's butterfly: the dot product in every lane
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
            offset //= 2
        if lane == 0:
            scores[j] = v


@cuda.jit
def split_partials(scores, values, partial_out, partial_max, partial_sum):
    c, h = cuda.blockIdx.x, cuda.blockIdx.y
    lane = cuda.threadIdx.x
    splits, keys = partial_max.shape[0], scores.shape[1]
    per = (keys + splits - 1) // splits             # rounded up, so that splits x per covers every key
    lo, hi = c * per, min(keys, (c + 1) * per)      # past the last key: hi <= lo, an empty range
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
    partial_out[c, h, lane] = acc                   # an empty split: (-inf, 0, 0), which a combine weighs 0
    if lane == 0:
        partial_max[c, h] = m
        partial_sum[c, h] = total
