"""ONNX Attention's past / present tensors (onnx-attention-23-24.zh.md): `past_key` (batch_size, kv_num_heads,
past_sequence_length, head_size) and `past_value` (..., v_head_size); `present_key` / `present_value` have the
same layout one step longer. Token t of batch b is [b, :, t]; with `nonpad_kv_seqlen` only the first
nonpad_kv_seqlen[b] tokens are real. Keys are what the model passed (post-RoPE in practice)."""

from __future__ import annotations

import numpy as np

from ._core import (
    KV,
    check_cache_array,
    check_kv,
    check_kv_fits,
    check_rotated,
    check_sequence,
    check_writable,
    is_float,
    lengths,
    prepare_pair,
    read_pair,
    site,
)


def _check(past_key, past_value):
    for name, x in (("past_key", past_key), ("past_value", past_value)):
        check_cache_array(name, x)
        if x.ndim != 4 or not is_float(x.dtype):
            raise ValueError(f"{name}: expected a float tensor (batch_size, kv_num_heads, past_sequence_length, "
                             f"head_size), got {x.dtype} {tuple(x.shape)}")
    if past_key.shape[:3] != past_value.shape[:3] or past_key.dtype != past_value.dtype:
        raise ValueError(f"past_value: expected batch, heads, length and dtype of past_key {past_key.shape[:3]} "
                         f"{past_key.dtype}, got {past_value.shape[:3]} {past_value.dtype}")


def _sites(past_key, past_value, b, tokens):
    t = np.arange(tokens)
    return [site(x, "B H T D", {"B": b}, {"T": t}) for x in (past_key, past_value)]


def export(past_key, past_value, nonpad_kv_seqlen=None, *, sequence, rotated=True) -> KV:
    """Batch `sequence`'s tokens: all past_sequence_length of them, or its nonpad_kv_seqlen.

    Parameters
    ----------
    past_key : array
        `(batch_size, kv_num_heads, past_sequence_length, head_size)`, float.
    past_value : array
        `(batch_size, kv_num_heads, past_sequence_length, v_head_size)`, past_key's dtype.
    nonpad_kv_seqlen : int array or None
        `(batch_size,)`: the real tokens of each batch (None: all past_sequence_length).
    sequence : int
        The batch b.
    rotated : bool or None
        Whether the keys carry RoPE (the model's choice; usually True).
    """
    _check(past_key, past_value)
    rotated = check_rotated("rotated", rotated)
    b = check_sequence("sequence", sequence, past_key.shape[0])
    tokens = past_key.shape[2] if nonpad_kv_seqlen is None else \
        int(lengths("nonpad_kv_seqlen", nonpad_kv_seqlen, past_key.shape[0], past_key.shape[2],
                    " (batch_size)")[b])
    ks, vs = _sites(past_key, past_value, b, tokens)
    return read_pair(ks, vs, None, None, None, 0, np.arange(tokens), rotated)


def import_(kv: KV, past_key, past_value, *, sequence) -> dict:
    """Write kv's tokens at [sequence, :, 0:T] of the caller's past tensors (T <= past_sequence_length), a cast to
    their dtype. Returns {"nonpad_kv_seqlen": T}; the caller's nonpad_kv_seqlen[sequence] becomes T.

    Parameters
    ----------
    kv : KV
        The tokens to write (kv_num_heads, head_size and v_head_size of the tensors).
    past_key : array
        `(batch_size, kv_num_heads, past_sequence_length, head_size)` (written).
    past_value : array
        `(batch_size, kv_num_heads, past_sequence_length, v_head_size)` (written).
    sequence : int
        The batch b.
    """
    kv = check_kv(kv)
    _check(past_key, past_value)
    check_writable("past_key", past_key)
    check_writable("past_value", past_value)
    b = check_sequence("sequence", sequence, past_key.shape[0])
    check_kv_fits(kv, past_key.shape[1], past_key.shape[3], "past_key / past_value (kv_num_heads, head_size, "
                  "v_head_size)", v_head_dim=past_value.shape[3])
    if kv.tokens > past_key.shape[2]:
        raise ValueError(f"past_key: expected past_sequence_length >= {kv.tokens} tokens, got {past_key.shape[2]}")
    ks, vs = _sites(past_key, past_value, b, kv.tokens)
    prepare_pair(kv, None, ks, vs)()
    return {"nonpad_kv_seqlen": kv.tokens}


def rule(past_key, past_value=None, **_) -> dict:
    """How this destination stores values (for `cacheattn.convert.error_bound`)."""
    return dict(kind=None, dtype=past_key.dtype)


def stores_rotated(**_) -> bool:
    """ONNX past keys are post-RoPE in practice."""
    return True
