"""TensorRT-LLM's generation phase on the kernel ladder's fast decode rungs: rung 3 (16-byte vector loads, lane groups
per key, `_attention_vector`), rung 4 (the same with split-K and `_split_k`'s combine) and rung 5's decode kernel
(a GQA group on tensor cores, K/V loaded into the mma's registers, `_attention_gqa_mma`; see "Rung 5" below).

The rung-3 loop is the one `_attention_vector.make_vector_attention_kernel` builds for OpenPPL; TensorRT-LLM's
semantics come in through the device functions it takes:

- where key t lives (`make_generation_walker`): a walk over the cache slots. The cyclic slot of the lane group's
  first key (sinks stay put, the rest cycle through the window's W - S slots) is stepped forward, wrapping with
  one subtraction, so the loop divides neither by the window nor by the page size (tokens_per_block is a power
  of two: shift and mask); paged blocks through the block offsets after the sinks' bubble; beams through
  cache_indirection (the prompt from the sequence's first row, later tokens from the beam it names). K and V take
  one walk (one cyclic step and one beam lookup a key) and each its own address: their blocks have offsets of their
  own;
- how a chunk is loaded (`trtllm_common.make_generation_chunk_load`): 16 bytes of float16 / float32 values, or of
  INT8 / FP8 (e4m3) codes. A per-tensor scale is folded out of the loads: a chunk holds the codes as float32 (e4m3
  read as the float16 with the same sign, exponent and mantissa bits, which is its value / 256, one shift and mask
  a value), the scale goes into the logit scale for K and into one multiply of each output row for V
  (`value_scale`). StreamingLLM's keys are rotated at their cache index as they are loaded, dequantized exactly
  (the rotation rounds to the input dtype, so the scale cannot be taken out of it);
- the score and the visible keys: `trtllm_common.make_trt_score`, the rung-1 kernel's own (causal, window
  and sinks, custom mask, softcap, ALiBi, relative bias; logn is applied to Q by the preprocess), over the keys
  the window leaves visible only (`hidden_keys`): the sinks, then the window, so a StreamingLLM sequence far past
  its window walks W keys, not every key it has seen.

The new token: the preprocess has written its K and V to the cache before this kernel runs. With an unquantized
cache, whose slot then holds exactly the (unquantized) K/V the document attends with, the kernel reads the new token
from that slot like any other key and the preprocess writes no K/V scratch for generation entries (`new_in_cache`).
A quantized cache holds its codes, StreamingLLM's holds K before RoPE, and a call whose context chunk wraps the
cyclic cache writes it after attention: then the new token's K/V come from the scratch the preprocess wrote, in
the input dtype.

Rung 5: `_attention_gqa_mma`'s kernel takes the generation entries except StreamingLLM's with RoPE (cached keys
rotated as they load, `register_problem`). Where a key t sits at slot t of the entry's own row (one beam, no sinks,
no sequence past the window; cross attention's encoder keys) it walks the slots in order. Otherwise it walks the
visible keys as rung 3 does and asks the slot map (`make_slot_map`) for the first key of each trip of 16: its row
(the beam's, past the prompt) and cyclic slot, and how many keys follow it in the slots after; a trip whose keys
all do, inside one page, loads as a whole, the others (the sinks' end, the window's wrap, a beam's keys past the
prompt) key by key.
The TensorRT-LLM sources become `DecodeSource`s: a paged pool's block offsets are the pages (a step of them
`page_unit` slots), a contiguous cache one page a row. INT8 and e4m3 codes go into the mma as they are: the
per-tensor scale (and e4m3's 256) folds into the logit scale for K and into one multiply of the output for V, as
on rung 3. A bfloat16 qkv with its bfloat16 cache runs it too, every array as its bits (the bfloat16 mma, P and the
output rounded to bfloat16); with an INT8 / FP8 cache it stays on rung 3/4 (the codes convert to float16 pairs).
The preprocess writes the query to the scratch for it; a quantized cache's new token comes from the K/V
scratch (`new_token`), in float32 after the warps' merge. Its choice is made on the host for the step (a batch
that multi-block mode would not split) and checked per layer (16-byte loads); otherwise rung 3 or 4 run as above.
"""

from __future__ import annotations

from collections import namedtuple
from functools import cache

