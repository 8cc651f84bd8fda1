"""TensorRT-LLM's caches (trtllm-gpt-attention.md): the contiguous `past_key_value` of one layer
(batch_beam, 2, num_kv_heads, max_seqlen, head_size), or the paged pool (num_blocks, num_layers, 2,
num_kv_heads, tokens_per_block, head_size) addressed through `kv_cache_block_offsets` (the plugin adds
2 * layer_idx to an offset; the manager writes offset = block * num_layers * 2 + kv).

A sliding window W = host_max_attention_window_sizes[layer_idx] with S = host_sink_token_length[0] sinks makes
the cache cyclic: it holds the S sinks and the last W - S tokens, at `cyclic_slot` (the reference's rule, with
the paged bubble after the sinks). Export returns only those tokens, with their true positions. Keys are stored
after RoPE, except with `streamingllm`, which stores them un-rotated (export says rotated=False).
INT8 / FP8 caches: one scale s per tensor, stored sat(round(x * kv_orig_quant_scale)), loaded code * s.
"""

from __future__ import annotations

import numpy as np

from reference import trtllm_gpt_attention as trt

from .._validate import check_int
from ._core import (
    KV,
    assign,
    check_bool,
    check_cache_array,
    check_index,
    check_kv,
    check_kv_fits,
    check_own,
    check_sequence,
    check_writable,
    commit_pages,
    fp8_dtype,
    is_float,
    lengths,
    positive_scalar,
    prepare_pair,
    read_pair,
    site,
    table,
    take_pages,
)


def _scalar(name, x):
    if x is None:
        raise ValueError(f"{name}: required with an INT8 or FP8 kv_cache_quant_mode, got None")
    return positive_scalar(name, x)


def _quant(kv_cache_quant_mode, kv_quant_orig_scale, kv_orig_quant_scale):
    """(kind, stored dtype or None, s, 1/s) of a quant mode."""
    mode = check_int("kv_cache_quant_mode", kv_cache_quant_mode, low=0)
    if mode & ~(trt.INT8_KV_CACHE | trt.FP8_KV_CACHE) or mode == trt.INT8_KV_CACHE | trt.FP8_KV_CACHE:
        raise ValueError(f"kv_cache_quant_mode: expected 0, 64 (INT8_KV_CACHE) or 128 (FP8_KV_CACHE), got {mode}")
    if not mode:
        return None, None, None, None
    s = _scalar("kv_quant_orig_scale", kv_quant_orig_scale)
    inv = np.float32(1) / s if kv_orig_quant_scale is None else _scalar("kv_orig_quant_scale", kv_orig_quant_scale)
    if mode & trt.INT8_KV_CACHE:
        return "int8", np.dtype(np.int8), s, inv
    return "fp8_e4m3", fp8_dtype("fp8_e4m3"), s, inv


def _layout(past_key_value, kv_cache_pool, kv_cache_block_offsets, paged_kv_cache, tokens_per_block, layer_idx,
            stored):
    """(name, array, heads, head_size, capacity per row, rows, offsets or None) of the cache in use, checked."""
    check_int("layer_idx", layer_idx, low=0)
    offsets = None
    if check_bool("paged_kv_cache", paged_kv_cache):
        pool = check_cache_array("kv_cache_pool", kv_cache_pool)
        check_int("tokens_per_block", tokens_per_block, low=1)
        if tokens_per_block & (tokens_per_block - 1):
            raise ValueError(f"tokens_per_block: expected a power of two, got {tokens_per_block}")
        if pool.ndim != 6 or pool.shape[2] != 2 or pool.shape[4] != tokens_per_block:
            raise ValueError(f"kv_cache_pool: expected shape (num_blocks, num_layers, 2, num_kv_heads, "
                             f"tokens_per_block = {tokens_per_block}, head_size), got {tuple(pool.shape)}")
        check_int("layer_idx", layer_idx, low=0, high=pool.shape[1] - 1)
        offsets = table("kv_cache_block_offsets", kv_cache_block_offsets)
        if offsets.ndim != 4 or offsets.shape[2] != 2:
            raise ValueError(f"kv_cache_block_offsets: expected shape (num_pools, batch_beam, 2, "
                             f"max_blocks_per_seq), got {offsets.shape}")
        array, name = pool, "kv_cache_pool"
        heads, head_size, capacity, rows = pool.shape[3], pool.shape[5], offsets.shape[3] * tokens_per_block, \
            offsets.shape[1]
    else:
        array, name = check_cache_array("past_key_value", past_key_value), "past_key_value"
        if array.ndim != 5 or array.shape[1] != 2:
            raise ValueError(f"past_key_value: expected shape (batch_beam, 2, num_kv_heads, max_seqlen, head_size), "
                             f"got {tuple(array.shape)}")
        heads, head_size, capacity, rows = array.shape[2], array.shape[4], array.shape[3], array.shape[0]
    want = stored
    if want is not None and array.dtype != want:
        raise TypeError(f"{name}: expected dtype {want} for the kv_cache_quant_mode, got {array.dtype}")
    if want is None and not is_float(array.dtype):
        raise TypeError(f"{name}: expected a float dtype without a quantized kv_cache_quant_mode, got {array.dtype}")
    return name, array, heads, head_size, capacity, rows, offsets


