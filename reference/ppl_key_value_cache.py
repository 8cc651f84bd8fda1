"""OpenPPL pmx `KeyValueCache` (ppl-key-value-cache.md), the static-batch cache operator.

The body follows the document's example for cache_layout 0: quantize and store
the current key/value at start_pos, then read back [0, start_pos + s) and
dequantize. The other layout is the same code on a transposed view.
"""

from __future__ import annotations

import numpy as np

from .cache_layout import STATIC_LAYOUTS, layer_views
from .quant import dequantize, quantize


def key_value_cache(current_key, current_value, start_pos, cache, scale=None, *, num_layer=1, layer_idx=0,
                    quant_bit=0, quant_group=8, num_repeat=1, cache_layout=0):
    """Returns (key, value), each (B, start_pos + S, H * num_repeat, Dh) in current_key's dtype.

    current_key, current_value: (B, S, H, Dh). `cache` and `scale` are modified in place.
    """
    batch, s = current_key.shape[:2]
    start_p = int(np.asarray(start_pos).reshape(-1)[0])
    axes = STATIC_LAYOUTS[cache_layout]
    # spec: ppl-kvc/layer-idx, ppl-kvc/layouts, ppl-kvc/in-out
    k_cache, v_cache = layer_views(cache, axes, layer_idx)                     # each (MaxB, MaxS, H, Dh stored)

    # spec: ppl-kvc/store, ppl-kvc/start-pos
    # "First store the input key and value in the position of start_pos indexing"
    if quant_bit:
        k_scales, v_scales = layer_views(scale, axes, layer_idx)               # each (MaxB, MaxS, H, Dh/quant_group)
        k_scale, k_quant = quantize(current_key, quant_bit, quant_group, scale.dtype)
        v_scale, v_quant = quantize(current_value, quant_bit, quant_group, scale.dtype)
        k_scales[:batch, start_p:start_p + s] = k_scale
        k_cache[:batch, start_p:start_p + s] = k_quant
        v_scales[:batch, start_p:start_p + s] = v_scale
        v_cache[:batch, start_p:start_p + s] = v_quant
    else:
        k_cache[:batch, start_p:start_p + s] = current_key
        v_cache[:batch, start_p:start_p + s] = current_value

    # spec: ppl-kvc/extract, ppl-kvc/dequant, ppl-kvc/outputs
    # "Then extract the key and value from the begining to start_pos + sequence_length"
    if quant_bit:
        key = dequantize(k_cache[:batch, :start_p + s], k_scales[:batch, :start_p + s],
                         quant_bit, quant_group, current_key.dtype)
        value = dequantize(v_cache[:batch, :start_p + s], v_scales[:batch, :start_p + s],
                           quant_bit, quant_group, current_value.dtype)
    else:
        key = k_cache[:batch, :start_p + s].astype(current_key.dtype)
        value = v_cache[:batch, :start_p + s].astype(current_value.dtype)

    # spec: ppl-kvc/num-repeat
    # num_repeat (GQA): each head repeated num_repeat times in a row on the head axis.
    return np.repeat(key, num_repeat, axis=2), np.repeat(value, num_repeat, axis=2)