import numpy as np
from numba import cuda

from ._attention_gqa_mma import decode_grid, decode_shape_problem, make_gqa_decode_attention_kernel
from ._attention_gqa_mma import heads_per_block as decode_heads
from ._attention_vector import KVWalker, keys_per_step, make_vector_attention_kernel, plan_vector_rows
from ._cache import CacheSource, _address
from ._launch import ceil_div, empty_like_kind, launch, to_kind
from ._numerics import BFLOAT16_BITS, bits_io, rounder
from ._split_k import choose_splits, combine_kernel
from ._vector import VECTOR_BYTES
from .trtllm_common import (
    BEAM,
    FIRST_ROW,
    FP8_KV_CACHE,
    IS_CONTEXT,
    PAST,
    PROMPT,
    SEQUENCE,
    TOKEN_START,
    cached_place,
    chunk_elements,
    cyclic_slot,
    fold_factor,
    make_generation_chunk_load,
    make_new_token,
    make_trt_score,
    vector_loads_ok,
)

# What the generation kernel forms its query rows from: the preprocess's inputs (qkv, bias, the RoPE frequencies and
# tables, logn; the entry table of the call's own tokens) and the cache's window (StreamingLLM rotates Q at min(p, W)).
QuerySource = namedtuple("QuerySource", "qkv bias table inv_freq position_divisor cos_sin cos_sin_long logn logn_on "
                                        "streaming window")

NO_PROMPT = 1 << 62                    # a context entry's keys never go through the beam indirection

# Rung 5's decode kernel reads `_cache.CacheSource`'s fields; TensorRT-LLM's sources add the new token's scratch,
# the per-tensor scale the codes are folded by (times 256 for e4m3; 1 for a float cache), and for the slot map
# (`make_slot_map`) the paged bubble after the sinks and cache_indirection.
DecodeSource = namedtuple("DecodeSource", CacheSource._fields + ("scratch", "fold", "bubble", "indirection"))
CONTIGUOUS_PAGE = 1 << 40              # a contiguous row as one page longer than any sequence (whole 16-key trips)


@cuda.jit(device=True, inline="always")
def hidden_keys(x, b):
    """How many keys a generation entry's window hides between its sinks and its first visible key (x: the
    KVSource or the ScoreArgs, both with table, window, sinks): with the query at p, keys S .. p - (W - S). The
    generation kernel walks the visible keys only: walk index u is key u below the sinks, key u + hidden past
    them, so a StreamingLLM sequence far past its window walks W keys, not every key it has seen."""
    if x.table[b, IS_CONTEXT] != 0:
        return np.int64(0)
    return max(np.int64(0), x.table[b, PAST] - (x.window - x.sinks) + 1 - x.sinks)