def _window(host_max_attention_window_sizes, host_sink_token_length, layer_idx):
    windows = table("host_max_attention_window_sizes", host_max_attention_window_sizes).reshape(-1)
    if windows.size == 0:
        raise ValueError("host_max_attention_window_sizes: expected one window per layer (or one for all), got none")
    window = int(windows[layer_idx % len(windows)])                     # a shorter list repeats over the layers
    if window < 1:
        raise ValueError(f"host_max_attention_window_sizes: expected windows >= 1, got {window} for layer "
                         f"{layer_idx}")
    sinks = table("host_sink_token_length", host_sink_token_length).reshape(-1)
    if sinks.size != 1:
        raise ValueError(f"host_sink_token_length: expected one value, got shape {sinks.shape}")
    sinks = int(sinks[0])
    if not 0 <= sinks < window:
        raise ValueError(f"host_sink_token_length: expected sinks in [0, window = {window}), got {sinks}")
    return window, sinks


def held_positions(length: int, window: int, sinks: int) -> np.ndarray:
    """Positions a cache of `length` tokens still holds: all of them within the window, else the sinks and the
    last window - sinks tokens (the others were overwritten in their cyclic slots)."""
    if length <= window:
        return np.arange(length)
    return np.concatenate([np.arange(sinks), np.arange(length - (window - sinks), length)])


