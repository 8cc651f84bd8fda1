"""OpenPPL `dynamic_batching.MultiHeadCacheAttention` on the GPU: "just fuse dynamic_batching.MultiHeadAttention
and dynamic_batching.KeyValueCache together".

Two launches on one stream: the store kernel writes (and quantizes) the current
key/value into the cache, then the attention kernel reads every key straight from
the cache (page table and dequantization on the fly). The packed key/value that the
unfused pair would pass between them never exists.
"""

from __future__ import annotations

from ._launch import caller_stream
from .ppl_dynamic_key_value_cache import cache_sources, page_table, store_current
from .ppl_dynamic_multi_head_attention import attend


# spec: ppl-mhca/fused
def multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *,
                               num_heads, head_dim, is_causal, alibi_slopes=None, num_kv_heads=0, layer_idx=0,
                               quant_bit=0, quant_group=8, cache_mode=0, cache_axes, page_size=128, threads=128,
                               rung=1, num_splits=None):
    """attn_output (seqstarts[B], num_heads, head_dim); cache/scale updated in place. Validated by `cacheattn`."""
    num_kv_heads = num_kv_heads or num_heads
    stream = caller_stream(query, cache)
    starts, page = page_table(cachestarts, cache_mode, page_size)
    key_src, value_src = cache_sources(cache, scale, starts, page, cache_axes, layer_idx)
    scale_dtype = (scale if quant_bit else current_key).dtype
    store_current(current_key, current_value, seqstarts, start_pos, max_seqlen, key_src, value_src,
                  quant_bit=quant_bit, quant_group=quant_group, scale_dtype=scale_dtype, threads=threads,
                  stream=stream)
    return attend(query, key_src, value_src, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask,
                  num_heads=num_heads, num_kv_heads=num_kv_heads, is_causal=is_causal, alibi_slopes=alibi_slopes,
                  quant_bit=quant_bit, quant_group=quant_group, scale_dtype=scale_dtype,
                  value_dtype=current_value.dtype, threads=threads, stream=stream, rung=rung, num_splits=num_splits)
