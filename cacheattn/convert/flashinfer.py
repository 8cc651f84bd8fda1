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
    check_choice_str,
    check_index,
    check_kv,
    check_kv_fits,
    check_own,
    check_sequence,
    check_writable,
    commit_pages,
    is_float,
    positive_scalar,
    prepare_pair,
    read_pair,
    site,
    table,
    take_pages,
)

_FP8 = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def _arrays(paged_kv_cache, kv_layout, k_scale, v_scale):
    check_choice_str("kv_layout", kv_layout, ("NHD", "HND"))
    axes = "N S H D" if kv_layout == "NHD" else "N H S D"
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache: expected one tensor or a (k_cache, v_cache) pair, got "
                             f"{len(paged_kv_cache)} tensors")
        arrays = [check_cache_array(n, x) for n, x in zip(("paged_kv_cache[0]", "paged_kv_cache[1]"), paged_kv_cache)]
        if any(x.ndim != 4 for x in arrays) or arrays[0].shape != arrays[1].shape:
            raise ValueError(f"paged_kv_cache: expected two [max_num_pages, ...] tensors of one 4-d shape "
                             f"({kv_layout}), got {[tuple(x.shape) for x in arrays]}")
        if arrays[0].dtype != arrays[1].dtype:
            raise TypeError(f"paged_kv_cache[1]: expected the dtype of paged_kv_cache[0] ({arrays[0].dtype}), got "
                            f"{arrays[1].dtype}")
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
        scales = tuple(positive_scalar(n, s, 1.0) for n, s in (("k_scale", k_scale), ("v_scale", v_scale)))
    return arrays, axes, kind, scales


def _sites(arrays, axes, pages, rows):
    fixed = [{"KV": kv} if "KV" in axes else {} for kv in (0, 1)]
    return [site(arrays[kv], axes, fixed[kv], {"N": pages, "S": rows}) for kv in (0, 1)]


def _csr(kv_indptr, kv_indices):
    """(indptr int64, indices int64): indptr (batch + 1,) non-decreasing from >= 0 to <= len(kv_indices)."""
    indptr = table("kv_indptr", kv_indptr, ndim=1).astype(np.int64)
    indices = table("kv_indices", kv_indices, ndim=1).astype(np.int64)
    if indptr.shape[0] < 2:
        raise ValueError(f"kv_indptr: expected shape (batch + 1,) with batch >= 1, got {indptr.shape}")
    steps = np.diff(indptr)
    if indptr[0] < 0 or (steps < 0).any() or indptr[-1] > indices.shape[0]:
        raise ValueError(f"kv_indptr: expected non-decreasing offsets into kv_indices in [0, "
                         f"{indices.shape[0]}], got {indptr.tolist()}")
    return indptr, indices


def _pages_of(indptr, indices, b, max_pages):
    pages = indices[indptr[b]:indptr[b + 1]]
    check_index("kv_indices", pages, 0, max_pages, f"page ids of request {b}")
    return pages


