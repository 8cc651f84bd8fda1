"""TensorRT-LLM `gpt_attention` on the GPU (trtllm-gpt-attention.md), through the shared online-softmax core.

Two kernels per call in the common case, all on the caller's stream with no host sync between them, context and
generation entries together (in-flight batching); the variants below add a launch each:

1. preprocess (one thread per 16-byte chunk of a token's Q, K or V head row where float16 / bfloat16 rows and the
   tensors are aligned, else per element): QKV bias, rounding to the input dtype,
   RoPE (GPT-J / GPT-NeoX / long_rope / yarn, partial, linear or dynamic scaling; cos/sin read from the
   `rotary_cos_sin` table at the token's position, or computed from frequencies per entry from the host, or
   `rotary_inv_freq` as given, times the m-scale), Qwen's logn factor on Q, then
   - Q, K, V of the new tokens -> scratch (T, heads, Dh) in the input dtype, which holds every one exactly (the
     current tokens attend with their own unquantized K/V, as the reference's `keys[P:] = k_rot`); a generation
     entry on rungs 3 and 4 writes no Q (rung 5's decode kernel reads it) and, when the cache holds its K/V
     exactly, no K/V (see 2.),
   - K, V -> their cache slot (contiguous row, or paged block through the block offsets; cyclic with sinks and
     the paged bubble), quantized to INT8 or FP8 e4m3 bits on the fly. The same thread that read a token's
     K/V from `qkv` writes it: one pass.
2. attention (the core, fused): entry b's key t comes from the cache for t < past (beam indirection, cyclic slot,
   INT8 dequant / e4m3 decode) and from the scratch for t >= past; `score` applies the causal / window / sinks /
   custom mask (the context entries read it from `attention_packed_mask` when given, bit by bit in its fragment
   order), softcap, then ALiBi or the relative bias; `key_range` bounds the walk to the visible keys.
   Generation entries run on the kernel ladder instead (`trtllm_generation`, with the same score and key range):
   rung 5's decode kernel where it serves them (one beam, float16: the GQA group on tensor cores), else rung 3's
   vector kernel (rung 4 when multi-block splits them; `rung` picks; Q formed from qkv, the new K/V read from their
   cache slot when unquantized); context entries on rung 6 (float16 or bfloat16, keys all in the scratch) or
   rung 5 (float16) (`trtllm_context`, mma.sync).
Unfused context (context_fmha_type 0, and FP8 context FMHA): scores in global memory, softmax rows, P V.
Cross attention: a third kernel copies the context entries' encoder K/V (`cross_kv`) to the scratch and to
cache slots 0..L-1 in one pass; keys are then the encoder's (scratch in the context phase, the cache in
generation), every one visible, and the decoder's own K/V are not cached.
StreamingLLM: K is cached before RoPE; generation rotates the new token at min(past, W) and each cached key at
its index in the cache as it loads it (the context phase is dense: no window).

Read before write: the reference reads the cached keys and only then writes the new ones. Writing first is
the same unless a multi-token chunk wraps a cyclic cache (N > W): then a cached key a query still sees would be
overwritten, so that call writes the cache in a second launch of the preprocess kernel, after attention. Of
several new tokens that wrap onto one slot only the latest writes (as the reference's `_last_writer`).

The cache sources and score arguments are namedtuples read by field name. FP8 context FMHA runs on the unfused
path (it needs each row's final max before rounding the probabilities to e4m3, which the online softmax does not
have). Multi-block: with few blocks for the SMs, each block walks one of num_splits ranges of whole key tiles
(`split_keys`) and writes (m, l, o); a combine kernel reduces them (`choose_splits` picks the count; `num_splits`
forces it). bfloat16: the tensors of qkv's dtype (qkv, qkv_bias, the cache, cross_kv, relative_attention_bias,
the scratch and the output) are their bits (uint16), each element widened by a shift and every result stored
rounded to nearest even; rounds_as="bfloat16" keys the kernels, which round to bfloat16 where the reference rounds
to the input dtype (`bfloat16_call`). No float32 copy of any of them.

The modules, one way: `trtllm_common` holds what every kernel shares (the entry table, the cache's sources and
codes, RoPE, the access and score device functions); `trtllm_context` and `trtllm_generation` build the phases'
ladder kernels on it; this module, the launcher, holds the preprocess, cross, unfused and rung-1 kernels and calls
the steps in `run_layer`.
"""

from __future__ import annotations

import math
from collections import namedtuple
from functools import cache

import numpy as np
from numba import cuda

from ._attention_core import make_attention_kernel, plan_tiles
from ._cache import _address, token_head_item
from ._launch import bfloat16_bits, bfloat16_like, caller_stream, ceil_div, empty_like_kind, flat, launch, to_kind
from ._mma import pack_bf162, pack_half2
from ._numerics import BFLOAT16_BITS, bits_io, element_io, rounder
from ._split_k import choose_splits
from ._split_k import combine_kernel as _combine_kernel
from ._vector import VECTOR_BYTES, store16
from .trtllm_common import (
    ALIBI,
    ALIBI_WITH_SCALE,
    BEAM,
    BIDIRECTIONAL,
    CAUSAL,
    CHUNK,
    CONTEXT,
    FIRST_ROW,
    FP8_KV_CACHE,
    INT8_KV_CACHE,
    IS_CONTEXT,
    LONG_ROPE,
    MASK_TILE,
    NEW,
    PADDING,
    PAST,
    PROMPT,
    RELATIVE,
    ROPE_GPT_NEOX,
    ROPE_GPTJ,
    ROPE_TABLE,
    SCALING_DYNAMIC,
    SCALING_LINEAR,
    SEQUENCE,
    SLIDING_WINDOW_CAUSAL,
    TABLE_COLUMNS,
    TOKEN_START,
    YARN,
    KVSource,
    ScoreArgs,
    acc_type,
    chunked_preprocess_ok,
    cyclic_slot,
    e4m3_decode,
    make_cache_address,
    make_kv_codec,
    make_new_chunks,
    make_new_token,
    make_trt_access,
    make_trt_score,
    preprocess_items,
    score_features,
    vector_loads_ok,
)
from .trtllm_context import (
    context_grid,
    context_kernel_for,
    context_rung,
    flash_context_kernel,
    flash_grid,
    scratch_aligned,
    scratch_sources,
)
from .trtllm_generation import (
    attend_generation,
    attend_generation_register,
    register_problem,
    register_slot_map,
    register_splits,
    slot_map_reason,
)


@cache
def _attention_kernel(dtype, num_heads, num_kv_heads, head_size, quant, tiles, rope_style=0, rotary_dim=0,
                      partials=False):
    """The core for these shapes and tiles (plan_tiles' heads_per_block, q_tile, key_tile); rope_style/rotary_dim
    only for StreamingLLM (cached keys rotated on load); partials: the multi-block kernel writing (m, l, o) per
    split."""
    acc_t = acc_type(dtype)
    round_dtype = rounder(dtype)
    widen, narrow = bits_io(dtype)
    row_offsets, load = make_trt_access(quant, num_kv_heads, head_size, acc_t, round_dtype, rope_style, rotary_dim)
    score, key_range = make_trt_score(acc_t, dtype == BFLOAT16_BITS)
    heads_per_block, q_tile, key_tile = tiles
    return make_attention_kernel(row_offsets, load, score, key_range, head_dim_k=head_size, head_dim_v=head_size,
                                 heads_per_block=heads_per_block, q_tile=q_tile, key_tile=key_tile,
                                 group=num_heads // num_kv_heads, acc_dtype=acc_t, partials=partials,
                                 widen_q=widen, narrow_out=narrow)