def make_generation_walker(num_kv_heads: int, head_size: int, new_in_cache: bool):
    """(row_offsets, walker) of `_attention_vector.make_vector_attention_kernel` for TensorRT-LLM's KVSources, over
    the visible keys (`hidden_keys`: walk index u is key u below the sinks, u + hidden past them): the element index
    of key u and `where` = (cyclic slot << 32) | (b + 1) for a cached key, or its scratch row and 0 for the new
    token when not new_in_cache. One walk for K and V (a `KVWalker`), whose state is (u, cyclic slot of its key,
    the entry's first row, prompt length, sequence, beam, past, hidden keys); each takes its own address."""
    HKV, DH = num_kv_heads, head_size

    @cuda.jit(device=True, inline="always")
    def cyclic_step(slot, n, window, sinks):
        """The cyclic slot n tokens after `slot`: below the window the slot is the position itself, past it the
        slots after the sinks repeat every W - S (a division only when a step wraps)."""
        s = slot + n
        if s >= window:
            s = sinks + (s - sinks) % (window - sinks)
        return s

    @cuda.jit(device=True, inline="always")
    def slot_after(src, u0, slot0, n, hidden):
        """The cyclic slot of walk index u0 + n, given u0's: a step within the sinks or past them, or the one
        step from the sinks across the hidden keys (a division, once per lane group)."""
        u = u0 + n
        if u0 >= src.sinks or u < src.sinks or hidden == 0:
            return cyclic_step(slot0, n, src.window, src.sinks)
        return cyclic_slot(u + hidden, src.window, src.sinks)

    @cuda.jit(device=True, inline="always")
    def address(src, row, slot, h):
        """Element 0 of kv head h at cyclic slot `slot` of cache row `row` (trtllm_common's cache_address,
        the block index by a shift: tokens_per_block is a power of two)."""
        if slot >= src.sinks:
            slot += src.bubble                          # paged: the sinks have their blocks to themselves
        if src.paged != 0:
            mask = src.tokens_per_block - 1
            block = src.offsets[row, src.kv, slot >> cuda.popc(mask)] + src.layer_blocks
            return block * src.s_block + h * src.s_head + (slot & mask) * DH
        return row * src.s_row + src.kv * src.s_kv + h * src.s_head + slot * DH

    @cuda.jit(device=True, inline="always")
    def begin(src, b, u0):
        table = src.table
        first_row, prompt, sequence, beam = b, np.int64(NO_PROMPT), np.int64(0), np.int64(0)
        if table[b, IS_CONTEXT] == 0:
            first_row, prompt, sequence, beam = table[b, FIRST_ROW], table[b, PROMPT], table[b, SEQUENCE], \
                table[b, BEAM]
        hidden = hidden_keys(src, b)
        t0 = u0 + hidden if u0 >= src.sinks else u0
        return u0, cyclic_slot(t0, src.window, src.sinks), first_row, prompt, sequence, beam, table[b, PAST], hidden

    # spec: trtllm/cyclic-cache, trtllm/sink-tokens, trtllm/generation-beam-tokens
    @cuda.jit(device=True, inline="always")
    def place(src, b, state, j):
        """(cache row or -1, slot, where, scratch index) of walk index u0 + j: the row whose slot holds it (its own
        row's for the new token with new_in_cache, the beam's past the prompt), or -1 for the new token read from
        the scratch at that index."""
        u0, slot0, first_row, prompt, sequence, beam, past, hidden = state
        t = u0 + j
        if t >= src.sinks:
            t += hidden
        slot = slot_after(src, u0, slot0, j, hidden)
        where = cached_place(slot, b)
        if t >= past:                                   # the new token: its own row's slot, or the scratch
            if new_in_cache:
                return np.int64(b), slot, where, np.int64(0)
            return np.int64(-1), slot, where, (src.table[b, TOKEN_START] + t - past) * HKV
        row = first_row
        if t >= prompt and src.indirection.shape[1] > 1:   # one beam: its only index is 0, no load
            row += src.indirection[sequence, beam, slot]
        return row, slot, where, np.int64(0)

    @cuda.jit(device=True, inline="always")
    def at(src, b, state, j, h):
        row, slot, where, scratch = place(src, b, state, j)
        if row < 0:
            return (scratch + h) * DH, np.int64(0)
        return address(src, row, slot, h), where

    @cuda.jit(device=True, inline="always")
    def advance(src, state, step):
        u0, slot0, first_row, prompt, sequence, beam, past, hidden = state
        return u0 + step, slot_after(src, u0, slot0, step, hidden), first_row, prompt, sequence, beam, past, hidden

    # K and V: one walk (their sources share the entry table, window, sinks, beams and block tables), each its own
    # address: a paged pool's K and V blocks have block offsets of their own, a contiguous cache's V is s_kv on.
    @cuda.jit(device=True, inline="always")
    def begin_both(k_src, v_src, b, h, u0):
        return begin(k_src, b, u0)

    @cuda.jit(device=True, inline="always")
    def at_both(k_src, v_src, b, state, j, h):
        row, slot, where, scratch = place(k_src, b, state, j)
        if row < 0:
            return (scratch + h) * DH, np.int64(0), (scratch + h) * DH, np.int64(0)
        return address(k_src, row, slot, h), where, address(v_src, row, slot, h), where

    @cuda.jit(device=True, inline="always")
    def advance_both(k_src, v_src, b, h, state, step, live):
        return advance(k_src, state, step)

    @cuda.jit(device=True, inline="always")
    def row_offsets(src, b, u, h):
        """Walk index u's place: the last visible key, which the keys past the end of the walk read instead
        (weighed 0). When that is the new token in the scratch, the key before it, cached (a vector load, not one
        load per element for every key of the last step's padding)."""
        row, where = at(src, b, begin(src, b, u), 0, h)
        if not new_in_cache and where == 0 and u >= 1:
            return at(src, b, begin(src, b, u - 1), 0, h)
        return row, where

    return row_offsets, KVWalker(begin_both, at_both, advance_both)


