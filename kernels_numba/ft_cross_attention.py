"""FasterTransformer decoder cross attention on the GPU: the per-step attention on the shared online-softmax core.

One step is, in launch order:
    1. Q = input_query . Wq, and at step 1 K, V = encoder_output . Wk, Wv   the array module's matmul (cuBLAS)
    2. step 1 only: layout_kernel     the [B*L, H*Dh] projections into the cache layout; positions below the
                                      length of a running sequence get the K/V bias (then IA3) on the way
    3. query_bias_kernel              q + query bias, in T
    4. the attention kernel           keys [0, length) through the cache's addressing; a finished row has
                                      seqlen 0, so its block exits without writing; acc / (l + 1e-6).
                                      Rung 1: the shared online-softmax core; rung 3: the vector core
                                      (`_attention_vector`) walking the cache in 16-byte chunks; rung 4:
                                      rung 3 over num_splits key ranges, then `_split_k`'s combine
    5. probs_kernel (if asked)        row step - 1 of cross_attentions
    6. hidden_features = context . Wo
FasterTransformer adds the K/V bias inside its attention kernel at step 1 and writes the biased rows back.
Here that write-back happens in step 2 instead, fused with the transpose that lays the GEMM output out: the
core's key loads clamp t = min(t0 + j, kvlen - 1), so the last key is loaded more than once per tile and an
in-place add inside `load` would bias it twice. The cache ends up holding exactly what FasterTransformer's does.

Both cache layouts are read by one device-function pair: element d of key t, head h, batch b sits at
    b*s_b + h*s_h + t*s_t + (d // x) * chunk_stride + d % x
with (x, chunk_stride) = (16 bytes / sizeof(T), L*x) for the batch-major key cache [B, H, Dh/x, L, x] and
(Dh, 0) for a plain [.., t, .., Dh] tensor, where d // x is always 0.

Rungs 3 and 4 read a key chunk by chunk: chunk c of a row (elements c*E .. c*E + E - 1, E = 16 bytes / sizeof(T))
is 16 contiguous bytes in both layouts (the split key cache's x is E), at the row's offset plus
`chunk_offset(src, c*E)`. Keys are walked (`CACHE_WALKER`): a lane group keeps the element offset of its first key
in its sequence and steps it forward by the block's keys each step; a key of the tile adds its head's and its own
place.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numba import cuda

from ._attention_core import make_attention_kernel, plan_tiles
from ._attention_vector import make_vector_attention_kernel, plan_vector_rows
from ._launch import caller_stream, ceil_div, empty_like_kind, flat, launch, to_kind
from ._numerics import rounder
from ._split_k import combine_kernel
from ._vector import VECTOR_BYTES, float_from_bits, half_from_bits, load16

SUM_EPSILON = 1e-6        # FasterTransformer's inv_sum = 1 / (sum + 1e-6)
ELEMENTS_PER_THREAD = 16  # layout kernel: enough blocks to fill a GPU for real L, one block for a test's few keys


# ---------------------------------------------------------------------------------------------- cache addressing

def chunked_source(cache_tensor, x: int, chunk_stride: int, s_b: int, s_h: int, s_t: int):
    """(data, x, chunk_stride, s_b, s_h, s_t): see the module docstring."""
    i64 = np.int64
    return flat(cache_tensor), i64(x), i64(chunk_stride), i64(s_b), i64(s_h), i64(s_t)


def cache_sources(key_cache, value_cache, is_batch_major_cache: bool):
    """Sources over the key and value caches of either layout."""
    if is_batch_major_cache:
        batch, heads, chunks, length, x = key_cache.shape
        dim = chunks * x
        k = chunked_source(key_cache, x, length * x, heads * dim * length, dim * length, x)   # [B, H, Dh/x, L, x]
        v = chunked_source(value_cache, dim, 0, heads * length * dim, length * dim, dim)      # [B, H, L, Dh]
        return k, v
    batch, length, heads, dim = key_cache.shape                                                # [B, L, H, Dh]
    strides = (dim, 0, length * heads * dim, dim, heads * dim)
    return chunked_source(key_cache, *strides), chunked_source(value_cache, *strides)


@cuda.jit(device=True, inline="always")
def chunked_row(src, b, t, h):
    """(row, unused scale row): where key t of batch b, head h starts, before its chunk offset."""
    return src[3] * b + src[4] * h + src[5] * t, np.int64(0)


@cuda.jit(device=True, inline="always")
def chunk_offset(src, d):
    """Offset of element d from its row: chunk d // x, then position d % x inside the chunk."""
    x = src[1]
    return (d // x) * src[2] + d % x


@cuda.jit(device=True, inline="always")
def chunked_load(src, row, unused, d):
    return np.float32(src[0][row + chunk_offset(src, d)])


@cuda.jit(device=True, inline="always")
def plain_score(args, qk, b, h, i, j, seqlen, kvlen):
    return qk             # no mask, no bias: keys past the length are never visited


@cuda.jit(device=True, inline="always")
def length_range(args, b, i_first, i_last, seqlen, kvlen):
    return 0, kvlen       # kvlens = encoder_sequence_length


# Rungs 3 and 4: the walk over the cache (`_attention_vector.make_vector_attention_kernel`'s walker). The state is
# the element offset of a lane group's first key t0 in batch b, before the head's stride.
@cuda.jit(device=True, inline="always")
def _walk_begin(src, b, t0):
    return src[3] * b + src[5] * t0


@cuda.jit(device=True, inline="always")
def _walk_at(src, b, state, j, h):
    return state + src[4] * h + src[5] * j, np.int64(0)


@cuda.jit(device=True, inline="always")
def _walk_advance(src, state, step):
    return state + src[5] * step


CACHE_WALKER = (_walk_begin, _walk_at, _walk_advance)


def make_chunk_load(elements: int):
    """load_chunk(src, row, unused, d0, regs, at, dims) of the vector core: the 16 bytes of elements d0 ..
    d0 + elements - 1 of a row (d0 a multiple of `elements`, the chunk's first element) in one vector load,
    unpacked in registers as float32 (8 float16 or 4 float32 values)."""
    bits = 128 // elements
    per_word = 32 // bits
    field_mask = (1 << bits) - 1

    @cuda.jit(device=True, inline="always")
    def load_chunk(src, row, unused, d0, regs, at, dims):
        loaded = load16(src[0], row + chunk_offset(src, d0))
        for j in range(4):
            for k in range(per_word):                   # little-endian: element e is the e-th field from bit 0
                field = (loaded[j] >> (bits * k)) & field_mask
                regs[at + j * per_word + k] = half_from_bits(field) if bits == 16 else float_from_bits(field)

    return load_chunk


def fast_rung_problem(dtype, size_per_head: int, caches) -> str | None:
    """Why rungs 3 and 4 cannot read these caches (None: they can): their chunks are 16-byte loads of float16 or
    float32 values, so a row must be whole chunks and every cache must start on a 16-byte boundary (the strides
    are then multiples of 16 bytes in both layouts)."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float16, np.float32):
        return f"16-byte chunks of float16 or float32, got {dtype.name}"
    if (size_per_head * dtype.itemsize) % VECTOR_BYTES:
        return f"size_per_head {size_per_head} is not whole 16-byte chunks of {dtype.name}"
    for name, array in caches.items():
        interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
        if int(interface["data"][0]) % VECTOR_BYTES:
            return f"{name} does not start on a 16-byte boundary"
    return None


def vector_plan(head_dim: int, itemsize: int, threads: int):
    """(heads_per_block, q_tile, chunk) of rungs 3 and 4: one query row, one head a block (each head has its own
    keys), chunks of 16 bytes."""
    chunk = VECTOR_BYTES // itemsize
    heads_per_block, q_tile = plan_vector_rows(1, 1, 1, head_dim, chunk, threads // 32)
    return heads_per_block, q_tile, chunk


# ---------------------------------------------------------------------------------------------- kernels

@cache
def _attention_kernel(head_dim: int):
    """The core specialised for one head size (compiled per size: FasterTransformer dispatches 12 of them)."""
    # spec: ft/head-size-dispatch
    heads_per_block, q_tile, key_tile = plan_tiles(1, 1, 1, head_dim, head_dim)
    return make_attention_kernel(chunked_row, chunked_load, plain_score, length_range, head_dim_k=head_dim,
                                 head_dim_v=head_dim, heads_per_block=heads_per_block, q_tile=q_tile,
                                 key_tile=key_tile, group=1, sum_epsilon=SUM_EPSILON)


@cache
def _vector_kernel(head_dim: int, itemsize: int, threads: int, partials: bool):
    """Rung 3's kernel (rung 4's with partials) for one head size and cache element size."""
    heads_per_block, q_tile, chunk = vector_plan(head_dim, itemsize, threads)
    return make_vector_attention_kernel(chunked_row, make_chunk_load(chunk), plain_score, length_range,
                                        head_dim_k=head_dim, head_dim_v=head_dim, chunk=chunk,
                                        heads_per_block=heads_per_block, q_tile=q_tile, group=1, warps=threads // 32,
                                        partials=partials, walker=CACHE_WALKER, sum_epsilon=SUM_EPSILON)


@cache
def _layout_kernel(dtype: str, use_ia3: bool):
    """Kernel: step 1's [B, L, H*Dh] projection into the cache, biased (then IA3-scaled) where FasterTransformer's
    attention kernel would write back: t < length and the sequence not finished. Grid (x: a few blocks, y: B,
    z: 0 key / 1 value); a grid-stride loop gives each element of [L, H*Dh] to one thread, so no element is
    touched twice."""
    round_t = rounder(dtype)

    @cuda.jit
    def layout_kernel(k_proj, v_proj, k_bias, v_bias, lengths, finished, tasks, ia3_k, ia3_v, k_dst, v_dst,
                      mem_len, head_dim, hidden):
        b = cuda.blockIdx.y
        key = cuda.blockIdx.z == 0
        proj, bias, ia3, dst = (k_proj, k_bias, ia3_k, k_dst) if key else (v_proj, v_bias, ia3_v, v_dst)
        # spec: ft/finished
        biased = lengths[b] if not finished[b] else 0                     # positions [0, biased) get the bias
        for e in range(cuda.grid(1), mem_len * hidden, cuda.gridsize(1)):    # (t, h, d) of [L, H, Dh]
            t, h, d = e // hidden, (e % hidden) // head_dim, e % head_dim
            value = np.float32(proj[b * mem_len * hidden + e])
            if t < biased:
                value = round_t(value + np.float32(bias[h * head_dim + d]))      # bias in T
                if use_ia3:
                    value = round_t(value * np.float32(ia3[tasks[b] * hidden + h * head_dim + d]))
            row, _ = chunked_row(dst, b, t, h)
            dst[0][row + chunk_offset(dst, d)] = value

    return layout_kernel


@cache
def _query_bias_kernel(dtype: str):
    """Kernel: q[b, e] = q_buf[b, e] + query bias[e], in T. Grid (x: H*Dh / threads, y: B)."""
    round_t = rounder(dtype)

    @cuda.jit
    def query_bias_kernel(q_buf, q_bias, hidden, q):
        b = cuda.blockIdx.y
        e = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if e < hidden:
            q[b * hidden + e] = round_t(np.float32(q_buf[b * hidden + e]) + np.float32(q_bias[e]))

    return query_bias_kernel


@cache
def _probs_kernel(head_dim: int):
    """Kernel: cross_attentions[b, h, step - 1, t] for t < length, one thread per (b, h), three passes over the
    row (scores and their max, the sum, the normalisation), using the row itself as scratch. Grid (x: H / threads,
    y: B); a finished row returns at once."""

    @cuda.jit
    def probs_kernel(q, k_src, lengths, finished, num_heads, row_of_step, sm_scale, out):
        b = cuda.blockIdx.y
        h = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if h >= num_heads or finished[b]:
            return
        n = lengths[b]
        q_row = (b * num_heads + h) * head_dim
        row_max = np.float32(-math.inf)
        for t in range(n):
            row, _ = chunked_row(k_src, b, t, h)
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += np.float32(q[q_row + d]) * chunked_load(k_src, row, 0, d)
            s = dot * sm_scale
            out[b, h, row_of_step, t] = s
            row_max = max(row_max, s)
        total = np.float32(0.0)
        for t in range(n):
            total += math.exp(out[b, h, row_of_step, t] - row_max)
        inv_sum = np.float32(1.0) / (total + np.float32(SUM_EPSILON))
        for t in range(n):
            out[b, h, row_of_step, t] = math.exp(out[b, h, row_of_step, t] - row_max) * inv_sum

    return probs_kernel


# ---------------------------------------------------------------------------------------------- launcher

def _array_module(like):
    if isinstance(like, np.ndarray):
        return np
    import cupy
    return cupy


def _gemm(xp, a, b):
    """a . b accumulated in float32, rounded to a's dtype (cuBLAS with float32 compute; NumPy in the simulator)."""
    return xp.matmul(xp.asarray(a).astype(np.float32), xp.asarray(b).astype(np.float32)).astype(a.dtype)


