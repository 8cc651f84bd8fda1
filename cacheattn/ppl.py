"""OpenPPL pmx operators: KeyValueCache, dynamic_batching.{KeyValueCache, MultiHeadAttention,
MultiHeadCacheAttention}. Arguments keep the documents' names and order.

Each function validates everything (shapes, dtypes, attributes, and every index the call
will follow into `cache`), then dispatches: NumPy arrays to `reference`, GPU arrays to
`kernels_numba`, or as `backend` says.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import reference
from reference.alibi import alibi_slopes
from reference.cache_layout import DYNAMIC_LAYOUTS, STATIC_LAYOUTS
from reference.quant import stored_head_dim

from . import _arrays as arrays
from ._validate import (
    FLOAT_T1,
    check_choice,
    check_contiguous,
    check_dtype,
    check_int,
    check_same_dtype,
    check_shape,
    check_starts,
)

QUANT_BITS = (0, 4, 8)


class KeyValue(NamedTuple):
    """The two outputs of KeyValueCache, in the document's order."""
    key: object
    value: object


# ---------------------------------------------------------------------------------------------- checks

def _check_quant(quant_bit, quant_group, head_dim):
    check_choice("quant_bit", quant_bit, QUANT_BITS)
    check_int("quant_group", quant_group, low=1)
    if quant_bit and head_dim % quant_group:
        raise ValueError(f"quant_group: expected a divisor of head_dim ({head_dim}), got {quant_group}")
    if quant_bit == 4 and quant_group % 2:
        raise ValueError(f"quant_group: expected an even group for quant_bit 4 (two values per byte), "
                         f"got {quant_group}")


def _check_layer(num_layer, layer_idx):
    check_int("num_layer", num_layer, low=1)
    check_int("layer_idx", layer_idx, low=0, high=num_layer - 1)


def _check_current(current_key, current_value, rank_shape, meaning):
    check_dtype("current_key", current_key, FLOAT_T1)
    check_shape("current_key", current_key, rank_shape, meaning)
    check_same_dtype("current_value", current_value, "current_key", current_key)
    check_shape("current_value", current_value, tuple(current_key.shape), "(that of current_key)")