def make_generation_score(bits: bool = False):
    """(score, key_range) of the vector kernel: trtllm_common's, over walk indices (`hidden_keys`): the
    range ends `hidden` before the last visible key, and index u past the sinks scores key u + hidden. bits: the
    relative attention bias holds bfloat16 bits."""
    score, key_range = make_trt_score(np.float32, bits)

    @cuda.jit(device=True, inline="always")
    def walk_score(args, qk, b, h, i, u, seqlen, kvlen):
        t = u + hidden_keys(args, b) if u >= args.sinks else u
        return score(args, qk, b, h, i, t, seqlen, kvlen)

    @cuda.jit(device=True, inline="always")
    def walk_range(args, b, i_first, i_last, seqlen, kvlen):
        lo, hi = key_range(args, b, i_first, i_last, seqlen, kvlen)
        hidden = hidden_keys(args, b)
        if hidden == 0:
            return lo, hi
        return np.int64(0), hi - hidden                 # lo was the window's first key, or 0 with sinks

    return walk_score, walk_range


def make_query(dtype, num_heads, num_kv_heads, head_size, rotary_dim, rope_style, has_bias):
    """query(src, b, i, h, d) of the vector kernel: element d of head h of entry b's new token i, as the preprocess
    would write it to the scratch (qkv + bias in the input dtype, RoPE at its position, or at min(p, W) in
    StreamingLLM generation, then Qwen's logn factor), from a QuerySource: no Q scratch written or read."""
    element, rotated = make_new_token(dtype, num_heads, num_kv_heads, head_size, rotary_dim, rope_style, has_bias)
    round_dtype = rounder(dtype)

    @cuda.jit(device=True, inline="always")
    def query(src, b, i, h, d):
        token = src.table[b, TOKEN_START] + i
        position = src.table[b, PAST] + i
        rope_position = position
        if src.streaming != 0 and src.table[b, IS_CONTEXT] == 0:
            rope_position = min(position, src.window)
        y = rotated(src, b, token, rope_position, h, d)
        if src.logn_on != 0:
            y = round_dtype(y * np.float32(src.logn[position]))
        return y

    return query


def make_value_scale(quant: int):
    """value_scale(v_src) of the vector kernel for a folded cache: its per-tensor scale (times 256 for e4m3)."""
    factor = np.float32(fold_factor(quant))

    @cuda.jit(device=True, inline="always")
    def value_scale(v_src):
        return v_src.scale * factor

    return value_scale