def _block_ids(offsets, row, layer_idx, slots, tokens_per_block, pool):
    """(2, blocks) ids of the pool seen as blocks (num_blocks * num_layers * 2 of them) that row `row` reads or
    writes for these slots: spec: the plugin's layer offset, block o + 2 * layer_idx."""
    num_blocks, num_layers = pool.shape[:2]
    index = np.unique(slots // tokens_per_block)
    ids = offsets[0, row][:, index].astype(np.int64) + 2 * layer_idx
    check_index("kv_cache_block_offsets", ids - 2 * layer_idx, 0, num_blocks * num_layers * 2 - 2 * layer_idx,
                f"block offsets of row {row} (the pool has {num_blocks * num_layers * 2} blocks)")
    return ids


def _sites(array, paged, offsets, row, layer_idx, slots, tokens_per_block):
    if not paged:
        return [site(array, "R KV H T D", {"R": row, "KV": kv}, {"T": slots}) for kv in (0, 1)]
    num_blocks, num_layers = array.shape[:2]
    blocks = array.reshape(-1, *array.shape[3:])                                # (num_blocks * L * 2, H, tpb, D)
    _block_ids(offsets, row, layer_idx, slots, tokens_per_block, array)            # every id inside the pool
    out = []
    for kv in (0, 1):
        block = offsets[0, row, kv, slots // tokens_per_block].astype(np.int64) + 2 * layer_idx
        out.append(site(blocks, "N H T D", {}, {"N": block, "T": slots % tokens_per_block}))
    return out


def export(*, past_key_value=None, kv_cache_pool=None, kv_cache_block_offsets=None, sequence_length,
           host_max_attention_window_sizes, host_sink_token_length, sequence, layer_idx=0, paged_kv_cache=False,
           tokens_per_block=64, streamingllm=False, kv_cache_quant_mode=0, kv_quant_orig_scale=None,
           kv_orig_quant_scale=None) -> KV:
    """Cache row `sequence` of layer `layer_idx` after sequence_length[sequence] tokens: the tokens it still
    holds, with their positions (beam search's indirection is not followed: row `sequence` is read as it is).

    Parameters
    ----------
    past_key_value : array or None
        Contiguous cache of one layer: `(batch_beam, 2, num_kv_heads, max_seqlen, head_size)` (axis 1: K, V).
    kv_cache_pool : array or None
        Paged pool: `(num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_size)`.
    kv_cache_block_offsets : int array or None
        Paged: `(num_pools, batch_beam, 2, max_blocks_per_seq)`, the blocks of each row (pool 0 is used), the
        KV cache manager's numbering block * num_layers * 2 + kv (the plugin adds 2 * layer_idx).
    sequence_length : int array
        `(batch_beam,)`: tokens each row has seen (past + current).
    host_max_attention_window_sizes : int array
        The window W per layer (a shorter list repeats over the layers): a cache of more than W tokens is
        cyclic.
    host_sink_token_length : int array
        `(1,)`: the S sink tokens a cyclic cache keeps, in [0, W).
    sequence : int
        The row.
    layer_idx : int
        The model layer: the pool's layer, and which window applies (a contiguous cache is that layer's).
    paged_kv_cache : bool
        True: the pool and its offsets; False: past_key_value.
    tokens_per_block : int
        The pool's tokens a block (a power of two).
    streamingllm : bool
        The keys are stored un-rotated (the KV says rotated=False).
    kv_cache_quant_mode : int
        0, 64 (INT8_KV_CACHE) or 128 (FP8_KV_CACHE, e4m3).
    kv_quant_orig_scale : float array or None
        INT8 / FP8: the scale s, value = code * s.
    kv_orig_quant_scale : float array or None
        INT8 / FP8: 1 / s, used to encode (default 1 / kv_quant_orig_scale).
    """
    kind, stored, s, _ = _quant(kv_cache_quant_mode, kv_quant_orig_scale, kv_orig_quant_scale)
    name, array, heads, head_size, capacity, rows, offsets = _layout(
        past_key_value, kv_cache_pool, kv_cache_block_offsets, paged_kv_cache, tokens_per_block, layer_idx, stored)
    paged = offsets is not None
    row = check_sequence("sequence", sequence, rows)
    length = int(lengths("sequence_length", sequence_length, rows, meaning=" (batch_beam)")[row])
    window, sinks = _window(host_max_attention_window_sizes, host_sink_token_length, layer_idx)
    positions = held_positions(length, window, sinks)
    bubble = trt.paged_bubble(sinks, tokens_per_block) if paged else 0
    slots = trt.cyclic_slot(positions, window, sinks, bubble)
    check_index("sequence_length", slots, 0, capacity, f"cache slots of row {row} (capacity {capacity})")
    ks, vs = _sites(array, paged, offsets, row, layer_idx, slots, tokens_per_block)
    return read_pair(ks, vs, kind, s, s, 0, positions, not check_bool("streamingllm", streamingllm))


def import_(kv: KV, *, past_key_value=None, kv_cache_pool=None, kv_cache_block_offsets=None,
            host_max_attention_window_sizes, host_sink_token_length, sequence, layer_idx=0, paged_kv_cache=False,
            tokens_per_block=64, streamingllm=False, kv_cache_quant_mode=0, kv_quant_orig_scale=None,
            kv_orig_quant_scale=None, free_pages=None, sequence_length=None) -> dict:
    """Write kv's tokens into row `sequence` at the cyclic slots of their positions (a token a later one
    overwrites is not written). Returns {"sequence_length": last position + 1, "slots", "pages"}; the caller's
    sequence_length[sequence] becomes that.

    Parameters
    ----------
    kv : KV
        The tokens to write, at the slots of kv.positions (num_kv_heads and head_size of the cache).
    past_key_value : array or None
        As for export (written).
    kv_cache_pool : array or None
        As for export (written).
    kv_cache_block_offsets : int array or None
        As for export; paged with free_pages: the row's first blocks (both halves) are set to fresh blocks,
        the manager's way (block * num_layers * 2 + kv).
    host_max_attention_window_sizes : int array
        The window W per layer.
    host_sink_token_length : int array
        `(1,)`: the S sink tokens, in [0, W).
    sequence : int
        The row.
    layer_idx : int
        The model layer written: the pool's layer, and which window applies.
    paged_kv_cache : bool
        True: the pool and its offsets; False: past_key_value.
    tokens_per_block : int
        The pool's tokens a block (a power of two).
    streamingllm : bool
        The cache stores un-rotated keys (`convert` un-rotates rotated ones first).
    kv_cache_quant_mode : int
        0, 64 (INT8_KV_CACHE) or 128 (FP8_KV_CACHE, e4m3): code = sat(round(x * kv_orig_quant_scale)).
    kv_quant_orig_scale : float array or None
        INT8 / FP8: the scale s.
    kv_orig_quant_scale : float array or None
        INT8 / FP8: 1 / s (default 1 / kv_quant_orig_scale).
    free_pages : list of int or None
        Paged: free block numbers of the pool (its first axis); the row takes as many as its slots need,
        removed from the list once written.
    sequence_length : int array or None
        `(batch_beam,)`, read only: the other rows' lengths, so that a block another row holds is refused as
        one of this row's.
    """
    kv = check_kv(kv)
    kind, stored, s, inv = _quant(kv_cache_quant_mode, kv_quant_orig_scale, kv_orig_quant_scale)
    name, array, heads, head_size, capacity, rows, offsets = _layout(
        past_key_value, kv_cache_pool, kv_cache_block_offsets, paged_kv_cache, tokens_per_block, layer_idx, stored)
    paged = offsets is not None
    check_bool("streamingllm", streamingllm)
    check_writable(name, array)
    check_kv_fits(kv, heads, head_size, f"{name} (num_kv_heads, head_size)")
    row = check_sequence("sequence", sequence, rows)
    window, sinks = _window(host_max_attention_window_sizes, host_sink_token_length, layer_idx)
    bubble = trt.paged_bubble(sinks, tokens_per_block) if paged else 0
    slots = trt.cyclic_slot(kv.positions, window, sinks, bubble)
    kept = trt._last_writer(slots)                                               # the latest token of each slot
    slots = slots[kept]
    check_index("host_max_attention_window_sizes", slots, 0, capacity,
                f"cache slots of the tokens (capacity {capacity} of {name})")
    if sequence_length is not None:
        lengths("sequence_length", sequence_length, rows, meaning=" (batch_beam)")
    pages = []
    if paged:
        num_blocks, num_layers = array.shape[:2]
        used = {}                                   # block id of the pool seen as blocks -> the row holding it
        if sequence_length is not None:
            lens = lengths("sequence_length", sequence_length, rows, meaning=" (batch_beam)")
            for r in range(rows):
                if r != row:
                    theirs = trt.cyclic_slot(held_positions(int(lens[r]), window, sinks), window, sinks, bubble)
                    check_index("sequence_length", theirs, 0, capacity, f"cache slots of row {r}")
                    for i in _block_ids(offsets, r, layer_idx, theirs, tokens_per_block, array).reshape(-1):
                        used.setdefault(int(i), f"row {r}")
        if free_pages is not None:
            table("kv_cache_block_offsets", kv_cache_block_offsets, written=True)
            pages = take_pages(free_pages, int(slots.max()) // tokens_per_block + 1 if slots.size else 0,
                               num_pages=num_blocks, meaning="block numbers of kv_cache_pool",
                               used={i // (2 * num_layers): who for i, who in used.items()})
            offsets = offsets.copy()
            for kv_half in (0, 1):
                offsets[0, row, kv_half, :len(pages)] = np.asarray(pages) * num_layers * 2 + kv_half
        check_own("kv_cache_block_offsets", _block_ids(offsets, row, layer_idx, slots, tokens_per_block, array),
                  used, f"blocks of row {row} (offset + 2 * layer_idx)")
    ks, vs = _sites(array, paged, offsets, row, layer_idx, slots, tokens_per_block)
    write = prepare_pair(_take(kv, kept), kind, ks, vs, scale=(s, s), inverse_scale=(inv, inv))
    if pages:
        assign(kv_cache_block_offsets, (0, row, slice(None), slice(0, len(pages))), offsets[0, row, :, :len(pages)])
        commit_pages(free_pages, len(pages))
    write()
    return {"sequence_length": int(kv.positions.max()) + 1 if kv.tokens else 0, "slots": slots, "pages": pages}


def _take(kv: KV, kept: np.ndarray) -> KV:
    """kv restricted to the tokens `kept` (their codes too)."""
    if len(kept) == kv.tokens:
        return kv
    q = kv.quant
    if q is not None:
        group = q.kind.endswith("group")
        q = type(q)(q.kind, q.key_codes[:, kept], q.value_codes[:, kept],
                    q.key_scale[:, kept] if group else q.key_scale, q.value_scale[:, kept] if group else q.value_scale,
                    q.quant_group)
    return KV(kv.key[:, kept], kv.value[:, kept], kv.positions[kept], kv.rotated, q)


def rule(*, past_key_value=None, kv_cache_pool=None, paged_kv_cache=False, kv_cache_quant_mode=0,
         kv_quant_orig_scale=None, kv_orig_quant_scale=None, **_) -> dict:
    """How this destination stores values (for `cacheattn.convert.error_bound`)."""
    kind, _, s, _ = _quant(kv_cache_quant_mode, kv_quant_orig_scale, kv_orig_quant_scale)
    array = kv_cache_pool if paged_kv_cache else past_key_value
    return dict(kind=kind, dtype=array.dtype, scale=(s, s))


def stores_rotated(*, streamingllm=False, **_) -> bool:
    """StreamingLLM stores keys before RoPE (rotated at their cache index when read)."""
    return not streamingllm