def _check_cache_tensors(cache, scale, axes, *, num_layer, num_heads, head_dim, quant_bit, quant_group):
    """cache / scale against a layout's named axes; returns {axis name: extent} of the cache."""
    names = axes.split()
    stored_dim = stored_head_dim(head_dim, quant_bit)
    want = {"L": num_layer, "KV": 2, "H": num_heads, "D": stored_dim}
    # spec: ppl-kvc/quant-skip, ppl-mhca/types
    if quant_bit:
        if np.dtype(cache.dtype) != np.int8:
            raise TypeError(f"cache: expected int8 for quant_bit {quant_bit}, got {np.dtype(cache.dtype).name}")
    else:
        check_dtype("cache", cache, FLOAT_T1)
    layout_text = "(" + ",".join(names) + ")"
    check_shape("cache", cache, tuple(want.get(n) for n in names), f"for layout {layout_text}")
    extents = dict(zip(names, (int(s) for s in cache.shape)))
    if quant_bit:
        # spec: ppl-mhca/scale-required
        if scale is None:
            raise ValueError(f"scale: required when quant_bit is {quant_bit}, got None")
        check_dtype("scale", scale, FLOAT_T1)
        check_shape("scale", scale, tuple(extents[n] for n in names[:-1]) + (head_dim // quant_group,),
                    f"(cache's, last dim head_dim/quant_group) for layout {layout_text}")
    return extents


def _check_dynamic_indices(seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen, total_tokens,
                           max_t, *, cache_mode, page_size):
    """The per-batch index inputs; returns (seqlens, kvlens). Every slot the call touches lies in [0, MaxT)."""
    seqlens = check_starts("seqstarts", seqstarts, total_tokens, "the token count of current_key")
    batch = seqlens.shape[0]
    kvlens = check_starts("kvstarts", kvstarts, None, "")
    if kvlens.shape[0] != batch:
        raise ValueError(f"kvstarts: expected shape ({batch + 1},) like seqstarts, got {kvstarts.shape}")
    check_shape("start_pos", start_pos, (batch,))
    if (start_pos < 0).any():
        raise ValueError(f"start_pos: expected values >= 0, got {start_pos.tolist()}")
    bad = np.nonzero(kvlens != start_pos + seqlens)[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"kvstarts: expected kvlen = start_pos + seqlen for every batch; batch {b} has kvlen "
                         f"{kvlens[b]}, start_pos {start_pos[b]} + seqlen {seqlens[b]}")
    # spec: ppl-mhca/max-lens
    _check_max("max_seqlen", max_seqlen, seqlens)
    _check_max("max_kvlen", max_kvlen, kvlens)
    _check_cachestarts(cachestarts, kvlens, max_t, cache_mode=cache_mode, page_size=page_size)
    _check_written_slots(cachestarts, start_pos, seqlens, cache_mode=cache_mode, page_size=page_size)
    return seqlens, kvlens


def _check_max(name, value, lengths):
    check_int(name, value, low=0)
    if value < lengths.max():
        raise ValueError(f"{name}: expected at least the longest length {lengths.max()}, got {value}")


def _check_cachestarts(cachestarts, kvlens, max_t, *, cache_mode, page_size):
    """Every slot of positions [0, kvlen) must lie inside MaxT; a used page must fit whole."""
    batch = kvlens.shape[0]
    if cache_mode == 0:
        check_shape("cachestarts", cachestarts, (batch,), "for cache_mode 0")
        ends = cachestarts + kvlens
        bad = np.nonzero((cachestarts < 0) | (ends > max_t))[0]
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cachestarts: expected [cachestarts[b], cachestarts[b] + kvlen) inside MaxT = {max_t}; "
                             f"batch {b} covers [{cachestarts[b]}, {ends[b]})")
        return
    pages_needed = -(-kvlens // page_size)
    check_shape("cachestarts", cachestarts, (batch, None), "(B, MaxP) for cache_mode 1")
    if cachestarts.shape[1] < pages_needed.max():
        raise ValueError(f"cachestarts: expected MaxP >= {pages_needed.max()} pages of page_size {page_size} for "
                         f"max kvlen {kvlens.max()}, got MaxP = {cachestarts.shape[1]}")
    # One pass over the whole table (a decode batch of 64 is 64 Python iterations otherwise).
    used = np.arange(cachestarts.shape[1]) < pages_needed[:, None]
    bad = np.argwhere(used & ((cachestarts < 0) | (cachestarts + page_size > max_t)))
    if bad.size:
        b, p = (int(i) for i in bad[0])
        raise ValueError(f"cachestarts: expected every used page [start, start + page_size) inside MaxT = "
                         f"{max_t}; cachestarts[{b}, {p}] = {cachestarts[b, p]} with page_size {page_size}")


def _check_written_slots(cachestarts, start_pos, seqlens, *, cache_mode, page_size):
    """No two current tokens of the call may be stored into the same cache slot: the store writes every token in
    parallel, so on a GPU that is a data race whose winner is undefined. Only the slots written now count:
    sequences may share the pages of a common prefix, which this call only reads (positions < start_pos)."""
    batch_of = np.repeat(np.arange(seqlens.shape[0]), seqlens)                  # (sum seqlens,) the token's batch
    first = np.cumsum(seqlens) - seqlens                                         # (B,) its first packed row
    position = start_pos[batch_of] + np.arange(batch_of.shape[0]) - first[batch_of]
    if cache_mode == 0:
        slots = cachestarts[batch_of] + position
    else:
        slots = cachestarts[batch_of, position // page_size] + position % page_size
    order = np.argsort(slots, kind="stable")
    clash = np.nonzero(slots[order][1:] == slots[order][:-1])[0]
    if clash.size:
        i, j = order[clash[0]], order[clash[0] + 1]
        where = "cachestarts[b]" if cache_mode == 0 else "cachestarts[b, t // page_size]"
        raise ValueError(f"cachestarts: expected the current tokens of the call to be stored into distinct cache "
                         f"slots, got batch {batch_of[i]} position {position[i]} and batch {batch_of[j]} position "
                         f"{position[j]} both at slot {slots[i]} (from {where}); two writes to one slot race on a "
                         f"GPU. Sequences may share read-only prefix pages (positions < start_pos), not written ones")


def _check_attention_attrs(num_heads, head_dim, num_kv_heads, is_causal, is_alibi):
    check_int("num_heads", num_heads, low=1)
    check_int("head_dim", head_dim, low=1)
    check_int("num_kv_heads", num_kv_heads, low=0)
    kv_heads = num_kv_heads or num_heads
    # spec: ppl-mhca/gqa-divisible
    if num_heads % kv_heads:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads ({num_heads}), got {num_kv_heads}")
    for name, flag in (("is_causal", is_causal), ("is_alibi", is_alibi)):
        if not isinstance(flag, (bool, np.bool_, int, np.integer)) or flag not in (0, 1):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    return kv_heads


def _check_query(query, num_heads, head_dim):
    check_dtype("query", query, FLOAT_T1)
    check_shape("query", query, (None, num_heads, head_dim), "(seqstarts[B], num_heads, head_dim)")


def _check_mask(attn_mask, query, num_heads, total_tokens, total_kv):
    if attn_mask is None:
        return
    check_same_dtype("attn_mask", attn_mask, "query", query)
    if attn_mask.ndim not in (2, 3):
        raise ValueError(f"attn_mask: expected shape (sum seqlens, >= sum kvlens) or "
                         f"(num_heads, sum seqlens, >= sum kvlens), got {tuple(attn_mask.shape)}")
    lead = (num_heads,) if attn_mask.ndim == 3 else ()
    check_shape("attn_mask", attn_mask, lead + (total_tokens, None),
                f"(sum seqlens = {total_tokens} rows, >= sum kvlens = {total_kv} columns)")
    if attn_mask.shape[-1] < total_kv:
        raise ValueError(f"attn_mask: expected a last dim >= sum kvlens = {total_kv}, got {attn_mask.shape[-1]}")


def _check_decoding(decoding_batches, batch):
    check_int("decoding_batches", decoding_batches, low=0, high=batch)


def _check_kernel_tensors(engine, **tensors):
    if engine == "numba":
        for name, x in tensors.items():
            if x is not None:
                check_contiguous(name, x)


# ---------------------------------------------------------------------------------------------- operators

@arrays.accepts_torch
def key_value_cache(current_key, current_value, start_pos, cache, scale=None, *, num_layer=1, layer_idx=0,
                    quant_bit=0, quant_group=8, num_repeat=1, cache_layout=0, backend="auto", threads=128):
    """OpenPPL `KeyValueCache`: store current key/value at start_pos, return the whole key/value so far.

    current_key, current_value: (B, S, H, Dh) float16/float32. start_pos: int or one-element tensor.
    cache: cache_layout 0 (MaxB, L, 2, MaxS, H, Dh) or 1 (L, MaxB, 2, H, MaxS, Dh); int8 when quant_bit != 0
    (last dim Dh/2 for quant_bit 4). scale: cache's layout with last dim Dh/quant_group.
    Returns KeyValue(key, value), each (B, start_pos + S, H * num_repeat, Dh). cache and scale are modified.
    """
    data = dict(current_key=current_key, current_value=current_value, cache=cache, scale=scale)
    engine = arrays.resolve_backend(backend, data)
    _check_current(current_key, current_value, (None, None, None, None), "(B, S, H, Dh)")
    batch, seqlen, num_heads, head_dim = (int(s) for s in current_key.shape)
    start = arrays.index_array("start_pos", start_pos).reshape(-1)
    if start.shape != (1,):
        raise ValueError(f"start_pos: expected a scalar or a one-element tensor, got shape {start.shape}")
    start_p = int(start[0])
    _check_layer(num_layer, layer_idx)
    _check_quant(quant_bit, quant_group, head_dim)
    check_int("num_repeat", num_repeat, low=1)
    check_choice("cache_layout", cache_layout, STATIC_LAYOUTS)
    extents = _check_cache_tensors(cache, scale, STATIC_LAYOUTS[cache_layout], num_layer=num_layer,
                                   num_heads=num_heads, head_dim=head_dim, quant_bit=quant_bit,
                                   quant_group=quant_group)
    if batch > extents["B"]:
        raise ValueError(f"current_key: expected batch <= MaxB = {extents['B']} of cache, got {batch}")
    if start_p < 0 or start_p + seqlen > extents["T"]:
        raise ValueError(f"start_pos: expected 0 <= start_pos and start_pos + S <= MaxS = {extents['T']}, "
                         f"got start_pos {start_p} with S = {seqlen}")
    _check_kernel_tensors(engine, cache=cache, scale=scale)
    attrs = dict(layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group, num_repeat=num_repeat)
    if engine == "reference":
        return KeyValue(*arrays.run_reference(data, ("cache", "scale"), lambda h: reference.key_value_cache(
            h["current_key"], h["current_value"], start_p, h["cache"], h["scale"], num_layer=num_layer,
            cache_layout=cache_layout, **attrs)))
    data = {name: arrays.as_kernel_array(x) for name, x in data.items()}
    return KeyValue(*arrays.kernels().key_value_cache(
        data["current_key"], data["current_value"], start_p, data["cache"], data["scale"],
        cache_axes=STATIC_LAYOUTS[cache_layout], threads=threads, **attrs))


def _dynamic_cache_checks(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                          max_kvlen, cache, scale, *, num_kv_heads, head_dim, num_layer, layer_idx, quant_bit,
                          quant_group, cache_mode, cache_layout, page_size):
    """Checks shared by dynamic_batching.KeyValueCache and MultiHeadCacheAttention; returns host index arrays."""
    _check_current(current_key, current_value, (None, num_kv_heads, head_dim),
                   "(seqstarts[B], num_kv_heads, head_dim)")
    _check_layer(num_layer, layer_idx)
    _check_quant(quant_bit, quant_group, head_dim)
    check_choice("cache_mode", cache_mode, (0, 1))
    check_choice("cache_layout", cache_layout, DYNAMIC_LAYOUTS)
    check_int("page_size", page_size, low=1)
    extents = _check_cache_tensors(cache, scale, DYNAMIC_LAYOUTS[cache_layout], num_layer=num_layer,
                                   num_heads=num_kv_heads, head_dim=head_dim, quant_bit=quant_bit,
                                   quant_group=quant_group)
    idx = {name: arrays.index_array(name, x) for name, x in
           (("seqstarts", seqstarts), ("kvstarts", kvstarts), ("cachestarts", cachestarts), ("start_pos", start_pos))}
    _check_dynamic_indices(idx["seqstarts"], idx["kvstarts"], idx["cachestarts"], idx["start_pos"], max_seqlen,
                           max_kvlen, int(current_key.shape[0]), extents["T"], cache_mode=cache_mode,
                           page_size=page_size)
    return idx


@arrays.accepts_torch
def dynamic_key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                            max_kvlen, cache, scale=None, *, num_layer=1, layer_idx=0, quant_bit=0, quant_group=8,
                            num_repeat=1, cache_mode=0, cache_layout=0, page_size=128, backend="auto", threads=128):
    """OpenPPL `dynamic_batching.KeyValueCache`. Returns KeyValue(key, value), each (kvstarts[B], H*num_repeat, Dh).

    current_key, current_value: (seqstarts[B], H, Dh). cache: cache_layout 0 (MaxT,L,2,H,Dh), 1 (L,MaxT,2,H,Dh),
    2 (L,2,MaxT,H,Dh), 3 (L,2,H,MaxT,Dh). cachestarts: (B,) offsets (cache_mode 0) or (B, MaxP) page starts
    (cache_mode 1). cache and scale are modified in place.
    """
    data = dict(current_key=current_key, current_value=current_value, cache=cache, scale=scale)
    engine = arrays.resolve_backend(backend, data)
    check_int("num_repeat", num_repeat, low=1)
    if getattr(current_key, "ndim", 0) != 3:
        raise ValueError(f"current_key: expected shape (seqstarts[B], num_kv_heads, head_dim), "
                         f"got {tuple(current_key.shape)}")
    num_kv_heads, head_dim = int(current_key.shape[1]), int(current_key.shape[2])
    attrs = dict(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
                 cache_mode=cache_mode, cache_layout=cache_layout, page_size=page_size)
    idx = _dynamic_cache_checks(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                                max_kvlen, cache, scale, num_kv_heads=num_kv_heads, head_dim=head_dim, **attrs)
    _check_kernel_tensors(engine, cache=cache, scale=scale)
    order = ("seqstarts", "kvstarts", "cachestarts", "start_pos")
    if engine == "reference":
        return KeyValue(*arrays.run_reference(data, ("cache", "scale"), lambda h: reference.dynamic_key_value_cache(
            h["current_key"], h["current_value"], *(idx[n] for n in order), max_seqlen, max_kvlen, h["cache"],
            h["scale"], num_repeat=num_repeat, **attrs)))
    data = {name: arrays.as_kernel_array(x) for name, x in data.items()}
    del attrs["num_layer"], attrs["cache_layout"]
    given = (seqstarts, kvstarts, cachestarts, start_pos)         # in `order`
    return KeyValue(*arrays.kernels().dynamic_key_value_cache(
        data["current_key"], data["current_value"],
        *(arrays.kernel_index(data["cache"], x, idx[n]) for n, x in zip(order, given)), max_seqlen, max_kvlen,
        data["cache"], data["scale"], total_kv=int(idx["kvstarts"][-1]), num_repeat=num_repeat,
        cache_axes=DYNAMIC_LAYOUTS[cache_layout], threads=threads, **attrs))


@arrays.accepts_torch
def dynamic_multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                                 attn_mask=None, *, num_heads, head_dim, is_causal, is_alibi=False, num_kv_heads=0,
                                 backend="auto", threads=128, rung=1, num_splits=None):
    """OpenPPL `dynamic_batching.MultiHeadAttention` over packed key/value (as KeyValueCache returns them).

    query: (seqstarts[B], num_heads, head_dim); key, value: (kvstarts[B], num_kv_heads, head_dim).
    Returns attn_output (seqstarts[B], num_heads, head_dim). threads, rung: the kernels' block size and which
    rung of the kernel ladder runs (1 shared-memory tiles, 2 a warp per key, 3 16-byte loads, 4 split-K, 5 tensor
    cores with a float16 query; docs/kernel-ladder.md); num_splits: rung 4's split count (default: chosen for the
    GPU's SM count).
    """
    data = dict(query=query, key=key, value=value, attn_mask=attn_mask)
    engine = arrays.resolve_backend(backend, data)
    _check_launch(threads, rung, num_splits)
    kv_heads = _check_attention_attrs(num_heads, head_dim, num_kv_heads, is_causal, is_alibi)
    _check_query(query, num_heads, head_dim)
    _check_rung(rung, query)
    for name, x in (("key", key), ("value", value)):
        check_same_dtype(name, x, "query", query)
        check_shape(name, x, (None, kv_heads, head_dim), "(kvstarts[B], num_kv_heads, head_dim)")
    seqs = arrays.index_array("seqstarts", seqstarts)
    kvs = arrays.index_array("kvstarts", kvstarts)
    seqlens = check_starts("seqstarts", seqs, int(query.shape[0]), "the row count of query")
    kvlens = check_starts("kvstarts", kvs, int(key.shape[0]), "the row count of key")
    if kvlens.shape != seqlens.shape:
        raise ValueError(f"kvstarts: expected shape {seqs.shape} like seqstarts, got {kvs.shape}")
    _check_decoding(decoding_batches, seqlens.shape[0])
    _check_max("max_seqlen", max_seqlen, seqlens)
    _check_max("max_kvlen", max_kvlen, kvlens)
    _check_mask(attn_mask, query, num_heads, int(seqs[-1]), int(kvs[-1]))
    _check_kernel_tensors(engine, query=query, key=key, value=value, attn_mask=attn_mask)
    _check_plan(engine, rung, threads, num_heads, kv_heads, max_seqlen, head_dim, cache_dtype=key.dtype)
    attrs = dict(num_heads=num_heads, head_dim=head_dim, is_causal=bool(is_causal), num_kv_heads=num_kv_heads)
    if engine == "reference":
        return arrays.run_reference(data, (), lambda h: reference.dynamic_multi_head_attention(
            h["query"], h["key"], h["value"], seqs, kvs, decoding_batches, max_seqlen, max_kvlen, h["attn_mask"],
            is_alibi=bool(is_alibi), **attrs))
    data = {name: arrays.as_kernel_array(x) for name, x in data.items()}
    return arrays.kernels().dynamic_multi_head_attention(
        data["query"], data["key"], data["value"], arrays.kernel_index(data["query"], seqstarts, seqs),
        arrays.kernel_index(data["query"], kvstarts, kvs), decoding_batches, max_seqlen, max_kvlen, data["attn_mask"],
        alibi_slopes=alibi_slopes(num_heads) if is_alibi else None, threads=threads, rung=rung, num_splits=num_splits,
        **attrs)