def block_plan(num_heads: int, num_kv_heads: int, head_size: int, chunk: int, threads: int):
    """(heads_per_block, q_tile) of the generation kernel: one token per entry, a GQA group's rows a block when
    they fit `_attention_vector.max_rows`."""
    return plan_vector_rows(num_heads, num_kv_heads, 1, head_size, chunk, threads // 32)


def key_step(head_size: int, chunk: int, threads: int) -> int:
    """Keys a block walks at once: `choose_splits`' key tile for rung 4."""
    return keys_per_step(head_size, chunk, threads // 32)


@cache
def generation_kernel(dtype, num_heads, num_kv_heads, head_size, quant, cache_itemsize, vector, new_in_cache,
                      threads, query_rope, rope_style=0, rotary_dim=0, partials=False):
    """The vector kernel for TensorRT-LLM generation entries (one new token each): `dtype` the one whose roundings
    the kernels emulate (float16, bfloat16 or float32; the accumulator is float32), the cache's element size,
    whether its rows take 16-byte loads, whether the new token is read from its cache slot; query_rope: the
    (rotary_dim, rope_style, has_bias) its query rows are formed with (`make_query`); rope_style/rotary_dim only
    for StreamingLLM (cached keys rotated on load: no folded scale); partials: rung 4's split kernel.
    Returns (kernel, heads_per_block, folded), folded whether the launcher multiplies the logit scale by the
    cache's per-tensor scale (`fold_factor` included)."""
    round_dtype = rounder(dtype)
    chunk = chunk_elements(cache_itemsize)
    fold = quant != 0 and rope_style == 0
    heads_per_block, q_tile = block_plan(num_heads, num_kv_heads, head_size, chunk, threads)
    row_offsets, walker = make_generation_walker(num_kv_heads, head_size, new_in_cache)
    load_chunk = make_generation_chunk_load(quant, chunk, vector, fold, round_dtype, num_kv_heads, head_size,
                                            rope_style, rotary_dim, new_in_cache)
    score, key_range = make_generation_score(dtype == BFLOAT16_BITS)
    kernel = make_vector_attention_kernel(row_offsets, load_chunk, score, key_range, head_dim_k=head_size,
                                          head_dim_v=head_size, chunk=chunk, heads_per_block=heads_per_block,
                                          q_tile=q_tile, group=num_heads // num_kv_heads, warps=threads // 32,
                                          partials=partials, walker=walker,
                                          value_scale=make_value_scale(quant) if fold else None,
                                          query=make_query(dtype, num_heads, num_kv_heads, head_size, *query_rope),
                                          narrow_out=bits_io(dtype)[1])
    return kernel, heads_per_block, fold


def generation_splits(rung, num_splits, multi_block_mode, blocks, max_kv_len, key_tile, num_sms=None) -> int:
    """Rung 3: 1. Rung 4: num_splits, or `choose_splits` (split only when the blocks leave SMs idle). None: as rung 4
    when multi_block_mode (a forced num_splits too), else 1."""
    if rung == 3 or (rung is None and not multi_block_mode and num_splits is None):
        return 1
    return num_splits or choose_splits(blocks, max_kv_len, key_tile, num_sms)


def step_splits(rung, num_splits, multi_block_mode, num_sms, new, kvlens, window, num_heads, num_kv_heads,
                head_size, cache_itemsize, threads) -> int:
    """The generation kernel's split count for this step (`generation_splits` over its blocks and the longest
    walk of a live entry: the keys the window leaves visible)."""
    chunk = chunk_elements(cache_itemsize)
    heads_per_block, _ = block_plan(num_heads, num_kv_heads, head_size, chunk, threads)
    live, longest = live_walks(new, kvlens, window)
    return generation_splits(rung, num_splits, multi_block_mode, (num_heads // heads_per_block) * live, longest,
                             key_step(head_size, chunk, threads), num_sms)


def live_walks(new, kvlens, window) -> tuple:
    """(entries with new tokens, the longest walk among them): the keys the window leaves visible."""
    live = np.asarray(new) > 0
    visible = np.minimum(np.asarray(kvlens, np.int64), int(window))     # the walk skips what the window hides
    return int(live.sum()), int(np.max(np.where(live, visible, 0)))


def attend_generation(rung, num_splits, multi_block_mode, num_sms, pre, out_geom, new, kvlens, k_src, v_src, args,
                      sm_scale, rounds_as, num_heads, num_kv_heads, head_size, quant, rope_on_load, new_in_cache,
                      num_tokens, threads, stream, query_rope):
    """Launch the generation kernel over the entries with new[e] = 1 (the others' blocks return at once): rung 3,
    or rung 4's partials and `_split_k.combine_kernel`. pre: the preprocess's arguments (its qkv, bias, RoPE and
    logn inputs, its entry table: the query rows come from them, `make_query`); query_rope: (rotary_dim,
    rope_style, has_bias); out_geom as trtllm_gpt_attention.gpt_attention builds it (the output's rows); sm_scale
    the document's 1 / (q_scaling sqrt(Dh)), times the per-tensor scale here when the loads fold it out."""
    # spec: trtllm/generation-mmha, trtllm/multi-block
    H, E = num_heads, len(new)
    like = pre.table
    q_src = QuerySource(qkv=pre.qkv, bias=pre.bias, table=pre.table, inv_freq=pre.inv_freq,
                        position_divisor=pre.position_divisor, cos_sin=pre.cos_sin, cos_sin_long=pre.cos_sin_long,
                        logn=pre.logn, logn_on=pre.logn_on, streaming=pre.streaming, window=pre.k_dst.window)
    cache_itemsize = np.dtype(k_src.cache.dtype).itemsize
    vector = vector_loads_ok(k_src.cache, head_size)
    key = (rounds_as, H, num_kv_heads, head_size, quant, cache_itemsize, vector, new_in_cache, threads, query_rope,
           *rope_on_load)
    kernel, heads_per_block, folded = generation_kernel(*key)
    splits = step_splits(rung, num_splits, multi_block_mode, num_sms, new, kvlens, args.window, H, num_kv_heads,
                         head_size, cache_itemsize, threads)
    if folded:
        sm_scale = np.float32(float(sm_scale) * float(k_src.scale) * fold_factor(quant))
    lens = to_kind(like, new), to_kind(like, kvlens)
    grid = (1, H // heads_per_block, E * splits)
    if splits == 1:
        launch(kernel, grid, threads, stream, q_src, out_geom, *lens, k_src, v_src, args, np.float32(sm_scale))
        return
    # Rung 4: each split's (m, l, unnormalised o) per row, then one combine pass over the splits.
    rows = num_tokens * H
    o_part = empty_like_kind(like, (splits * rows * head_size,), np.float32)
    m_part, l_part = (empty_like_kind(like, (splits * rows,), np.float32) for _ in range(2))
    split_geom = (o_part, *out_geom[1:], np.int64(splits), np.int64(rows * head_size), np.int64(rows), np.int64(H),
                  m_part, l_part)
    partials, _, _ = generation_kernel(*key, partials=True)
    launch(partials, grid, threads, stream, q_src, split_geom, *lens, k_src, v_src, args, np.float32(sm_scale))
    starts = to_kind(like, np.concatenate([[0], np.cumsum(new)]).astype(np.int64))
    launch(combine_kernel(rounds_as, H, head_size), (max(1, ceil_div(H * head_size, threads)), E), threads, stream,
           o_part, m_part, l_part, np.int64(splits), out_geom[1], starts, out_geom[0])


# ---- rung 5: the register-fed decode kernel ----------------------------------------------------------------------

def register_problem(*, rounds_as, head_size, num_heads, num_kv_heads, quant, threads, use_cache, cross, beam_width,
                     sinks, streaming, generation_new, generation_kvlens, window) -> str | None:
    """Why the step's generation entries cannot run on rung 5's decode kernel, or None (host facts only; the
    layer's arrays are checked at launch, `register_sources`). streaming: StreamingLLM with RoPE, whose cached keys
    are rotated as they load; sinks, a wrapped window and beams take the slot map (`register_slot_map`); cross
    attention's generation entries read the encoder's keys from their own row's slots 0 .. L - 1, as a decode
    reads its cache."""
    if not use_cache:
        return "no cache"
    if streaming:
        return ("StreamingLLM with RoPE rotates each cached key at its slot as it loads (a cosine and sine a key and "
                "pair of dims; GPT-NeoX pairs dims of other lanes' slices), which the register-fed loads do not")
    # the cache holds qkv's dtype, or INT8 / FP8 codes (kept as int8 here: the kernel reads them as bytes)
    return decode_shape_problem(query_dtype=rounds_as, max_seqlen=int(np.max(generation_new, initial=1)),
                                head_dim=head_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                quant_bit=8 if quant else 0, cache_dtype=np.int8 if quant else rounds_as,
                                threads=threads)


def register_slot_map(*, sinks, beam_width, generation_kvlens, window, cross=False) -> tuple:
    """(slot map, beams) of the decode kernel for the step: whether its keys need `make_slot_map` (sink tokens, a
    sequence past the cyclic window, or beams), and whether through cache_indirection. Cross attention's keys are
    the encoder's at slots 0 .. L - 1 of the entry's own row: no map."""
    if cross:
        return False, False
    wrapped = len(generation_kvlens) > 0 and int(np.max(generation_kvlens)) > window
    return bool(sinks or wrapped or beam_width > 1), beam_width > 1


def slot_map_reason(*, sinks, beam_width, generation_kvlens, window, cross=False) -> str:
    """What sends the step's keys through the slot map (`register_slot_map`), for the plan's reason, or ""."""
    if not register_slot_map(sinks=sinks, beam_width=beam_width, generation_kvlens=generation_kvlens, window=window,
                             cross=cross)[0]:
        return ""
    causes = [f"{beam_width} beams' cache_indirection"] * (beam_width > 1) + [f"{sinks} sink tokens"] * bool(sinks) \
        + [f"a sequence past the cyclic window of {window}"] * bool(int(np.max(generation_kvlens)) > window)
    return f", each trip's keys through the slot map ({', '.join(causes)})"


def make_slot_map(beams: bool):
    """slot_map(args, src, b, u) of the decode kernel (`make_gqa_decode_attention_kernel`) over the visible keys
    (walk index u: `hidden_keys`): (cache row, slot, run) of key t = u (below the sinks) or u + hidden, its slot
    by the cyclic formula plus the paged bubble past the sinks, and how many walk indices from u sit in the slots
    after it in that row: up to the sinks' end or the window's wrap. beams (compile-time): past the prompt, the row
    cache_indirection names at the key's cyclic slot (the prompt from the entry's first row, the new token its
    own), a run of one key."""
    # spec: trtllm/cyclic-cache, trtllm/sink-tokens, trtllm/cache-indirection
    @cuda.jit(device=True, inline="always")
    def slot_map(args, src, b, u):
        sinks, cycle = args.sinks, args.window - args.sinks
        t = u + hidden_keys(args, b) if u >= sinks else u
        slot, run, bubble = t, sinks - t, np.int64(0)
        if t >= sinks:
            c = (t - sinks) % cycle
            slot, run, bubble = sinks + c, cycle - c, src.bubble
        row = np.int64(b)
        if beams and t < args.table[b, PAST]:           # the new token (t = past) is in its own row
            row = args.table[b, FIRST_ROW]
            if t < args.table[b, PROMPT]:
                run = min(run, args.table[b, PROMPT] - t)
            else:
                row += src.indirection[args.table[b, SEQUENCE], args.table[b, BEAM], slot]
                run = np.int64(1)
        return row, slot + bubble, run

    return slot_map


def register_sources(k_src, v_src, quant: int, head_size: int, contiguous_starts):
    """(K, V DecodeSource, page_unit) over a layer's KVSources, or None where its arrays do not allow 16-byte loads.
    Paged: slot s of entry b's row is at (offsets[b, kv, s // tpb] + layer_blocks) * s_block + (s % tpb) * Dh, so
    the offsets are the pages and a step of them is s_block / Dh slots; contiguous: row b one page, V s_kv on."""
    itemsize = np.dtype(k_src.cache.dtype).itemsize
    if itemsize != (1 if quant else 2) or not vector_loads_ok(k_src.cache, head_size):
        return None
    i64 = np.int64
    fold = np.float32(float(k_src.scale) * fold_factor(quant)) if quant else np.float32(1.0)

    def source(src):
        if src.paged:
            layout = dict(starts=src.offsets[:, int(src.kv), :], page=i64(src.tokens_per_block),
                          base=i64(src.layer_blocks * src.s_block), s_b=i64(0))
        else:
            layout = dict(starts=contiguous_starts, page=i64(CONTIGUOUS_PAGE), base=i64(src.kv * src.s_kv),
                          s_b=i64(src.s_row))
        return DecodeSource(data=src.cache, scales=src.scratch, s_t=i64(head_size), s_h=i64(src.s_head),
                            sc_base=i64(0), sc_s_b=i64(0), sc_s_t=i64(0), sc_s_h=i64(0), scratch=src.scratch,
                            fold=fold, bubble=i64(src.bubble), indirection=src.indirection, **layout)

    unit = int(k_src.s_block) // head_size if k_src.paged else 1
    return source(k_src), source(v_src), unit


@cache
def register_kernel(num_heads, num_kv_heads, head_size, quant, paged, page_unit, whole, biased, new_token, threads,
                    partials=False, rounds_as="float16", slots=(False, False)):
    """Rung 5's decode kernel for TensorRT-LLM's generation entries (`_attention_gqa_mma`), with its score and keys
    (partials: split-K's, as rung 4's); rounds_as "bfloat16": qkv, the cache, the scratch and the output (and a
    relative attention bias) as bfloat16 bits; slots: `register_slot_map`'s (slot map, beams), the kernel then
    walking the visible keys as rung 3 does, `make_generation_score`."""
    bf16 = rounds_as == BFLOAT16_BITS
    mapped, beams = slots
    score, key_range = make_generation_score(bf16) if mapped else make_trt_score(np.float32, bf16)
    return make_gqa_decode_attention_kernel(
        score, key_range, quant_bit=8 if quant else 0, quant_group=head_size, head_dim=head_size,
        heads_per_block=decode_heads(num_heads, num_kv_heads), group=num_heads // num_kv_heads,
        warps=threads // 32, whole_trips=whole, biased=biased, per_tensor=bool(quant), e4m3=quant == FP8_KV_CACHE,
        shared_pages=not paged, page_unit=page_unit, new_token=new_token, num_kv_heads=num_kv_heads,
        partials=partials, bf16=bf16, slot_map=make_slot_map(beams) if mapped else None)


def scores_biased(args) -> bool:
    """Whether a generation score is more than the scaled q.k (softcap, ALiBi, a custom mask or a relative bias):
    the decode kernel then calls the score function on every key."""
    return bool(args.alibi_on or args.softcap > 0 or args.mask_cols > 0 or args.relative != 0)


def register_splits(rung, num_splits, multi_block_mode, num_sms, new, kvlens, window, num_heads, num_kv_heads,
                    threads) -> int:
    """The decode kernel's split count for the step: as rung 4's (`generation_splits`; rung 5 asked for splits as
    rung 4 does), over its blocks (a GQA group each) and a warp's trip of 16 keys a step."""
    live, longest = live_walks(new, kvlens, window)
    blocks, step = decode_grid(num_heads, num_kv_heads, live, threads)
    return generation_splits(None if rung is None else 4, num_splits, multi_block_mode, blocks, longest, step,
                             num_sms)


def attend_generation_register(q_geom, out_geom, lens, k_src, v_src, args, sm_scale, num_heads, num_kv_heads,
                               head_size, quant, new_in_cache, threads, stream, contiguous_starts, splits=1,
                               num_tokens=0, new_starts=None, rounds_as="float16", slots=(False, False),
                               cross=False) -> bool:
    """Launch rung 5's decode kernel over the generation entries (lens: the step's (new, kvlens) with 0 new for the
    others, whose blocks return at once), split `splits` ways with the combine after it (num_tokens, new_starts:
    the output's rows and the entries' first rows among the new tokens; rounds_as: float16, or "bfloat16" for
    arrays of bfloat16 bits; slots: `register_slot_map`'s; cross: every key is an encoder key in the cache, none
    from the scratch); False, launching nothing, where the layer's arrays do not allow it."""
    sources = register_sources(k_src, v_src, quant, head_size, contiguous_starts)
    if sources is None or _address(q_geom[0]) % VECTOR_BYTES:    # the query rows come in 16-byte loads too
        return False
    k_dec, v_dec, unit = sources
    whole = int(k_dec.page) % 16 == 0
    key = (num_heads, num_kv_heads, head_size, quant, bool(k_src.paged), unit, whole, scores_biased(args),
           not new_in_cache and not cross, threads)
    if quant:
        sm_scale = float(sm_scale) * float(k_dec.fold)
    entries = len(lens[0])
    grid = (1, num_heads // decode_heads(num_heads, num_kv_heads), entries)
    inputs = (*lens, k_dec, v_dec, args, np.float32(sm_scale))
    if splits == 1:
        launch(register_kernel(*key, rounds_as=rounds_as, slots=slots), grid, threads, stream, q_geom, out_geom,
               *inputs)
        return True
    like = q_geom[0]
    rows = num_tokens * num_heads
    o_part = empty_like_kind(like, (splits * rows * head_size,), np.float32)
    m_part, l_part = (empty_like_kind(like, (splits * rows,), np.float32) for _ in range(2))
    split_geom = (o_part, *out_geom[1:], np.int64(splits), np.int64(rows * head_size), np.int64(rows),
                  np.int64(num_heads), m_part, l_part)
    launch(register_kernel(*key, partials=True, rounds_as=rounds_as, slots=slots), grid[:2] + (entries * splits,),
           threads, stream, q_geom, split_geom, *inputs)
    launch(combine_kernel(rounds_as, num_heads, head_size),
           (max(1, ceil_div(num_heads * head_size, threads)), entries), threads, stream, o_part, m_part, l_part,
           np.int64(splits), out_geom[1], new_starts, out_geom[0])
    return True