def cross_attention(input_query, encoder_output, encoder_sequence_length, step, key_cache, value_cache,
                    finished=None, ia3_tasks=None, context_buf=None, cross_attentions=None, *, weights, head_num,
                    size_per_head, q_scaling=1.0, is_batch_major_cache=True, threads=128, rung=1, num_splits=1):
    """(hidden_features, context). Inputs are validated by `cacheattn`; key_cache, value_cache, context_buf and
    cross_attentions are written in place. rung: the attention kernel (launch 4 in the module docstring), 1, 3 or
    4 (`cacheattn.ft` plans it; 3 and 4 need `fast_rung_problem` to be None); num_splits: rung 4's key ranges."""
    xp = _array_module(input_query)
    like = input_query
    stream = caller_stream(input_query, key_cache)
    dtype = np.dtype(input_query.dtype)
    batch, mem_len = encoder_output.shape[:2]
    hidden = head_num * size_per_head
    use_ia3 = ia3_tasks is not None
    if finished is None:
        finished = to_kind(like, np.zeros(batch, np.bool_))

    def bias(dense):     # a null bias pointer adds nothing
        return xp.zeros(hidden, dtype) if dense.bias is None else dense.bias

    # 1. QKV generation: Q every step, K/V of the encoder output at step 1; no bias in any GEMM.
    # spec: ft/q-every-step
    q_buf = _gemm(xp, input_query, weights.query_weight.kernel)                 # [B, H*Dh]
    k_src, v_src = cache_sources(key_cache, value_cache, is_batch_major_cache)
    # spec: ft/step, ft/kv-from-encoder, ft/kv-once, ft/store-first-step
    if step == 1:
        memory = encoder_output.reshape(batch * mem_len, -1)                     # [B*L, mem_d_model]
        k_proj = _gemm(xp, memory, weights.key_weight.kernel)                    # [B*L, H*Dh]
        v_proj = _gemm(xp, memory, weights.value_weight.kernel)
        unread = bias(weights.key_weight)                     # stands in for absent IA3 weights (never read)
        ia3 = (weights.ia3_key_weight.kernel, weights.ia3_value_weight.kernel) if use_ia3 else (unread, unread)
        tasks = ia3_tasks if use_ia3 else to_kind(like, np.zeros(batch, np.int64))
        grid = (max(1, ceil_div(mem_len * hidden, threads * ELEMENTS_PER_THREAD)), batch, 2)
        launch(_layout_kernel(dtype.str, use_ia3), grid, threads, stream, flat(k_proj), flat(v_proj),
               bias(weights.key_weight), bias(weights.value_weight), encoder_sequence_length, finished, tasks,
               flat(ia3[0]), flat(ia3[1]), k_src, v_src, np.int64(mem_len), np.int64(size_per_head),
               np.int64(hidden))

    # 2. output generation: query bias, then attention over keys [0, length) of running sequences.
    q = empty_like_kind(like, (batch, hidden), dtype)
    launch(_query_bias_kernel(dtype.str), (max(1, ceil_div(hidden, threads)), batch), threads, stream, flat(q_buf),
           bias(weights.query_weight), np.int64(hidden), flat(q))
    context = xp.zeros((batch, hidden), dtype) if context_buf is None else context_buf
    sm_scale = np.float32(1.0 / (math.sqrt(size_per_head) * q_scaling))
    # spec: ft/finished
    seqlens = (~xp.asarray(finished)).astype(np.int64)          # one query row; a finished sequence has none
    zero_starts = to_kind(like, np.zeros(batch, np.int64))
    geometry = (zero_starts, np.int64(hidden), np.int64(0), np.int64(size_per_head))    # [B, H*Dh], one row
    # spec: ft/read-from-cache
    if rung == 1:
        launch(_attention_kernel(size_per_head), (1, head_num, batch), threads, stream, (flat(q), *geometry),
               (flat(context), *geometry), seqlens, encoder_sequence_length, k_src, v_src, (np.int64(0),), sm_scale)
    else:
        _attend_fast(rung, num_splits, like, q, context, seqlens, encoder_sequence_length, k_src, v_src, sm_scale,
                     head_num, size_per_head, threads, stream)
    if cross_attentions is not None:
        launch(_probs_kernel(size_per_head), (max(1, ceil_div(head_num, threads)), batch), threads, stream, flat(q),
               k_src, encoder_sequence_length, finished, np.int64(head_num), np.int64(step - 1), sm_scale,
               cross_attentions)

    # 3. output linear over every row (a finished row's context is whatever the buffer held).
    # spec: ft/output-linear, ft/hidden-features
    return _gemm(xp, context, weights.attention_output_weight.kernel), context


