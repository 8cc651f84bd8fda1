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
from ._plans import asked_text, bind_step, phase_line, plan_signature
from ._types import IndexTensor, Tensor
from ._validate import (
    FLOAT_T1,
    check_choice,
    check_contiguous,
    check_dtype,
    check_int,
    check_launch,
    check_same_dtype,
    check_shape,
    check_starts,
)
from .kernel_choice import AttentionShape
from .kernel_choice import choose_kernel as plan_kernels

QUANT_BITS = (0, 4, 8)

# The kernels' rungs: the ladder's five and rung 6, the FlashAttention-2 prefill (`kernels_numba._attention_flash`).
RUNGS = (1, 2, 3, 4, 5, 6)


class KeyValue(NamedTuple):
    """The two outputs of KeyValueCache (static and dynamic_batching), in the document's order.

    Attributes
    ----------
    key : Tensor
        Every key so far: `(B, start_pos + S, H * num_repeat, Dh)` (`key_value_cache`) or
        `(kvstarts[B], H * num_repeat, Dh)` (`dynamic_key_value_cache`).
    value : Tensor
        The values, shaped like `key`.
    """
    key: Tensor
    value: Tensor


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
    check_same_dtype("current_value", current_value, "current_key", current_key, allowed=FLOAT_T1)
    check_shape("current_value", current_value, tuple(current_key.shape), "(that of current_key)")


def _check_cache_tensors(cache, scale, axes, *, num_layer, num_heads, head_dim, quant_bit, quant_group):
    """cache / scale against a layout's named axes; returns {axis name: extent} of the cache."""
    names = axes.split()
    stored_dim = stored_head_dim(head_dim, quant_bit)
    want = {"L": num_layer, "KV": 2, "H": num_heads, "D": stored_dim}
    # spec: ppl-kvc/quant-skip, ppl-mhca/types
    if quant_bit:
        if np.dtype(cache.dtype) != np.int8:
            raise TypeError(f"cache: expected int8 codes for quant_bit {quant_bit}, got {np.dtype(cache.dtype).name}: "
                            f"pass the cache as int8 (its scales in scale), or quant_bit=0 for a float cache")
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


def _check_dynamic_indices(seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen, total_tokens, *,
                           cache_mode, page_size):
    """The per-batch index inputs, all that needs no cache: returns (seqlens, kvlens, slots_end), slots_end the
    end of the furthest slot the call touches (a cache's MaxT must reach it, `_check_inside_cache`). total_tokens:
    the packed token count, None where no layer is known yet (a plan)."""
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
    slots_end = _check_cachestarts(cachestarts, kvlens, cache_mode=cache_mode, page_size=page_size)
    written = _written_slots(cachestarts, start_pos, seqlens, cache_mode=cache_mode, page_size=page_size)
    _check_written_slots(*written)
    _check_reads_not_overwritten(cachestarts, start_pos, *written, cache_mode=cache_mode, page_size=page_size)
    return seqlens, kvlens, slots_end


def _check_max(name, value, lengths):
    check_int(name, value, low=0)
    if value < lengths.max():
        raise ValueError(f"{name}: expected at least the longest length {lengths.max()}, got {value}")


