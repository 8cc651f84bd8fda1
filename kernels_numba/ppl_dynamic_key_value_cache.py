"""OpenPPL `dynamic_batching.KeyValueCache` on the GPU: a store kernel, then a gather kernel.

The store quantizes current key/value per group and writes them at positions
[start_pos, start_pos + s) of each batch; the gather reads [0, kvlen) back,
dequantized, into the packed `key`/`value` outputs. Both find a token's slot
through the cache source of `_cache.py`, so cache_mode and cache_layout only
change the numbers passed in.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ._cache import _address, cache_source, make_gather_kernel, make_store_kernel, store_items, vector_loads_ok
from ._launch import OFFSET_PAGE, caller_stream, ceil_div, empty_like_kind, flat, launch
from ._numerics import rounder
from ._vector import VECTOR_BYTES


@cache
def _store_kernel(quant_bit, quant_group, head_dim, input_dtype, scale_dtype, value_dtype, vector):
    return make_store_kernel(quant_bit, quant_group, head_dim, np.dtype(input_dtype),
                             rounder(scale_dtype), rounder(value_dtype), vector)


def _vector_copy(current_key, current_value, key_dst, value_dst, quant_bit, head_dim) -> bool:
    """Whether the store copies 16-byte chunks: a cache in the input's dtype (no quantization) whose rows, and
    the current rows, all start 16-byte aligned (decided on the host, once per launch)."""
    if quant_bit or key_dst.data.dtype != current_key.dtype:
        return False
    rows = (head_dim * current_key.dtype.itemsize) % VECTOR_BYTES == 0 and all(
        _address(x) % VECTOR_BYTES == 0 for x in (current_key, current_value))
    return rows and vector_loads_ok(key_dst, 0, head_dim) and vector_loads_ok(value_dst, 0, head_dim)


@cache
def _gather_kernel(quant_bit, quant_group, head_dim, scale_dtype, value_dtype):
    return make_gather_kernel(quant_bit, quant_group, head_dim, rounder(scale_dtype), rounder(value_dtype))


def cache_sources(cache, scale, starts, page, cache_axes, layer_idx):
    """(key source, value source) of one layer of `cache` (see `_cache.py`)."""
    return tuple(cache_source(cache, scale, starts, page, cache_axes, layer_idx, kv) for kv in (0, 1))


def page_table(cachestarts, cache_mode, page_size):
    """cachestarts as the (B, pages) table and page length that `_cache.row_offsets` reads."""
    if cache_mode == 0:
        return cachestarts.reshape(-1, 1), OFFSET_PAGE
    return cachestarts, page_size


def store_current(current_key, current_value, seqstarts, start_pos, max_seqlen, key_dst, value_dst, *,
                  quant_bit, quant_group, scale_dtype, threads, stream):
    """Launch the store kernel: current (T, H, Dh) tokens into their cache slots."""
    _, num_heads, head_dim = current_key.shape
    batch = seqstarts.shape[0] - 1
    vector = _vector_copy(current_key, current_value, key_dst, value_dst, quant_bit, head_dim)
    kernel = _store_kernel(quant_bit, quant_group, head_dim, current_key.dtype.str, scale_dtype.str,
                           current_key.dtype.str, vector)
    items = store_items(quant_bit, quant_group, head_dim, current_key.dtype.itemsize, vector)
    grid = (max(1, ceil_div(max_seqlen * num_heads * items, threads)), batch)
    launch(kernel, grid, threads, stream, flat(current_key), flat(current_value), seqstarts, num_heads, start_pos,
                                  key_dst, value_dst)


def gather(key_src, value_src, kvstarts, rows, max_kvlen, num_heads, head_dim, num_repeat, like_dtype, like, *,
           quant_bit, quant_group, scale_dtype, threads, stream):
    """Launch the gather kernel: packed (rows = kvstarts[B], H * num_repeat, Dh) key and value. rows comes from
    the host: reading kvstarts[B] off a device array would stall the host until the stream drains."""
    batch = kvstarts.shape[0] - 1
    key = empty_like_kind(like, (rows, num_heads * num_repeat, head_dim), like_dtype)
    value = empty_like_kind(like, (rows, num_heads * num_repeat, head_dim), like_dtype)
    kernel = _gather_kernel(quant_bit, quant_group, head_dim, scale_dtype.str, np.dtype(like_dtype).str)
    grid = (max(1, ceil_div(max_kvlen * num_heads * head_dim, threads)), batch, 2)
    launch(kernel, grid, threads, stream, key_src, value_src, kvstarts, num_heads, num_repeat, flat(key), flat(value))
    return key, value


def dynamic_key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                            max_seqlen, max_kvlen, cache, scale=None, *, total_kv, layer_idx=0, quant_bit=0,
                            quant_group=8, num_repeat=1, cache_mode=0, cache_axes, page_size=128, threads=128):
    """(key, value), each (total_kv = kvstarts[B], H * num_repeat, Dh). Inputs are validated by `cacheattn`."""
    stream = caller_stream(current_key, cache)
    starts, page = page_table(cachestarts, cache_mode, page_size)
    key_src, value_src = cache_sources(cache, scale, starts, page, cache_axes, layer_idx)
    scale_dtype = (scale if quant_bit else current_key).dtype
    common = dict(quant_bit=quant_bit, quant_group=quant_group, scale_dtype=scale_dtype, threads=threads,
                  stream=stream)
    store_current(current_key, current_value, seqstarts, start_pos, max_seqlen, key_src, value_src, **common)
    _, num_heads, head_dim = current_key.shape
    return gather(key_src, value_src, kvstarts, total_kv, max_kvlen, num_heads, head_dim, num_repeat,
                  current_key.dtype, current_key, **common)
