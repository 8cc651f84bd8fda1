"""FasterTransformer's cross-attention cache (fastertransformer-cross-attention.zh.md): batch-major K
[B, H, Dh / x, mem_max_seq_len, x] with x = 16 bytes / sizeof(T), V [B, H, mem_max_seq_len, Dh]; or, with
is_batch_major_cache false, [B, mem_max_seq_len, H, Dh] for both. A leading layer axis (the decoder's one buffer
that `mem_cache_offset` steps through) is accepted. Token t of batch b is encoder position t < encoder length;
the keys are encoder keys: RoPE does not apply (export says rotated=None)."""

from __future__ import annotations

import numpy as np

from .._validate import check_int
from ._core import (
    KV,
    check_bool,
    check_cache_array,
    check_kv,
    check_kv_fits,
    check_sequence,
    check_writable,
    is_float,
    lengths,
    prepare_pair,
    read_pair,
    site,
)


def _layout(key_cache, value_cache, is_batch_major_cache, layer_idx):
    """(key axes, value axes, fixed layer index, batch, mem_max_seq_len, heads, head_dim)."""
    check_cache_array("key_cache", key_cache)
    check_cache_array("value_cache", value_cache)
    check_int("layer_idx", layer_idx, low=0)
    is_batch_major_cache = check_bool("is_batch_major_cache", is_batch_major_cache)
    k_axes, v_axes = ("B H DC T X", "B H T D") if is_batch_major_cache else ("B T H D", "B T H D")
    layered = value_cache.ndim == 5
    if layered:
        k_axes, v_axes = "L " + k_axes, "L " + v_axes
    for name, x, axes in (("key_cache", key_cache, k_axes), ("value_cache", value_cache, v_axes)):
        if x.ndim != len(axes.split()) or not is_float(x.dtype):
            raise ValueError(f"{name}: expected a float tensor ({', '.join(axes.split())}) for is_batch_major_cache "
                             f"{bool(is_batch_major_cache)}, got {x.dtype} {tuple(x.shape)}")
    v = dict(zip(v_axes.split(), value_cache.shape))
    k = dict(zip(k_axes.split(), key_cache.shape))
    fixed = {}
    if layered:
        check_int("layer_idx", layer_idx, low=0, high=v["L"] - 1)
        fixed = {"L": layer_idx}
    elif layer_idx:
        # Without the layer axis the caches are one layer's; another index would be silently read as this one.
        raise ValueError(f"layer_idx: expected 0, as key_cache and value_cache have no layer axis (they hold one "
                         f"layer: pass that layer's caches, or the decoder's buffer with its leading layer axis), "
                         f"got {layer_idx}")
    if is_batch_major_cache:
        x = 16 // np.dtype(key_cache.dtype).itemsize
        if k["X"] != x or k["DC"] * x != v["D"]:
            raise ValueError(f"key_cache: expected (B, H, Dh / x, mem_max_seq_len, x) with x = 16 bytes / "
                             f"{np.dtype(key_cache.dtype).itemsize} = {x} and Dh = {v['D']}, "
                             f"got {tuple(key_cache.shape)}")
    if (k["B"], k["T"], k["H"]) != (v["B"], v["T"], v["H"]) or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"value_cache: expected the batch, length, heads and dtype of key_cache, got "
                         f"{tuple(value_cache.shape)} {value_cache.dtype}")
    return k_axes, v_axes, fixed, v["B"], v["T"], v["H"], v["D"]


def _sites(key_cache, value_cache, k_axes, v_axes, fixed, b, tokens):
    t = np.arange(tokens)
    width = "DC X" if "X" in k_axes else "D"
    return (site(key_cache, k_axes, {**fixed, "B": b}, {"T": t}, width_axes=width),
            site(value_cache, v_axes, {**fixed, "B": b}, {"T": t}))


def export(key_cache, value_cache, encoder_sequence_length, *, sequence, is_batch_major_cache=True,
           layer_idx=0) -> KV:
    """Batch `sequence`'s encoder tokens [0, encoder_sequence_length[b]) (keys: rotated=None, no RoPE).

    Parameters
    ----------
    key_cache : array
        Batch-major `[B, H, Dh / x, mem_max_seq_len, x]` with x = 16 bytes / element size, else
        `[B, mem_max_seq_len, H, Dh]`; a leading layer axis is accepted. Float.
    value_cache : array
        Batch-major `[B, H, mem_max_seq_len, Dh]`, else `[B, mem_max_seq_len, H, Dh]` (and the layer axis).
    encoder_sequence_length : int array
        `(B,)`: each batch's encoder tokens.
    sequence : int
        The batch b.
    is_batch_major_cache : bool
        Which of the two layouts.
    layer_idx : int
        The layer, with a leading layer axis (else 0: the caches are one layer's).
    """
    k_axes, v_axes, fixed, B, L, _, _ = _layout(key_cache, value_cache, is_batch_major_cache, layer_idx)
    b = check_sequence("sequence", sequence, B)
    tokens = int(lengths("encoder_sequence_length", encoder_sequence_length, B, L, " (B)")[b])
    ks, vs = _sites(key_cache, value_cache, k_axes, v_axes, fixed, b, tokens)
    return read_pair(ks, vs, None, None, None, 0, np.arange(tokens), None)


def import_(kv: KV, key_cache, value_cache, *, sequence, is_batch_major_cache=True, layer_idx=0) -> dict:
    """Write kv's tokens at encoder positions [0, T) of batch `sequence`, a cast to the cache's dtype. Returns
    {"encoder_sequence_length": T}; the caller's encoder_sequence_length[sequence] becomes T.

    Parameters
    ----------
    kv : KV
        The tokens to write (H and Dh of the caches).
    key_cache : array
        As for export (written).
    value_cache : array
        As for export (written).
    sequence : int
        The batch b.
    is_batch_major_cache : bool
        Which of the two layouts.
    layer_idx : int
        The layer written, with a leading layer axis (else 0: the caches are one layer's).
    """
    kv = check_kv(kv)
    k_axes, v_axes, fixed, B, L, H, D = _layout(key_cache, value_cache, is_batch_major_cache, layer_idx)
    check_writable("key_cache", key_cache)
    check_writable("value_cache", value_cache)
    b = check_sequence("sequence", sequence, B)
    check_kv_fits(kv, H, D, "value_cache (H, Dh)")
    if kv.tokens > L:
        raise ValueError(f"key_cache: expected mem_max_seq_len >= {kv.tokens} tokens, got {L}")
    ks, vs = _sites(key_cache, value_cache, k_axes, v_axes, fixed, b, kv.tokens)
    prepare_pair(kv, None, ks, vs)()
    return {"encoder_sequence_length": kv.tokens}


def rule(key_cache, value_cache=None, **_) -> dict:
    """How this destination stores values (for `cacheattn.convert.error_bound`)."""
    return dict(kind=None, dtype=key_cache.dtype)


def stores_rotated(**_):
    """Encoder keys: RoPE does not apply."""
    return None
