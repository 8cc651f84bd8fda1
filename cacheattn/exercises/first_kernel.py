"""The first cache-attention kernel (docs/first-kernel.md): decode over a paged cache, one query token a sequence.

The cache is OpenPPL's paged layout 2 of one layer, K and V each (MaxT, num_kv_heads, head_dim), with a page table
`cachestarts` (batch, pages) of token offsets: token t of sequence b is slot cachestarts[b, t // page_size] +
t % page_size. One block of one warp (32 threads) per (sequence, query head); head_dim is 32, a dimension a lane.
"""

import math

import numpy as np
from numba import cuda, float32

MAX_KV = 128            # the most keys a sequence may hold: its scores live in shared memory


@cuda.jit
def decode_attention(query, k_cache, v_cache, cachestarts, kvlens, page_size, scale, out):
    b, h = cuda.blockIdx.x, cuda.blockIdx.y
    lane = cuda.threadIdx.x                                   # 32 lanes, one warp
    group = query.shape[1] // k_cache.shape[1]                # GQA: query heads per key/value head
    g = h // group                                            # the key/value head this query head reads
    kvlen = kvlens[b]
    scores = cuda.shared.array(MAX_KV, float32)

    # 1. scores: lane j takes keys j, j + 32, ... and walks the head dimension of each
    for t in range(lane, kvlen, 32):
        slot = cachestarts[b, t // page_size] + t % page_size
        s = float32(0)
        for d in range(32):
            s += float32(query[b, h, d]) * float32(k_cache[slot, g, d])
        scores[t] = s * scale
    cuda.syncthreads()

    # 2. softmax statistics: every lane reads every score (one word for the whole warp)
    m = float32(-math.inf)
    for t in range(kvlen):
        m = max(m, scores[t])
    total = float32(0)
    for t in range(kvlen):
        total += math.exp(scores[t] - m)

    # 3. output: lane d sums dimension d of the values, weighted by the probabilities
    acc = float32(0)
    for t in range(kvlen):
        slot = cachestarts[b, t // page_size] + t % page_size
        acc += math.exp(scores[t] - m) * float32(v_cache[slot, g, lane])
    out[b, h, lane] = acc / total


def tiled_decode_attention(width):
    """decode_attention with step 1 through a shared (32, width) tile of keys: 32 lanes load one key's 32
    dimensions side by side, then lane j reads key j's row of the tile."""

    @cuda.jit
    def kernel(query, k_cache, v_cache, cachestarts, kvlens, page_size, scale, out):
        b, h = cuda.blockIdx.x, cuda.blockIdx.y
        lane = cuda.threadIdx.x
        g = h // (query.shape[1] // k_cache.shape[1])
        kvlen = kvlens[b]
        scores = cuda.shared.array(MAX_KV, float32)
        tile = cuda.shared.array((32, width), float32)

        # 1. scores, 32 keys at a time: load the tile a key (row) at a time, lanes along the head dimension
        for t0 in range(0, kvlen, 32):
            for r in range(min(32, kvlen - t0)):
                t = t0 + r
                tile[r, lane] = k_cache[cachestarts[b, t // page_size] + t % page_size, g, lane]
            cuda.syncthreads()
            if t0 + lane < kvlen:
                s = float32(0)
                for d in range(32):
                    s += float32(query[b, h, d]) * tile[lane, d]
                scores[t0 + lane] = s * scale
            cuda.syncthreads()                                # the next tile overwrites this one

        # 2. and 3. as in decode_attention
        m = float32(-math.inf)
        for t in range(kvlen):
            m = max(m, scores[t])
        total = float32(0)
        for t in range(kvlen):
            total += math.exp(scores[t] - m)
        acc = float32(0)
        for t in range(kvlen):
            slot = cachestarts[b, t // page_size] + t % page_size
            acc += math.exp(scores[t] - m) * float32(v_cache[slot, g, lane])
        out[b, h, lane] = acc / total

    return kernel


def run(kernel, query, k_cache, v_cache, cachestarts, kvlens, page_size):
    """Launch `kernel` on one block of 32 threads per (sequence, query head); returns the float32 output, which
    starts as NaN so that an element the kernel never writes shows."""
    batch, num_heads, head_dim = query.shape
    if head_dim != 32 or max(kvlens) > MAX_KV:
        raise ValueError(f"head_dim must be 32 and every kvlen at most {MAX_KV}; got head_dim {head_dim}, "
                         f"kvlens {list(kvlens)}")
    out = np.full(query.shape, np.nan, np.float32)
    kernel[(batch, num_heads), 32](query, k_cache, v_cache, cachestarts, np.asarray(kvlens, np.int64), page_size,
                                   np.float32(1 / math.sqrt(head_dim)), out)
    return out
