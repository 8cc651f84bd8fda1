"""OpenPPL `dynamic_batching.MultiHeadAttention` on the GPU: the shared online-softmax core
(`_attention_core.py`) specialised with OpenPPL's mask rules.

The logit of query i for key j, in a sequence of seqlen queries and kvlen keys, is q.k / sqrt(head_dim):
  - hidden (-inf) when causal applies and j > kvlen - seqlen + i (bottom-right alignment);
    causal applies when is_causal, seqlen > 1 and b >= decoding_batches, and always with ALiBi;
  - plus the user mask, rows offset by seqstarts[b], columns by kvstarts[b];
  - with ALiBi, slope_h * (j - (kvlen - seqlen + i)) + mask, rounded to the query dtype as upstream forms it.
The key range of a block stops at the last key its last row may see, so causal prefill skips the
upper-right tiles instead of masking them.
"""

from __future__ import annotations

import math
from collections import namedtuple
from functools import cache

import numpy as np
from numba import cuda

from ._attention_core import make_attention_kernel, plan_tiles
from ._attention_flash import make_flash_attention_kernel, rows_per_block
from ._attention_flash import why_not as flash_why_not
from ._attention_gqa_mma import KEY_TILE as DECODE_TRIP
from ._attention_gqa_mma import decode_grid, decode_kernel_choice, make_gqa_decode_attention_kernel
from ._attention_gqa_mma import heads_per_block as decode_heads
from ._attention_mma import check_fits, make_mma_attention_kernel, plan_mma_rows
from ._attention_vector import keys_per_step, make_vector_attention_kernel, plan_vector_rows
from ._attention_warp import make_warp_attention_kernel, plan_warp_rows
from ._cache import _address, chunk_elements, make_cache_access, make_chunk_load, packed_source, vector_loads_ok
from ._launch import caller_stream, ceil_div, empty_like_kind, flat, launch, to_kind
from ._numerics import keep_float32, rounder
from ._split_k import choose_splits, combine_kernel
from ._vector import VECTOR_BYTES

NEG_INF = np.float32(-math.inf)

# What OpenPPL's score needs besides q.k: the causal rule's inputs, ALiBi slopes, and the user mask with its
# row/column offsets (mask element (h, i, j) of batch b at h*mask_sh + (seqstarts[b]+i)*mask_si + kvstarts[b]+j).
PPLScoreArgs = namedtuple("PPLScoreArgs", "is_causal decoding_batches is_alibi slopes mask mask_sh mask_si seqstarts "
                                          "kvstarts has_mask")


def make_ppl_score(round_query, biased=True):
    """(score, key_range) of OpenPPL's rules. biased=False: a kernel for calls without a mask and without ALiBi,
    which compiles neither bias in (the flags are then never read: only causal masking is left)."""
    @cuda.jit(device=True, inline="always")
    # spec: ppl-mhca/causal, ppl-mhca/decoding-batches, ppl-mhca/alibi
    def causal_applies(args, b, seqlen):
        return (args.is_causal != 0 and seqlen > 1 and b >= args.decoding_batches) or (biased and args.is_alibi != 0)

    @cuda.jit(device=True, inline="always")
    def score(args, qk, b, h, i, j, seqlen, kvlen):
        """qk / sqrt(head_dim) plus the bias; -inf for a hidden key."""
        last_visible = np.int32(kvlen - seqlen + i)    # 32-bit: one compare against a 32-bit key, not a pair
        if j > last_visible and causal_applies(args, b, seqlen):
            return NEG_INF
        if not biased:
            return qk
        m = np.float32(0.0)
        if args.has_mask != 0:
            m = np.float32(args.mask[h * args.mask_sh + (args.seqstarts[b] + i) * args.mask_si + args.kvstarts[b] + j])
        if args.is_alibi != 0:
            alibi = round_query(args.slopes[h] * round_query(np.float32(j - last_visible)))
            m = round_query(alibi + m)
        return qk + m

    @cuda.jit(device=True, inline="always")
    def key_range(args, b, i_first, i_last, seqlen, kvlen):
        if causal_applies(args, b, seqlen):
            return 0, kvlen - seqlen + i_last + 1
        return 0, kvlen

    return score, key_range


