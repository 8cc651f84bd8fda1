"""OpenPPL `dynamic_batching.MultiHeadCacheAttention` on the GPU: "just fuse dynamic_batching.MultiHeadAttention
and dynamic_batching.KeyValueCache together".

Two launches on one stream: the store kernel writes (and quantizes) the current
key/value into the cache, then the attention kernel reads every key straight from
the cache (page table and dequantization on the fly). The packed key/value that the
unfused pair would pass between them never exists.

A server runs the operator once per layer of a batch step with the same index tensors, so the host side is split
in two: `prepare_step` holds what every layer of a step shares (the index tensors on the device, the page table,
the step's attributes), `run_layer` takes one layer's tensors and launches. The one call is the two in a row.
"""

from __future__ import annotations

from typing import NamedTuple

from ._launch import caller_stream
from .ppl_dynamic_key_value_cache import cache_sources, page_table, store_current
from .ppl_dynamic_multi_head_attention import attend


class CacheAttentionStep(NamedTuple):
    """One batch step as every layer of it launches: index tensors of the kernels' array kind, the page table
    (`starts`, `page`: what `_cache.row_offsets` reads) and the step's attributes."""
    seqstarts: object
    kvstarts: object
    start_pos: object
    starts: object
    page: int
    decoding_batches: int
    max_seqlen: int
    max_kvlen: int
    num_heads: int
    num_kv_heads: int
    is_causal: bool
    alibi_slopes: object
    quant_bit: int
    quant_group: int
    cache_axes: str


def prepare_step(seqstarts, kvstarts, cachestarts, start_pos, decoding_batches, max_seqlen, max_kvlen, *, num_heads,
                 is_causal, alibi_slopes=None, num_kv_heads=0, quant_bit=0, quant_group=8, cache_mode=0, cache_axes,
                 page_size=128) -> CacheAttentionStep:
    """The step's share of every layer's launches (index tensors already of the kernels' array kind)."""
    starts, page = page_table(cachestarts, cache_mode, page_size)
    return CacheAttentionStep(seqstarts, kvstarts, start_pos, starts, page, decoding_batches, max_seqlen, max_kvlen,
                              num_heads, num_kv_heads or num_heads, is_causal, alibi_slopes, quant_bit, quant_group,
                              cache_axes)


# spec: ppl-mhca/fused
def run_layer(step: CacheAttentionStep, query, current_key, current_value, cache, scale=None, attn_mask=None, *,
              layer_idx=0, threads=128, rung=1, num_splits=None):
    """One layer of a prepared step: store its current key/value into its cache layer, then attend.
    attn_output (seqstarts[B], num_heads, head_dim); cache/scale updated in place."""
    stream = caller_stream(query, cache)
    key_src, value_src = cache_sources(cache, scale, step.starts, step.page, step.cache_axes, layer_idx)
    scale_dtype = (scale if step.quant_bit else current_key).dtype
    quant = dict(quant_bit=step.quant_bit, quant_group=step.quant_group, scale_dtype=scale_dtype)
    store_current(current_key, current_value, step.seqstarts, step.start_pos, step.max_seqlen, key_src, value_src,
                  **quant, threads=threads, stream=stream)
    return attend(query, key_src, value_src, step.seqstarts, step.kvstarts, step.decoding_batches, step.max_seqlen,
                  step.max_kvlen, attn_mask, num_heads=step.num_heads, num_kv_heads=step.num_kv_heads,
                  is_causal=step.is_causal, alibi_slopes=step.alibi_slopes, **quant, value_dtype=current_value.dtype,
                  threads=threads, stream=stream, rung=rung, num_splits=num_splits)


def multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *,
                               num_heads, head_dim, is_causal, alibi_slopes=None, num_kv_heads=0, layer_idx=0,
                               quant_bit=0, quant_group=8, cache_mode=0, cache_axes, page_size=128, threads=128,
                               rung=1, num_splits=None):
    """attn_output (seqstarts[B], num_heads, head_dim); cache/scale updated in place. Validated by `cacheattn`."""
    step = prepare_step(seqstarts, kvstarts, cachestarts, start_pos, decoding_batches, max_seqlen, max_kvlen,
                        num_heads=num_heads, is_causal=is_causal, alibi_slopes=alibi_slopes,
                        num_kv_heads=num_kv_heads, quant_bit=quant_bit, quant_group=quant_group,
                        cache_mode=cache_mode, cache_axes=cache_axes, page_size=page_size)
    return run_layer(step, query, current_key, current_value, cache, scale, attn_mask, layer_idx=layer_idx,
                     threads=threads, rung=rung, num_splits=num_splits)
