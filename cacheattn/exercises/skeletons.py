"""The exercises' skeletons: each kernel has its signature, its launch and everything but the one idea the exercise
is about. Copy one, fill in the marked lines, and check it with `cacheattn.exercises.check(n, kernel)`.

Each runs as it stands, and fails its check: the outputs start as NaN, and the marked lines are what writes them.
Exercise 10's skeleton is a plain Python function, not a kernel: it answers with the wrong place.
"""
# The skeletons leave the lines that use their loop variables and locals to the reader:
# ruff: noqa: B007, F841

import math

from numba import cuda, float32

from kernels_numba._vector import half_from_bits, load16  # noqa: F401  (exercise 9 calls them)

GROUP = 2               # exercise 6: query heads per key/value head


@cuda.jit
def copy_head(k_cache, head, out):
    """Exercise 1, coalesced loads. out[t, d] = k_cache[t, head, d]. Launch: 1 block of 32 threads."""
    lane = cuda.threadIdx.x
    tokens, head_dim = out.shape
    for i in range(lane, tokens * head_dim, 32):
        # Fill in: which (t, d) is element i? Neighbouring lanes should read neighbouring bytes of k_cache.
        pass


@cuda.jit
def tile_scores(q, k, scores):
    """Exercise 2, a padded shared tile. scores[j] = sum_d q[d] k[j, d] for keys j < 32, through a shared tile
    loaded a key (row) at a time. Launch: 1 block of 32 threads; head_dim 32."""
    lane = cuda.threadIdx.x
    keys = k.shape[0]
    # Fill in: declare the shared tile, so that lane j reading row j, column d finds its own bank.
    for j in range(keys):
        pass            # Fill in: lanes along the row: tile[j, lane] = k[j, lane]
    cuda.syncthreads()
    if lane < keys:
        s = float32(0)
        for d in range(32):
            pass        # Fill in: s += q[d] * (row `lane`, column d of the tile)
        scores[lane] = s


@cuda.jit
def online_softmax(scores, values, out):
    """Exercise 3, online softmax. Row r (lane r) has scores[:, r] and values[:, r]; out[r] is the softmax-weighted
    sum of its values, in one pass over the keys. Launch: 1 block of 32 threads."""
    r = cuda.threadIdx.x
    keys, rows = scores.shape
    if r < rows:
        m = float32(-math.inf)          # the largest score so far
        total = float32(0)              # sum of exp(score - m) so far
        acc = float32(0)                # sum of exp(score - m) * value so far
        for t in range(keys):
            s = scores[t, r]
            # Fill in: a new largest score changes m: rescale total and acc, then add key t.
        out[r] = acc / total


@cuda.jit
def gather_pages(k_cache, cachestarts, kvlens, page_size, out):
    """Exercise 4, the page lookup. out[b, t] = the key of token t of sequence b for t < kvlens[b], zeros after.
    Launch: one block of 32 threads per sequence; head_dim 32."""
    b = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    for t in range(out.shape[1]):
        # Fill in: the cache slot of token t, through the page table (entries are token offsets; -1: no page).
        out[b, t, lane] = 0


@cuda.jit
def dequantize_int8(k, scale, out):
    """Exercise 5, int8 dequantization. out[t, d] = k[t, d] * scale[t, d // 8]: one float16 scale per group of 8.
    Launch: 1 block of 32 threads."""
    lane = cuda.threadIdx.x
    tokens, head_dim = k.shape
    for i in range(lane, tokens * head_dim, 32):
        t, d = i // head_dim, i % head_dim
        # Fill in: out[t, d] from the int8 code and its group's scale, in float32.


@cuda.jit
def gqa_values(probs, v, out):
    """Exercise 6, GQA sharing. out[h] = sum_t probs[h, t] * v[t, g] where g = h // GROUP, each value row read
    once for the GROUP query heads that share it. Launch: one block of 32 threads per key/value head; head_dim 32."""
    g = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    acc = cuda.local.array(GROUP, float32)
    for j in range(GROUP):
        acc[j] = 0
    for t in range(v.shape[0]):
        x = v[t, g, lane]
        # Fill in: add x to every query head of group g.
    for j in range(GROUP):
        pass            # Fill in: write each head's row of out.


