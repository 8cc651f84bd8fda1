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
    check_index,
    check_sequence,
    commit_pages,
    fp8_dtype,
    host,
    is_float,
    prepare_pair,
    read_pair,
    site,
    take_pages,
)

KINDS = {"auto": None, "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def _arrays(key_cache, value_cache, kv_cache, kv_cache_dtype, kv_cache_layout, k_scale, v_scale):
    """(K array, V array, K axes, V axes, width axes of K, kind, (k_scale, v_scale)); fp8 bytes as fp8 views."""
    if kv_cache_dtype not in KINDS:
        raise ValueError(f"kv_cache_dtype: expected one of {tuple(KINDS)}, got {kv_cache_dtype!r}")
    kind = KINDS[kv_cache_dtype]
    if kv_cache is not None:
        check_cache_array("kv_cache", kv_cache)
        if kv_cache_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_cache_layout: expected 'NHD' or 'HND', got {kv_cache_layout!r}")
        if kv_cache.ndim != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"kv_cache: expected shape (2, num_blocks, block_size, num_kv_heads, head_size) or its "
                             f"HND twin, got {tuple(kv_cache.shape)}")
        arrays = [_typed("kv_cache", kv_cache, kind)[i] for i in (0, 1)]
        axes = "N S H D" if kv_cache_layout == "NHD" else "N H S D"
        k_axes = v_axes = axes
        width = "D"
    else:
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
        k_axes, v_axes, width = "N H DC S X", "N H D S", "DC X"
    scales = (None, None)
    if kind is not None:
        scales = tuple(_scale(n, s) for n, s in (("k_scale", k_scale), ("v_scale", v_scale)))
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


def _scale(name, s):
    value = np.asarray(1.0 if s is None else s, np.float32).reshape(-1)
    if value.size != 1 or not np.isfinite(value[0]) or value[0] <= 0:
        raise ValueError(f"{name}: expected one positive float, got {s!r}")
    return np.float32(value[0])


def _sites(arrays, k_axes, v_axes, width, blocks, rows):
    return (site(arrays[0], k_axes, {}, {"N": blocks, "S": rows}, width_axes=width),
            site(arrays[1], v_axes, {}, {"N": blocks, "S": rows}))


def _where(block_tables, req, tokens, block_size, num_blocks):
    table = host(block_tables)
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"block_tables: expected integers (num_seqs, max_blocks), got {table.dtype} {table.shape}")
    if -(-tokens // block_size) > table.shape[1]:
        raise ValueError(f"block_tables: expected room for {-(-tokens // block_size)} blocks, got {table.shape[1]}")
    p = np.arange(tokens)
    blocks = table[req, p // block_size].astype(np.int64)
    check_index("block_tables", blocks, 0, num_blocks, f"block numbers of request {req}")
    return blocks, p % block_size


def export(*, key_cache=None, value_cache=None, kv_cache=None, block_tables, seq_lens, sequence,
           kv_cache_dtype="auto", kv_cache_layout="NHD", k_scale=None, v_scale=None) -> KV:
    """Request `sequence`'s seq_lens[req] tokens (one layer's caches: vLLM keeps one cache per layer)."""
    arrays, k_axes, v_axes, width, kind, scales = _arrays(key_cache, value_cache, kv_cache, kv_cache_dtype,
                                                          kv_cache_layout, k_scale, v_scale)
    lens = host(seq_lens).reshape(-1)
    req = check_sequence("sequence", sequence, lens.shape[0])
    block_size = dict(zip(v_axes.split(), arrays[1].shape))["S"]
    blocks, rows = _where(block_tables, req, int(lens[req]), block_size, arrays[1].shape[0])
    ks, vs = _sites(arrays, k_axes, v_axes, width, blocks, rows)
    return read_pair(ks, vs, kind, *scales, 0, np.arange(int(lens[req])), True)


def import_(kv: KV, *, key_cache=None, value_cache=None, kv_cache=None, block_tables, sequence,
            kv_cache_dtype="auto", kv_cache_layout="NHD", k_scale=None, v_scale=None, free_pages=None) -> dict:
    """Write kv's tokens at positions [0, T) of request `sequence` (seq_lens[req] becomes T); with `free_pages`
    the request's block_tables row gets fresh blocks from the front of the list."""
    arrays, k_axes, v_axes, width, kind, scales = _arrays(key_cache, value_cache, kv_cache, kv_cache_dtype,
                                                          kv_cache_layout, k_scale, v_scale)
    ext = dict(zip(v_axes.split(), arrays[1].shape))
    if (kv.num_kv_heads, kv.head_dim) != (ext["H"], ext["D"]):
        raise ValueError(f"kv: expected {ext['H']} heads of head_size {ext['D']}, got {kv.num_kv_heads} of "
                         f"{kv.head_dim}")
    table = host(block_tables)
    req = check_sequence("sequence", sequence, table.shape[0] if table.ndim == 2 else 0)
    pages = take_pages(free_pages, -(-kv.tokens // ext["S"]))
    if pages:
        check_index("free_pages", np.asarray(pages), 0, ext["N"], "block numbers")
        table = table.copy()
        table[req, :len(pages)] = pages
    blocks, rows = _where(table, req, kv.tokens, ext["S"], ext["N"])
    ks, vs = _sites(arrays, k_axes, v_axes, width, blocks, rows)
    write = prepare_pair(kv, kind, ks, vs, scale=scales)
    if pages:
        assign(block_tables, (req, slice(0, len(pages))), pages)
        commit_pages(free_pages, len(pages))
    write()
    return {"seq_lens": kv.tokens, "pages": pages}


def rule(*, key_cache=None, value_cache=None, kv_cache=None, kv_cache_dtype="auto", kv_cache_layout="NHD",
         k_scale=None, v_scale=None, **_) -> dict:
    arrays, _, _, _, kind, scales = _arrays(key_cache, value_cache, kv_cache, kv_cache_dtype, kv_cache_layout,
                                            k_scale, v_scale)
    return dict(kind=kind, dtype=arrays[0].dtype, scale=scales)


def stores_rotated(**_) -> bool:
    return True