MAX_SPLITS = 64      # rung 4's most key splits, the cap of kernels_numba._split_k.choose_splits too


def _check_launch(threads, rung, num_splits):
    check_choice("rung", rung, (1, 2, 3, 4, 5))
    check_int("threads", threads, low=32, high=1024)
    if rung >= 2 and threads % 32:
        raise ValueError(f"threads: expected a multiple of 32 for rung {rung} (whole warps), got {threads}")
    if num_splits is not None:
        if rung != 4:
            raise ValueError(f"num_splits: only rung 4 (split-K) splits the keys, got num_splits={num_splits!r} "
                             f"with rung {rung}")
        check_int("num_splits", num_splits, low=1, high=MAX_SPLITS)


def _check_rung(rung, query):
    if rung == 5 and query.dtype != np.float16:
        raise ValueError(f"rung: 5 (tensor cores, mma.sync on float16) needs a float16 query, got {query.dtype}")


def _check_plan(engine, rung, threads, num_heads, kv_heads, max_seqlen, head_dim, quant_bit=0, cache_dtype=None):
    """Every kernel keeps its rows' K/V tiles or softmax states in shared memory, so a head_dim too wide for it is
    a ValueError naming head_dim here, from the launcher's own planner, before the cache store or any kernel runs.
    A rung asked for by name (2 to 5) is checked on either backend, so the call fails the same way wherever it
    runs; the default rung 1 only on the kernels (the reference has no such limit)."""
    if rung == 1 and engine == "reference":
        return
    # numba only now, as arrays.kernels() explains
    from kernels_numba._cache import chunk_elements
    from kernels_numba.ppl_dynamic_multi_head_attention import block_plan

    chunk = chunk_elements(quant_bit, cache_dtype) if rung in (3, 4) else None
    block_plan(rung, num_heads, kv_heads, max_seqlen, head_dim, threads, chunk)


