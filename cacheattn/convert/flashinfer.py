"""FlashInfer's paged cache (outside the documents; facts from FlashInfer's docs): one tensor
[max_num_pages, 2, page_size, num_kv_heads, head_dim] ("NHD") or [max_num_pages, 2, num_kv_heads, page_size,
head_dim] ("HND"), or a (k_cache, v_cache) pair of those shapes without the 2; a CSR page table per batch:
kv_indptr [batch + 1], kv_indices (page ids), kv_last_page_len [batch] in 1 ... page_size. Token p of request b is
at page kv_indices[kv_indptr[b] + p // page_size], row p % page_size. FP8 (e4m3 / e5m2) caches hold x / scale;
attention multiplies by k_scale / v_scale. Keys are post-RoPE."""

from __future__ import annotations

import numpy as np

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

_FP8 = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def _arrays(paged_kv_cache, kv_layout, k_scale, v_scale):
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    axes = "N S H D" if kv_layout == "NHD" else "N H S D"
    if isinstance(paged_kv_cache, (tuple, list)):
        arrays = [check_cache_array(n, x) for n, x in zip(("paged_kv_cache[0]", "paged_kv_cache[1]"), paged_kv_cache)]
        if any(x.ndim != 4 for x in arrays) or arrays[0].shape != arrays[1].shape:
            raise ValueError(f"paged_kv_cache: expected two [max_num_pages, ...] tensors of one 4-d shape "
                             f"({kv_layout}), got {[tuple(x.shape) for x in arrays]}")
    else:
        check_cache_array("paged_kv_cache", paged_kv_cache)
        if paged_kv_cache.ndim != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(f"paged_kv_cache: expected [max_num_pages, 2, ...] ({kv_layout}), got "
                             f"{tuple(paged_kv_cache.shape)}")
        # A view of one half is not C-contiguous: address the whole tensor with the half fixed.
        arrays = [paged_kv_cache, paged_kv_cache]
        axes = axes.replace("N ", "N KV ")
    dtype = np.dtype(arrays[0].dtype)
    kind = _FP8.get(dtype.name)
    if kind is None and not is_float(dtype):
        raise TypeError(f"paged_kv_cache: expected float16, bfloat16, float32 or an fp8 dtype, got {dtype}")
    scales = (None, None)
    if kind is not None:
        scales = tuple(_scale(n, s) for n, s in (("k_scale", k_scale), ("v_scale", v_scale)))
    return arrays, axes, kind, scales


def _scale(name, s):
    value = np.asarray(1.0 if s is None else s, np.float32).reshape(-1)
    if value.size != 1 or not np.isfinite(value[0]) or value[0] <= 0:
        raise ValueError(f"{name}: expected one positive float, got {s!r}")
    return np.float32(value[0])


def _sites(arrays, axes, pages, rows):
    fixed = [{"KV": kv} if "KV" in axes else {} for kv in (0, 1)]
    return [site(arrays[kv], axes, fixed[kv], {"N": pages, "S": rows}) for kv in (0, 1)]


def _pages_of(kv_indptr, kv_indices, b, max_pages):
    indptr = host(kv_indptr).astype(np.int64)
    b = check_sequence("sequence", b, indptr.shape[0] - 1)
    indices = host(kv_indices).astype(np.int64)
    if not 0 <= indptr[b] <= indptr[b + 1] <= indices.shape[0]:
        raise ValueError(f"kv_indptr: expected 0 <= kv_indptr[{b}] <= kv_indptr[{b + 1}] <= len(kv_indices) = "
                         f"{indices.shape[0]}, got {indptr[b]}, {indptr[b + 1]}")
    pages = indices[indptr[b]:indptr[b + 1]]
    check_index("kv_indices", pages, 0, max_pages, f"page ids of request {b}")
    return b, int(indptr[b]), pages


def export(paged_kv_cache, *, kv_indptr, kv_indices, kv_last_page_len, sequence, kv_layout="NHD", k_scale=None,
           v_scale=None) -> KV:
    """Request `sequence`'s tokens: (pages - 1) * page_size + kv_last_page_len[b] of them."""
    arrays, axes, kind, scales = _arrays(paged_kv_cache, kv_layout, k_scale, v_scale)
    ext = dict(zip(axes.split(), arrays[0].shape))
    b, _, pages = _pages_of(kv_indptr, kv_indices, sequence, ext["N"])
    last = int(host(kv_last_page_len).reshape(-1)[b])
    if pages.size and not 1 <= last <= ext["S"]:
        raise ValueError(f"kv_last_page_len: expected values in [1, page_size = {ext['S']}], got {last}")
    tokens = (pages.size - 1) * ext["S"] + last if pages.size else 0
    p = np.arange(tokens)
    ks, vs = _sites(arrays, axes, pages[p // ext["S"]], p % ext["S"])
    return read_pair(ks, vs, kind, *scales, 0, p, True)


def import_(kv: KV, paged_kv_cache, *, kv_indptr, kv_indices, kv_last_page_len, sequence, kv_layout="NHD",
            k_scale=None, v_scale=None, free_pages=None) -> dict:
    """Write kv's tokens into request `sequence`'s pages, which the CSR table reserves: exactly ceil(T / page_size)
    entries of kv_indices; with `free_pages` those entries get fresh pages from the front of the list.
    kv_last_page_len[b] is set."""
    arrays, axes, kind, scales = _arrays(paged_kv_cache, kv_layout, k_scale, v_scale)
    ext = dict(zip(axes.split(), arrays[0].shape))
    if (kv.num_kv_heads, kv.head_dim) != (ext["H"], ext["D"]):
        raise ValueError(f"kv: expected {ext['H']} heads of head_dim {ext['D']}, got {kv.num_kv_heads} of "
                         f"{kv.head_dim}")
    indices = host(kv_indices)
    b, first, pages = _pages_of(kv_indptr, indices, sequence, ext["N"])
    need = -(-kv.tokens // ext["S"])
    if pages.size != need:
        raise ValueError(f"kv_indptr: expected {need} pages reserved for request {b} ({kv.tokens} tokens), "
                         f"got {pages.size}")
    fresh = take_pages(free_pages, need)
    if fresh:
        check_index("free_pages", np.asarray(fresh), 0, ext["N"], "page ids")
        pages = np.asarray(fresh, np.int64)
    p = np.arange(kv.tokens)
    ks, vs = _sites(arrays, axes, pages[p // ext["S"]], p % ext["S"])
    write = prepare_pair(kv, kind, ks, vs, scale=scales)
    if fresh:
        assign(kv_indices, slice(first, first + need), fresh)
        commit_pages(free_pages, need)
    if need:
        assign(kv_last_page_len, b, kv.tokens - (need - 1) * ext["S"])
    write()
    return {"pages": list(pages)}


def rule(paged_kv_cache, *, kv_layout="NHD", k_scale=None, v_scale=None, **_) -> dict:
    arrays, _, kind, scales = _arrays(paged_kv_cache, kv_layout, k_scale, v_scale)
    return dict(kind=kind, dtype=arrays[0].dtype, scale=scales)


def stores_rotated(**_) -> bool:
    return True
