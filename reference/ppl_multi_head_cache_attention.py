"""OpenPPL pmx `dynamic_batching.MultiHeadCacheAttention` (ppl-multi-head-cache-attention.md):
"it is just fuse dynamic_batching.MultiHeadAttention and dynamic_batching.KeyValueCache together".

So the current key/value pass through the cache (and its quantization) before attention.
"""

from __future__ import annotations

from .ppl_dynamic_key_value_cache import dynamic_key_value_cache
from .ppl_dynamic_multi_head_attention import dynamic_multi_head_attention


def multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *,
                               num_heads, head_dim, is_causal, is_alibi=False, num_kv_heads=0, num_layer=1,
                               layer_idx=0, quant_bit=0, quant_group=8, cache_mode=0, cache_layout=0, page_size=128):
    """attn_output (seqstarts[B], num_heads, head_dim); `cache` and `scale` are modified in place."""
    # spec: ppl-mhca/fused
    key, value = dynamic_key_value_cache(
        current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen, cache,
        scale, num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
        cache_mode=cache_mode, cache_layout=cache_layout, page_size=page_size)
    return dynamic_multi_head_attention(
        query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask,
        num_heads=num_heads, head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi, num_kv_heads=num_kv_heads)
