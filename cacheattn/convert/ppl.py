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
    check_kv,
    check_kv_fits,
    check_own,
    check_rotated,
    check_sequence,
    check_writable,
    commit_pages,
    is_float,
    prepare_pair,
    read_pair,
    site,
    table,
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
        if not is_float(scale.dtype):
            raise TypeError(f"scale: expected float16 or float32, got {scale.dtype}")
        want = tuple(head_dim // quant_group if n == "D" else ext[n] for n in names)
        if tuple(scale.shape) != want:
            raise ValueError(f"scale: expected shape {want} (the cache's layout, head_dim / quant_group last), "
                             f"got {tuple(scale.shape)}")
        return axes, head_dim
    if not is_float(cache.dtype):
        raise TypeError(f"cache: expected a float dtype with quant_bit 0, got {cache.dtype}")
    return axes, ext["D"]


def _starts(cachestarts, cache_mode):
    starts = table("cachestarts", cachestarts).astype(np.int64)
    if starts.ndim != cache_mode + 1:
        raise ValueError(f"cachestarts: expected {'(B,)' if cache_mode == 0 else '(B, max_pages)'} for cache_mode "
                         f"{cache_mode}, got shape {starts.shape}")
    return starts


def _kvlens(kvstarts, starts, cache_mode, page_size, max_t):
    """Each sequence's tokens from kvstarts (B + 1,), non-decreasing; none more than a sequence can hold (MaxT
    with offsets, its row of pages with cache_mode 1)."""
    batch = starts.shape[0]
    ks = table("kvstarts", kvstarts, ndim=1).astype(np.int64)
    if ks.shape != (batch + 1,):
        raise ValueError(f"kvstarts: expected shape ({batch + 1},) (B + 1, B = rows of cachestarts), got {ks.shape}")
    lens = np.diff(ks)
    if (lens < 0).any():
        b = int(np.argmax(lens < 0))
        raise ValueError(f"kvstarts: expected non-decreasing values, got kvstarts[{b + 1}] = {ks[b + 1]} < "
                         f"kvstarts[{b}] = {ks[b]}")
    most = max_t if cache_mode == 0 else starts.shape[1] * page_size
    if (lens > most).any():
        b = int(np.argmax(lens > most))
        raise ValueError(f"kvstarts: expected at most {most} tokens a sequence ("
                         f"{'MaxT' if cache_mode == 0 else 'its row of cachestarts'}), got {lens[b]} for sequence {b}")
    return lens


def _slots(starts, b, tokens, cache_mode, page_size, max_t):
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
    """Sequence `sequence`'s tokens [0, kvlen) of layer `layer_idx`, kvlen = kvstarts[b + 1] - kvstarts[b].

    Parameters
    ----------
    cache : array
        Every layer's K and V in `cache_layout`'s order of (MaxT, L, 2, H, Dh): 0 `(MaxT, L, 2, H, Dh)`,
        1 `(L, MaxT, 2, H, Dh)`, 2 `(L, 2, MaxT, H, Dh)`, 3 `(L, 2, H, MaxT, Dh)`; float, or int8 with
        quant_bit (int4: Dh / 2 bytes).
    scale : array or None
        quant_bit 8 / 4: the group scales, cache's layout with Dh / quant_group last (float16 or float32).
    kvstarts : int array
        `(B + 1,)`: sequence b holds kvstarts[b + 1] - kvstarts[b] tokens.
    cachestarts : int array
        cache_mode 0: `(B,)`, sequence b's first slot; cache_mode 1: `(B, max_pages)`, the token offsets of its
        pages in order.
    sequence : int
        The sequence b.
    num_layer : int
        L, the layers the cache holds.
    layer_idx : int
        The layer, in [0, num_layer).
    quant_bit : int
        0 (float), 8 or 4 (int groups).
    quant_group : int
        Elements sharing one scale.
    cache_mode : int
        0 (offsets) or 1 (paged).
    cache_layout : int
        0 ... 3.
    page_size : int
        Tokens a page (cache_mode 1).
    rotated : bool or None
        Whether the cached keys carry RoPE (the model's choice; True for OpenPPL's own attention); None when
        RoPE does not apply.
    """
    axes, _ = _check(cache, scale, num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit,
                     quant_group=quant_group, cache_mode=cache_mode, cache_layout=cache_layout, page_size=page_size)
    rotated = check_rotated("rotated", rotated)
    starts = _starts(cachestarts, cache_mode)
    max_t = cache.shape[axes.split().index("T")]
    lens = _kvlens(kvstarts, starts, cache_mode, page_size, max_t)
    b = check_sequence("sequence", sequence, starts.shape[0])
    tokens = int(lens[b])
    slots = _slots(starts, b, tokens, cache_mode, page_size, max_t)
    (ks, vs), scales = _sites(cache, scale, axes, layer_idx, slots, quant_bit)
    return read_pair(ks, vs, KIND[quant_bit], None, None, quant_group, np.arange(tokens), rotated, scales)


def import_(kv: KV, cache, scale=None, *, cachestarts, sequence, num_layer=1, layer_idx=0, quant_bit=0,
            quant_group=8, cache_mode=0, cache_layout=0, page_size=128, free_pages=None, kvstarts=None) -> dict:
    """Write kv's tokens at positions [0, T) of sequence `sequence` (quantized by OpenPPL's group rule unless
    kv already holds codes of this rule). Returns {"slots": the T token slots, "pages": the pages taken}; the
    caller's kvlen of the sequence becomes T.

    Parameters
    ----------
    kv : KV
        The tokens to write (H and head_dim of the cache).
    cache : array
        As for export (written).
    scale : array or None
        As for export (written: the groups' new scales).
    cachestarts : int array
        As for export; cache_mode 1 with free_pages: the sequence's first ceil(T / page_size) entries are set
        to the fresh pages' token offsets (page * page_size).
    sequence : int
        The sequence b.
    num_layer : int
        L, the layers the cache holds.
    layer_idx : int
        The layer written, in [0, num_layer).
    quant_bit : int
        0 (float), 8 or 4 (int groups).
    quant_group : int
        Elements sharing one scale.
    cache_mode : int
        0 (offsets) or 1 (paged).
    cache_layout : int
        0 ... 3.
    page_size : int
        Tokens a page (cache_mode 1).
    free_pages : list of int or None
        cache_mode 1: free page numbers (page p holds slots p * page_size ...); the sequence takes the first
        ceil(T / page_size), removed from the list once written. Ignored with cache_mode 0.
    kvstarts : int array or None
        `(B + 1,)`, read only: the other sequences' lengths, so that slots they hold are refused as this
        sequence's (a page of free_pages, or an overlapping cachestarts).
    """
    kv = check_kv(kv)
    axes, head_dim = _check(cache, scale, num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit,
                            quant_group=quant_group, cache_mode=cache_mode, cache_layout=cache_layout,
                            page_size=page_size)
    check_writable("cache", cache)
    if quant_bit:
        check_writable("scale", scale)
    check_kv_fits(kv, cache.shape[axes.split().index("H")], head_dim, "cache (H, head_dim)")
    max_t = cache.shape[axes.split().index("T")]
    paging = free_pages is not None and cache_mode == 1
    starts = _starts(cachestarts, cache_mode)
    if paging:
        table("cachestarts", cachestarts, written=True)
    b = check_sequence("sequence", sequence, starts.shape[0])
    used = {}                                      # slot -> the sequence holding it
    if kvstarts is not None:
        lens = _kvlens(kvstarts, starts, cache_mode, page_size, max_t)
        for r in range(starts.shape[0]):
            if r != b:
                for slot in _slots(starts, r, int(lens[r]), cache_mode, page_size, max_t):
                    used.setdefault(int(slot), f"sequence {r}")
    pages = []
    if paging:
        need = -(-kv.tokens // page_size)
        if need > starts.shape[1]:
            raise ValueError(f"cachestarts: expected room for {need} pages in row {b}, got {starts.shape[1]}")
        pages = take_pages(free_pages, need, num_pages=max_t // page_size, meaning="page numbers",
                           used={s // page_size: who for s, who in used.items()})
        starts = starts.copy()
        starts[b, :need] = np.asarray(pages, np.int64) * page_size
    slots = _slots(starts, b, kv.tokens, cache_mode, page_size, max_t)
    check_own("cachestarts", slots, used, "token slots")
    (ks, vs), scales = _sites(cache, scale, axes, layer_idx, slots, quant_bit)
    write = prepare_pair(kv, KIND[quant_bit], ks, vs, scales, quant_group=quant_group)
    # Everything is checked and encoded: now write.
    if pages:
        assign(cachestarts, (b, slice(0, len(pages))), np.asarray(pages) * page_size)
        commit_pages(free_pages, len(pages))
    write()
    return {"slots": slots, "pages": pages}


def stored_dim(head_dim: int, quant_bit: int) -> int:
    return stored_head_dim(head_dim, quant_bit)


def rule(cache, scale=None, *, quant_bit=0, quant_group=8, **_) -> dict:
    """How this destination stores values: for error bounds (`cacheattn.convert.error_bound`)."""
    return dict(kind=KIND[quant_bit], dtype=cache.dtype if not quant_bit else scale.dtype, quant_group=quant_group)


def stores_rotated(**_) -> bool:
    """OpenPPL caches the keys its caller passes: post-RoPE."""
    return True
