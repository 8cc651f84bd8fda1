"""OpenPPL's dynamic-batching cache (ppl-multi-head-cache-attention.md): one tensor for every layer, K and V,
in one of four `cache_layout`s; offset (`cache_mode` 0: `cachestarts[b]`) or paged (`cache_mode` 1: a page
table of token offsets) placement; int8 / int4 group quantization with a `scale` tensor of the cache's layout.

Keys are stored as the caller passed them (the model applies RoPE before the operator): post-RoPE by default.
The slot and quantization rules are the reference's own (`cache_slots`, `reference.quant`).
"""

from __future__ import annotations

import numpy as np

from reference.cache_layout import DYNAMIC_LAYOUTS
from reference.ppl_dynamic_key_value_cache import cache_slots
from reference.quant import stored_head_dim

from .._validate import check_choice, check_int
from ._core import (
    KV,
    assign,
    check_cache_array,
    check_index,
    check_sequence,
    commit_pages,
    host,
    is_float,
    prepare_pair,
    read_pair,
    site,
    take_pages,
)

KIND = {0: None, 8: "int8_group", 4: "int4_group"}


def _check(cache, scale, *, num_layer, layer_idx, quant_bit, quant_group, cache_mode, cache_layout, page_size):
    check_choice("cache_layout", cache_layout, tuple(DYNAMIC_LAYOUTS))
    check_choice("cache_mode", cache_mode, (0, 1))
    check_choice("quant_bit", quant_bit, (0, 4, 8))
    check_int("num_layer", num_layer, low=1)
    check_int("layer_idx", layer_idx, low=0, high=num_layer - 1)
    check_int("page_size", page_size, low=1)
    check_cache_array("cache", cache)
    axes = DYNAMIC_LAYOUTS[cache_layout]
    names = axes.split()
    ext = dict(zip(names, cache.shape))
    if cache.ndim != 5 or ext["L"] != num_layer or ext["KV"] != 2:
        raise ValueError(f"cache: expected shape ({','.join(names)}) with L = num_layer = {num_layer} and KV = 2 "
                         f"for cache_layout {cache_layout}, got {tuple(cache.shape)}")
    if quant_bit:
        if cache.dtype != np.int8:
            raise TypeError(f"cache: expected int8 for quant_bit {quant_bit}, got {cache.dtype}")
        head_dim = ext["D"] * (2 if quant_bit == 4 else 1)
        check_int("quant_group", quant_group, low=1)
        if head_dim % quant_group or (quant_bit == 4 and quant_group % 2):
            raise ValueError(f"quant_group: expected an (even for int4) divisor of head_dim {head_dim}, "
                             f"got {quant_group}")
        if scale is None:
            raise ValueError(f"scale: required with quant_bit {quant_bit}, got None")
        check_cache_array("scale", scale)
        want = tuple(head_dim // quant_group if n == "D" else ext[n] for n in names)
        if tuple(scale.shape) != want:
            raise ValueError(f"scale: expected shape {want} (the cache's layout, head_dim / quant_group last), "
                             f"got {tuple(scale.shape)}")
        return axes, head_dim
    if not is_float(cache.dtype):
        raise TypeError(f"cache: expected a float dtype with quant_bit 0, got {cache.dtype}")
    return axes, ext["D"]


def _slots(cachestarts, sequence, tokens, cache_mode, page_size, max_t):
    starts = host(cachestarts).astype(np.int64)
    if starts.ndim != cache_mode + 1:
        raise ValueError(f"cachestarts: expected {'(B,)' if cache_mode == 0 else '(B, max_pages)'} for cache_mode "
                         f"{cache_mode}, got shape {starts.shape}")
    b = check_sequence("sequence", sequence, starts.shape[0])
    if cache_mode == 1 and -(-tokens // page_size) > starts.shape[1]:
        raise ValueError(f"cachestarts: expected room for {-(-tokens // page_size)} pages in row {b}, "
                         f"got {starts.shape[1]}")
    slots = cache_slots(b, np.arange(tokens), starts, cache_mode, page_size)
    check_index("cachestarts", slots, 0, max_t, f"token slots of sequence {b} (MaxT = {max_t})")
    return slots


def _sites(cache, scale, axes, layer_idx, slots, quant_bit):
    fixed = {"L": layer_idx}
    sites = [site(cache, axes, {**fixed, "KV": kv}, {"T": slots}) for kv in (0, 1)]
    scales = [site(scale, axes, {**fixed, "KV": kv}, {"T": slots}) for kv in (0, 1)] if quant_bit else None
    return sites, scales


def export(cache, scale=None, *, kvstarts, cachestarts, sequence, num_layer=1, layer_idx=0, quant_bit=0,
           quant_group=8, cache_mode=0, cache_layout=0, page_size=128, rotated=True) -> KV:
    """Sequence `sequence`'s tokens [0, kvlen) of layer `layer_idx`, kvlen = kvstarts[b + 1] - kvstarts[b]."""
    axes, _ = _check(cache, scale, num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit,
                     quant_group=quant_group, cache_mode=cache_mode, cache_layout=cache_layout, page_size=page_size)
    kvstarts = host(kvstarts).astype(np.int64)
    b = check_sequence("sequence", sequence, kvstarts.shape[0] - 1)
    tokens = int(kvstarts[b + 1] - kvstarts[b])
    slots = _slots(cachestarts, b, tokens, cache_mode, page_size, cache.shape[axes.split().index("T")])
    (ks, vs), scales = _sites(cache, scale, axes, layer_idx, slots, quant_bit)
    return read_pair(ks, vs, KIND[quant_bit], None, None, quant_group, np.arange(tokens), rotated, scales)


def import_(kv: KV, cache, scale=None, *, cachestarts, sequence, num_layer=1, layer_idx=0, quant_bit=0,
            quant_group=8, cache_mode=0, cache_layout=0, page_size=128, free_pages=None) -> dict:
    """Write kv's tokens at positions [0, T) of sequence `sequence` (quantized by OpenPPL's group rule unless
    kv already holds codes of this rule). cache_mode 1 with `free_pages` (page numbers): the sequence's row of
    `cachestarts` gets fresh pages (token offsets page * page_size), taken from the front of the list."""
    axes, head_dim = _check(cache, scale, num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit,
                            quant_group=quant_group, cache_mode=cache_mode, cache_layout=cache_layout,
                            page_size=page_size)
    if (kv.num_kv_heads, kv.head_dim) != (cache.shape[axes.split().index("H")], head_dim):
        raise ValueError(f"kv: expected {cache.shape[axes.split().index('H')]} heads of head_dim {head_dim} "
                         f"(cache), got {kv.num_kv_heads} of {kv.head_dim}")
    max_t = cache.shape[axes.split().index("T")]
    table = cachestarts
    pages = []
    if free_pages is not None and cache_mode == 1:
        pages = take_pages(free_pages, -(-kv.tokens // page_size))
        check_index("free_pages", np.asarray(pages, np.int64), 0, max_t // page_size, "page numbers")
        table = host(cachestarts).copy()
        check_sequence("sequence", sequence, table.shape[0])
        table[sequence, :len(pages)] = np.asarray(pages) * page_size
    slots = _slots(table, sequence, kv.tokens, cache_mode, page_size, max_t)
    (ks, vs), scales = _sites(cache, scale, axes, layer_idx, slots, quant_bit)
    write = prepare_pair(kv, KIND[quant_bit], ks, vs, scales, quant_group=quant_group)
    # Everything is checked and encoded: now write.
    if pages:
        assign(cachestarts, (sequence, slice(0, len(pages))), np.asarray(pages) * page_size)
        commit_pages(free_pages, len(pages))
    write()
    return {"slots": slots, "pages": pages}


def stored_dim(head_dim: int, quant_bit: int) -> int:
    return stored_head_dim(head_dim, quant_bit)


def rule(cache, scale=None, *, quant_bit=0, quant_group=8, **_) -> dict:
    """How this destination stores values: for error bounds (`cacheattn.convert.error_bound`)."""
    return dict(kind=KIND[quant_bit], dtype=cache.dtype if not quant_bit else scale.dtype, quant_group=quant_group)


def stores_rotated(**_) -> bool:
    return True
