"""TensorRT-LLM's context phase (fused context FMHA) on the kernel ladder's rungs 5 and 6: `mma.sync` on tensor
cores (`_attention_mma.make_mma_attention_kernel` for a float16 query, `_attention_flash` for float16 or bfloat16).

The rung-5 loop is the one OpenPPL's prefill runs; TensorRT-LLM's semantics come in through the device functions it
takes, all of them rung 1's or the generation phase's (`trtllm_common`):

- where key t lives: `make_trt_access`'s row_offsets (the new tokens in the preprocess's scratch, the earlier ones
  of a chunked context in the cache: contiguous or paged, cyclic with sinks and the paged bubble);
- how a 16-byte chunk of a row is loaded: `make_generation_chunk_load` for cached keys (float16, INT8 or FP8 codes
  times the cache's scale, not folded: rung 5 rounds every K/V value to float16 for the mma; StreamingLLM's keys
  rotated at their cache index as they load), plus one 16-byte load of 8 float16 values for the scratch rows, which
  hold most of a prompt's keys;
- the score and the visible keys: `make_trt_score` (causal, window and sinks, the packed or plain custom mask,
  softcap, ALiBi, relative bias), called per (row, key) by the mma kernel on the scaled logit, as rung 1 calls it.

Rung 6 (`_attention_flash`, FlashAttention-2 tiles, float16 or bfloat16) takes the context entries when every key
they read is a new token: no chunked context (past 0) and no cross attention. Its K/V tiles are copied by cp.async
from one source of rows, here the scratch as a cache of one page that never ends (`scratch_sources`); keys in the
cache (a chunked context's earlier ones, quantized or rotated on load) stay on rung 5, or rung 1 for bfloat16.

`context_rung` decides on the host, once per step, and says why: rung 5 needs a float16 query, whole warps and a
head size whose tiles fit the shared memory, and takes the fused launch only when it holds context entries alone
(generation entries run on rungs 3/4; with rung 1 forced, or without a cache, they share rung 1's launch); rung 6
where it serves and, when both serve, where its bound is no worse than rung 5's (`cacheattn.kernel_choice`).
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda

from ._attention_flash import make_flash_attention_kernel, rows_per_block
from ._attention_flash import why_not as flash_why_not
from ._attention_mma import check_fits, make_mma_attention_kernel, plan_mma_rows
from ._cache import _address, cache_source
from ._launch import OFFSET_PAGE, ceil_div
from ._numerics import rounder
from ._vector import VECTOR_BYTES, half_from_bits, load16
from .trtllm_common import (
    SCORE_FEATURES,
    chunk_elements,
    make_generation_chunk_load,
    make_trt_access,
    make_trt_score,
    vector_loads_ok,
)

HALVES = VECTOR_BYTES // 2             # float16 values in one 16-byte load of the scratch


def flash_problem(*, rounds_as, head_size, threads, keys_elsewhere) -> str:
    """Why rung 6 cannot take the context entries ('' when it can): it multiplies float16 or bfloat16 and copies
    K and V tiles from one source of contiguous rows, the preprocess's scratch, so every context entry's keys must
    be its new tokens (keys_elsewhere: why some are not, '' when all are)."""
    if rounds_as not in ("float16", "bfloat16"):
        return f"rung 6 takes a float16 or bfloat16 query, got {rounds_as}"
    if keys_elsewhere:
        return f"rung 6 reads the keys from the scratch only: {keys_elsewhere}"
    return flash_why_not(head_size, threads)


def context_rung(*, rung, rounds_as, head_size, threads, fused_generation, num_splits, keys_elsewhere="",
                 flash_wins=None) -> tuple:
    """(rung, reason) of the fused context launch: 6 or 5 where a tensor-core kernel can serve it, else 1 and why.
    rung: the call's (None, 1, 3, 4, 5 or 6; 3 and 4 name the generation's kernel); fused_generation: whether
    generation entries share the fused launch; num_splits: the count asked for with rung None (rung 1's multi-block
    mode splits the fused launch; rungs 5 and 6 never split); keys_elsewhere: why some context keys are not in the
    scratch ('' when all are: `flash_problem`); flash_wins: with rung None and both rungs serving, a callable giving
    (whether rung 6's bound is no worse than rung 5's, the plan's reason). ValueError naming `rung` when 5 or 6
    was asked for and cannot run."""
    if rung == 1:
        return 1, "rung=1 asked for"
    shared = None
    if fused_generation:
        shared = "generation entries share the fused launch (rung 1 forced for them, or no cache to read them from)"
    elif rung is None and num_splits is not None:
        shared = f"num_splits={num_splits} asks for rung 1's multi-block split"
    flash_why = shared or flash_problem(rounds_as=rounds_as, head_size=head_size, threads=threads,
                                        keys_elsewhere=keys_elsewhere)
    why = shared
    if why is None and rounds_as != "float16":
        why = f"rung 5 takes a float16 query, got {rounds_as}"
    elif why is None:
        try:
            check_fits(head_size, threads // 32)
        except ValueError as e:
            why = str(e)
    if rung == 6:
        if flash_why:
            raise ValueError(f"rung: 6 cannot run this call's context phase: {flash_why}")
        return 6, "FlashAttention-2 tiles on tensor cores (rung=6 asked for)"
    if rung != 5 and not flash_why:
        if why is not None:
            wins, reason = True, f"rung 5 cannot: {why}"
        elif flash_wins is None:
            wins, reason = True, "both serve, no bound weighed"
        else:
            wins, reason = flash_wins()
        if wins:
            return 6, f"FlashAttention-2 tiles on tensor cores: {reason}"
        flash_why = f"its bound is above rung 5's ({reason})"
    if why is None:
        return 5, "tensor cores: a float16 context on mma.sync" + (" (rung=5 asked for)" if rung == 5 else
                                                                    f"; not rung 6: {flash_why}")
    if rung == 5:
        raise ValueError(f"rung: 5 cannot run this call's context phase: {why}")
    return 1, f"fallback to shared-memory tiles: {why}" + ("" if shared else f"; not rung 6: {flash_why}")


@cache
def flash_context_kernel(rounds_as, num_heads, num_kv_heads, head_size, threads, features=SCORE_FEATURES):
    """Rung 6's kernel for TensorRT-LLM's context entries: the scratch's rows as one page that never ends
    (`scratch_sources`), TensorRT-LLM's score and visible keys as rung 5's (the bias as bfloat16 bits for a
    bfloat16 qkv), with the score features the call uses (`score_features`) compiled in."""
    score, key_range = make_trt_score(np.float32, rounds_as == "bfloat16", features)
    return make_flash_attention_kernel(score, key_range, head_dim=head_size, group=num_heads // num_kv_heads,
                                       warps=threads // 32, dtype=rounds_as)


def flash_grid(num_heads, max_new, threads, entries) -> tuple:
    """Rung 6's grid: ceil(longest context / rows a block) x query heads x entries."""
    return max(1, ceil_div(max_new, rows_per_block(threads))), num_heads, entries


def scratch_sources(k_scratch, v_scratch, token_starts, num_kv_heads, head_size):
    """Cache sources (`_cache.CacheSource`) over the preprocess's K and V scratch, (tokens, Hkv, Dh) rows: entry
    b's key t is token row token_starts[b] + t (every key of a context entry without past is a new token), one page
    that never ends, so rung 6's page walk never leaves it."""
    starts = token_starts.reshape(-1, 1)
    return tuple(cache_source(x.reshape(-1, num_kv_heads, head_size), None, starts, OFFSET_PAGE, "T H D")
                 for x in (k_scratch, v_scratch))


def scratch_aligned(k_scratch, v_scratch) -> bool:
    """Whether rung 6's 16-byte copies can read the scratch (rows of rung 6's head sizes are whole chunks)."""
    return all(_address(x) % VECTOR_BYTES == 0 for x in (k_scratch, v_scratch))


def context_grid(num_heads, num_kv_heads, head_size, max_new, threads, entries) -> tuple:
    """(mma plan (heads_per_block, positions, row_tiles), grid) of the rung-5 launch over `entries` entries."""
    mma_plan = plan_mma_rows(num_heads, num_kv_heads, max(max_new, 1), threads // 32, head_size)
    heads_per_block, positions, row_tiles = mma_plan
    return mma_plan, (max(1, ceil_div(max_new, positions * row_tiles)), num_heads // heads_per_block, entries)


def make_context_chunk_load(quant: int, elements: int, vector: bool, scratch_vector: bool, num_kv_heads: int,
                            head_size: int, rope_style: int = 0, rotary_dim: int = 0):
    """load_chunk(src, row, where, d0, regs, at, dims) of the mma kernel over a KVSource: a scratch row (where 0,
    float16) in 16-byte loads when `scratch_vector` (its rows are whole chunks, aligned), else the generation
    phase's chunk load (cached rows dequantized as rung 1 reads them, the scratch element by element)."""
    cached = make_generation_chunk_load(quant, elements, vector, False, rounder("float16"), num_kv_heads, head_size,
                                        rope_style, rotary_dim, new_in_cache=False)
    loads = max(1, elements // HALVES)               # an INT8 / FP8 cache's chunk of 16 is two scratch loads

    @cuda.jit(device=True, inline="always")
    def load_chunk(src, row, where, d0, regs, at, dims):
        if scratch_vector and where == 0:
            for n in range(loads):
                words = load16(src.scratch, row + d0 + n * HALVES)
                for j in range(4):                   # little-endian: element 2j is the low half of word j
                    regs[at + n * HALVES + 2 * j] = half_from_bits(words[j])
                    regs[at + n * HALVES + 2 * j + 1] = half_from_bits(words[j] >> 16)
            return
        cached(src, row, where, d0, regs, at, dims)

    return load_chunk


@cache
def context_kernel(num_heads, num_kv_heads, head_size, quant, cache_itemsize, vector, scratch_vector, threads,
                   mma_plan, rope_style=0, rotary_dim=0):
    """The mma kernel for TensorRT-LLM's context entries (float16 query and scratch, float32 accumulation): the
    cache's element size and whether its rows take 16-byte loads, whether the scratch's do, the block's plan
    (`context_grid`); rope_style/rotary_dim only for StreamingLLM (cached keys rotated on load)."""
    chunk = max(chunk_elements(cache_itemsize), HALVES)
    row_offsets, _ = make_trt_access(quant, num_kv_heads, head_size, np.float32, rounder("float16"), rope_style,
                                     rotary_dim)
    load_chunk = make_context_chunk_load(quant, chunk, vector and chunk == chunk_elements(cache_itemsize),
                                         scratch_vector, num_kv_heads, head_size, rope_style, rotary_dim)
    score, key_range = make_trt_score(np.float32)
    heads_per_block, positions, row_tiles = mma_plan
    return make_mma_attention_kernel(row_offsets, load_chunk, score, key_range, head_dim_k=head_size,
                                     head_dim_v=head_size, chunk=chunk, heads_per_block=heads_per_block,
                                     positions=positions, row_tiles=row_tiles, group=num_heads // num_kv_heads,
                                     warps=threads // 32, q_registers=True)


def context_kernel_for(k_src, v_src, num_heads, num_kv_heads, head_size, quant, threads, mma_plan, rope_on_load):
    """context_kernel for this layer's sources: 16-byte loads where the cache's and the scratch's rows allow them
    (decided per launch, on the host)."""
    cache_itemsize = np.dtype(k_src.cache.dtype).itemsize
    chunk = max(chunk_elements(cache_itemsize), HALVES)
    vector = vector_loads_ok(k_src.cache, head_size)
    scratch_vector = head_size % chunk == 0 and all(_address(src.scratch) % VECTOR_BYTES == 0 for src in (k_src, v_src))
    return context_kernel(num_heads, num_kv_heads, head_size, quant, cache_itemsize, vector, scratch_vector, threads,
                          mma_plan, *rope_on_load)
