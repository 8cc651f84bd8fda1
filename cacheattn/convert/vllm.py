"""vLLM's paged caches (outside the documents; facts from vLLM's sources): the classic paged_attention layout,
K [num_blocks, num_kv_heads, head_size / x, block_size, x] with x = 16 bytes / element size and
V [num_blocks, num_kv_heads, head_size, block_size]; or the V1 FlashAttention layout, one tensor
(2, num_blocks, block_size, num_kv_heads, head_size) ("NHD"; "HND" swaps the middle two). Token p of request
`sequence` is at block block_tables[req, p // block_size], row p % block_size. kv_cache_dtype "fp8" (= e4m3) or
"fp8_e5m2": code = sat(x / scale), value = code * scale with per-tensor k_scale / v_scale; the caches may hold
the fp8 bytes as uint8. Keys are post-RoPE."""

from __future__ import annotations

import numpy as np

from ._core import (
    KV,
    assign,
    check_cache_array,
    check_choice_str,
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

KINDS = {"auto": None, "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def _arrays(key_cache, value_cache, kv_cache, kv_cache_dtype, kv_cache_layout, k_scale, v_scale):
    """(K array, V array, K axes, V axes, width axes of K, kind, (k_scale, v_scale)); fp8 bytes as fp8 views."""
    kind = KINDS[check_choice_str("kv_cache_dtype", kv_cache_dtype, KINDS)]
    if kv_cache is not None:
        if key_cache is not None or value_cache is not None:
            raise ValueError("kv_cache: expected either kv_cache (V1) or key_cache and value_cache (classic), "
                             "got both")
        check_cache_array("kv_cache", kv_cache)
        check_choice_str("kv_cache_layout", kv_cache_layout, ("NHD", "HND"))
        if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"kv_cache: expected shape (2, num_blocks, block_size, num_kv_heads, head_size) or its "
                             f"HND twin, got {tuple(kv_cache.shape)}")
        arrays = [_typed("kv_cache", kv_cache, kind)[i] for i in (0, 1)]
        axes = "N S H D" if kv_cache_layout == "NHD" else "N H S D"
        k_axes = v_axes = axes
        width = "D"
    else:
        if key_cache is None or value_cache is None:
            raise ValueError(f"{'key_cache' if key_cache is None else 'value_cache'}: required (with the other of "
                             f"key_cache and value_cache) when kv_cache is not given, got None")
        check_cache_array("key_cache", key_cache)
        check_cache_array("value_cache", value_cache)
        if key_cache.ndim != 5 or value_cache.ndim != 4:
            raise ValueError(f"key_cache: expected [num_blocks, num_kv_heads, head_size / x, block_size, x] with "
                             f"value_cache [num_blocks, num_kv_heads, head_size, block_size], got "
                             f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
        arrays = [_typed("key_cache", key_cache, kind), _typed("value_cache", value_cache, kind)]
        x = 16 // arrays[0].dtype.itemsize
        if key_cache.shape[4] != x or key_cache.shape[2] * x != value_cache.shape[2]:
            raise ValueError(f"key_cache: expected x = 16 bytes / element size = {x} and head_size / x chunks, "
                             f"got {tuple(key_cache.shape)}")
        if (key_cache.shape[:2], key_cache.shape[3]) != (value_cache.shape[:2], value_cache.shape[3]) or \
                key_cache.dtype != value_cache.dtype:
            raise ValueError(f"value_cache: expected the num_blocks, num_kv_heads, block_size and dtype of "
                             f"key_cache, got {tuple(value_cache.shape)} {value_cache.dtype}")
        k_axes, v_axes, width = "N H DC S X", "N H D S", "DC X"
    scales = (None, None)
    if kind is not None:
        scales = tuple(positive_scalar(n, s, 1.0) for n, s in (("k_scale", k_scale), ("v_scale", v_scale)))
    return arrays, k_axes, v_axes, width, kind, scales


def _typed(name, x, kind):
    if kind is None:
        if not is_float(x.dtype):
            raise TypeError(f"{name}: expected float16, bfloat16 or float32 with kv_cache_dtype 'auto', got {x.dtype}")
        return x
    want = fp8_dtype(kind)
    if x.dtype == np.uint8:
        return x.view(want)                             # vLLM's fp8 caches are often uint8 tensors of the bytes
    if x.dtype != want:
        raise TypeError(f"{name}: expected {want} (or uint8 bytes) for the fp8 kv_cache_dtype, got {x.dtype}")
    return x


def _sites(arrays, k_axes, v_axes, width, blocks, rows):
    return (site(arrays[0], k_axes, {}, {"N": blocks, "S": rows}, width_axes=width),
            site(arrays[1], v_axes, {}, {"N": blocks, "S": rows}))


def _room(tokens, block_size, table_):
    need = -(-tokens // block_size)
    if need > table_.shape[1]:
        raise ValueError(f"block_tables: expected room for {need} blocks ({tokens} tokens), got {table_.shape[1]}")
    return need


def _where(table_, req, tokens, block_size, num_blocks):
    _room(tokens, block_size, table_)
    p = np.arange(tokens)
    blocks = table_[req, p // block_size].astype(np.int64)
    check_index("block_tables", blocks, 0, num_blocks, f"block numbers of request {req}")
    return blocks, p % block_size


def export(*, key_cache=None, value_cache=None, kv_cache=None, block_tables, seq_lens, sequence,
           kv_cache_dtype="auto", kv_cache_layout="NHD", k_scale=None, v_scale=None) -> KV:
    """Request `sequence`'s seq_lens[sequence] tokens, from one layer's caches (vLLM keeps one cache per layer).

    Parameters
    ----------
    key_cache : array or None
        Classic layout: `[num_blocks, num_kv_heads, head_size / x, block_size, x]`, x = 16 bytes / element size.
    value_cache : array or None
        Classic layout: `[num_blocks, num_kv_heads, head_size, block_size]`, key_cache's dtype.
    kv_cache : array or None
        V1 layout instead of the two: `(2, num_blocks, block_size, num_kv_heads, head_size)` (NHD) or
        `(2, num_blocks, num_kv_heads, block_size, head_size)` (HND).
    block_tables : int array
        `(num_seqs, max_blocks)`: row r lists request r's blocks in token order.
    seq_lens : int array
        `(num_seqs,)`: each request's tokens.
    sequence : int
        The request (row of block_tables).
    kv_cache_dtype : str
        "auto" (a float cache), "fp8" (= "fp8_e4m3") or "fp8_e5m2" (the fp8 dtype, or uint8 bytes).
    kv_cache_layout : str
        "NHD" or "HND", of kv_cache.
    k_scale : float or None
        fp8 keys: value = code * k_scale (default 1.0).
    v_scale : float or None
        fp8 values: value = code * v_scale (default 1.0).
    """
    arrays, k_axes, v_axes, width, kind, scales = _arrays(key_cache, value_cache, kv_cache, kv_cache_dtype,
                                                          kv_cache_layout, k_scale, v_scale)
    ext = dict(zip(v_axes.split(), arrays[1].shape))
    tables = table("block_tables", block_tables, ndim=2)
    lens = lengths("seq_lens", seq_lens, tables.shape[0], tables.shape[1] * ext["S"], " (num_seqs of block_tables)")
    req = check_sequence("sequence", sequence, tables.shape[0])
    blocks, rows = _where(tables, req, int(lens[req]), ext["S"], ext["N"])
    ks, vs = _sites(arrays, k_axes, v_axes, width, blocks, rows)
    return read_pair(ks, vs, kind, *scales, 0, np.arange(int(lens[req])), True)


def import_(kv: KV, *, key_cache=None, value_cache=None, kv_cache=None, block_tables, sequence,
            kv_cache_dtype="auto", kv_cache_layout="NHD", k_scale=None, v_scale=None, free_pages=None,
            seq_lens=None) -> dict:
    """Write kv's tokens at positions [0, T) of request `sequence`. Returns {"seq_lens": T, "pages": the blocks
    taken from free_pages}; the caller's seq_lens[sequence] becomes T (import does not write it).

    Parameters
    ----------
    kv : KV
        The tokens to write (num_kv_heads and head_size of the caches).
    key_cache : array or None
        Classic layout K, as for export (written).
    value_cache : array or None
        Classic layout V, as for export (written).
    kv_cache : array or None
        V1 layout, as for export (written).
    block_tables : int array
        `(num_seqs, max_blocks)`: the request's row holds its blocks; with free_pages, its first
        ceil(T / block_size) entries are set to fresh blocks.
    sequence : int
        The request (row of block_tables).
    kv_cache_dtype : str
        "auto", "fp8" (= "fp8_e4m3") or "fp8_e5m2": fp8 caches store sat(x / scale).
    kv_cache_layout : str
        "NHD" or "HND", of kv_cache.
    k_scale : float or None
        fp8 keys' scale (default 1.0).
    v_scale : float or None
        fp8 values' scale (default 1.0).
    free_pages : list of int or None
        Free block numbers: the request takes the first ceil(T / block_size), removed from the list once the
        import has written them.
    seq_lens : int array or None
        `(num_seqs,)`, read only: the other requests' lengths, so that a block another request holds (its first
        ceil(seq_lens[r] / block_size) entries) is refused as one of this request's.
    """
    kv = check_kv(kv)
    arrays, k_axes, v_axes, width, kind, scales = _arrays(key_cache, value_cache, kv_cache, kv_cache_dtype,
                                                          kv_cache_layout, k_scale, v_scale)
    for name, x in (("kv_cache", kv_cache), ("key_cache", key_cache), ("value_cache", value_cache)):
        if x is not None:
            check_writable(name, x)
    ext = dict(zip(v_axes.split(), arrays[1].shape))
    check_kv_fits(kv, ext["H"], ext["D"], "the caches (num_kv_heads, head_size)")
    tables = table("block_tables", block_tables, ndim=2, written=free_pages is not None)
    req = check_sequence("sequence", sequence, tables.shape[0])
    need = _room(kv.tokens, ext["S"], tables)
    used = {}
    if seq_lens is not None:
        lens = lengths("seq_lens", seq_lens, tables.shape[0], tables.shape[1] * ext["S"],
                       " (num_seqs of block_tables)")
        for r in np.flatnonzero(np.arange(tables.shape[0]) != req):
            for block in tables[r, :-(-int(lens[r]) // ext["S"])]:
                used.setdefault(int(block), f"request {r}")
    pages = take_pages(free_pages, need, num_pages=ext["N"], meaning="block numbers", used=used)
    if pages:
        tables = tables.copy()
        tables[req, :need] = pages
    blocks, rows = _where(tables, req, kv.tokens, ext["S"], ext["N"])
    check_own("free_pages" if free_pages is not None else "block_tables", tables[req, :need], used, "block numbers")
    ks, vs = _sites(arrays, k_axes, v_axes, width, blocks, rows)
    write = prepare_pair(kv, kind, ks, vs, scale=scales)
    if pages:
        assign(block_tables, (req, slice(0, need)), pages)
        commit_pages(free_pages, need)
    write()
    return {"seq_lens": kv.tokens, "pages": pages}


def rule(*, key_cache=None, value_cache=None, kv_cache=None, kv_cache_dtype="auto", kv_cache_layout="NHD",
         k_scale=None, v_scale=None, **_) -> dict:
    """How this destination stores values (for `cacheattn.convert.error_bound`)."""
    arrays, _, _, _, kind, scales = _arrays(key_cache, value_cache, kv_cache, kv_cache_dtype, kv_cache_layout,
                                            k_scale, v_scale)
    return dict(kind=kind, dtype=arrays[0].dtype, scale=scales)


def stores_rotated(**_) -> bool:
    """vLLM caches post-RoPE keys."""
    return True