def block_plan(rung, num_heads, num_kv_heads, max_seqlen, head_dim, threads=128, chunk=None):
    """How the kernel of `rung` lays out a block, from its planner: rung 1 (heads_per_block, q_tile, key_tile);
    2 to 4 (heads_per_block, q_tile; chunk: elements per 16-byte load for 3 and 4); 5 (heads_per_block, positions,
    row_tiles). ValueError naming head_dim when no layout fits the shared memory; whether one fits does not depend
    on max_seqlen (every planner shrinks the query tile to one position before it gives up), so validation asks
    this before the cache store, or any kernel, runs."""
    warps = threads // 32
    if rung in (3, 4):
        return plan_vector_rows(num_heads, num_kv_heads, max_seqlen, head_dim, chunk, warps)
    if rung == 2:
        return plan_warp_rows(num_heads, num_kv_heads, max_seqlen, head_dim, warps)
    if rung == 5:
        check_fits(head_dim, warps)
        return plan_mma_rows(num_heads, num_kv_heads, max_seqlen, warps, head_dim)
    return plan_tiles(num_heads, num_kv_heads, max_seqlen, head_dim, head_dim)


@cache
def attention_kernel(quant_bit, quant_group, scale_dtype, value_dtype, query_dtype, head_dim, num_heads,
                     num_kv_heads, max_seqlen, rung=1, threads=128, cache_dtype=None, vector=False, partials=False,
                     whole_trips=None, biased=True):
    """The core specialised for OpenPPL: cache reads of this quantization, OpenPPL's bias; plus its tile plan.
    rung 1: the shared-memory tile loop (_attention_core); rung 2: a warp per key (_attention_warp); rung 3
    (rung 4's too): lane groups per key reading 16-byte chunks of a `cache_dtype` cache, in vector loads when
    `vector` (_attention_vector), writing split-K partials when `partials`; rung 5: tensor cores (_attention_mma,
    float16 query; K/V staged in shared memory in 16-byte chunks, vector loads when `vector`; a decode batch that
    `decode_kernel_choice` accepts: _attention_gqa_mma, whole_trips saying whether a page holds whole 16-key trips,
    biased whether the call has a mask or ALiBi)."""
    round_scale = rounder(scale_dtype) if quant_bit else keep_float32
    row_offsets, load = make_cache_access(quant_bit, quant_group, round_scale, rounder(value_dtype))
    score, key_range = make_ppl_score(rounder(query_dtype))
    warps, chunk = threads // 32, chunk_elements(quant_bit, cache_dtype, rung) if rung in (3, 5) else None
    plan = block_plan(rung, num_heads, num_kv_heads, max_seqlen, head_dim, threads, chunk)
    if rung == 3:
        heads_per_block, q_tile = plan
        load_chunk = make_chunk_load(quant_bit, quant_group, round_scale, rounder(value_dtype), chunk, vector)
        kernel = make_vector_attention_kernel(row_offsets, load_chunk, score, key_range, head_dim_k=head_dim,
                                              head_dim_v=head_dim, chunk=chunk, heads_per_block=heads_per_block,
                                              q_tile=q_tile, group=num_heads // num_kv_heads, warps=warps,
                                              partials=partials)
        return kernel, heads_per_block, q_tile
    if rung == 2:
        heads_per_block, q_tile = plan
        kernel = make_warp_attention_kernel(row_offsets, load, score, key_range, head_dim_k=head_dim,
                                            head_dim_v=head_dim, heads_per_block=heads_per_block, q_tile=q_tile,
                                            group=num_heads // num_kv_heads, warps=warps)
        return kernel, heads_per_block, q_tile
    if rung == 5 and whole_trips is not None:
        heads = decode_heads(num_heads, num_kv_heads)
        kernel = make_gqa_decode_attention_kernel(score, key_range, quant_bit=quant_bit, quant_group=quant_group,
                                                  head_dim=head_dim, heads_per_block=heads,
                                                  group=num_heads // num_kv_heads, warps=warps,
                                                  whole_trips=whole_trips, biased=biased, partials=partials)
        return kernel, heads, 1
    if rung == 5:
        heads_per_block, positions, row_tiles = plan
        load_chunk = make_chunk_load(quant_bit, quant_group, round_scale, rounder(value_dtype), chunk, vector)
        kernel = make_mma_attention_kernel(row_offsets, load_chunk, score, key_range, head_dim_k=head_dim,
                                           head_dim_v=head_dim, chunk=chunk, heads_per_block=heads_per_block,
                                           positions=positions, row_tiles=row_tiles, group=num_heads // num_kv_heads,
                                           warps=warps, q_registers=quant_bit != 4)   # int4: no registers left
        return kernel, heads_per_block, positions * row_tiles
    heads_per_block, q_tile, key_tile = plan
    kernel = make_attention_kernel(row_offsets, load, score, key_range, head_dim_k=head_dim, head_dim_v=head_dim,
                                   heads_per_block=heads_per_block, q_tile=q_tile, key_tile=key_tile,
                                   group=num_heads // num_kv_heads)
    return kernel, heads_per_block, q_tile


@cache
def flash_kernel(dtype, head_dim, num_heads, num_kv_heads, threads, biased):
    """Rung 6 (`_attention_flash`) specialised with OpenPPL's score, for a float16 or bfloat16 query and cache; the
    mask and ALiBi compiled in only for a call that has one (`biased`)."""
    score, key_range = make_ppl_score(rounder(dtype), biased)
    return make_flash_attention_kernel(score, key_range, head_dim=head_dim, group=num_heads // num_kv_heads,
                                       warps=threads // 32, dtype=dtype)


def flash_refusal(query, key_src, value_src, quant_bit, threads) -> str:
    """Why rung 6 cannot take this launch ('' when it can): it copies 16-byte chunks of unquantized float16 rows
    as they are, so the cache must hold the query's dtype, with every row aligned (`vector_loads_ok`), and K and V
    must share the page table."""
    head_dim = query.shape[2]
    if query.dtype != np.float16:
        return f"a {query.dtype} query"
    if quant_bit or key_src.data.dtype != query.dtype or value_src.data.dtype != query.dtype:
        return "a quantized cache, or one of another dtype than the query"
    if not all(vector_loads_ok(src, 0, head_dim) for src in (key_src, value_src)):
        return "cache rows not 16-byte aligned"
    if key_src.starts is not value_src.starts or int(key_src.page) != int(value_src.page):
        return "K and V on different page tables"
    return flash_why_not(head_dim, threads)


def attend(query, key_src, value_src, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask, *,
           num_heads, num_kv_heads, is_causal, alibi_slopes, quant_bit, quant_group, scale_dtype, value_dtype, threads,
           stream, rung=1, num_splits=None):
    """Launch the OpenPPL attention kernel over K/V sources; returns attn_output (seqstarts[B], H, Dh).
    rung: which kernel of the ladder (1 shared-memory tiles, 2 a warp per key, 3 16-byte loads, 4 split-K, 5 tensor
    cores; threads a multiple of 32 from rung 2); num_splits: the split count of rung 4, or of rung 5's decode kernel
    (None: `choose_splits`, which splits only where the blocks leave SMs idle)."""
    head_dim = query.shape[2]
    batch = seqstarts.shape[0] - 1
    # Rung 6 where its copies can serve the launch (the plan checked the dtypes and head_dim; alignment is known
    # here only), else rung 5's staged kernel, which takes any float16-query launch.
    if rung == 6 and not flash_refusal(query, key_src, value_src, quant_bit, threads):
        return _attend_flash(query, key_src, value_src, seqstarts, kvstarts, decoding_batches, max_seqlen, attn_mask,
                             num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=is_causal,
                             alibi_slopes=alibi_slopes, threads=threads, stream=stream)
    rung = 5 if rung == 6 else rung
    # Rungs 3-5 read whole 16-byte chunks when every row of both sources is aligned (decided here, per launch).
    vector = rung in (3, 4, 5) and all(vector_loads_ok(src, quant_bit, head_dim) for src in (key_src, value_src))
    # Query tiles stop growing at 16 rows, so lengths past 16 share one compiled kernel; rung 4 is rung 3's.
    shape = (quant_bit, quant_group, np.dtype(scale_dtype).str, np.dtype(value_dtype).str, query.dtype.str, head_dim,
             num_heads, num_kv_heads, min(max_seqlen, 16), 3 if rung == 4 else rung, threads if rung >= 2 else 128,
             key_src.data.dtype.str if rung in (3, 4, 5) else None, vector)
    # Rung 5 on a decode batch: the register-fed GQA kernel where it serves the call (the reason says why not). It
    # reads the query in 16-byte loads too, whose rows (H x Dh halves) are whole chunks: its start must be aligned.
    query_rows = flat(query)
    decode, _ = decode_kernel_choice(
        query_dtype=query.dtype, max_seqlen=max_seqlen, head_dim=head_dim, num_heads=num_heads,
        num_kv_heads=num_kv_heads, quant_bit=quant_bit, quant_group=quant_group, scale_dtype=scale_dtype,
        value_dtype=value_dtype, threads=threads, vector=vector and _address(query_rows) % VECTOR_BYTES == 0,
        key_src=key_src, value_src=value_src) if rung == 5 else (False, None)
    whole_trips = int(key_src.page) % DECODE_TRIP == 0 if decode else None
    biased = not decode or attn_mask is not None or alibi_slopes is not None
    kernel, heads_per_block, q_tile = attention_kernel(*shape, whole_trips=whole_trips, biased=biased)
    grid = (max(1, ceil_div(max_seqlen, q_tile)), num_heads // heads_per_block, batch)
    splits = 1
    if rung == 4:
        step = keys_per_step(head_dim, chunk_elements(quant_bit, key_src.data.dtype, rung), threads // 32)
        splits = num_splits or choose_splits(grid[0] * grid[1] * grid[2], max_kvlen, step)
    elif decode:                                  # the decode kernel splits as rung 4 does, a warp's trip a step
        blocks, step = decode_grid(num_heads, num_kv_heads, batch, threads)
        splits = num_splits or choose_splits(blocks, max_kvlen, step)
    score_args = _score_args(query, seqstarts, kvstarts, decoding_batches, attn_mask, is_causal, alibi_slopes)
    seqlens = seqstarts[1:] - seqstarts[:-1]
    kvlens = kvstarts[1:] - kvstarts[:-1]
    attn_output = empty_like_kind(query, query.shape, query.dtype)
    geometry = (np.int64(0), np.int64(num_heads * head_dim), np.int64(head_dim))   # (s_b, s_i, s_h) of (T, H, Dh)
    inputs = ((query_rows, seqstarts, *geometry), seqlens, kvlens, key_src, value_src, score_args,
              np.float32(1 / math.sqrt(head_dim)))
    if splits == 1:
        launch(kernel, grid, threads, stream, inputs[0], (flat(attn_output), seqstarts, *geometry), *inputs[1:])
        return attn_output
    # Split-K: each split's unnormalised output, max and sum per (token, head) row, then one combine pass.
    rows = query.shape[0] * num_heads
    o_part = empty_like_kind(query, (splits * rows * head_dim,), np.float32)
    m_part, l_part = (empty_like_kind(query, (splits * rows,), np.float32) for _ in range(2))
    split_geom = (o_part, seqstarts, *geometry, np.int64(splits), np.int64(rows * head_dim), np.int64(rows),
                  np.int64(num_heads), m_part, l_part)
    kernel, _, _ = attention_kernel(*shape, partials=True, whole_trips=whole_trips, biased=biased)
    launch(kernel, grid[:2] + (batch * splits,), threads, stream, inputs[0], split_geom, *inputs[1:])
    launch(combine_kernel(query.dtype.str, num_heads, head_dim),
           (max(1, ceil_div(max_seqlen * num_heads * head_dim, threads)), batch), threads, stream, o_part, m_part,
           l_part, np.int64(splits), seqstarts, seqstarts, flat(attn_output))
    return attn_output


def _score_args(query, seqstarts, kvstarts, decoding_batches, attn_mask, is_causal, alibi_slopes):
    is_alibi = alibi_slopes is not None
    # Upstream forms the ALiBi bias in the query dtype, so the slopes are rounded to it first.
    slopes = np.asarray(alibi_slopes if is_alibi else [0.0]).astype(query.dtype).astype(np.float32)
    if attn_mask is None:
        mask, mask_sh, mask_si, has_mask = query[:1, 0, 0], 0, 0, 0     # placeholder, never read
    else:
        mask_si = attn_mask.shape[-1]
        mask_sh = attn_mask.shape[-2] * mask_si if attn_mask.ndim == 3 else 0
        mask, has_mask = flat(attn_mask), 1
    return PPLScoreArgs(np.int64(is_causal), np.int64(decoding_batches), np.int64(is_alibi), to_kind(query, slopes),
                        mask, np.int64(mask_sh), np.int64(mask_si), seqstarts, kvstarts, np.int64(has_mask))


def _attend_flash(query, key_src, value_src, seqstarts, kvstarts, decoding_batches, max_seqlen, attn_mask, *,
                  num_heads, num_kv_heads, is_causal, alibi_slopes, threads, stream):
    """Rung 6: one launch of (ceil(max_seqlen / rows a block), heads, sequences) blocks, the query and output passed
    as their 16-bit patterns."""
    head_dim, batch = query.shape[2], seqstarts.shape[0] - 1
    kernel = flash_kernel(query.dtype.name, head_dim, num_heads, num_kv_heads, threads,
                          attn_mask is not None or alibi_slopes is not None)
    score_args = _score_args(query, seqstarts, kvstarts, decoding_batches, attn_mask, is_causal, alibi_slopes)
    attn_output = empty_like_kind(query, query.shape, query.dtype)
    geometry = (np.int64(0), np.int64(num_heads * head_dim), np.int64(head_dim))   # (s_b, s_i, s_h) of (T, H, Dh)
    grid = (max(1, ceil_div(max_seqlen, rows_per_block(threads))), num_heads, batch)
    launch(kernel, grid, threads, stream, (flat(query).view(np.uint16), seqstarts, *geometry),
           (flat(attn_output).view(np.uint16), seqstarts, *geometry), seqstarts[1:] - seqstarts[:-1],
           kvstarts[1:] - kvstarts[:-1], key_src, value_src, score_args, np.float32(1 / math.sqrt(head_dim)))
    return attn_output


def dynamic_multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                                 attn_mask=None, *, num_heads, head_dim, is_causal, alibi_slopes=None, num_kv_heads=0,
                                 threads=128, rung=1, num_splits=None):
    """attn_output (seqstarts[B], num_heads, head_dim) from packed key/value. Inputs validated by `cacheattn`.

    alibi_slopes: float32 (num_heads,) when is_alibi, else None.
    """
    num_kv_heads = num_kv_heads or num_heads
    stream = caller_stream(query, key)
    row_starts = kvstarts[:-1].reshape(-1, 1)
    return attend(query, packed_source(key, row_starts), packed_source(value, row_starts), seqstarts, kvstarts,
                  decoding_batches, max_seqlen, max_kvlen, attn_mask, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  is_causal=is_causal, alibi_slopes=alibi_slopes, quant_bit=0, quant_group=head_dim,
                  scale_dtype=query.dtype, value_dtype=value.dtype, threads=threads, stream=stream, rung=rung,
                  num_splits=num_splits)