def _attend_fast(rung, num_splits, like, q, context, seqlens, lengths, k_src, v_src, sm_scale, head_num, head_dim,
                 threads, stream):
    """Rung 3: the vector kernel, one block per (head, batch entry). Rung 4: its partials over num_splits key
    ranges (each split's m, l and unnormalised o per row), then one combine pass that finishes the softmax with
    FasterTransformer's 1 / (sum + 1e-6). Rows are addressed as tokens b of [B, H*Dh] (starts b, s_b 0), so the
    partials' (token, head) rows are distinct."""
    batch, hidden = context.shape
    itemsize = np.dtype(context.dtype).itemsize
    heads_per_block = vector_plan(head_dim, itemsize, threads)[0]
    rows = to_kind(like, np.arange(batch, dtype=np.int64))
    q_geom = (flat(q), rows, np.int64(0), np.int64(hidden), np.int64(head_dim))
    out_geom = (flat(context), rows, np.int64(0), np.int64(hidden), np.int64(head_dim))
    splits = num_splits if rung == 4 else 1
    grid = (1, head_num // heads_per_block, batch * splits)
    if splits == 1:
        launch(_vector_kernel(head_dim, itemsize, threads, False), grid, threads, stream, q_geom, out_geom, seqlens,
               lengths, k_src, v_src, (np.int64(0),), sm_scale)
        return
    o_part = empty_like_kind(like, (splits * batch * hidden,), np.float32)
    m_part, l_part = (empty_like_kind(like, (splits * batch * head_num,), np.float32) for _ in range(2))
    split_geom = (o_part, *out_geom[1:], np.int64(splits), np.int64(batch * hidden), np.int64(batch * head_num),
                  np.int64(head_num), m_part, l_part)
    launch(_vector_kernel(head_dim, itemsize, threads, True), grid, threads, stream, q_geom, split_geom, seqlens,
           lengths, k_src, v_src, (np.int64(0),), sm_scale)
    # A finished row has no token (new_starts), so the combine leaves its context row as it was.
    xp = _array_module(like)
    new_starts = xp.concatenate((xp.zeros(1, np.int64), xp.cumsum(seqlens))).astype(np.int64)
    launch(combine_kernel(context.dtype.str, head_num, head_dim, SUM_EPSILON),
           (max(1, ceil_div(hidden, threads)), batch), threads, stream, o_part, m_part, l_part, np.int64(splits),
           rows, new_starts, flat(context))
