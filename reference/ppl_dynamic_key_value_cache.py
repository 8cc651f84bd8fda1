"""OpenPPL pmx `dynamic_batching.KeyValueCache`, the cache half of MultiHeadCacheAttention
(ppl-multi-head-cache-attention.md, with ppl-key-value-cache.md for the store/read steps).

Each batch b has its own sequence (seqstarts), key/value range (kvstarts) and
place in the cache (cachestarts): cache_mode 0 gives one offset into MaxT,
cache_mode 1 a page table of offsets.
"""

from __future__ import annotations

import numpy as np

from .cache_layout import DYNAMIC_LAYOUTS, layer_views
from .quant import dequantize, quantize


def cache_slots(b, positions, cachestarts, cache_mode, page_size):
    """Token slot in MaxT of positions of batch b.

    cache_mode 0: cachestarts[b] + t.  cache_mode 1: cachestarts[b, t // page_size] + t % page_size
    (the page table holds token offsets into MaxT, not page numbers).
    """
    # spec: ppl-mhca/offset-mode, ppl-mhca/paged-mode, ppl-mhca/page-size
    if cache_mode == 0:
        return cachestarts[b] + positions
    return cachestarts[b, positions // page_size] + positions % page_size


def dynamic_key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                            max_seqlen, max_kvlen, cache, scale=None, *, num_layer=1, layer_idx=0, quant_bit=0,
                            quant_group=8, num_repeat=1, cache_mode=0, cache_layout=0, page_size=128):
    """Returns (key, value), each (kvstarts[B], H * num_repeat, Dh), packed past + current per batch.

    current_key, current_value: (seqstarts[B], H, Dh). `cache` and `scale` are modified in place.
    max_seqlen and max_kvlen only size parallel work; the result does not depend on them.
    """
    axes = DYNAMIC_LAYOUTS[cache_layout]
    # spec: ppl-mhca/layouts, ppl-mhca/layer-idx, ppl-mhca/cache-in-out
    k_cache, v_cache = layer_views(cache, axes, layer_idx)              # each (MaxT, H, Dh stored)
    if quant_bit:
        k_scales, v_scales = layer_views(scale, axes, layer_idx)        # each (MaxT, H, Dh/quant_group)
    kv_total = int(kvstarts[-1])
    key = np.empty((kv_total, *current_key.shape[1:]), current_key.dtype)    # (kvstarts[B], H, Dh)
    value = np.empty((kv_total, *current_value.shape[1:]), current_value.dtype)

    batches = range(len(seqstarts) - 1)
    # Store every batch first, then read: a read sees all of this call's writes.
    for b in batches:
        seq = slice(seqstarts[b], seqstarts[b + 1])
        start_p = int(start_pos[b])
        # spec: ppl-mhca/start-pos, ppl-mhca/seqstarts
        # Current tokens go to positions [start_pos, start_pos + s) of batch b.
        stored = cache_slots(b, np.arange(start_p, start_p + seq.stop - seq.start), cachestarts, cache_mode,
                             page_size)
        if quant_bit:
            k_scale, k_quant = quantize(current_key[seq], quant_bit, quant_group, scale.dtype)
            v_scale, v_quant = quantize(current_value[seq], quant_bit, quant_group, scale.dtype)
            k_scales[stored], k_cache[stored] = k_scale, k_quant
            v_scales[stored], v_cache[stored] = v_scale, v_quant
        else:
            k_cache[stored], v_cache[stored] = current_key[seq], current_value[seq]

    for b in batches:
        # spec: ppl-mhca/kvstarts
        # Read back positions [0, kvlen) of batch b; kvlen = start_pos + s.
        kv = slice(kvstarts[b], kvstarts[b + 1])
        read = cache_slots(b, np.arange(kv.stop - kv.start), cachestarts, cache_mode, page_size)
        if quant_bit:
            key[kv] = dequantize(k_cache[read], k_scales[read], quant_bit, quant_group, key.dtype)
            value[kv] = dequantize(v_cache[read], v_scales[read], quant_bit, quant_group, value.dtype)
        else:
            key[kv], value[kv] = k_cache[read], v_cache[read]

    return np.repeat(key, num_repeat, axis=1), np.repeat(value, num_repeat, axis=1)
