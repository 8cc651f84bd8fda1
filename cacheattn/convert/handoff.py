"""Hand a live generation from one engine to another: the tour's serving loop (cacheattn.serving) prefills with
one operator, then `move` converts every live request's cache, layer by layer, into the other operator's paged
cache, and decoding continues there. What disaggregated serving does between a prefill and a decode engine.

    serving.serve(model, requests, operator="multi_head_cache_attention",
                  handoff=serving.Handoff(step=1, operator="gpt_attention", move=handoff.move))
"""

from __future__ import annotations

import numpy as np

from . import Cache, convert


def cache_of(path, table, length: int, *, shadow: bool = False) -> Cache:
    """The serving path's cache (OpenPPL's paged cache or TensorRT-LLM's pool, or the pool's float64 shadow) with
    a one-row page table `table` and `length` tokens, as a convert.Cache; the request is sequence 0."""
    m, cfg = path.model.cfg, path.cfg
    if path.operator == "multi_head_cache_attention":
        return Cache("ppl", cache=path.cache, scale=path.scale, kvstarts=np.array([0, length]), cachestarts=table,
                     num_layer=m.num_layers, quant_bit=cfg.quant_bit, quant_group=cfg.quant_group, cache_mode=1,
                     cache_layout=0, page_size=cfg.page_size)
    return Cache("trtllm", kv_cache_pool=path.shadow if shadow else path.pool, kv_cache_block_offsets=table,
                 sequence_length=np.array([length]), paged_kv_cache=True, tokens_per_block=cfg.page_size,
                 host_max_attention_window_sizes=np.array([cfg.num_pages * cfg.page_size], np.int32),
                 host_sink_token_length=np.zeros(1, np.int32))


def _table(path, pages):
    """A one-row page table of `path`'s kind for these pages (empty rows are filled by convert's free list)."""
    m, cfg = path.model.cfg, path.cfg
    if path.operator == "multi_head_cache_attention":
        return (np.asarray(pages, np.int64) * cfg.page_size)[None]                  # token offsets of the pages
    table = np.zeros((1, 1, 2, max(len(pages), 1)), np.int32)
    for kv in range(2):                                   # the KV cache manager's offsets: block * num_layers * 2 + kv
        table[0, 0, kv, :len(pages)] = np.asarray(pages, np.int64) * m.num_layers * 2 + kv
    return table


def move(src_path, dst_path, states, pool) -> None:
    """Convert each live request's cached tokens, every layer, from src_path's cache into dst_path's (the
    destination's pages come from `pool`, through convert's free list); each state then holds its new pages."""
    cfg = src_path.cfg
    for state in states:
        pages = [pool.take() for _ in range(-(-state.cached // cfg.page_size))]
        src_table = _table(src_path, state.pages)
        dst_table = _table(dst_path, [0] * len(pages))                       # rows filled from the free list
        for layer in range(src_path.model.cfg.num_layers):
            free = list(pages) if layer == 0 else None                       # layer 0 allocates, the others reuse
            convert(cache_of(src_path, src_table, state.cached), cache_of(dst_path, dst_table, state.cached),
                    sequence=0, layer_idx=layer, free_pages=free)
            if dst_path.operator == "gpt_attention":                          # the float64 shadow the loop checks
                convert(cache_of(src_path, src_table, state.cached),
                        cache_of(dst_path, dst_table, state.cached, shadow=True), sequence=0, layer_idx=layer)
        state.pages = pages
