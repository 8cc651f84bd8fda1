"""OpenPPL `KeyValueCache` (static batch) on the GPU.

The static operator is the dynamic one with every batch the same length: batch b's
current tokens are rows b*S .. b*S+S-1, all start at start_pos, and the cache source
steps between batches with the cache's batch stride (starts all 0). So it launches
the same store and gather kernels as `ppl_dynamic_key_value_cache`.
"""

from __future__ import annotations

import numpy as np

from ._launch import OFFSET_PAGE, caller_stream, to_kind
from .ppl_dynamic_key_value_cache import cache_sources, gather, store_current


def key_value_cache(current_key, current_value, start_pos: int, cache, scale=None, *, layer_idx=0, quant_bit=0,
                    quant_group=8, num_repeat=1, cache_axes, threads=128):
    """(key, value), each (B, start_pos + S, H * num_repeat, Dh). Inputs are validated by `cacheattn`."""
    batch, seqlen, num_heads, head_dim = current_key.shape
    kvlen = start_pos + seqlen
    stream = caller_stream(current_key, cache)
    seqstarts = to_kind(cache, np.arange(batch + 1, dtype=np.int64) * seqlen)
    kvstarts = to_kind(cache, np.arange(batch + 1, dtype=np.int64) * kvlen)
    starts = to_kind(cache, np.zeros((batch, 1), np.int64))
    start_positions = to_kind(cache, np.full(batch, start_pos, np.int64))
    key_src, value_src = cache_sources(cache, scale, starts, OFFSET_PAGE, cache_axes, layer_idx)
    scale_dtype = (scale if quant_bit else current_key).dtype
    common = dict(quant_bit=quant_bit, quant_group=quant_group, scale_dtype=scale_dtype, threads=threads,
                  stream=stream)
    packed = (batch * seqlen, num_heads, head_dim)                 # (B*S, H, Dh): batch b is rows b*S..b*S+S-1
    store_current(current_key.reshape(packed), current_value.reshape(packed), seqstarts, start_positions, seqlen,
                  key_src, value_src, **common)
    key, value = gather(key_src, value_src, kvstarts, batch * kvlen, kvlen, num_heads, head_dim, num_repeat,
                        current_key.dtype, current_key, **common)
    shape = (batch, kvlen, num_heads * num_repeat, head_dim)
    return key.reshape(shape), value.reshape(shape)