@arrays.accepts_torch
def multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *,
                               num_heads, head_dim, is_causal, is_alibi=False, num_kv_heads=0, num_layer=1,
                               layer_idx=0, quant_bit=0, quant_group=8, cache_mode=0, cache_layout=0, page_size=128,
                               backend="auto", threads=128, rung=1, num_splits=None):
    """OpenPPL `dynamic_batching.MultiHeadCacheAttention` = dynamic KeyValueCache + dynamic MultiHeadAttention.

    query: (seqstarts[B], num_heads, head_dim); current_key/value: (seqstarts[B], num_kv_heads, head_dim).
    Returns attn_output (seqstarts[B], num_heads, head_dim); cache and scale are modified in place.
    threads, rung, num_splits: the kernels' block size, kernel-ladder rung (1 shared-memory tiles, 2 a warp per
    key, 3 16-byte loads, 4 split-K, 5 tensor cores with a float16 query) and rung 4's split count (default: chosen
    for the GPU's SM count).
    """
    data = dict(query=query, current_key=current_key, current_value=current_value, cache=cache, scale=scale,
                attn_mask=attn_mask)
    engine = arrays.resolve_backend(backend, data)
    _check_launch(threads, rung, num_splits)
    kv_heads = _check_attention_attrs(num_heads, head_dim, num_kv_heads, is_causal, is_alibi)
    _check_query(query, num_heads, head_dim)
    _check_rung(rung, query)
    check_same_dtype("current_key", current_key, "query", query)
    cache_attrs = dict(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
                       cache_mode=cache_mode, cache_layout=cache_layout, page_size=page_size)
    idx = _dynamic_cache_checks(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                                max_kvlen, cache, scale, num_kv_heads=kv_heads, head_dim=head_dim, **cache_attrs)
    _check_decoding(decoding_batches, idx["seqstarts"].shape[0] - 1)
    _check_mask(attn_mask, query, num_heads, int(idx["seqstarts"][-1]), int(idx["kvstarts"][-1]))
    _check_kernel_tensors(engine, query=query, cache=cache, scale=scale, attn_mask=attn_mask)
    _check_plan(engine, rung, threads, num_heads, kv_heads, max_seqlen, head_dim, quant_bit, cache.dtype)
    order = ("seqstarts", "kvstarts", "cachestarts", "start_pos")
    attrs = dict(num_heads=num_heads, head_dim=head_dim, is_causal=bool(is_causal), num_kv_heads=num_kv_heads)
    if engine == "reference":
        return arrays.run_reference(data, ("cache", "scale"), lambda h: reference.multi_head_cache_attention(
            h["query"], h["current_key"], h["current_value"], *(idx[n] for n in order), decoding_batches,
            max_seqlen, max_kvlen, h["cache"], h["scale"], h["attn_mask"], is_alibi=bool(is_alibi), **attrs,
            **cache_attrs))
    data = {name: arrays.as_kernel_array(x) for name, x in data.items()}
    del cache_attrs["num_layer"], cache_attrs["cache_layout"]
    given = (seqstarts, kvstarts, cachestarts, start_pos)         # in `order`
    return arrays.kernels().multi_head_cache_attention(
        data["query"], data["current_key"], data["current_value"],
        *(arrays.kernel_index(data["cache"], x, idx[n]) for n, x in zip(order, given)), decoding_batches, max_seqlen,
        max_kvlen, data["cache"], data["scale"], data["attn_mask"],
        alibi_slopes=alibi_slopes(num_heads) if is_alibi else None, cache_axes=DYNAMIC_LAYOUTS[cache_layout],
        threads=threads, rung=rung, num_splits=num_splits, **attrs, **cache_attrs)
