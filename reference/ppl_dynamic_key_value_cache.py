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
    """Token slot in MaxT of positions of batch b (b may be an array too: one batch per position).

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
    batches = range(len(seqstarts) - 1)
    if quant_bit:
        # Every group of every token and head has its own scale: quantize all current tokens at once.
        k_scale, k_quant = quantize(current_key, quant_bit, quant_group, scale.dtype)
        v_scale, v_quant = quantize(current_value, quant_bit, quant_group, scale.dtype)
    # Store every batch first, then read: a read sees all of this call's writes.
    for b in batches:
        seq = slice(seqstarts[b], seqstarts[b + 1])
        start_p = int(start_pos[b])
        # spec: ppl-mhca/start-pos, ppl-mhca/seqstarts
        # Current tokens go to positions [start_pos, start_pos + s) of batch b.
        stored = cache_slots(b, np.arange(start_p, start_p + seq.stop - seq.start), cachestarts, cache_mode,
                             page_size)
        if quant_bit:
            k_scales[stored], k_cache[stored] = k_scale[seq], k_quant[seq]
            v_scales[stored], v_cache[stored] = v_scale[seq], v_quant[seq]
        else:
            k_cache[stored], v_cache[stored] = current_key[seq], current_value[seq]

    # spec: ppl-mhca/kvstarts
    # Read back positions [0, kvlen) of every batch, kvlen = start_pos + s: packed row r belongs to the batch b
    # with kvstarts[b] <= r < kvstarts[b + 1] and holds its position r - kvstarts[b]. One gather for all batches.
    owner = np.repeat(np.arange(len(batches)), np.diff(kvstarts))                # (kvstarts[B],)
    position = np.arange(int(kvstarts[-1])) - np.asarray(kvstarts)[owner]        # within its batch
    read = cache_slots(owner, position, np.asarray(cachestarts), cache_mode, page_size)
    if quant_bit:
        key = dequantize(k_cache[read], k_scales[read], quant_bit, quant_group, current_key.dtype)
        value = dequantize(v_cache[read], v_scales[read], quant_bit, quant_group, current_value.dtype)
    else:
        key = k_cache[read].astype(current_key.dtype, copy=False)               # (kvstarts[B], H, Dh)
        value = v_cache[read].astype(current_value.dtype, copy=False)

    # num_repeat (GQA): each head repeated num_repeat times in a row on the head axis.
    if num_repeat > 1:
        key, value = np.repeat(key, num_repeat, axis=1), np.repeat(value, num_repeat, axis=1)
    return key, value