@cuda.jit
def combine_splits(partial_out, partial_max, partial_sum, out):
    """Exercise 7, a split-K combine. Split s of the keys left partial_out[s, h] (its values weighted by its own
    softmax), partial_max[s, h] (its largest score) and partial_sum[s, h] (its sum of exp(score - max)); out[h] is
    attention over all the keys. Launch: one block of 32 threads per head; head_dim 32."""
    h = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    acc = float32(0)
    total = float32(0)
    for s in range(partial_out.shape[0]):
        pass            # Fill in: weigh split s by how much its sum counts against the largest score of all splits.
    out[h, lane] = acc / total


@cuda.jit
def warp_sum(x, out):
    """Exercise 8, a warp shuffle sum. out[r, lane] = sum_d x[r, d] in every lane, the lanes exchanging values
    with cuda.shfl_xor_sync (no shared memory, no barrier). Launch: one block of 32 threads per row."""
    r = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    v = x[r, lane]
    # Fill in: add the value of lane `lane ^ offset` for offset 16, 8, 4, 2, 1: then every lane holds the sum.
    out[r, lane] = v


@cuda.jit
def unpack_halves(k, out):
    """Exercise 9, unpacking a 16-byte chunk. out[t, d] = k[t, d] as float32 for a float16 k (tokens, 64): each lane
    takes 16-byte chunks of 8 halves, loads one with a single load16(row, first element), which returns four uint32
    words, and unpacks them with half_from_bits. Launch: 1 block of 32 threads."""
    lane = cuda.threadIdx.x
    tokens, head_dim = k.shape
    chunks = head_dim // 8                          # 16-byte chunks a row
    for c in range(lane, tokens * chunks, 32):
        t, j = c // chunks, c % chunks              # chunk c is halves 8j .. 8j + 7 of row t
        # Fill in: one load16 of the chunk; word w holds half 2w in its low 16 bits and half 2w + 1 in its high ones.


def c_position(lane, e):
    """Exercise 10, an mma fragment's position: the (row, col) in the 16x8 accumulator C (and D) of
    mma.sync.m16n8k16 of element e (0..3) of lane's fragment, as the PTX ISA lays it out. A plain Python function."""
    group, thread = lane // 4, lane % 4         # the ISA's groupID and threadID_in_group
    # Fill in: rows group and group + 8, two neighbouring columns a thread; e = 0, 1 first, then 2, 3.
    return 0, 0


@cuda.jit
def warp_scores(q, k, scores):
    """Exercise 11, a warp per key. scores[j] = sum_d q[d] k[j, d] for every key j: the warp takes one key at a time,
    lane d its dimension d, and sums the 32 products in registers (exercise 8's butterfly); no shared tile.
    Launch: 1 block of 32 threads."""
    lane = cuda.threadIdx.x
    for j in range(k.shape[0]):
        part = float32(0)
        # Fill in: lane `lane`'s product for key j, summed over the warp; one lane writes scores[j].


@cuda.jit
def split_partials(scores, values, partial_out, partial_max, partial_sum):
    """Exercise 12, split-K partials. Block (c, h) takes split c of head h's keys: ceil(keys / splits) keys a split,
    so the last splits may get fewer, or none. It writes its online-softmax state over those keys, unnormalised:
    partial_max[c, h] = m, partial_sum[c, h] = l = sum exp(s - m), partial_out[c, h, lane] = sum exp(s - m) v[lane];
    an empty split writes (-inf, 0, 0). Launch: a block of 32 threads per (split, head); head_dim 32."""
    c, h = cuda.blockIdx.x, cuda.blockIdx.y
    lane = cuda.threadIdx.x
    splits, keys = partial_max.shape[0], scores.shape[1]
    lo, hi = 0, 0           # Fill in: split c's keys [lo, hi), ceil(keys / splits) a split, none past the last key.
    m = float32(-math.inf)
    total = float32(0)
    acc = float32(0)
    for t in range(lo, hi):
        s = scores[h, t]
        if s > m:                                   # exercise 3's running maximum
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