def export(paged_kv_cache, *, kv_indptr, kv_indices, kv_last_page_len, sequence, kv_layout="NHD", k_scale=None,
           v_scale=None) -> KV:
    """Request `sequence`'s tokens: (pages - 1) * page_size + kv_last_page_len[b] of them.

    Parameters
    ----------
    paged_kv_cache : array or (array, array)
        `[max_num_pages, 2, page_size, num_kv_heads, head_dim]` (NHD) or `[max_num_pages, 2, num_kv_heads,
        page_size, head_dim]` (HND), or a (k_cache, v_cache) pair of those shapes without the 2. float16,
        bfloat16, float32, or fp8 (e4m3 / e5m2).
    kv_indptr : int array
        `(batch + 1,)`: request b's pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]].
    kv_indices : int array
        The page ids, request after request.
    kv_last_page_len : int array
        `(batch,)`: tokens in each request's last page, 1 ... page_size.
    sequence : int
        The request b.
    kv_layout : str
        "NHD" or "HND".
    k_scale : float or None
        fp8 keys: value = code * k_scale (default 1.0).
    v_scale : float or None
        fp8 values: value = code * v_scale (default 1.0).
    """
    arrays, axes, kind, scales = _arrays(paged_kv_cache, kv_layout, k_scale, v_scale)
    ext = dict(zip(axes.split(), arrays[0].shape))
    indptr, indices = _csr(kv_indptr, kv_indices)
    b = check_sequence("sequence", sequence, indptr.shape[0] - 1)
    pages = _pages_of(indptr, indices, b, ext["N"])
    last = _last_page_len(kv_last_page_len, indptr.shape[0] - 1)[b]
    if pages.size and not 1 <= last <= ext["S"]:
        raise ValueError(f"kv_last_page_len: expected values in [1, page_size = {ext['S']}], got {last}")
    tokens = (pages.size - 1) * ext["S"] + last if pages.size else 0
    p = np.arange(tokens)
    ks, vs = _sites(arrays, axes, pages[p // ext["S"]], p % ext["S"])
    return read_pair(ks, vs, kind, *scales, 0, p, True)


def _last_page_len(kv_last_page_len, batch, written=False):
    last = table("kv_last_page_len", kv_last_page_len, ndim=1, written=written)
    if last.shape != (batch,):
        raise ValueError(f"kv_last_page_len: expected shape ({batch},) (batch of kv_indptr), got {last.shape}")
    return last.astype(np.int64)


def import_(kv: KV, paged_kv_cache, *, kv_indptr, kv_indices, kv_last_page_len, sequence, kv_layout="NHD",
            k_scale=None, v_scale=None, free_pages=None) -> dict:
    """Write kv's tokens into request `sequence`'s pages, which the CSR table reserves: exactly ceil(T / page_size)
    entries of kv_indices. kv_last_page_len[b] is set. Returns {"pages": the request's pages}.

    Parameters
    ----------
    kv : KV
        The tokens to write (num_kv_heads and head_dim of the cache).
    paged_kv_cache : array or (array, array)
        As for export (written).
    kv_indptr : int array
        `(batch + 1,)`, read only: request b owns entries kv_indptr[b] ... kv_indptr[b + 1] - 1 of kv_indices,
        exactly ceil(T / page_size) of them.
    kv_indices : int array
        The page ids; with free_pages, request b's entries are set to fresh pages. A page of another request
        is refused as one of b's.
    kv_last_page_len : int array
        `(batch,)`: entry b is set to the tokens of b's last page.
    sequence : int
        The request b.
    kv_layout : str
        "NHD" or "HND".
    k_scale : float or None
        fp8 keys: code = sat(x / k_scale) (default 1.0).
    v_scale : float or None
        fp8 values: code = sat(x / v_scale) (default 1.0).
    free_pages : list of int or None
        Free page ids: request b takes the first ceil(T / page_size), removed from the list once the import
        has written them.
    """
    kv = check_kv(kv)
    arrays, axes, kind, scales = _arrays(paged_kv_cache, kv_layout, k_scale, v_scale)
    for i, x in enumerate(arrays):
        check_writable("paged_kv_cache" if x is paged_kv_cache else f"paged_kv_cache[{i}]", x)
    ext = dict(zip(axes.split(), arrays[0].shape))
    check_kv_fits(kv, ext["H"], ext["D"], "paged_kv_cache (num_kv_heads, head_dim)")
    indptr, indices = _csr(kv_indptr, kv_indices)
    batch = indptr.shape[0] - 1
    b = check_sequence("sequence", sequence, batch)
    _last_page_len(kv_last_page_len, batch, written=True)
    if free_pages is not None:
        table("kv_indices", kv_indices, written=True)
    first = int(indptr[b])
    need = -(-kv.tokens // ext["S"])
    if indptr[b + 1] - first != need:
        raise ValueError(f"kv_indptr: expected {need} pages reserved for request {b} ({kv.tokens} tokens), "
                         f"got {indptr[b + 1] - first}")
    # Every page the table lists belongs to a request: one outside the cache is a broken table, and the others'
    # pages may not become this request's.
    check_index("kv_indices", indices[indptr[0]:indptr[-1]], 0, ext["N"], "page ids")
    used = {}
    for r in range(batch):
        if r != b:
            for page in indices[indptr[r]:indptr[r + 1]]:
                used.setdefault(int(page), f"request {r}")
    fresh = take_pages(free_pages, need, num_pages=ext["N"], meaning="page ids", used=used)
    pages = np.asarray(fresh, np.int64) if free_pages is not None else _pages_of(indptr, indices, b, ext["N"])
    check_own("free_pages" if free_pages is not None else "kv_indices", pages, used, "page ids")
    p = np.arange(kv.tokens)
    ks, vs = _sites(arrays, axes, pages[p // ext["S"]], p % ext["S"])
    write = prepare_pair(kv, kind, ks, vs, scale=scales)
    if fresh:
        assign(kv_indices, slice(first, first + need), fresh)
        commit_pages(free_pages, need)
    if need:
        assign(kv_last_page_len, b, kv.tokens - (need - 1) * ext["S"])
    write()
    return {"pages": [int(x) for x in pages]}


def rule(paged_kv_cache, *, kv_layout="NHD", k_scale=None, v_scale=None, **_) -> dict:
    """How this destination stores values (for `cacheattn.convert.error_bound`)."""
    arrays, _, kind, scales = _arrays(paged_kv_cache, kv_layout, k_scale, v_scale)
    return dict(kind=kind, dtype=arrays[0].dtype, scale=scales)


def stores_rotated(**_) -> bool:
    """FlashInfer caches post-RoPE keys."""
    return True