def _used_pages(cachestarts, kvlens, page_size):
    """(B, MaxP) bool: the pages that hold positions [0, kvlen) of their sequence."""
    return np.arange(cachestarts.shape[1]) < -(-kvlens[:, None] // page_size)


def _check_cachestarts(cachestarts, kvlens, *, cache_mode, page_size):
    """The table's shape and no slot below 0 for positions [0, kvlen); returns the end of the furthest slot (a used
    page counts whole), which the cache's MaxT must reach (`_check_inside_cache`, once the cache is known)."""
    batch = kvlens.shape[0]
    if cache_mode == 0:
        check_shape("cachestarts", cachestarts, (batch,), "for cache_mode 0")
        bad = np.nonzero(cachestarts < 0)[0]
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cachestarts: expected [cachestarts[b], cachestarts[b] + kvlen) inside the cache "
                             f"(slots >= 0); batch {b} covers [{cachestarts[b]}, {cachestarts[b] + kvlens[b]})")
        return int((cachestarts + kvlens).max())
    pages_needed = -(-kvlens // page_size)
    check_shape("cachestarts", cachestarts, (batch, None), "(B, MaxP) for cache_mode 1")
    if cachestarts.shape[1] < pages_needed.max():
        raise ValueError(f"cachestarts: expected MaxP >= {pages_needed.max()} pages of page_size {page_size} for "
                         f"max kvlen {kvlens.max()}, got MaxP = {cachestarts.shape[1]}")
    # One pass over the whole table (a decode batch of 64 is 64 Python iterations otherwise).
    used = _used_pages(cachestarts, kvlens, page_size)
    bad = np.argwhere(used & (cachestarts < 0))
    if bad.size:
        b, p = (int(i) for i in bad[0])
        raise ValueError(f"cachestarts: expected every used page [start, start + page_size) inside the cache "
                         f"(slots >= 0); cachestarts[{b}, {p}] = {cachestarts[b, p]} with page_size {page_size}")
    return int(np.max(cachestarts + page_size, where=used, initial=0))


def _check_inside_cache(cachestarts, kvlens, slots_end, max_t, *, cache_mode, page_size):
    """Every slot of positions [0, kvlen) inside MaxT, a used page whole: one comparison with the step's
    slots_end, the culprit looked up only when it fails."""
    if slots_end <= max_t:
        return
    if cache_mode == 0:
        ends = cachestarts + kvlens
        b = int(np.flatnonzero(ends > max_t)[0])
        raise ValueError(f"cachestarts: expected [cachestarts[b], cachestarts[b] + kvlen) inside MaxT = {max_t}; "
                         f"batch {b} covers [{cachestarts[b]}, {ends[b]})")
    used = _used_pages(cachestarts, kvlens, page_size)
    b, p = (int(i) for i in np.argwhere(used & (cachestarts + page_size > max_t))[0])
    raise ValueError(f"cachestarts: expected every used page [start, start + page_size) inside MaxT = "
                     f"{max_t}; cachestarts[{b}, {p}] = {cachestarts[b, p]} with page_size {page_size}")


def _written_slots(cachestarts, start_pos, seqlens, *, cache_mode, page_size):
    """(slot, batch, position) of every current token, in packed order: the slots this call stores into."""
    batch_of = np.repeat(np.arange(seqlens.shape[0]), seqlens)                  # (sum seqlens,) the token's batch
    first = np.cumsum(seqlens) - seqlens                                         # (B,) its first packed row
    position = start_pos[batch_of] + np.arange(batch_of.shape[0]) - first[batch_of]
    if cache_mode == 0:
        slots = cachestarts[batch_of] + position
    else:
        slots = cachestarts[batch_of, position // page_size] + position % page_size
    return slots, batch_of, position


def _check_written_slots(slots, batch_of, position):
    """No two current tokens of the call may be stored into the same cache slot: the store writes every token in
    parallel, so on a GPU that is a data race whose winner is undefined. Only the slots written now count:
    sequences may share the pages of a common prefix, which this call only reads (positions < start_pos)."""
    order = np.argsort(slots, kind="stable")
    clash = np.nonzero(slots[order][1:] == slots[order][:-1])[0]
    if clash.size:
        i, j = order[clash[0]], order[clash[0] + 1]
        raise ValueError(f"cachestarts: expected distinct cache slots for the tokens this call stores, got batch "
                         f"{batch_of[i]} position {position[i]} and batch {batch_of[j]} position {position[j]} both "
                         f"at slot {slots[i]} (a write race on a GPU; sequences may share only pages they read, "
                         f"positions < start_pos)")


def _check_reads_not_overwritten(cachestarts, start_pos, slots, batch_of, position, *, cache_mode, page_size):
    """No current token may be stored into a slot that holds a cached position (< start_pos) some sequence of
    the call reads, its own or another's: the store would replace a key the attention is to read (on a GPU,
    while other blocks read it). Checked per read run of slots (a page, or an offset sequence's prefix), not per
    cached token, so a long context costs its page count."""
    if cache_mode == 0:
        owner, first_pos = np.arange(start_pos.shape[0]), np.zeros_like(start_pos)
        run_start, run_len = cachestarts, start_pos
    else:
        page_pos = np.arange(cachestarts.shape[1]) * page_size                  # (MaxP,) each page's first position
        cached = np.clip(start_pos[:, None] - page_pos, 0, page_size)         # (B, MaxP) its cached positions
        owner, page = np.nonzero(cached)
        first_pos, run_start, run_len = page_pos[page], cachestarts[owner, page], cached[owner, page]
    keep = run_len > 0
    owner, first_pos, run_start, run_end = owner[keep], first_pos[keep], run_start[keep], (run_start + run_len)[keep]
    if not owner.size or not slots.size:
        return
    # A slot lies in some run [start, end) iff the furthest end among the runs starting at or before it passes it.
    order = np.argsort(run_start, kind="stable")
    reach = np.maximum.accumulate(run_end[order])
    last = np.searchsorted(run_start[order], slots, side="right") - 1
    hit = np.flatnonzero((last >= 0) & (reach[np.maximum(last, 0)] > slots))
    if hit.size:
        i = int(hit[0])
        r = int(np.flatnonzero((run_start <= slots[i]) & (slots[i] < run_end))[0])
        b = int(owner[r])
        raise ValueError(f"cachestarts: expected the slots this call stores to hold no cached position it reads, "
                         f"got batch {batch_of[i]} position {position[i]} stored at slot {slots[i]}, which holds "
                         f"batch {b}'s cached position {first_pos[r] + slots[i] - run_start[r]} (< start_pos[{b}] = "
                         f"{start_pos[b]}); the store would overwrite a cached key/value that the call reads back")


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
    check_same_dtype("attn_mask", attn_mask, "query", query, allowed=FLOAT_T1)
    if attn_mask.ndim not in (2, 3):
        raise ValueError(f"attn_mask: expected shape (sum seqlens, >= sum kvlens) or "
                         f"(num_heads, sum seqlens, >= sum kvlens), got {tuple(attn_mask.shape)}")
    lead = (num_heads,) if attn_mask.ndim == 3 else ()
    check_shape("attn_mask", attn_mask, lead + (total_tokens, None),
                f"(sum seqlens = {total_tokens} rows, >= sum kvlens = {total_kv} columns)")
    if attn_mask.shape[-1] < total_kv:
        raise ValueError(f"attn_mask: expected a last dim >= sum kvlens = {total_kv}, got {attn_mask.shape[-1]}")


def _check_decoding(decoding_batches, seqlens):
    """The document: "how many batches in front are being decoded, those who are not need causal mask". A decode
    step has one query token, so the first decoding_batches sequences must each have seqlen 1; a longer one there
    would silently lose its causal mask."""
    check_int("decoding_batches", decoding_batches, low=0, high=seqlens.shape[0])
    bad = np.flatnonzero(seqlens[:decoding_batches] != 1)
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"decoding_batches: expected the first {decoding_batches} sequences to be decode steps of "
                         f"one query token each (decoding requests first, then prefill), got seqlen {seqlens[b]} "
                         f"for batch {b} (seqstarts[{b + 1}] - seqstarts[{b}])")


def _check_kernel_tensors(engine, **tensors):
    if engine == "numba":
        for name, x in tensors.items():
            if x is not None:
                check_contiguous(name, x)


# ---------------------------------------------------------------------------------------------- operators

@arrays.accepts_torch
def key_value_cache(current_key: Tensor, current_value: Tensor, start_pos: int | IndexTensor, cache: Tensor,
                    scale: Tensor | None = None, *, num_layer: int = 1, layer_idx: int = 0, quant_bit: int = 0,
                    quant_group: int = 8, num_repeat: int = 1, cache_layout: int = 0, backend: str = "auto",
                    threads: int = 128) -> KeyValue:
    """OpenPPL `KeyValueCache`: store this step's key/value at `start_pos`, return every key/value so far.

    For every batch b, token s, head h: `cache[key of layer_idx, b, start_pos + s, h] = current_key[b, s, h]`
    (quantized when `quant_bit` is set), likewise for the value; then positions `[0, start_pos + S)` are read
    back (dequantized) and each head is repeated `num_repeat` times in a row (grouped-query attention).
    The same `start_pos` holds for the whole batch (a padded batch); `dynamic_key_value_cache` is the packed one.

    Parameters
    ----------
    current_key : Tensor
        `(B, S, H, Dh)`, float16 or float32: this step's keys (`B` ≤ MaxB of `cache`).
    current_value : Tensor
        `(B, S, H, Dh)`, the dtype of `current_key`.
    start_pos : int or IndexTensor
        A scalar or a one-element integer tensor: the position of the first current token;
        `start_pos + S` ≤ MaxS.
    cache : Tensor
        In-out. `cache_layout` 0: `(MaxB, L, 2, MaxS, H, Dh)`; 1: `(L, MaxB, 2, H, MaxS, Dh)` (axis `2`: 0 key,
        1 value; `L` = `num_layer`). The dtype of `current_key`, or int8 when `quant_bit` is set, whose last
        dim is `Dh / 2` for `quant_bit` 4 (two values per byte). C-contiguous on the kernels.
    scale : Tensor or None, optional
        In-out; required when `quant_bit` is set, float16 or float32: one scale per group of `quant_group`
        values of a token and head, laid out like `cache` with `G = Dh / quant_group` last: `cache_layout` 0
        `(MaxB, L, 2, MaxS, H, G)`, 1 `(L, MaxB, 2, H, MaxS, G)`.
    num_layer : int, default 1
        `L`, the layers `cache` holds.
    layer_idx : int, default 0
        The layer this call stores and reads, in `[0, num_layer)`.
    quant_bit : int, default 0
        0 (no quantization), 8 (int8) or 4 (int4, this project's extension: the document lists it, upstream
        refuses it).
    quant_group : int, default 8
        Values sharing one scale; divides `Dh` (and is even for `quant_bit` 4).
    num_repeat : int, default 1
        How many times each head is repeated in the outputs (≥ 1).
    cache_layout : int, default 0
        0 or 1, as under `cache`.
    backend : str, default "auto"
        "auto" (NumPy arrays: the reference; GPU arrays: the kernels), "reference" or "numba".
    threads : int, default 128
        The kernels' block size (ignored by the reference).

    Returns
    -------
    KeyValue
        `(key, value)`, each `(B, start_pos + S, H * num_repeat, Dh)` in the dtype of `current_key`: head `h`
        of the cache is heads `h * num_repeat ... h * num_repeat + num_repeat - 1` of the output.

    Raises
    ------
    ValueError
        A shape, attribute or index out of its range, named by its parameter: `start_pos + S` past MaxS, a
        batch larger than MaxB, `quant_group` not dividing `Dh`, a missing `scale` with `quant_bit` set.
    TypeError
        A dtype outside float16/float32 (int8 for a quantized `cache`), or a non-integer attribute.

    Notes
    -----
    int8: `scale = max(max|x| / 127, 1e-5)` per group, `q = clip(round_half_even(x / scale), -127, 127)`,
    computed in the input dtype; reading back multiplies `q * scale` in the dtype of `scale`. int4: the same
    with 7, element `2i` in the low nibble. Source: OpenPPL ppl.pmx,
    [KeyValueCache](https://github.com/OpenPPL/ppl.pmx/blob/master/docs/operators/KeyValueCache.md).

    Examples
    --------
    >>> import numpy as np, cacheattn
    >>> rng = np.random.default_rng(0)
    >>> cache = rng.standard_normal((2, 1, 2, 8, 2, 4)).astype(np.float32)   # layout 0, MaxS = 8
    >>> k = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)             # B = 2, S = 3, H = 2, Dh = 4
    >>> key, value = cacheattn.key_value_cache(k, -k, 5, cache, num_repeat=2)
    >>> key.shape
    (2, 8, 4, 4)
    >>> bool(np.array_equal(key[:, 5:, ::2], k)), bool(np.array_equal(cache[:, 0, 1, 5:], -k))
    (True, True)
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


def _check_cache_attrs(num_layer, quant_bit, quant_group, head_dim, cache_mode, cache_layout, page_size):
    """The cache's attributes, which hold for every layer of a step."""
    check_int("num_layer", num_layer, low=1)
    _check_quant(quant_bit, quant_group, head_dim)
    check_choice("cache_mode", cache_mode, (0, 1))
    check_choice("cache_layout", cache_layout, DYNAMIC_LAYOUTS)
    check_int("page_size", page_size, low=1)


def _index_arrays(seqstarts, kvstarts, cachestarts, start_pos):
    """Host int64 copies of the index tensors (a device read each for device arrays)."""
    return {name: arrays.index_array(name, x) for name, x in
            (("seqstarts", seqstarts), ("kvstarts", kvstarts), ("cachestarts", cachestarts), ("start_pos", start_pos))}


def _dynamic_cache_checks(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                          max_kvlen, cache, scale, *, num_kv_heads, head_dim, num_layer, layer_idx, quant_bit,
                          quant_group, cache_mode, cache_layout, page_size):
    """dynamic_batching.KeyValueCache's checks; returns host index arrays."""
    _check_current(current_key, current_value, (None, num_kv_heads, head_dim),
                   "(seqstarts[B], num_kv_heads, head_dim)")
    _check_cache_attrs(num_layer, quant_bit, quant_group, head_dim, cache_mode, cache_layout, page_size)
    _check_layer(num_layer, layer_idx)
    extents = _check_cache_tensors(cache, scale, DYNAMIC_LAYOUTS[cache_layout], num_layer=num_layer,
                                   num_heads=num_kv_heads, head_dim=head_dim, quant_bit=quant_bit,
                                   quant_group=quant_group)
    idx = _index_arrays(seqstarts, kvstarts, cachestarts, start_pos)
    _, kvlens, slots_end = _check_dynamic_indices(
        idx["seqstarts"], idx["kvstarts"], idx["cachestarts"], idx["start_pos"], max_seqlen, max_kvlen,
        int(current_key.shape[0]), cache_mode=cache_mode, page_size=page_size)
    _check_inside_cache(idx["cachestarts"], kvlens, slots_end, extents["T"], cache_mode=cache_mode,
                        page_size=page_size)
    return idx


@arrays.accepts_torch
def dynamic_key_value_cache(current_key: Tensor, current_value: Tensor, seqstarts: IndexTensor, kvstarts: IndexTensor,
                            cachestarts: IndexTensor, start_pos: IndexTensor, max_seqlen: int, max_kvlen: int,
                            cache: Tensor, scale: Tensor | None = None, *, num_layer: int = 1, layer_idx: int = 0,
                            quant_bit: int = 0, quant_group: int = 8, num_repeat: int = 1, cache_mode: int = 0,
                            cache_layout: int = 0, page_size: int = 128, backend: str = "auto",
                            threads: int = 128) -> KeyValue:
    """OpenPPL `dynamic_batching.KeyValueCache`: store a packed batch's current key/value, read back each
    sequence's whole key/value.

    Batch b's `seqlen = seqstarts[b+1] - seqstarts[b]` current tokens are positions
    `start_pos[b] ... start_pos[b] + seqlen - 1` of its sequence and are stored (quantized when `quant_bit` is
    set) at cache slot `slot(b, t)`: `cachestarts[b] + t` with `cache_mode` 0 (offset), or
    `cachestarts[b, t // page_size] + t % page_size` with `cache_mode` 1 (paged; the table holds token offsets
    into MaxT, not page numbers). Every sequence is stored first; then positions `[0, kvlen)` of each are read
    back (dequantized), packed at rows `kvstarts[b] ...`, with `kvlen = kvstarts[b+1] - kvstarts[b]`.

    Parameters
    ----------
    current_key : Tensor
        `(seqstarts[B], H, Dh)`, float16 or float32: the current tokens of all B sequences, packed (`H` =
        the kv heads).
    current_value : Tensor
        `(seqstarts[B], H, Dh)`, the dtype of `current_key`.
    seqstarts : IndexTensor
        `(B + 1,)`, integer: `0`, then the running sum of the current lengths.
    kvstarts : IndexTensor
        `(B + 1,)`, integer: `0`, then the running sum of `kvlen = start_pos[b] + seqlen[b]`.
    cachestarts : IndexTensor
        `cache_mode` 0: `(B,)`, sequence b's first slot in MaxT. `cache_mode` 1: `(B, MaxP)`, the token
        offset in MaxT of each page of sequence b (entries past its last page are not read; -1 is customary).
        Every slot of `[0, kvlen)` lies in `[0, MaxT)`; a used page lies whole inside MaxT.
        Sequences may share the pages (or offsets) of a common prefix that this call only reads
        (positions `< start_pos[b]`); no two current tokens may be stored into one slot, nor into a slot that
        holds a cached position the call reads back (see Raises).
    start_pos : IndexTensor
        `(B,)`, integer ≥ 0: the cached length of each sequence before this call.
    max_seqlen : int
        ≥ the longest current length (sizes the kernels' work; the result does not depend on it).
    max_kvlen : int
        ≥ the longest `kvlen`.
    cache : Tensor
        In-out, `cache_layout` 0: `(MaxT, L, 2, H, Dh)`; 1: `(L, MaxT, 2, H, Dh)`; 2: `(L, 2, MaxT, H, Dh)`;
        3: `(L, 2, H, MaxT, Dh)` (axis `2`: 0 key, 1 value; `L` = `num_layer`). The dtype of `current_key`, or
        int8 when `quant_bit` is set, with last dim `Dh / 2` for `quant_bit` 4. C-contiguous on the kernels.
    scale : Tensor or None, optional
        In-out; required when `quant_bit` is set, float16 or float32: laid out like `cache` with
        `G = Dh / quant_group` last: `cache_layout` 0 `(MaxT, L, 2, H, G)`, 1 `(L, MaxT, 2, H, G)`,
        2 `(L, 2, MaxT, H, G)`, 3 `(L, 2, H, MaxT, G)`.
    num_layer : int, default 1
        `L`.
    layer_idx : int, default 0
        The layer stored and read, in `[0, num_layer)`.
    quant_bit : int, default 0
        0, 8 (int8) or 4 (int4, this project's extension).
    quant_group : int, default 8
        Values per scale; divides `Dh` (even for `quant_bit` 4).
    num_repeat : int, default 1
        Each head repeated this many times in a row in the outputs.
    cache_mode : int, default 0
        0 offset, 1 paged (see `cachestarts`).
    cache_layout : int, default 0
        0 to 3, as under `cache`.
    page_size : int, default 128
        Tokens per page with `cache_mode` 1 (any positive int; it need not divide the lengths).
    backend : str, default "auto"
        "auto", "reference" or "numba".
    threads : int, default 128
        The kernels' block size.

    Returns
    -------
    KeyValue
        `(key, value)`, each `(kvstarts[B], H * num_repeat, Dh)` in the dtype of `current_key`.

    Raises
    ------
    ValueError
        Named by the parameter: `seqstarts`/`kvstarts` not starting at 0, decreasing, or not matching the
        packed tensors; `kvlen != start_pos + seqlen`; `max_seqlen`/`max_kvlen` too small; a slot or page
        outside MaxT; too few pages; and `cachestarts` when two current tokens (of two sequences, or of one)
        would be stored into the same slot — a data race on a GPU — or a current token into a slot holding a
        cached position (`< start_pos`) of any sequence of the call, its own included: refused on both
        backends.
    TypeError
        Float index tensors, float `cache` with `quant_bit`, dtypes outside float16/float32.

    Notes
    -----
    Source: OpenPPL ppl.pmx,
    [dynamic_batching.KeyValueCache](https://github.com/OpenPPL/ppl.pmx/blob/master/docs/operators/dynamic_batching/KeyValueCache.md)
    (its quantization: [KeyValueCache](https://github.com/OpenPPL/ppl.pmx/blob/master/docs/operators/KeyValueCache.md)).

    Examples
    --------
    Two sequences with 4 cached tokens each share the page at slot 0 (their common prefix, only read) and
    store their next token into pages of their own:

    >>> import numpy as np, cacheattn
    >>> rng = np.random.default_rng(0)
    >>> cache = rng.standard_normal((12, 1, 2, 2, 8)).astype(np.float32)   # layout 0: (MaxT, L, 2, H, Dh)
    >>> new = rng.standard_normal((2, 2, 8)).astype(np.float32)            # one token per sequence
    >>> key, value = cacheattn.dynamic_key_value_cache(
    ...     new, new, np.array([0, 1, 2]), np.array([0, 5, 10]), np.array([[0, 4], [0, 8]]), np.array([4, 4]),
    ...     1, 5, cache, cache_mode=1, page_size=4)
    >>> key.shape
    (10, 2, 8)
    >>> bool(np.array_equal(key[:4], key[5:9])), bool(np.array_equal(key[[4, 9]], new))
    (True, True)
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
def dynamic_multi_head_attention(query: Tensor, key: Tensor, value: Tensor, seqstarts: IndexTensor,
                                 kvstarts: IndexTensor, decoding_batches: int, max_seqlen: int, max_kvlen: int,
                                 attn_mask: Tensor | None = None, *, num_heads: int, head_dim: int, is_causal: bool,
                                 is_alibi: bool = False, num_kv_heads: int = 0, backend: str = "auto",
                                 threads: int | None = None, rung: int | None = None,
                                 num_splits: int | None = None) -> Tensor:
    """OpenPPL `dynamic_batching.MultiHeadAttention` over packed key/value (as `dynamic_key_value_cache`
    returns them).

    For batch b, query head h, row i (the token at position `p = kvlen - seqlen + i`) and key j < kvlen, with
    kv head `g = h // (num_heads // num_kv_heads)`:

        s[j] = q[i, h] · k[j, g] / sqrt(head_dim) + bias[h, i, j]        (float32)
        out[i, h] = softmax(s).astype(value dtype) @ v[:, g]

    `bias` is `-inf` for `j > p` when causal applies (`is_causal` and `seqlen > 1` and `b >= decoding_batches`,
    or always with `is_alibi`: the mask is aligned bottom-right), plus `slope_h * (j - p)` with `is_alibi`,
    plus `attn_mask[(h,) seqstarts[b] + i, kvstarts[b] + j]`. ALiBi slopes, with `c = 2^floor(log2 H)`:
    `2^(-8n/c)` for n = 1..c, then `2^(-4n/c)` for odd n until H slopes.

    Parameters
    ----------
    query : Tensor
        `(seqstarts[B], num_heads, head_dim)`, float16 or float32.
    key : Tensor
        `(kvstarts[B], num_kv_heads, head_dim)`, the dtype of `query`.
    value : Tensor
        `(kvstarts[B], num_kv_heads, head_dim)`, the dtype of `query`.
    seqstarts : IndexTensor
        `(B + 1,)`, integer: `0`, then the running sum of the query lengths.
    kvstarts : IndexTensor
        `(B + 1,)`, integer: `0`, then the running sum of the key lengths.
    decoding_batches : int
        The first `decoding_batches` sequences are decode steps (no causal mask), in `[0, B]`; each of them has
        exactly one query token (seqlen 1), the sequences after them are prefill.
    max_seqlen : int
        ≥ the longest query length.
    max_kvlen : int
        ≥ the longest key length.
    attn_mask : Tensor or None, optional
        `(seqstarts[B], ≥ kvstarts[B])` or `(num_heads, seqstarts[B], ≥ kvstarts[B])`, the dtype of `query`,
        added to the scores (columns past `kvstarts[B]` are padding, never read).
    num_heads : int
        Query heads.
    head_dim : int
        Size of each head.
    is_causal : bool
        Causal mask for prefill sequences (see above).
    is_alibi : bool, default False
        Add ALiBi's bias (with its causal cut).
    num_kv_heads : int, default 0
        Key/value heads, dividing `num_heads` (grouped-query attention); 0 means `num_heads`.
    backend : str, default "auto"
        "auto", "reference" or "numba".
    threads : int or None, default None
        The kernels' block size, 32 to 1024 (a multiple of 32 for rungs 2 to 5); None: the plan's (128, fewer
        warps where a rung's shared-memory buffers need them).
    rung : int or None, default None
        Which kernel of the ladder runs (docs/kernel-ladder.md). None: the plan's choice for this call's shapes
        (`choose_kernel`): for a float16 decode batch rung 5's decode kernel (its keys split across blocks where
        the grid leaves SMs idle), else rung 3 for decode, rung 4 when the grid leaves SMs idle, rung 5 where
        tensor cores are faster (a float16 `query`), rung 1 where those cannot run (`threads` not whole warps, a
        `head_dim` too wide for them). 1 to 5 force one: 1 shared-memory tiles, 2 a warp per key, 3 16-byte loads,
        4 split-K, 5 tensor cores (float16 `query` only).
    num_splits : int or None, default None
        Key splits, 1 to 64, of rung 4 or of rung 5's decode kernel (None: chosen for the GPU's SM count,
        splitting only where the grid leaves SMs idle); given with `rung` None, rung 4 runs.

    Returns
    -------
    Tensor
        `attn_output`, `(seqstarts[B], num_heads, head_dim)`, the dtype of `query`.

    Raises
    ------
    ValueError
        A shape, length or attribute out of range, named by its parameter (`num_kv_heads` not dividing
        `num_heads`, `key` or `value` rows not `kvstarts[B]`, a decoding sequence with more than one query token
        (`decoding_batches`), `rung`, `threads`, a `head_dim` too wide for the kernels' shared memory, ...).
    TypeError
        Mismatched or unsupported dtypes, a non-bool `is_causal`.

    Notes
    -----
    Source: OpenPPL ppl.pmx,
    [dynamic_batching.MultiHeadAttention](https://github.com/OpenPPL/ppl.pmx/blob/master/docs/operators/dynamic_batching/MultiHeadAttention.md).

    Examples
    --------
    >>> import numpy as np, cacheattn
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((3, 4, 8)).astype(np.float32)       # sequences of 1 and 2 tokens, 4 heads
    >>> k = rng.standard_normal((7, 2, 8)).astype(np.float32)       # their 3 and 4 keys, 2 kv heads
    >>> out = cacheattn.dynamic_multi_head_attention(q, k, k, np.array([0, 1, 3]), np.array([0, 3, 7]), 1, 2, 4,
    ...                                              num_heads=4, head_dim=8, is_causal=True, num_kv_heads=2)
    >>> out.shape
    (3, 4, 8)
    """
    data = dict(query=query, key=key, value=value, attn_mask=attn_mask)
    engine = arrays.resolve_backend(backend, data)
    check_launch(rung, threads, num_splits, rungs=RUNGS, split_rungs=(4, 5))
    kv_heads = _check_attention_attrs(num_heads, head_dim, num_kv_heads, is_causal, is_alibi)
    _check_query(query, num_heads, head_dim)
    _check_rung(rung, query)
    for name, x in (("key", key), ("value", value)):
        check_same_dtype(name, x, "query", query, allowed=FLOAT_T1)
        check_shape(name, x, (None, kv_heads, head_dim), "(kvstarts[B], num_kv_heads, head_dim)")
    seqs = arrays.index_array("seqstarts", seqstarts)
    kvs = arrays.index_array("kvstarts", kvstarts)
    seqlens = check_starts("seqstarts", seqs, int(query.shape[0]), "the row count of query")
    kvlens = check_starts("kvstarts", kvs, int(key.shape[0]), "the row count of key")
    if kvlens.shape != seqlens.shape:
        raise ValueError(f"kvstarts: expected shape {seqs.shape} like seqstarts, got {kvs.shape}")
    # The kernels read value row kvstarts[b] + j beside key row kvstarts[b] + j.
    if value.shape[0] != kvs[-1]:
        raise ValueError(f"value: expected kvstarts[B] = {int(kvs[-1])} rows like key, got {int(value.shape[0])}")
    _check_decoding(decoding_batches, seqlens)
    _check_max("max_seqlen", max_seqlen, seqlens)
    _check_max("max_kvlen", max_kvlen, kvlens)
    _check_mask(attn_mask, query, num_heads, int(seqs[-1]), int(kvs[-1]))
    _check_kernel_tensors(engine, query=query, key=key, value=value, attn_mask=attn_mask)
    launch = _kernel_plan(engine, rung, threads, num_splits, query.dtype, seqlens, max_seqlen, max_kvlen, num_heads,
                          kv_heads, head_dim, key.dtype, is_causal, is_alibi, keys_apart=True)
    attrs = dict(num_heads=num_heads, head_dim=head_dim, is_causal=bool(is_causal), num_kv_heads=num_kv_heads)
    if engine == "reference":
        return arrays.run_reference(data, (), lambda h: reference.dynamic_multi_head_attention(
            h["query"], h["key"], h["value"], seqs, kvs, decoding_batches, max_seqlen, max_kvlen, h["attn_mask"],
            is_alibi=bool(is_alibi), **attrs))
    data = {name: arrays.as_kernel_array(x) for name, x in data.items()}
    return arrays.kernels().dynamic_multi_head_attention(
        data["query"], data["key"], data["value"], arrays.kernel_index(data["query"], seqstarts, seqs),
        arrays.kernel_index(data["query"], kvstarts, kvs), decoding_batches, max_seqlen, max_kvlen, data["attn_mask"],
        alibi_slopes=alibi_slopes(num_heads) if is_alibi else None, **_launch_args(launch), **attrs)




def _check_rung(rung, query):
    if rung in (5, 6) and query.dtype != np.float16:
        raise ValueError(f"rung: {rung} (tensor cores, mma.sync on float16) needs a float16 query, got {query.dtype}")


def _kernel_plan(engine, rung, threads, num_splits, query_dtype, seqlens, max_seqlen, max_kvlen, num_heads, kv_heads,
                 head_dim, cache_dtype, is_causal, is_alibi, quant_bit=0, quant_group=0, page_size=0, keys_apart=False):
    """The kernels' rung, split count and block size (`choose_kernel`, from the call's shapes; seqlens: the host
    query lengths), planned before the cache store or any kernel runs: every kernel keeps its rows' K/V tiles or
    softmax states in shared memory, so a rung asked for whose layout does not fit is a ValueError naming head_dim
    here, from the launcher's own planner. A rung asked for by name (2 to 5, or 4 through num_splits) is checked on
    either backend, so the call fails the same way wherever it runs; the plan's own choice is made on the kernels
    only (the reference ignores the rung). keys_apart: the keys are given apart from the queries (dynamic
    attention's key and value), so a sequence may have more query tokens than keys."""
    if engine == "reference" and rung in (None, 1) and num_splits is None:
        return None
    # With a cache, kvlen = start_pos + seqlen: no sequence has more new tokens than max_kvlen, however loose the
    # bound max_seqlen is.
    query_len = max_seqlen if keys_apart else min(max_seqlen, max_kvlen)
    shape = AttentionShape(batch=int(seqlens.shape[0]), max_query_len=query_len, max_kv_len=max_kvlen,
                           num_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim, query_dtype=query_dtype,
                           cache_dtype=cache_dtype, quant_bit=quant_bit, quant_group=quant_group if quant_bit else 0,
                           page_size=page_size, decode_sequences=int(np.count_nonzero(seqlens == 1)),
                           causal=bool(is_causal or is_alibi), keys_apart=keys_apart)
    return plan_kernels(shape, rung=rung, num_splits=num_splits, threads=threads, rungs=RUNGS)


def _launch_args(launch):
    """A KernelPlan as the kernel launchers' keywords."""
    return dict(threads=launch.threads, rung=launch.rung,
                num_splits=launch.num_splits if launch.rung in (4, 5) else None)


@arrays.accepts_torch
def multi_head_cache_attention(query: Tensor, current_key: Tensor, current_value: Tensor, seqstarts: IndexTensor,
                               kvstarts: IndexTensor, cachestarts: IndexTensor, start_pos: IndexTensor,
                               decoding_batches: int, max_seqlen: int, max_kvlen: int, cache: Tensor,
                               scale: Tensor | None = None, attn_mask: Tensor | None = None, *, num_heads: int,
                               head_dim: int, is_causal: bool, is_alibi: bool = False, num_kv_heads: int = 0,
                               num_layer: int = 1, layer_idx: int = 0, quant_bit: int = 0, quant_group: int = 8,
                               cache_mode: int = 0, cache_layout: int = 0, page_size: int = 128,
                               backend: str = "auto", threads: int | None = None, rung: int | None = None,
                               num_splits: int | None = None) -> Tensor:
    """OpenPPL `dynamic_batching.MultiHeadCacheAttention`: `dynamic_key_value_cache` then
    `dynamic_multi_head_attention`, fused.

    The current tokens of every sequence are stored into `cache` first (quantized when `quant_bit` is set), then
    each sequence's positions `[0, kvlen)` are read back (dequantized: the current tokens too pass through the
    quantizer) and attended to. Slot of position t of sequence b: `cachestarts[b] + t` (`cache_mode` 0) or
    `cachestarts[b, t // page_size] + t % page_size` (`cache_mode` 1). For query head h, row i at position
    `p = kvlen - seqlen + i`, key j < kvlen and kv head `g = h // (num_heads // num_kv_heads)`:

        s[j] = q[i, h] · k[j, g] / sqrt(head_dim) + bias[h, i, j]        (float32)
        out[i, h] = softmax(s).astype(value dtype) @ v[:, g]

    with `bias` as in `dynamic_multi_head_attention` (bottom-right causal `-inf` for `j > p` when `is_causal`,
    `seqlen > 1` and `b >= decoding_batches`, or with `is_alibi`; ALiBi `slope_h * (j - p)`; `attn_mask`).

    Parameters
    ----------
    query : Tensor
        `(seqstarts[B], num_heads, head_dim)`, float16 or float32: the current tokens' queries, packed.
    current_key : Tensor
        `(seqstarts[B], num_kv_heads, head_dim)`, the dtype of `query`.
    current_value : Tensor
        `(seqstarts[B], num_kv_heads, head_dim)`, the dtype of `query`.
    seqstarts : IndexTensor
        `(B + 1,)`, integer: `0`, then the running sum of the current lengths `seqlen[b]`.
    kvstarts : IndexTensor
        `(B + 1,)`, integer: `0`, then the running sum of `kvlen[b] = start_pos[b] + seqlen[b]`.
    cachestarts : IndexTensor
        `cache_mode` 0: `(B,)`, the slot of each sequence's position 0 in MaxT. `cache_mode` 1: `(B, MaxP)`,
        the token offset in MaxT of each page of each sequence (MaxP ≥ `ceil(kvlen / page_size)`; entries past
        a sequence's last page are not read, -1 is customary). Sequences may share the pages of a common
        prefix that this call only reads (positions `< start_pos[b]`); the slots it writes (positions
        `start_pos[b] ... kvlen - 1`) must be distinct across the whole call and hold no position it reads
        from the cache (see Raises).
    start_pos : IndexTensor
        `(B,)`, integer ≥ 0: each sequence's cached length before this call.
    decoding_batches : int
        The first `decoding_batches` sequences are decode steps (no causal mask), in `[0, B]`; each of them has
        exactly one query token (seqlen 1), the sequences after them are prefill.
    max_seqlen : int
        ≥ the longest `seqlen`.
    max_kvlen : int
        ≥ the longest `kvlen`.
    cache : Tensor
        In-out. `cache_layout` 0: `(MaxT, L, 2, num_kv_heads, Dh)`; 1: `(L, MaxT, 2, num_kv_heads, Dh)`;
        2: `(L, 2, MaxT, num_kv_heads, Dh)`; 3: `(L, 2, num_kv_heads, MaxT, Dh)` (axis `2`: 0 key, 1 value;
        `L` = `num_layer`; `Dh` = `head_dim`). The dtype of `query`; int8 when `quant_bit` is set, with last
        dim `head_dim / 2` for `quant_bit` 4 (two values per byte). C-contiguous on the kernels.
    scale : Tensor or None, optional
        In-out; required when `quant_bit` is set, float16 or float32: laid out like `cache` with
        `G = head_dim / quant_group` last: `cache_layout` 0 `(MaxT, L, 2, num_kv_heads, G)`,
        1 `(L, MaxT, 2, num_kv_heads, G)`, 2 `(L, 2, MaxT, num_kv_heads, G)`, 3 `(L, 2, num_kv_heads, MaxT, G)`.
    attn_mask : Tensor or None, optional
        `(seqstarts[B], ≥ kvstarts[B])` or `(num_heads, seqstarts[B], ≥ kvstarts[B])`, the dtype of `query`:
        row `seqstarts[b] + i`, column `kvstarts[b] + j` is added to the score of query i and key j.
    num_heads : int
        Query heads.
    head_dim : int
        Size of each head.
    is_causal : bool
        Bottom-right causal mask for prefill sequences.
    is_alibi : bool, default False
        ALiBi bias (it carries the causal cut).
    num_kv_heads : int, default 0
        Key/value heads, dividing `num_heads`; 0 means `num_heads`.
    num_layer : int, default 1
        `L`.
    layer_idx : int, default 0
        The cache layer used, in `[0, num_layer)`.
    quant_bit : int, default 0
        0, 8 (int8) or 4 (int4, this project's extension).
    quant_group : int, default 8
        Values per scale; divides `head_dim` (even for `quant_bit` 4).
    cache_mode : int, default 0
        0 offset, 1 paged.
    cache_layout : int, default 0
        0 to 3, as under `cache`.
    page_size : int, default 128
        Tokens per page with `cache_mode` 1.
    backend : str, default "auto"
        "auto", "reference" or "numba".
    threads : int or None, default None
        The kernels' block size, 32 to 1024 (a multiple of 32 for rungs 2 to 5); None: the plan's (128, fewer
        warps where a rung's shared-memory buffers need them).
    rung : int or None, default None
        Which kernel of the ladder runs (docs/kernel-ladder.md). None: the plan's choice for this call's shapes
        (`choose_kernel`): for a float16 decode batch rung 5's decode kernel (its keys split across blocks where
        the grid leaves SMs idle), else rung 3 for decode, rung 4 when the grid leaves SMs idle, rung 5 where
        tensor cores are faster (a float16 `query`), rung 1 where those cannot run (`threads` not whole warps, a
        `head_dim` too wide for them). 1 to 5 force one: 1 shared-memory tiles, 2 a warp per key, 3 16-byte loads,
        4 split-K, 5 tensor cores (float16 `query` only).
    num_splits : int or None, default None
        Key splits, 1 to 64, of rung 4 or of rung 5's decode kernel (None: chosen for the GPU's SM count,
        splitting only where the grid leaves SMs idle); given with `rung` None, rung 4 runs.

    Returns
    -------
    Tensor
        `attn_output`, `(seqstarts[B], num_heads, head_dim)`, the dtype of `query`. `cache` and `scale` are
        updated in place at the written slots only; every other byte stays as it was.

    Raises
    ------
    ValueError
        Named by the parameter, before the store or any kernel runs: shapes, lengths (`kvlen != start_pos +
        seqlen` names `kvstarts`; a decoding sequence with more than one query token names `decoding_batches`;
        `query` rows not `seqstarts[B]`), attributes, a slot or page outside MaxT, and `cachestarts` when two
        current tokens would be stored into one slot — two sequences whose written slots overlap, or one
        sequence whose pages overlap where it writes (a data race on a GPU) — or when a current token would be
        stored into a slot holding a cached position (`< start_pos`) that the call reads, of another sequence
        or of its own (a written page mapped onto a page of the prefix). Read-only sharing of a prefix stays
        legal.
    TypeError
        Mismatched or unsupported dtypes, float index tensors, a non-bool `is_causal`.

    Notes
    -----
    Source: OpenPPL ppl.pmx,
    [dynamic_batching.MultiHeadCacheAttention](https://github.com/OpenPPL/ppl.pmx/blob/master/docs/operators/dynamic_batching/MultiHeadCacheAttention.md).
    The walk-through with pictures of the page table and the layouts is docs/ppl.md. A server that runs every layer
    of a batch step with the same index tensors validates them once with `plan_multi_head_cache_attention` and
    runs each layer with its `run`; this call is exactly that plan and one run.

    Examples
    --------
    One decode step (1 token after 4 cached) and one prefill of 2 tokens, an int8 paged cache of page size 4:

    >>> import numpy as np, cacheattn
    >>> rng = np.random.default_rng(0)
    >>> cache = rng.integers(-127, 128, (16, 1, 2, 2, 8)).astype(np.int8)         # layout 0, MaxT = 16
    >>> scale = (rng.random((16, 1, 2, 2, 1)) * 0.02).astype(np.float32)        # Dh / quant_group = 1
    >>> q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    >>> kv = rng.standard_normal((3, 2, 8)).astype(np.float32)
    >>> out = cacheattn.multi_head_cache_attention(
    ...     q, kv, kv, np.array([0, 1, 3]), np.array([0, 5, 7]), np.array([[8, 4], [0, -1]]), np.array([4, 0]),
    ...     1, 2, 5, cache, scale, num_heads=4, head_dim=8, is_causal=True, num_kv_heads=2,
    ...     quant_bit=8, quant_group=8, cache_mode=1, page_size=4)
    >>> out.shape, out.dtype
    ((3, 4, 8), dtype('float32'))
    """
    # Exactly a plan of this step, run for this layer: both paths share every line. The one call knows the step's
    # token count from current_key and its query's head_dim, so seqstarts and head_dim are checked against them
    # first, as they always were.
    step = {k: v for k, v in locals().items() if k not in LAYER_INPUTS and k != "backend"}
    return MultiHeadCacheAttentionPlan(step, tokens=_rows(current_key), query=query).run(
        query, current_key, current_value, cache, scale, attn_mask, layer_idx=layer_idx, backend=backend)


LAYER_INPUTS = ("query", "current_key", "current_value", "cache", "scale", "attn_mask", "layer_idx")
"""multi_head_cache_attention's per-layer inputs: what `MultiHeadCacheAttentionPlan.run` takes (with backend)."""

_INDEX_INPUTS = ("seqstarts", "kvstarts", "cachestarts", "start_pos")


def _rows(x):
    """The leading extent of an array (None for anything else: its own check names it)."""
    shape = getattr(x, "shape", ())
    return int(shape[0]) if len(shape) else None


class MultiHeadCacheAttentionPlan:
    """One batch step of `multi_head_cache_attention`, checked once, run once per layer
    (`plan_multi_head_cache_attention` builds it).

    The step is the index tensors (seqstarts, kvstarts, cachestarts, start_pos), decoding_batches, max_seqlen,
    max_kvlen and the attributes (heads, head_dim, masks, quantization, cache mode, layout, page size, threads,
    rung, num_splits); a layer brings its own query, current_key, current_value, cache, scale, attn_mask and
    layer_idx. Building the plan validates the step and reads its device index tensors back once; `run` checks
    only the layer's inputs against the plan and MaxT of the layer's cache, and on the kernels reuses the step's
    index tensors, page table and launch geometry (prepared at the first layer of each array kind and dtype),
    reading nothing back from the device. The plan keeps the index tensors it was given (the kernels read a
    device int64 one in place): they must not change while the plan is in use."""

    def __init__(self, step: dict, tokens: int | None = None, query=None):
        launch = {name: step.pop(name) for name in ("threads", "rung", "num_splits")}
        check_launch(launch["rung"], launch["threads"], launch["num_splits"], rungs=RUNGS, split_rungs=(4, 5))
        kv_heads = _check_attention_attrs(step["num_heads"], step["head_dim"], step["num_kv_heads"],
                                          step["is_causal"], step["is_alibi"])
        if query is not None:      # the one call: a head_dim its query contradicts is named before what follows it
            _check_query(query, step["num_heads"], step["head_dim"])
        _check_cache_attrs(step["num_layer"], step["quant_bit"], step["quant_group"], step["head_dim"],
                           step["cache_mode"], step["cache_layout"], step["page_size"])
        self._given = {name: step.pop(name) for name in _INDEX_INPUTS}
        idx = _index_arrays(**self._given)
        seqlens, kvlens, slots_end = _check_dynamic_indices(
            *(idx[n] for n in _INDEX_INPUTS), step["max_seqlen"], step["max_kvlen"], tokens,
            cache_mode=step["cache_mode"], page_size=step["page_size"])
        _check_decoding(step["decoding_batches"], seqlens)
        self._step, self._idx, self._launch = step, idx, launch
        self._kv_heads, self._seqlens, self._kvlens, self._slots_end = kv_heads, seqlens, kvlens, slots_end
        self._tokens, self._total_kv = int(idx["seqstarts"][-1]), int(idx["kvstarts"][-1])
        self._kernel_plans = {}             # (backend, query dtype, cache dtype) -> KernelPlan
        self._prepared = {}                 # the cache's array kind -> the kernels' CacheAttentionStep

    def __repr__(self) -> str:
        """The step, then one line per phase (decode, prefill) and per query and cache dtype the kernels were planned
        for: the rung, the split count, the block size and why. One launch serves both phases, so their lines agree;
        the kernels plan at the first layer of each dtype pair (the reference plans only a rung asked for)."""
        s = self._step
        batch, decode = int(self._seqlens.shape[0]), int(s["decoding_batches"])
        phases = [p for p, n in (("decode", decode), ("prefill", batch - decode)) if n]
        lines = [f"MultiHeadCacheAttentionPlan({batch} sequences: {decode} decode, {batch - decode} prefill; "
                 f"max_seqlen {s['max_seqlen']}, max_kvlen {s['max_kvlen']}; {s['num_heads']} heads over "
                 f"{self._kv_heads} kv heads, head_dim {s['head_dim']}; {asked_text(self._launch)})"]
        chosen = {key: plan for key, plan in self._kernel_plans.items() if plan is not None}
        for (engine, query, cache), plan in chosen.items():
            both = " (one launch with the decode)" if len(phases) == 2 else ""
            lines += [phase_line(f"{phase} ({query.name} query, {cache.name} cache, {engine})", plan.rung,
                                 plan.num_splits, plan.reason + (both if phase == "prefill" else ""),
                                 threads=plan.threads) for phase in phases]
        if not chosen:
            lines += [f"  {phase}: not chosen yet: the kernels choose at the first layer run on them, by the query's "
                      f"and the cache's dtypes (the reference runs no kernel)" for phase in phases]
        return "\n".join(lines)

    @arrays.accepts_torch
    def run(self, query: Tensor, current_key: Tensor, current_value: Tensor, cache: Tensor,
            scale: Tensor | None = None, attn_mask: Tensor | None = None, *, layer_idx: int = 0,
            backend: str = "auto") -> Tensor:
        """One layer of the planned step: `multi_head_cache_attention(**step, **layer)`, the same output and cache
        bit for bit.

        Parameters are multi_head_cache_attention's per-layer ones (see its docstring): query, current_key,
        current_value, cache, scale, attn_mask, layer_idx, and backend. Returns attn_output; cache and scale are
        updated in place. Raises ValueError / TypeError naming the layer's argument at fault (rows that are not
        the step's seqstarts[B], heads or dtypes that do not fit, a cache without the step's slots), before the
        store or any kernel runs."""
        s = self._step
        data = dict(query=query, current_key=current_key, current_value=current_value, cache=cache, scale=scale,
                    attn_mask=attn_mask)
        engine = arrays.resolve_backend(backend, data)
        _check_query(query, s["num_heads"], s["head_dim"])
        _check_rung(self._launch["rung"], query)
        check_same_dtype("current_key", current_key, "query", query, allowed=FLOAT_T1)
        _check_current(current_key, current_value, (None, self._kv_heads, s["head_dim"]),
                       "(seqstarts[B], num_kv_heads, head_dim)")
        _check_layer(s["num_layer"], layer_idx)
        extents = _check_cache_tensors(cache, scale, DYNAMIC_LAYOUTS[s["cache_layout"]], num_layer=s["num_layer"],
                                       num_heads=self._kv_heads, head_dim=s["head_dim"], quant_bit=s["quant_bit"],
                                       quant_group=s["quant_group"])
        # The kernels read row seqstarts[b] + i of both.
        if current_key.shape[0] != self._tokens:
            raise ValueError(f"current_key: expected seqstarts[B] = {self._tokens} rows (the planned step's), got "
                             f"{int(current_key.shape[0])}")
        if query.shape[0] != self._tokens:
            raise ValueError(f"query: expected seqstarts[B] = {self._tokens} rows like current_key, got "
                             f"{int(query.shape[0])}")
        _check_inside_cache(self._idx["cachestarts"], self._kvlens, self._slots_end, extents["T"],
                            cache_mode=s["cache_mode"], page_size=s["page_size"])
        _check_mask(attn_mask, query, s["num_heads"], self._tokens, self._total_kv)
        _check_kernel_tensors(engine, query=query, cache=cache, scale=scale, attn_mask=attn_mask)
        launch = self._kernel_plan(engine, query.dtype, cache.dtype)
        if engine == "reference":
            return self._run_reference(data, layer_idx)
        return self._run_kernels({name: arrays.as_kernel_array(x) for name, x in data.items()}, layer_idx, launch)

    def _kernel_plan(self, engine, query_dtype, cache_dtype):
        """The kernels' rung, split count and block size for this step at these dtypes, planned once."""
        key = (engine, np.dtype(query_dtype), np.dtype(cache_dtype))
        if key not in self._kernel_plans:
            s = self._step
            self._kernel_plans[key] = _kernel_plan(
                engine, self._launch["rung"], self._launch["threads"], self._launch["num_splits"],
                query_dtype, self._seqlens, s["max_seqlen"], s["max_kvlen"], s["num_heads"],
                self._kv_heads, s["head_dim"], cache_dtype, s["is_causal"], s["is_alibi"], s["quant_bit"],
                s["quant_group"], s["page_size"] if s["cache_mode"] == 1 else 0)
        return self._kernel_plans[key]

    def _run_reference(self, data, layer_idx):
        s, idx = self._step, self._idx
        attrs = dict(num_heads=s["num_heads"], head_dim=s["head_dim"], is_causal=bool(s["is_causal"]),
                     num_kv_heads=s["num_kv_heads"], is_alibi=bool(s["is_alibi"]), num_layer=s["num_layer"],
                     layer_idx=layer_idx, quant_bit=s["quant_bit"], quant_group=s["quant_group"],
                     cache_mode=s["cache_mode"], cache_layout=s["cache_layout"], page_size=s["page_size"])
        return arrays.run_reference(data, ("cache", "scale"), lambda h: reference.multi_head_cache_attention(
            h["query"], h["current_key"], h["current_value"], *(idx[n] for n in _INDEX_INPUTS),
            s["decoding_batches"], s["max_seqlen"], s["max_kvlen"], h["cache"], h["scale"], h["attn_mask"], **attrs))

    def _run_kernels(self, data, layer_idx, launch):
        launches = arrays.kernels().ppl_multi_head_cache_attention
        cache = data["cache"]
        kind = (type(cache), str(getattr(cache, "device", "")))
        step = self._prepared.get(kind)
        if step is None:
            s = self._step
            index = (arrays.kernel_index(cache, self._given[n], self._idx[n]) for n in _INDEX_INPUTS)
            step = self._prepared[kind] = launches.prepare_step(
                *index, s["decoding_batches"], s["max_seqlen"], s["max_kvlen"], num_heads=s["num_heads"],
                is_causal=bool(s["is_causal"]), alibi_slopes=alibi_slopes(s["num_heads"]) if s["is_alibi"] else None,
                num_kv_heads=s["num_kv_heads"], quant_bit=s["quant_bit"], quant_group=s["quant_group"],
                cache_mode=s["cache_mode"], cache_axes=DYNAMIC_LAYOUTS[s["cache_layout"]], page_size=s["page_size"])
        return launches.run_layer(step, data["query"], data["current_key"], data["current_value"], cache,
                                  data["scale"], data["attn_mask"], layer_idx=layer_idx, **_launch_args(launch))


@arrays.accepts_torch
def plan_multi_head_cache_attention(*args, **kwargs) -> MultiHeadCacheAttentionPlan:
    """Plan one batch step of `multi_head_cache_attention` (as FlashInfer's `plan`): validate the step once, then
    `plan.run(query, current_key, current_value, cache, scale, attn_mask, layer_idx=...)` per layer.

    Takes multi_head_cache_attention's arguments, with its names, order and defaults, except the per-layer ones
    (query, current_key, current_value, cache, scale, attn_mask, layer_idx) and backend, which
    `MultiHeadCacheAttentionPlan.run` takes: the step's index tensors (seqstarts, kvstarts, cachestarts,
    start_pos), decoding_batches, max_seqlen, max_kvlen, the attributes, threads, rung and num_splits.

    Every error multi_head_cache_attention raises about these is raised here, naming the same argument, except
    what needs a layer's tensors: the rows of current_key and query against seqstarts[B] (named after the layer's
    tensor), a slot or page past the cache's MaxT (named `cachestarts`, checked in `run` from the host copies kept
    here, with no device read), a rung the query's dtype or the kernels' shared memory rule out (checked at the
    first layer of each dtype). `multi_head_cache_attention(**step, **layer)` is
    `plan_multi_head_cache_attention(**step).run(**layer)`.

    Examples
    --------
    One decode step (1 token after 4 cached) and one prefill of 2 tokens, two layers of a float32 paged cache:

    >>> import numpy as np, cacheattn
    >>> rng = np.random.default_rng(0)
    >>> cache = rng.standard_normal((16, 2, 2, 2, 8)).astype(np.float32)       # layout 0: MaxT, L, 2, kv heads, Dh
    >>> plan = cacheattn.plan_multi_head_cache_attention(
    ...     np.array([0, 1, 3]), np.array([0, 5, 7]), np.array([[8, 4], [0, -1]]), np.array([4, 0]), 1, 2, 5,
    ...     num_heads=4, head_dim=8, is_causal=True, num_kv_heads=2, num_layer=2, cache_mode=1, page_size=4)
    >>> outs = [plan.run(rng.standard_normal((3, 4, 8)).astype(np.float32),
    ...                  *rng.standard_normal((2, 3, 2, 8)).astype(np.float32), cache, layer_idx=layer)
    ...         for layer in (0, 1)]
    >>> [o.shape for o in outs]
    [(3, 4, 8), (3, 4, 8)]
    """
    step = bind_step(_PLAN_PARAMETERS, args, kwargs, function="plan_multi_head_cache_attention",
                     layer_inputs=LAYER_INPUTS)
    return MultiHeadCacheAttentionPlan(step)


_PLAN_PARAMETERS = plan_signature(multi_head_cache_attention, LAYER_INPUTS, "MultiHeadCacheAttentionPlan")
plan_multi_head_cache_attention.__signature__ = _PLAN_PARAMETERS