@cache
def _unfused_kernels(dtype, num_heads, num_kv_heads, head_size, quant, rope_style=0, rotary_dim=0, fp8_fmha=False):
    """context_fmha_type 0: scores to global memory, softmax, P V, one thread per element each.

    scores (E, H, max new tokens, max keys): the (b, h, i, j) logit from the same score function as the fused
    kernel (hidden: -inf); then one thread per (b, h, i) row turns it into probabilities in place (a row with
    no visible key gives zeros); then one thread per output element sums P V. Grids: (x: elements / threads,
    y: entries), rows of an entry with no new tokens here (seqlens 0) do nothing.

    fp8_fmha (use_fp8_context_fmha): Q, K, V enter as e4m3 of x / s (the cache's scale; sm_scale carries s^2),
    the row's exp(score - max) is rounded to e4m3 for P V while its sum (`totals`) stays float32, and the output
    is (P V) * s / sum."""
    acc_t = acc_type(dtype)
    round_dtype = rounder(dtype)
    widen, narrow = element_io(dtype)
    row_offsets, load = make_trt_access(quant, num_kv_heads, head_size, acc_t, round_dtype, rope_style, rotary_dim)
    score, _ = make_trt_score(acc_t, dtype == BFLOAT16_BITS)
    H, DH, GROUP = num_heads, head_size, num_heads // num_kv_heads
    NEG_INF = acc_t(-math.inf)
    to_e4m3, _ = make_kv_codec(FP8_KV_CACHE, acc_t)

    @cuda.jit(device=True, inline="always")
    def fmha_input(x, inv_scale):
        """What the FMHA reads: x itself, or (FP8 context FMHA) the e4m3 value of x / s."""
        if fp8_fmha:
            return acc_t(e4m3_decode(to_e4m3(x, inv_scale)))
        return x

    @cuda.jit
    def scores_kernel(q, token_starts, seqlens, kvlens, k_src, args, sm_scale, inv_scale, scores):
        b = cuda.blockIdx.y
        idx = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        keys = scores.shape[3]
        i, h, j = idx // (H * keys), (idx // keys) % H, idx % keys
        if i >= seqlens[b] or j >= kvlens[b]:
            return
        index, where = row_offsets(k_src, b, j, h // GROUP)
        q_row = ((token_starts[b] + i) * H + h) * DH
        dot = acc_t(0.0)
        for d in range(DH):
            q_d = acc_t(widen(q[q_row + d]))
            dot += fmha_input(q_d, inv_scale) * fmha_input(load(k_src, index, where, d), inv_scale)
        scores[b, h, i, j] = score(args, dot * sm_scale, b, h, i, j, seqlens[b], kvlens[b])

    @cuda.jit
    def softmax_kernel(seqlens, kvlens, scores, totals):
        b = cuda.blockIdx.y
        idx = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        i, h = idx // H, idx % H
        if i >= seqlens[b]:
            return
        row_max = NEG_INF
        for j in range(kvlens[b]):
            row_max = max(row_max, scores[b, h, i, j])
        total = acc_t(0.0)
        if row_max != NEG_INF:
            for j in range(kvlens[b]):
                total += math.exp(scores[b, h, i, j] - row_max)
        if fp8_fmha:                                    # unnormalised e4m3 probabilities, the float32 sum apart
            totals[b, h, i] = total
            shift = acc_t(0.0) if row_max == NEG_INF else row_max
            for j in range(kvlens[b]):
                p = math.exp(scores[b, h, i, j] - shift)
                scores[b, h, i, j] = e4m3_decode(to_e4m3(p, np.float32(1.0)))
            return
        for j in range(kvlens[b]):
            scores[b, h, i, j] = math.exp(scores[b, h, i, j] - row_max) / total if total > 0 else acc_t(0.0)

    @cuda.jit
    def pv_kernel(token_starts, seqlens, kvlens, v_src, scores, totals, scale, inv_scale, out):
        b = cuda.blockIdx.y
        idx = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        i, h, d = idx // (H * DH), (idx // DH) % H, idx % DH
        if i >= seqlens[b]:
            return
        total = acc_t(0.0)
        for j in range(kvlens[b]):
            p = scores[b, h, i, j]
            if p != 0:                                  # a hidden key's value is never read
                index, where = row_offsets(v_src, b, j, h // GROUP)
                total += p * fmha_input(load(v_src, index, where, d), inv_scale)
        if fp8_fmha:
            row_sum = totals[b, h, i]
            total = total * scale / row_sum if row_sum > 0 else acc_t(0.0)
        out[((token_starts[b] + i) * H + h) * DH + d] = narrow(total)

    return scores_kernel, softmax_kernel, pv_kernel


@cache
def _preprocess_kernel(dtype, num_heads, num_kv_heads, head_size, rotary_dim, rope_style, quant, has_bias):
    """Kernel: bias, dtype rounding, RoPE of one element of a new token's Q/K/V head, then scratch and cache.

    Grid (x: ceil(max new tokens * (H + 2 Hkv) * Dh / threads), y: entries); one thread per element. A rotated
    element reads its pair partner too (both threads of a pair compute the same two inputs). A generation entry
    writes to the scratch only what `pre.generation_scratch` asks for (bit 1: Q, bit 2: K and V): the generation
    kernel of rungs 3 and 4 forms Q from qkv itself, and reads K and V from the cache when it holds them exactly."""
    acc_t = acc_type(dtype)
    # spec: trtllm/generation-mmha
    round_dtype = rounder(dtype)
    narrow = element_io(dtype)[1]
    encode, _ = make_kv_codec(quant, acc_t, dtype == BFLOAT16_BITS)
    cache_address = make_cache_address(head_size)
    element, rotated = make_new_token(dtype, num_heads, num_kv_heads, head_size, rotary_dim, rope_style, has_bias)
    H, HKV, DH = num_heads, num_kv_heads, head_size
    HEADS = H + 2 * HKV

    @cuda.jit(device=True, inline="always")
    def store(dst, pre, b, position, g, d, x):
        """x -> cache row b at the position's cyclic slot, unless a later new token of this call takes the slot."""
        src = dst
        length = pre.table[b, PAST] + pre.table[b, NEW]
        if position < src.sinks or position + (src.window - src.sinks) >= length:
            index = cache_address(src, b, cyclic_slot(position, src.window, src.sinks), g)
            src.cache[index + d] = encode(x, pre.inv_scale)

    @cuda.jit
    def preprocess_kernel(pre, new_starts):
        b, i, hh, d = token_head_item(new_starts, HEADS, DH)
        if i < 0:
            return
        wanted = 3 if pre.table[b, IS_CONTEXT] != 0 else pre.generation_scratch     # bit 1: Q, bit 2: K and V
        if hh < H and wanted & 1 == 0:
            return                                      # the generation kernel forms this query element itself
        scratch, kv_scratch = pre.write_scratch != 0 and wanted & 1 != 0, pre.write_scratch != 0 and wanted & 2 != 0
        token = pre.table[b, TOKEN_START] + i
        position = pre.table[b, PAST] + i
        rope_position = position
        if pre.streaming != 0 and pre.table[b, IS_CONTEXT] == 0:
            rope_position = min(position, pre.k_dst.window)   # StreamingLLM generation: the index in the cache
        y = rotated(pre, b, token, rope_position, hh, d)
        if hh < H:
            if pre.logn_on != 0:                        # Qwen's logn attention: Q scaled at its absolute position
                y = round_dtype(y * acc_t(pre.logn[position]))
            if scratch:
                pre.q_out[(token * H + hh) * DH + d] = narrow(y)
        elif hh < H + HKV:
            g = hh - H
            if kv_scratch:
                pre.k_out[(token * HKV + g) * DH + d] = narrow(y)
            if pre.write_cache != 0:               # StreamingLLM caches K before RoPE
                store(pre.k_dst, pre, b, position, g, d, element(pre, token, hh, d) if pre.streaming != 0 else y)
        else:
            g = hh - H - HKV
            if kv_scratch:
                pre.v_out[(token * HKV + g) * DH + d] = narrow(y)
            if pre.write_cache != 0:
                store(pre.v_dst, pre, b, position, g, d, y)

    return preprocess_kernel


@cache
def _preprocess_chunk_kernel(dtype, num_heads, num_kv_heads, head_size, rotary_dim, rope_style, quant, has_bias,
                             vector_cache):
    """Kernel: `_preprocess_kernel`'s work a thread per 16-byte chunk of a head row (`make_new_chunks`; GPT-NeoX:
    a chunk of the first rotary half with its partner chunk), bit for bit the same results.

    Grid (x: ceil(max new tokens * (H + 2 Hkv) * preprocess_items / threads), y: entries). qkv, the bias and the
    scratch are read and written in 16-byte vectors (the launcher found them aligned, `_preprocess_launch`), the
    cache too where `vector_cache` (unquantized, of the scratch's dtype, aligned rows), else element by element
    (INT8 / e4m3 codes)."""
    acc_t = acc_type(dtype)
    # spec: trtllm/generation-mmha
    round_dtype = rounder(dtype)
    bits = dtype == BFLOAT16_BITS
    pack = pack_bf162 if bits else pack_half2
    encode, _ = make_kv_codec(quant, acc_t, bits)
    cache_address = make_cache_address(head_size)
    chunk_starts, new_chunks = make_new_chunks(dtype, num_heads, num_kv_heads, head_size, rotary_dim, rope_style,
                                               has_bias)
    H, HKV, DH = num_heads, num_kv_heads, head_size
    HEADS = H + 2 * HKV
    ITEMS = preprocess_items(True, head_size, rope_style, rotary_dim)
    SPAN = 2 * CHUNK                                    # values a thread holds: up to two chunks
    PAIRED = rope_style == ROPE_GPT_NEOX and ITEMS < head_size // CHUNK     # some items own two chunks

    @cuda.jit(device=True, inline="always")
    def put(out, index, v, at):
        """v[at:at + CHUNK] rounded to the dtype (exact: they are rounded already) as 16 bytes at out[index]."""
        store16(out, index, pack(v[at], v[at + 1]), pack(v[at + 2], v[at + 3]), pack(v[at + 4], v[at + 5]),
                pack(v[at + 6], v[at + 7]))

    @cuda.jit(device=True, inline="always")
    def write(cache, index, v, at, inv_scale):
        """v[at:at + CHUNK] -> the cache from `index`: one vector store, or each element's code."""
        if vector_cache:
            put(cache, index, v, at)
        else:
            for e in range(CHUNK):
                cache[index + e] = encode(v[at + e], inv_scale)

    @cuda.jit
    def preprocess_kernel(pre, new_starts):
        b, i, hh, item = token_head_item(new_starts, HEADS, ITEMS)
        if i < 0:
            return
        wanted = 3 if pre.table[b, IS_CONTEXT] != 0 else pre.generation_scratch     # bit 1: Q, bit 2: K and V
        if hh < H and wanted & 1 == 0:
            return                                      # the generation kernel forms this query row itself
        scratch, kv_scratch = pre.write_scratch != 0 and wanted & 1 != 0, pre.write_scratch != 0 and wanted & 2 != 0
        past = pre.table[b, PAST]
        token = pre.table[b, TOKEN_START] + i
        position = past + i
        rope_position = position
        if pre.streaming != 0 and pre.table[b, IS_CONTEXT] == 0:
            rope_position = min(position, pre.k_dst.window)   # StreamingLLM generation: the index in the cache
        d0, d1 = chunk_starts(item)
        second = PAIRED and d1 >= 0                     # a GPT-NeoX pair of chunks (a compile-time False without)
        x = cuda.local.array(SPAN, acc_t)              # after the bias (StreamingLLM caches K so)
        y = cuda.local.array(SPAN, acc_t)              # after RoPE
        new_chunks(pre, b, token, rope_position, hh, d0, d1, x, y)
        if hh < H:
            if pre.logn_on != 0:                        # Qwen's logn attention: Q scaled at its absolute position
                logn = acc_t(pre.logn[position])
                for e in range(SPAN):
                    y[e] = round_dtype(y[e] * logn)
            if scratch:
                row = (token * H + hh) * DH
                put(pre.q_out, row + d0, y, 0)
                if second:
                    put(pre.q_out, row + d1, y, CHUNK)
            return
        # K or V: one path for both, the same arrays' types (code written once, the slot's arithmetic once)
        is_k = hh < H + HKV
        g = hh - H if is_k else hh - H - HKV
        if kv_scratch:
            out = pre.k_out if is_k else pre.v_out
            row = (token * HKV + g) * DH
            put(out, row + d0, y, 0)
            if second:
                put(out, row + d1, y, CHUNK)
        if pre.write_cache != 0:
            dst = pre.k_dst if is_k else pre.v_dst
            # Into its cyclic slot, unless a later new token of this call takes the slot.
            if position < dst.sinks or position + (dst.window - dst.sinks) >= past + pre.table[b, NEW]:
                index = cache_address(dst, b, cyclic_slot(position, dst.window, dst.sinks), g)
                if is_k and pre.streaming != 0:         # StreamingLLM caches K before RoPE (y is written already;
                    for e in range(SPAN):               # a copy, not a choice of array, keeps both in registers)
                        y[e] = x[e]
                write(dst.cache, index + d0, y, 0, pre.inv_scale)
                if second:
                    write(dst.cache, index + d1, y, CHUNK, pre.inv_scale)

    return preprocess_kernel


def _preprocess_launch(s: StepLaunch, pre, has_bias: bool) -> tuple:
    """(kernel, grid) of this layer's preprocess: a thread per 16-byte chunk where the dtype and RoPE allow it
    (`chunked_preprocess_ok`) and qkv, the bias and the scratch start on 16-byte boundaries (every row then does),
    else a thread per element. The cache is stored in vectors too where it holds the scratch's dtype unquantized
    with aligned rows (decided here, once per launch)."""
    arrays = (pre.qkv, pre.bias, pre.q_out, pre.k_out, pre.v_out) if has_bias else \
        (pre.qkv, pre.q_out, pre.k_out, pre.v_out)
    chunked = chunked_preprocess_ok(s.rounds_as, s.Dh, s.rope_style, s.rotary_dim) and \
        all(_address(a) % VECTOR_BYTES == 0 for a in arrays)
    items = preprocess_items(chunked, s.Dh, s.rope_style, s.rotary_dim)
    grid = (max(1, ceil_div(int(s.new.max()) * (s.H + 2 * s.Hkv) * items, s.threads)), s.E)
    if not chunked:
        return _preprocess_kernel(s.rounds_as, s.H, s.Hkv, s.Dh, s.rotary_dim, s.rope_style, s.quant, has_bias), grid
    cache = pre.k_dst.cache
    vector_cache = not s.quant and cache.dtype == pre.k_out.dtype and vector_loads_ok(cache, s.Dh)
    return _preprocess_chunk_kernel(s.rounds_as, s.H, s.Hkv, s.Dh, s.rotary_dim, s.rope_style, s.quant, has_bias,
                                    vector_cache), grid


@cache
def _cross_kernel(dtype, num_kv_heads, head_size, quant):
    """Kernel: the context entries' encoder K/V -> scratch (encoder token rows) and cache slots 0..L-1, encoded.

    Grid (x: ceil(longest encoder input * 2 Hkv * Dh / threads), y: entries); generation entries have no rows
    in enc_starts, so no thread."""
    # spec: trtllm/cross-attention
    acc_t = acc_type(dtype)
    round_dtype = rounder(dtype)
    widen, narrow = element_io(dtype)
    encode, _ = make_kv_codec(quant, acc_t, dtype == BFLOAT16_BITS)
    cache_address = make_cache_address(head_size)
    HKV, DH = num_kv_heads, head_size

    @cuda.jit(device=True, inline="always")
    def copy(out, dst, b, token, t, g, d, x, inv_scale, write_cache):
        out[(token * HKV + g) * DH + d] = narrow(x)
        if write_cache != 0:
            dst.cache[cache_address(dst, b, t, g) + d] = encode(x, inv_scale)

    @cuda.jit
    def cross_kernel(cross_kv, enc_starts, src_starts, k_out, v_out, k_dst, v_dst, inv_scale, write_cache):
        b, t, item, d = token_head_item(enc_starts, 2 * HKV, DH)
        if t < 0:
            return
        token = enc_starts[b] + t                       # the scratch row (context entries' encoder tokens, packed)
        source = src_starts[b] + t                      # cross_kv (encoder tokens, [K heads | V heads], Dh)
        x = round_dtype(acc_t(widen(cross_kv[(source * 2 * HKV + item) * DH + d])))
        if item < HKV:
            copy(k_out, k_dst, b, token, t, item, d, x, inv_scale, write_cache)
        else:
            copy(v_out, v_dst, b, token, t, item - HKV, d, x, inv_scale, write_cache)

    return cross_kernel


Preprocess = namedtuple("Preprocess", "qkv bias table inv_freq position_divisor cos_sin cos_sin_long inv_scale "
                                      "q_out k_out v_out k_dst v_dst write_scratch write_cache streaming logn logn_on "
                                      "generation_scratch")


# ---- Host side -----------------------------------------------------------------------------------------------

def rope_inv_freq(rotary_inv_freq, rotary_dim, base, scale_type, scale, max_positions, lengths, acc_t):
    """(entries, rotary_dim / 2) frequencies: `rotary_inv_freq` as given, or 1 / base^(2i / rotary_dim) with
    dynamic NTK scaling raising the base past max_positions for an entry of that length (after this step)."""
    if rotary_inv_freq is not None:
        freq = np.asarray(rotary_inv_freq).astype(acc_t)
        return np.repeat(freq[None, :], len(lengths), axis=0)     # a writable row per entry (rope_plan edits rows)
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    entry_base = np.full(len(lengths), float(base))
    longer = np.asarray(lengths) > max_positions
    if scale_type == SCALING_DYNAMIC and longer.any():
        long_lengths = np.asarray(lengths, np.float64)[longer]
        entry_base[longer] *= ((scale * long_lengths / max_positions) - (scale - 1)) ** (rotary_dim / (rotary_dim - 2))
    return (1.0 / entry_base[:, None] ** exponents[None, :]).astype(acc_t)


RopePlan = namedtuple("RopePlan", "inv_freq position_divisor cos_sin cos_sin_long table_at")


def rope_plan(like, *, position_embedding_type, rotary_dim, rotary_inv_freq, long_rope_rotary_inv_freq, rotary_cos_sin,
              long_rope_rotary_cos_sin, base, scale_type, scale, max_positions, original_max_positions, short_m_scale,
              long_m_scale, streamingllm, lengths, is_context, acc_t) -> RopePlan:
    """Per entry: frequencies, m-scale and which table (if any) it reads cos/sin from, as reference.
    trtllm_gpt_attention.rope_plan decides: long_rope takes the long frequencies and table for a whole phase once
    its longest sequence passes original_max_positions; the table serves unless dynamic scaling, a length past
    max_positions or StreamingLLM make the kernels recompute (times the m-scale of the newest position)."""
    E = len(lengths)
    long_phase = np.zeros(E, bool)
    if position_embedding_type == LONG_ROPE:
        for phase in (True, False):
            members = is_context == phase
            if members.any() and lengths[members].max() > original_max_positions:
                long_phase[members] = True
    freq = rope_inv_freq(rotary_inv_freq, rotary_dim, base, scale_type, scale, max_positions, lengths, acc_t)
    if long_phase.any():
        freq[long_phase] = np.asarray(long_rope_rotary_inv_freq).reshape(-1).astype(acc_t)
    recompute = (scale_type == SCALING_DYNAMIC) | (lengths > max_positions) | bool(streamingllm)
    table_at = np.where(recompute | (rotary_cos_sin is None), -1, long_phase.astype(np.int64)).astype(np.int64)
    m_scale = np.where(lengths - 1 <= original_max_positions, short_m_scale, long_m_scale).astype(acc_t)
    placeholder = to_kind(like, np.zeros(1, np.float32))
    divisor = float(scale) if scale_type == SCALING_LINEAR and rotary_inv_freq is None else 1.0
    # The m-scale rides as a last column of the frequencies: fewer kernel parameters than an array of its own.
    return RopePlan(inv_freq=to_kind(like, np.concatenate([freq, m_scale[:, None]], axis=1)),
                    position_divisor=np.float64(divisor),
                    cos_sin=flat(rotary_cos_sin) if rotary_cos_sin is not None else placeholder,
                    cos_sin_long=flat(long_rope_rotary_cos_sin) if long_rope_rotary_cos_sin is not None
                    else placeholder, table_at=table_at)


def entry_table(num_context, beam_width, past, new, context_lengths, token_starts, rope_tables=None) -> np.ndarray:
    """(entries, TABLE_COLUMNS) int64: see the column names. Generation entry e = C + bi*W + w reads the prompt
    from row C + bi*W and later tokens from row C + bi*W + cache_indirection[bi, w, slot]."""
    E = len(past)
    table = np.zeros((E, TABLE_COLUMNS), np.int64)
    table[:, TOKEN_START], table[:, PAST], table[:, NEW] = token_starts, past, new
    table[:num_context, IS_CONTEXT] = 1
    generation = np.arange(num_context, E)
    sequence, beam = np.divmod(generation - num_context, beam_width)
    table[num_context:, SEQUENCE], table[num_context:, BEAM] = sequence, beam
    table[num_context:, FIRST_ROW] = num_context + sequence * beam_width
    table[:, PROMPT] = context_lengths
    # The packed custom mask pads each entry's query rows to 128 (two 64-row m-tiles).
    table[:, MASK_TILE] = np.concatenate([[0], np.cumsum(-(-np.asarray(new) // 128) * 2)])[:-1]
    table[:, ROPE_TABLE] = -1 if rope_tables is None else rope_tables
    return table


def _kv_templates(*, block_offsets, indirection, table, k_scratch, v_scratch, tokens_per_block, window, sinks, like,
                  rope, rotate_keys):
    """KVSource for K and for V with the step's fields (tables uploaded once); _kv_sources fills in a layer's cache."""
    i64 = np.int64
    offsets = block_offsets[0] if block_offsets is not None else np.zeros((1, 2, 1), np.int32)
    if indirection is None:
        indirection = np.zeros((1, 1, 1), np.int32)
    common = dict(cache=None, table=table, offsets=to_kind(like, offsets), indirection=to_kind(like, indirection),
                  paged=i64(0), tokens_per_block=i64(tokens_per_block), layer_blocks=i64(0), s_row=i64(0),
                  s_kv=i64(0), s_head=i64(0), s_block=i64(0), window=i64(window), sinks=i64(sinks), bubble=i64(0),
                  scale=np.float32(1.0), inv_freq=rope.inv_freq, position_divisor=rope.position_divisor)
    return (KVSource(scratch=k_scratch, kv=i64(0), rotate=i64(rotate_keys), **common),
            KVSource(scratch=v_scratch, kv=i64(1), rotate=i64(0), **common))


def _kv_sources(templates, *, cache_array, paged, layer_idx, tokens_per_block, sinks, scale, num_kv_heads,
                head_size):
    """KVSource for K and for V (templates: _kv_templates) over one layer's contiguous cache (rows, 2, Hkv, slots,
    Dh) or the paged pool (blocks, layers, 2, Hkv, tokens_per_block, Dh); e4m3 caches are read and written as
    their bytes."""
    if cache_array is None:                             # use_cache=False: every key is a new token
        cache_array, paged = templates[0].scratch, False
    elif np.dtype(cache_array.dtype).itemsize == 1 and np.dtype(cache_array.dtype).kind not in "iu":
        cache_array = cache_array.view(np.uint8)        # float8_e4m3fn: numba has no fp8 type
    i64 = np.int64
    if paged:
        tpb = tokens_per_block
        s_head, s_block, s_row, s_kv = tpb * head_size, num_kv_heads * tpb * head_size, 0, 0
        bubble = (tpb - sinks % tpb) % tpb
    else:
        slots = cache_array.shape[3] if cache_array.ndim == 5 else 1
        s_head, s_block = slots * head_size, 0
        s_kv = num_kv_heads * s_head
        s_row, bubble = 2 * s_kv, 0
    layer = dict(cache=flat(cache_array), paged=i64(paged), layer_blocks=i64(2 * layer_idx), s_row=i64(s_row),
                 s_kv=i64(s_kv), s_head=i64(s_head), s_block=i64(s_block), bubble=i64(bubble), scale=np.float32(scale))
    return templates[0]._replace(**layer), templates[1]._replace(**layer)


def _mask_and_bias(attention_mask, attention_packed_mask, relative_attention_bias, position_embedding_type,
                   max_distance, mask_type, like):
    """ScoreArgs fields of the custom mask (mask_cols 0: none) and the relative attention bias (relative 0: none,
    1: the regular (H, L, L) table, 2: T5 buckets (H, num_buckets) with max_distance)."""
    placeholder = to_kind(like, np.zeros(1, np.float32))
    fields = dict(mask=to_kind(like, np.ones(1, np.bool_)), mask_cols=np.int64(0), bias=placeholder,
                  relative=np.int64(0), bias_len=np.int64(0), max_distance=np.int64(max_distance),
                  bidirectional=np.int64(mask_type in (PADDING, BIDIRECTIONAL)),
                  packed=to_kind(like, np.zeros(1, np.int32)), packed_words=np.int64(0))
    if attention_packed_mask is not None:
        fields.update(packed=flat(attention_packed_mask), packed_words=np.int64(attention_packed_mask.shape[-1]))
    if attention_mask is not None:
        fields.update(mask=flat(attention_mask), mask_cols=np.int64(attention_mask.shape[-1]))
    if relative_attention_bias is not None:
        fields.update(_relative_bias(relative_attention_bias, position_embedding_type, max_distance))
    return fields


def _relative_bias(relative_attention_bias, position_embedding_type, max_distance):
    """ScoreArgs fields of the relative attention bias (a layer's own table): none unless position type relative."""
    if position_embedding_type != RELATIVE:
        return {}
    return dict(bias=flat(relative_attention_bias), relative=np.int64(2 if max_distance > 0 else 1),
                bias_len=np.int64(relative_attention_bias.shape[1]))


def _cross_keys(qkv, cross_kv, encoder_input_lengths, num_context, table, k_src, v_src, rounds_as, Hkv, Dh, quant,
                kv_orig_quant_scale, use_cache, threads, stream, remove_input_padding):
    """Cross attention's keys: launch the cross kernel, and return (key table, kv lengths, K source, V source).

    In the key table a context entry has past 0 (every key from the scratch, at its encoder token rows), a
    generation entry past L (every key from cache slot t of its own row: FIRST_ROW = itself, no prompt to share).
    The window is unbounded: the encoder's L slots never cycle."""
    lengths = np.asarray(encoder_input_lengths, np.int64)
    E = lengths.shape[0]
    context_lengths = np.where(np.arange(E) < num_context, lengths, 0)
    enc_starts = np.concatenate([[0], np.cumsum(context_lengths)]).astype(np.int64)
    # Entry b's encoder tokens in cross_kv: packed like the scratch, or padded at row b of (E, L_max, 2 Hkv Dh).
    src_starts = enc_starts[:-1] if remove_input_padding else np.arange(E, dtype=np.int64) * cross_kv.shape[1]
    rows = max(1, int(enc_starts[-1]))
    k_scratch = empty_like_kind(qkv, (rows * Hkv * Dh,), _allocated(rounds_as, k_src.scratch.dtype))
    v_scratch = empty_like_kind(qkv, (rows * Hkv * Dh,), _allocated(rounds_as, k_src.scratch.dtype))
    unbounded = np.int64(1 << 40)
    k_src = k_src._replace(scratch=k_scratch, window=unbounded)
    v_src = v_src._replace(scratch=v_scratch, window=unbounded)
    if enc_starts[-1] > 0:
        grid = (max(1, ceil_div(int(context_lengths.max()) * 2 * Hkv * Dh, threads)), E)
        launch(_cross_kernel(rounds_as, Hkv, Dh, quant), grid, threads, stream, flat(cross_kv),
               to_kind(qkv, enc_starts), to_kind(qkv, src_starts), k_scratch, v_scratch, k_src, v_src,
               np.float32(kv_orig_quant_scale if quant else 1.0), np.int64(use_cache))
    keys = np.zeros((E, TABLE_COLUMNS), np.int64)
    keys[:, TOKEN_START] = enc_starts[:-1]
    keys[:, PAST] = lengths - context_lengths
    keys[:num_context, IS_CONTEXT] = 1
    keys[:, FIRST_ROW] = np.arange(E)
    keys[:, PROMPT] = unbounded
    table = to_kind(qkv, keys)
    return table, lengths, k_src._replace(table=table), v_src._replace(table=table)


# The inputs TensorRT-LLM hands each layer's plugin; everything else of a call is the batch step's (the index
# tensors) or the model's (attributes), the same for every layer of one step.
LAYER_INPUTS = ("qkv", "past_key_value", "kv_cache_pool", "layer_idx", "qkv_bias", "kv_orig_quant_scale",
                "kv_quant_orig_scale", "cross_kv", "relative_attention_bias")


def gpt_attention(*, qkv, past_key_value, attention_mask, sequence_length, host_past_key_value_lengths,
                  host_max_attention_window_sizes, host_sink_token_length, context_lengths, cache_indirection,
                  host_request_types, layer_idx, num_heads, num_kv_heads, hidden_size_per_head, q_scaling,
                  attn_logit_softcapping_scale=0.0, rotary_embedding_dim=0, rotary_embedding_base=10000.0,
                  rotary_embedding_scale_type=0, rotary_embedding_short_m_scale=1.0, rotary_embedding_long_m_scale=1.0,
                  rotary_embedding_scale=1.0, rotary_embedding_max_positions=1024,
                  rotary_embedding_original_max_positions=1024, position_embedding_type=0, rotary_inv_freq=None,
                  rotary_cos_sin=None, long_rope_rotary_inv_freq=None, long_rope_rotary_cos_sin=None,
                  logn_scaling=None, attention_packed_mask=None, kv_orig_quant_scale=None, kv_quant_orig_scale=None,
                  kv_cache_quant_mode=0, mask_type=CAUSAL, alibi_slopes=None, kv_cache_block_offsets=None,
                  do_cross_attention=False, cross_kv=None, encoder_input_lengths=None, relative_attention_bias=None,
                  max_distance=0, qkv_bias=None, use_cache=True, remove_input_padding=True, paged_kv_cache=False,
                  tokens_per_block=64, streamingllm=False, use_fp8_context_fmha=False, kv_cache_pool=None,
                  context_fmha_type=1, multi_block_mode=True, max_context_length=None, host_context_lengths=None,
                  cross_kv_length=None, host_kv_cache_block_offsets=None, num_splits=None, num_sms=None, threads=128,
                  rung=None, rounds_as=None):
    """(output, present_key_value), the cache written in place: reference.gpt_attention's arguments (validated
    by cacheattn.gpt_attention; index tensors on the host), data arrays CuPy / CAI, or NumPy in the simulator.

    Every entry runs the fused online-softmax kernel, one block per (entry, query tile, head group), except the
    context entries with context_fmha_type 0 (disabled), which take the unfused path (scores in global memory,
    softmax, P V) as TensorRT-LLM's unfused context attention; both compute the same. multi_block_mode lets
    `choose_splits` split each block's keys over several blocks when the grid is smaller than num_sms (default:
    the GPU's, 132 without one); num_splits forces a count (1: never split). bfloat16: see _bfloat16_via_float32
    (rounds_as is its internal argument: "bfloat16" when the arrays are bfloat16 bits).

    rung: the kernel of the ladder for the generation entries (docs/kernel-ladder.md). 1: the tiled core above; 3:
    the vector kernel (`trtllm_generation`), never split; 4: the vector kernel split over num_splits blocks
    (`choose_splits` when None; 1 is rung 3's kernel); 5: rung 5's decode kernel where it serves the step
    (`trtllm_generation.register_problem`), split as rung 4, else as None; None: rung 5's decode kernel where it
    serves (split where multi_block_mode splits), else rung 3, or 4 when multi_block_mode splits. Rungs 3 to 5
    accumulate in float32: a float64 call runs on rung 1 (validation refuses it when forced). Context entries run on
    rung 6 or 5, or 1 (`trtllm_context.context_rung`); 6 asks for rung 6 there (the generation entries as with
    None); num_splits is then the generation kernel's count.

    It is exactly `run_layer(prepare_step(...), ...)`: a plan (cacheattn.GptAttentionPlan) keeps the step and
    calls run_layer once per layer."""
    call = locals()
    if np.dtype(qkv.dtype).name == "bfloat16":
        bits = bfloat16_call(call)
        return bfloat16_results(call, *gpt_attention(**bits))
    layer = {name: call[name] for name in LAYER_INPUTS}
    step = {name: value for name, value in call.items() if name not in LAYER_INPUTS}
    window = int(host_max_attention_window_sizes[layer_idx % len(host_max_attention_window_sizes)])  # list repeats
    return run_layer(prepare_step(like=qkv, window=window, **step), **layer)


class StepLaunch:
    """What a batch step's launches share over its layers: the entry table and the RoPE plan uploaded once, the
    scratch buffers, the kernels and the grids (prepare_step builds it; run_layer reads its attributes)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def prepare_step(*, like, window, sequence_length, host_past_key_value_lengths, context_lengths, cache_indirection,
                 host_request_types, num_heads, num_kv_heads, hidden_size_per_head, q_scaling, attention_mask,
                 attn_logit_softcapping_scale, rotary_embedding_dim, rotary_embedding_base,
                 rotary_embedding_scale_type, rotary_embedding_short_m_scale, rotary_embedding_long_m_scale,
                 rotary_embedding_scale, rotary_embedding_max_positions, rotary_embedding_original_max_positions,
                 position_embedding_type, rotary_inv_freq, rotary_cos_sin, long_rope_rotary_inv_freq,
                 long_rope_rotary_cos_sin, logn_scaling, attention_packed_mask, kv_cache_quant_mode, mask_type,
                 alibi_slopes, kv_cache_block_offsets, do_cross_attention, encoder_input_lengths, max_distance,
                 use_cache, remove_input_padding, paged_kv_cache, tokens_per_block, streamingllm,
                 use_fp8_context_fmha, context_fmha_type, multi_block_mode, host_sink_token_length, num_splits,
                 num_sms, threads, rung, rounds_as, choose_context=None, **unused) -> StepLaunch:
    """The launches' step-wide part for layers whose qkv is shaped, typed and placed like `like` and whose window is
    `window`: everything but the per-layer inputs (LAYER_INPUTS), computed and uploaded once. The rows, lengths,
    RoPE plan and entry table first, then each step's plan in run_layer's order: the generation phase's kernel
    (`_plan_generation`), the preprocess (`_plan_preprocess`), the scores (`_score_args`), the context phase's
    launch (`_plan_context`). choose_context(**shape) -> (rung 6 wins, why): the caller's choice between rungs 5 and
    6 for the context entries' shape (the bound model, a layer above the kernels); None takes rung 6 where both
    serve."""
    H, Hkv, Dh = num_heads, num_kv_heads, hidden_size_per_head
    dtype = np.dtype(like.dtype)
    rounds_as = rounds_as or dtype.name                 # the kernels' keys: the dtype whose roundings they emulate
    acc_t = acc_type(dtype)
    past = np.asarray(host_past_key_value_lengths, np.int64)
    lengths = np.asarray(sequence_length, np.int64)
    new = lengths - past
    E = len(past)
    num_context = int((np.asarray(host_request_types) == CONTEXT).sum())
    beam_width = int(cache_indirection.shape[1]) if cache_indirection is not None else 1
    sinks = int(host_sink_token_length[0])
    quant = kv_cache_quant_mode & (INT8_KV_CACHE | FP8_KV_CACHE)

    # Token rows: packed entries follow each other; padded entry e owns rows e * max_seqlen + i.
    new_starts = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
    token_starts = new_starts[:-1] if remove_input_padding else np.arange(E, dtype=np.int64) * like.shape[1]
    num_tokens = like.shape[0] if remove_input_padding else E * like.shape[1]
    # long_rope and yarn rotate GPT-NeoX's halves.
    rope_style = {ROPE_GPTJ: ROPE_GPTJ, ROPE_GPT_NEOX: ROPE_GPT_NEOX, LONG_ROPE: ROPE_GPT_NEOX,
                  YARN: ROPE_GPT_NEOX}.get(position_embedding_type, 0)
    rotary_dim = rotary_embedding_dim if rope_style else 0
    rope = rope_plan(like, position_embedding_type=position_embedding_type, rotary_dim=rotary_dim,
                     rotary_inv_freq=rotary_inv_freq, long_rope_rotary_inv_freq=long_rope_rotary_inv_freq,
                     rotary_cos_sin=rotary_cos_sin if rope_style else None,
                     long_rope_rotary_cos_sin=long_rope_rotary_cos_sin, base=rotary_embedding_base,
                     scale_type=rotary_embedding_scale_type, scale=rotary_embedding_scale,
                     max_positions=rotary_embedding_max_positions,
                     original_max_positions=rotary_embedding_original_max_positions,
                     short_m_scale=rotary_embedding_short_m_scale, long_m_scale=rotary_embedding_long_m_scale,
                     streamingllm=streamingllm, lengths=lengths,
                     is_context=np.arange(E) < num_context, acc_t=acc_t)
    table = to_kind(like, entry_table(num_context, beam_width, past, new, np.asarray(context_lengths, np.int64),
                                      token_starts, rope.table_at))
    # Every Q, K, V value the preprocess writes is rounded to the input dtype already: the scratch holds them in it.
    # The layers of a step run one after another on the stream, so they share the scratch.
    held = _allocated(rounds_as, dtype)
    q_scratch = empty_like_kind(like, (num_tokens * H * Dh,), held)
    k_scratch = empty_like_kind(like, (num_tokens * Hkv * Dh,), held)
    v_scratch = empty_like_kind(like, (num_tokens * Hkv * Dh,), held)
    rotate_cached = bool(streamingllm and rope_style)   # StreamingLLM: cached K rotated at its cache index on load
    # A chunk that wraps the cyclic cache would overwrite keys its own queries read: write after attention.
    write_after = bool(use_cache) and not do_cross_attention and bool(((new > 1) & (lengths > window)).any())
    kvlens = np.asarray(encoder_input_lengths, np.int64) if do_cross_attention else lengths

    generation = _plan_generation(
        like, rung=None if rung == 6 else rung, acc_t=acc_t, rotate_cached=rotate_cached, write_after=write_after,
        num_context=num_context,
        new=new, kvlens=kvlens, num_splits=num_splits, multi_block_mode=multi_block_mode, num_sms=num_sms,
        rounds_as=rounds_as, head_size=Dh, num_heads=H, num_kv_heads=Hkv, quant=quant, threads=threads,
        use_cache=bool(use_cache), cross=bool(do_cross_attention), beam_width=beam_width, sinks=sinks,
        streaming=rotate_cached, window=window)
    pre, pre_grid = _plan_preprocess(
        like, table=table, rope=rope, logn_scaling=logn_scaling, scratch=(q_scratch, k_scratch, v_scratch),
        write_cache=bool(use_cache) and not write_after and not do_cross_attention, streamingllm=streamingllm,
        generation=generation, new=new, num_heads=H, num_kv_heads=Hkv, head_size=Dh, threads=threads)
    args = _score_args(like, table=table, acc_t=acc_t, window=window, sinks=sinks, streamingllm=streamingllm,
                       alibi_slopes=alibi_slopes, attn_logit_softcapping_scale=attn_logit_softcapping_scale,
                       mask_type=mask_type, do_cross_attention=do_cross_attention, attention_mask=attention_mask,
                       attention_packed_mask=attention_packed_mask, position_embedding_type=position_embedding_type,
                       max_distance=max_distance)
    context = _plan_context(
        like, rung=rung, rounds_as=rounds_as, acc_t=acc_t, num_heads=H, num_kv_heads=Hkv, head_size=Dh,
        num_context=num_context, new=new, kvlens=kvlens, threads=threads, num_splits=num_splits,
        multi_block_mode=multi_block_mode, num_sms=num_sms, context_fmha_type=context_fmha_type,
        use_fp8_context_fmha=use_fp8_context_fmha, vector_generation=generation["vector_generation"],
        choose_context=choose_context,
        keys_elsewhere=("cross attention reads the encoder's keys" if do_cross_attention else
                        "a chunked context (past > 0) reads earlier keys from the cache"
                        if (past[:num_context] > 0).any() else
                        "" if scratch_aligned(k_scratch, v_scratch) else "the scratch is not 16-byte aligned"))
    # spec: trtllm/norm-factor
    sm_scale = acc_t(1.0 / (q_scaling * math.sqrt(Dh)))
    return StepLaunch(
        rounds_as=rounds_as, acc_t=acc_t, H=H, Hkv=Hkv, Dh=Dh, E=E, new=new, num_context=num_context, window=window,
        sinks=sinks, quant=quant, rope_style=rope_style, rotary_dim=rotary_dim, rope=rope, table=table,
        num_tokens=num_tokens, rotate_cached=rotate_cached, write_after=write_after, pre=pre, pre_grid=pre_grid,
        starts_arg=to_kind(like, new_starts), args=args, kvlens=kvlens,
        rope_on_load=(rope_style, rotary_dim) if rotate_cached else (0, 0), num_sms=num_sms,
        multi_block_mode=multi_block_mode,
        q_geom=(q_scratch, to_kind(like, token_starts), np.int64(0), np.int64(H * Dh), np.int64(Dh)),
        sm_scale=sm_scale,
        kv_templates=_kv_templates(block_offsets=kv_cache_block_offsets, indirection=cache_indirection, table=table,
                                   k_scratch=k_scratch, v_scratch=v_scratch, tokens_per_block=tokens_per_block,
                                   window=window, sinks=sinks, like=like, rope=rope, rotate_keys=rotate_cached),
        paged_kv_cache=paged_kv_cache, use_cache=use_cache, tokens_per_block=tokens_per_block,
        remove_input_padding=remove_input_padding, do_cross_attention=do_cross_attention,
        encoder_input_lengths=encoder_input_lengths, position_embedding_type=position_embedding_type,
        max_distance=max_distance, threads=threads, rung=rung, k_scratch=k_scratch, v_scratch=v_scratch,
        q_scratch=q_scratch, **generation, **context)


def _plan_generation(like, *, rung, acc_t, rotate_cached, write_after, num_context, new, kvlens, num_splits,
                     multi_block_mode, num_sms, **facts) -> dict:
    """The generation phase's part of the step (StepLaunch fields): whether the masked MHA runs on the kernel
    ladder, on which rung (`_generation_choice`; facts: `trtllm_generation.register_problem`'s), whether the new
    token is read back from its cache slot, and the lengths and rows its launches take."""
    E = len(new)
    # Rungs 3 and 4 (trtllm_generation) take the generation entries (float32 accumulation); rung 1 the rest. Their
    # kernel forms Q from qkv itself, and reads the new token's K/V back from the cache slot the preprocess writes
    # when it holds them as the document attends with them (unquantized, after RoPE, written before attention): no
    # scratch for those entries then.
    generation = np.arange(E) >= num_context
    vector_generation = rung != 1 and acc_t == np.float32 and facts["use_cache"] and bool(generation.any())
    new_in_cache = vector_generation and not facts["quant"] and not rotate_cached and not write_after
    generation_new = np.where(generation, new, 0)
    register, register_splits, generation_reason = _generation_choice(
        vector_generation, rung, generation_new=new[num_context:], generation_kvlens=kvlens[num_context:],
        num_splits=num_splits, multi_block_mode=multi_block_mode, num_sms=num_sms, new=generation_new, kvlens=kvlens,
        **facts)
    return dict(vector_generation=vector_generation, new_in_cache=new_in_cache, register_generation=register,
                register_splits=register_splits, generation_reason=generation_reason, generation_new=generation_new,
                generation_starts=to_kind(like, np.concatenate([[0], np.cumsum(generation_new)]).astype(np.int64)),
                generation_lens=(to_kind(like, generation_new), to_kind(like, kvlens)),
                contiguous_starts=to_kind(like, np.zeros((E, 1), np.int64)), generation_splits=num_splits,
                register_slots=register_slot_map(sinks=facts["sinks"], beam_width=facts["beam_width"],
                                                 generation_kvlens=kvlens[num_context:], window=facts["window"],
                                                 cross=facts["cross"]))


def _plan_preprocess(like, *, table, rope, logn_scaling, scratch, write_cache, streamingllm, generation, new,
                     num_heads, num_kv_heads, head_size, threads) -> tuple:
    """(Preprocess arguments without the layer's arrays, grid) of the preprocess kernel: what it writes where, and
    for the generation entries what their kernel reads from the scratch (`generation`: _plan_generation's)."""
    q_scratch, k_scratch, v_scratch = scratch
    vector_generation, register, new_in_cache = (generation[k] for k in ("vector_generation", "register_generation",
                                                                         "new_in_cache"))
    pre = Preprocess(qkv=None, bias=None, table=table, inv_freq=rope.inv_freq, position_divisor=rope.position_divisor,
                     cos_sin=rope.cos_sin, cos_sin_long=rope.cos_sin_long,
                     logn=flat(logn_scaling) if logn_scaling is not None else to_kind(like, np.ones(1, np.float32)),
                     logn_on=np.int64(logn_scaling is not None), inv_scale=np.float32(1.0), q_out=q_scratch,
                     k_out=k_scratch, v_out=v_scratch, k_dst=None, v_dst=None, write_scratch=np.int64(1),
                     write_cache=np.int64(write_cache), streaming=np.int64(streamingllm),
                     # bit 1: Q (rung 5 reads it), bit 2: K and V (the new token not in the cache as attended)
                     generation_scratch=np.int64((register | 2 * (not new_in_cache)) if vector_generation else 3))
    heads = num_heads + 2 * num_kv_heads
    return pre, (max(1, ceil_div(int(new.max()) * heads * head_size, threads)), len(new))


def _score_args(like, *, table, acc_t, window, sinks, streamingllm, alibi_slopes, attn_logit_softcapping_scale,
                mask_type, do_cross_attention, attention_mask, attention_packed_mask, position_embedding_type,
                max_distance) -> ScoreArgs:
    """The score function's arguments for the step (a layer's relative attention bias and cross attention's keys
    are filled in per layer)."""
    placeholder = to_kind(like, np.zeros(1, np.float32))
    alibi_on = position_embedding_type in (ALIBI, ALIBI_WITH_SCALE)
    return ScoreArgs(table=table, alibi=widened_slopes(alibi_slopes) if alibi_on else placeholder,
                     alibi_on=np.int64(alibi_on),
                     softcap=acc_t(attn_logit_softcapping_scale),
                     causal=np.int64(mask_type in (CAUSAL, SLIDING_WINDOW_CAUSAL) and not do_cross_attention),
                     window=np.int64(window), sinks=np.int64(sinks), streaming=np.int64(streamingllm),
                     **_mask_and_bias(attention_mask, attention_packed_mask, None, position_embedding_type,
                                      max_distance, mask_type, like))


def _plan_context(like, *, rung, rounds_as, acc_t, num_heads, num_kv_heads, head_size, num_context, new, kvlens,
                  threads, num_splits, multi_block_mode, num_sms, context_fmha_type, use_fp8_context_fmha,
                  vector_generation, choose_context=None, keys_elsewhere="") -> dict:
    """The context phase's part of the step (StepLaunch fields): the unfused path or not, and the fused launch's
    entries, rung (`trtllm_context.context_rung`), tiles, split count and grid. The fused launch also takes the
    generation entries that do not run on the kernel ladder (`vector_generation` False)."""
    H, Hkv, Dh, E = num_heads, num_kv_heads, head_size, len(new)
    max_new = int(new.max())
    # One kernel for every length past 16 query tokens.
    tiles = plan_tiles(H, Hkv, min(max_new, 16), Dh, Dh, np.dtype(acc_t).itemsize)
    heads_per_block, q_tile, key_tile = tiles
    q_blocks = max(1, ceil_div(max_new, q_tile)) * (H // heads_per_block) * E
    # spec: trtllm/multi-block
    generation_splits = num_splits
    num_splits = None if vector_generation else num_splits     # a forced count is the generation kernel's
    if num_splits is None:
        num_splits = choose_splits(q_blocks, int(np.max(kvlens)), key_tile, num_sms) if multi_block_mode else 1
    # context_fmha_type 0 (disabled): the context entries take the unfused path, the fused kernel the rest.
    # spec: trtllm/context-unfused, trtllm/fp8-context-fmha
    fp8_fmha = bool(use_fp8_context_fmha) and num_context > 0
    unfused = (context_fmha_type == 0 or fp8_fmha) and num_context > 0
    fused_new = np.where(np.arange(E) < num_context, 0, new) if unfused else new
    if vector_generation:
        fused_new = np.where(np.arange(E) >= num_context, 0, fused_new)
    # The context entries of the fused launch on rung 6 or 5 (tensor cores) where they can serve them
    # (trtllm_context); between the two, the caller's choice (the bound model) for the context entries' shape.
    def flash_wins():
        return choose_context(batch=max(num_context, 1), max_query_len=max(int(fused_new.max()), 2),
                              max_kv_len=int(np.max(kvlens[:max(num_context, 1)])), num_heads=H, num_kv_heads=Hkv,
                              head_dim=Dh, query_dtype=rounds_as, threads=threads, sms=num_sms)

    # A fused launch with nothing to run asks nothing of its rung: rung 5 asked for a bfloat16 step of generation
    # entries alone is the decode kernel's (rung 5's context kernel multiplies float16 only).
    asked = None if rung == 5 and not fused_new.any() else rung
    fused_rung, fused_reason = context_rung(rung=asked, rounds_as=rounds_as, head_size=Dh, threads=threads,
                                            fused_generation=bool((fused_new[num_context:] > 0).any()),
                                            num_splits=generation_splits if not vector_generation else None,
                                            keys_elsewhere=keys_elsewhere,
                                            flash_wins=flash_wins if choose_context is not None else None)
    mma_plan, grid = None, (max(1, ceil_div(max_new, q_tile)), H // heads_per_block, E * num_splits)
    if fused_rung == 6:
        num_splits = 1
        grid = flash_grid(H, int(fused_new.max()), threads, E)
    if fused_rung == 5:
        num_splits = 1
        mma_plan, grid = context_grid(H, Hkv, Dh, int(fused_new.max()), threads, E)
    return dict(tiles=tiles, num_splits=num_splits, grid=grid, fused_rung=fused_rung, fused_reason=fused_reason,
                context_keys=int(np.max(kvlens[:num_context], initial=0)), mma_plan=mma_plan, fp8_fmha=fp8_fmha,
                unfused=unfused, fused=bool(fused_new.any()),
                lens=(to_kind(like, fused_new), to_kind(like, kvlens)),
                fused_starts=to_kind(like, np.concatenate([[0], np.cumsum(fused_new)]).astype(np.int64)))


def _generation_choice(vector_generation, rung, *, num_splits, multi_block_mode, num_sms, new, kvlens,
                       **facts) -> tuple:
    """(rung 5's decode kernel or not, its split count, why) for the step's generation entries: with rung None or
    5, where its conditions hold (`trtllm_generation.register_problem`); split as rung 4 would be (multi-block
    mode with None, always with 5) where its blocks leave SMs idle."""
    if not vector_generation:
        return False, 1, "no generation entries on the vector rungs"
    if rung not in (None, 5):
        return False, 1, f"rung={rung} asked for"
    why = register_problem(**facts)
    if why is not None:
        return False, 1, f"rung 3/4: {why}"
    splits = register_splits(rung, num_splits, multi_block_mode, num_sms, new, kvlens, facts["window"],
                             facts["num_heads"], facts["num_kv_heads"], facts["threads"])
    split = f", its keys split {splits} ways (multi-block)" if splits > 1 else ""
    mapped = slot_map_reason(sinks=facts["sinks"], beam_width=facts["beam_width"],
                             generation_kvlens=facts["generation_kvlens"], window=facts["window"], cross=facts["cross"])
    return True, splits, ("rung 5's decode kernel: the GQA group on tensor cores, K/V loaded into the mma's "
                          f"registers{mapped}{split}")


def run_layer(s: StepLaunch, *, qkv, past_key_value, kv_cache_pool, layer_idx, qkv_bias, kv_orig_quant_scale,
              kv_quant_orig_scale, cross_kv, relative_attention_bias):
    """One layer's launches on the step `s` (prepare_step for this qkv's shape, dtype and kind and this layer's
    window): (output, present_key_value), the cache written in place. Per layer only the layer's own arrays enter
    the kernels' arguments; nothing is read back from the device and nothing but the output is allocated (cross
    attention's encoder scratch apart).

    The steps of TensorRT-LLM's attention plugin, in its order, on the caller's stream: the preprocess (QKV bias,
    RoPE, the KV cache written), the generation phase's masked multi-head attention (multi-block: split and
    combined), the context phase (unfused, or the fused context FMHA with its multi-block combine), and the cache
    write a wrapping chunk leaves until after attention."""
    stream = caller_stream(qkv, past_key_value, kv_cache_pool)
    k_src, v_src = _layer_kv_sources(s, past_key_value, kv_cache_pool, layer_idx, kv_quant_orig_scale)
    pre = s.pre._replace(qkv=flat(qkv), bias=flat(qkv_bias) if qkv_bias is not None else flat(qkv)[:1],
                         inv_scale=np.float32(kv_orig_quant_scale if s.quant else 1.0), k_dst=k_src, v_dst=v_src)
    preprocess = _preprocess_launch(s, pre, qkv_bias is not None)
    qkv_preprocessing(s, preprocess, pre, stream)
    output = empty_like_kind(qkv, qkv.shape[:-1] + (s.H * s.Dh,), _allocated(s.rounds_as, qkv.dtype))
    if not s.remove_input_padding:
        output[...] = 0                                 # padding rows are zero, as the reference's
    args, k_src, v_src = _layer_keys(s, qkv, cross_kv, relative_attention_bias, k_src, v_src, kv_orig_quant_scale,
                                     stream)
    out_geom = (flat(output), s.q_geom[1], np.int64(0), np.int64(s.H * s.Dh), np.int64(s.Dh))
    if s.vector_generation:
        masked_multihead_attention(s, pre, out_geom, k_src, v_src, args, stream, qkv_bias is not None)
    if s.unfused:
        unfused_context(s, output, k_src, v_src, args, stream,
                        (kv_orig_quant_scale, kv_quant_orig_scale) if s.fp8_fmha else None)
    if s.fused:
        partials = context_fmha(s, qkv, out_geom, k_src, v_src, args, stream)
        if partials is not None:
            multi_block_combine(s, partials, output, stream)
    if s.write_after:
        write_cache_after_attention(s, preprocess, pre, stream)
    present = past_key_value if (s.use_cache and not s.paged_kv_cache) else None
    return output, present


def _layer_kv_sources(s: StepLaunch, past_key_value, kv_cache_pool, layer_idx, kv_quant_orig_scale) -> tuple:
    """The step's K and V sources over this layer's cache (the contiguous cache, or its layer of the pool)."""
    cache_array = (kv_cache_pool if s.paged_kv_cache else past_key_value) if s.use_cache else None
    return _kv_sources(s.kv_templates, cache_array=cache_array, paged=s.paged_kv_cache, layer_idx=layer_idx,
                       tokens_per_block=s.tokens_per_block, sinks=s.sinks,
                       scale=kv_quant_orig_scale if s.quant else 1.0, num_kv_heads=s.Hkv, head_size=s.Dh)


def qkv_preprocessing(s: StepLaunch, preprocess, pre, stream) -> None:
    """The preprocess (`preprocess`: its kernel and grid, `_preprocess_launch`): QKV bias, RoPE and logn, the new
    tokens' Q/K/V to the scratch and their K/V to the cache (unless a wrapping chunk writes it after attention,
    `write_cache_after_attention`)."""
    kernel, grid = preprocess
    launch(kernel, grid, s.threads, stream, pre, s.starts_arg)


def _layer_keys(s: StepLaunch, qkv, cross_kv, relative_attention_bias, k_src, v_src, kv_orig_quant_scale,
                stream) -> tuple:
    """(score arguments, K source, V source) of this layer: its relative attention bias; with cross attention the
    encoder's keys (the cross kernel copies them to the scratch and the cache), every one in view."""
    args = s.args
    if relative_attention_bias is not None:
        args = args._replace(**_relative_bias(relative_attention_bias, s.position_embedding_type, s.max_distance))
    if s.do_cross_attention:
        table, _, k_src, v_src = _cross_keys(qkv, cross_kv, s.encoder_input_lengths, s.num_context, s.table, k_src,
                                             v_src, s.rounds_as, s.Hkv, s.Dh, s.quant, kv_orig_quant_scale,
                                             bool(s.use_cache), s.threads, stream, s.remove_input_padding)
        args = args._replace(table=table, window=k_src.window)      # the encoder's keys: every one in view
    return args, k_src, v_src


def masked_multihead_attention(s: StepLaunch, pre, out_geom, k_src, v_src, args, stream, has_bias: bool) -> None:
    """The generation phase (the document's masked multi-head attention) on the kernel ladder: rung 5's decode
    kernel where the step and this layer's arrays allow it, else rung 3's vector kernel, or rung 4's when
    multi-block splits it (each with its combine, `trtllm_generation`)."""
    # spec: trtllm/generation-mmha, trtllm/multi-block
    if s.register_generation and attend_generation_register(
            s.q_geom, out_geom, s.generation_lens, k_src, v_src, args, s.sm_scale, s.H, s.Hkv, s.Dh, s.quant,
            s.new_in_cache, s.threads, stream, s.contiguous_starts, s.register_splits, s.num_tokens,
            s.generation_starts, s.rounds_as, s.register_slots, s.do_cross_attention):
        return
    attend_generation(None if s.rung in (5, 6) else s.rung, s.generation_splits, s.multi_block_mode, s.num_sms, pre,
                      out_geom, s.generation_new, s.kvlens, k_src, v_src, args, s.sm_scale, s.rounds_as, s.H, s.Hkv,
                      s.Dh, s.quant, s.rope_on_load, s.new_in_cache, s.num_tokens, s.threads, stream,
                      (s.rotary_dim, s.rope_style, has_bias))


def unfused_context(s: StepLaunch, output, k_src, v_src, args, stream, fp8_scales=None) -> None:
    """The context phase with context_fmha_type 0 (and FP8 context FMHA): the context entries' scores in global
    memory (E, H, max new, max keys), softmax rows, then P V into the output; generation entries have 0 rows here.
    fp8_scales: the cache's (1 / s, s) for FP8 context FMHA."""
    E, H, Dh, acc_t, threads = s.E, s.H, s.Dh, s.acc_t, s.threads
    context_new = np.where(np.arange(E) < s.num_context, s.new, 0)
    rows, keys = int(context_new.max()), int(np.max(s.kvlens[:s.num_context]))
    like, token_starts = s.q_scratch, s.q_geom[1]
    scores = empty_like_kind(like, (E, H, rows, keys), acc_t)
    seqlens, kv = to_kind(like, context_new), to_kind(like, s.kvlens)
    totals = empty_like_kind(like, (E, H, rows), acc_t)
    inv_scale, scale = (np.float32(x) for x in (fp8_scales or (1.0, 1.0)))
    sm_scale = s.sm_scale
    if fp8_scales:
        sm_scale = acc_t(float(sm_scale) * float(scale) * float(scale))   # (q / s).(k / s) * s^2 = q.k
    scores_kernel, softmax_kernel, pv_kernel = _unfused_kernels(s.rounds_as, H, s.Hkv, Dh, s.quant, *s.rope_on_load,
                                                                fp8_scales is not None)
    launch(scores_kernel, (max(1, ceil_div(rows * H * keys, threads)), E), threads, stream, s.q_scratch,
           token_starts, seqlens, kv, k_src, args, sm_scale, inv_scale, scores)
    launch(softmax_kernel, (max(1, ceil_div(rows * H, threads)), E), threads, stream, seqlens, kv, scores, totals)
    launch(pv_kernel, (max(1, ceil_div(rows * H * Dh, threads)), E), threads, stream, token_starts, seqlens, kv,
           v_src, scores, totals, acc_t(scale), inv_scale, flat(output))


def context_fmha(s: StepLaunch, qkv, out_geom, k_src, v_src, args, stream):
    """The fused context FMHA: the context entries on rung 6 or 5 (tensor cores; rung 6 reads K and V from the
    scratch), or on rung 1's tiles with any generation entries the ladder does not take. Returns rung 1's
    multi-block partials (o, m, l) for `multi_block_combine`, or None when the launch wrote the output itself."""
    if s.fused_rung == 6:
        kernel = flash_context_kernel(s.rounds_as, s.H, s.Hkv, s.Dh, s.threads,
                                      score_features(args, s.context_keys))
        k_rows, v_rows = scratch_sources(s.k_scratch, s.v_scratch, s.q_geom[1], s.Hkv, s.Dh)
        q_bits = (s.q_geom[0].view(np.uint16), *s.q_geom[1:])
        out_bits = (out_geom[0].view(np.uint16), *out_geom[1:])
        launch(kernel, s.grid, s.threads, stream, q_bits, out_bits, *s.lens, k_rows, v_rows, args,
               np.float32(s.sm_scale))
        return None
    if s.fused_rung == 5:
        kernel = context_kernel_for(k_src, v_src, s.H, s.Hkv, s.Dh, s.quant, s.threads, s.mma_plan, s.rope_on_load)
        launch(kernel, s.grid, s.threads, stream, s.q_geom, out_geom, *s.lens, k_src, v_src, args,
               np.float32(s.sm_scale))
        return None
    kernel = _attention_kernel(s.rounds_as, s.H, s.Hkv, s.Dh, s.quant, s.tiles, *s.rope_on_load, s.num_splits > 1)
    if s.num_splits == 1:
        launch(kernel, s.grid, s.threads, stream, s.q_geom, out_geom, *s.lens, k_src, v_src, args, s.sm_scale)
        return None
    # Multi-block: each split's (m, l, unnormalised o) per row, combined after.
    rows = s.num_tokens * s.H
    o_part = empty_like_kind(qkv, (s.num_splits * rows * s.Dh,), s.acc_t)
    m_part, l_part = (empty_like_kind(qkv, (s.num_splits * rows,), s.acc_t) for _ in range(2))
    split_geom = (o_part, s.q_geom[1], np.int64(0), np.int64(s.H * s.Dh), np.int64(s.Dh), np.int64(s.num_splits),
                  np.int64(rows * s.Dh), np.int64(rows), np.int64(s.H), m_part, l_part)
    launch(kernel, s.grid, s.threads, stream, s.q_geom, split_geom, *s.lens, k_src, v_src, args, s.sm_scale)
    return o_part, m_part, l_part


def multi_block_combine(s: StepLaunch, partials, output, stream) -> None:
    """Multi-block mode's combine: one pass over the splits' (m, l, o) of each row into the output."""
    # spec: trtllm/multi-block
    o_part, m_part, l_part = partials
    launch(_combine_kernel(s.rounds_as, s.H, s.Dh), s.pre_grid, s.threads, stream, o_part, m_part, l_part,
           np.int64(s.num_splits), s.q_geom[1], s.fused_starts, flat(output))


def write_cache_after_attention(s: StepLaunch, preprocess, pre, stream) -> None:
    """A chunk that wraps the cyclic cache: the preprocess again, writing the cache only, after attention read
    the keys the chunk overwrites (read before write, as the reference)."""
    # spec: trtllm/cyclic-overwrite
    after = pre._replace(write_scratch=np.int64(0), write_cache=np.int64(1))
    kernel, grid = preprocess
    launch(kernel, grid, s.threads, stream, after, s.starts_arg)


def _allocated(rounds_as, dtype):
    """What a new tensor of the call's dtype is allocated as: "bfloat16" (bits, `empty_like_kind`) or dtype."""
    return BFLOAT16_BITS if rounds_as == BFLOAT16_BITS else np.dtype(dtype)


BITS_INPUTS = ("qkv", "qkv_bias", "past_key_value", "kv_cache_pool", "cross_kv", "relative_attention_bias")


def bfloat16_call(call: dict) -> dict:
    """The call for the kernels when qkv is bfloat16 (numba has no bfloat16 arithmetic): every tensor of qkv's
    dtype as its bits (uint16, no copy: the cache is written in place through them), rounds_as="bfloat16"."""
    bits = {name: bfloat16_bits(call[name]) for name in BITS_INPUTS
            if call.get(name) is not None and np.dtype(call[name].dtype).name == "bfloat16"}
    return {**call, **bits, "rounds_as": BFLOAT16_BITS}


def widened_slopes(slopes):
    """alibi_slopes (H values, any float dtype) as float32 when bfloat16, widened by a shift (exact): the score reads
    them as floats; else as given."""
    if slopes is None or np.dtype(slopes.dtype).name != "bfloat16":
        return slopes
    return (bfloat16_bits(slopes).astype(np.uint32) << 16).view(np.float32)


def bfloat16_results(call: dict, output, present):
    """(output, present_key_value) of a bfloat16 call: the output as qkv's kind of bfloat16, present the caller's
    own cache (written in place through its bits)."""
    return bfloat16_like(call["qkv"], output), (None if present is None else call["past_key_value"])
