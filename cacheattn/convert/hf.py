"""transformers' own cache: a `DynamicCache` (transformers 5.x) whose `layers[layer_idx]` hold `keys` and
`values` tensors [batch, num_kv_heads, seq_len, head_dim], written by `update(k, v, layer_idx)` after RoPE
(post-RoPE keys). torch is imported only when this module is used."""

from __future__ import annotations

import numpy as np

from .._arrays import to_host
from .._validate import check_int
from ._core import KV, check_kv, check_kv_fits, check_sequence, codes_for


def _torch():
    try:
        import torch
    except ImportError as e:                               # pragma: no cover - depends on the environment
        raise ImportError("cacheattn.convert's 'hf' format needs torch and transformers "
                          "(pip install -e '.[hf]')") from e
    return torch


def _layer(past_key_values, layer_idx):
    check_int("layer_idx", layer_idx, low=0)
    layers = getattr(past_key_values, "layers", None)
    if layers is None:
        raise TypeError(f"past_key_values: expected a transformers Cache (with .layers), got "
                        f"{type(past_key_values).__name__}")
    if not 0 <= layer_idx < len(layers) or getattr(layers[layer_idx], "keys", None) is None:
        return None
    return layers[layer_idx]


def export(past_key_values, *, sequence, layer_idx=0, seq_len=None) -> KV:
    """Batch row `sequence` of layer `layer_idx`: its first seq_len tokens (all of them by default).

    Parameters
    ----------
    past_key_values : transformers Cache
        A `DynamicCache` (transformers 5.x): `layers[layer_idx].keys` / `.values` `[batch, num_kv_heads,
        seq_len, head_dim]`.
    sequence : int
        The batch row.
    layer_idx : int
        The layer.
    seq_len : int or None
        The tokens to read (None: the layer's whole seq_len).
    """
    layer = _layer(past_key_values, layer_idx)
    if layer is None:
        raise ValueError(f"layer_idx: expected a layer the cache holds, got {layer_idx}")
    keys, values = layer.keys, layer.values                                # [B, Hkv, S, D]
    b = check_sequence("sequence", sequence, keys.shape[0])
    tokens = keys.shape[2] if seq_len is None else check_int("seq_len", seq_len, low=0, high=keys.shape[2])
    k, v = _host(keys[b, :, :tokens]), _host(values[b, :, :tokens])       # (Hkv, T, D) each
    return KV(k, v, np.arange(tokens), True)


def _host(t) -> np.ndarray:
    """A NumPy copy of a tensor (bfloat16, which NumPy lacks, widened to float32: exact)."""
    t = t.detach().cpu()
    if t.dtype == _torch().bfloat16:
        t = t.float()
    return t.contiguous().numpy().copy()


def import_(kv: KV, past_key_values, *, sequence, layer_idx=0, dtype=None) -> dict:
    """Write kv's tokens at [sequence, :, 0:T] of layer `layer_idx` (T <= its seq_len), a cast to its dtype. A
    layer the cache does not hold yet is created by `update` (batch row 0 only). Returns {"seq_len": T}.

    Parameters
    ----------
    kv : KV
        The tokens to write (num_kv_heads and head_dim of the layer).
    past_key_values : transformers Cache
        A `DynamicCache` (written in place, or extended by one layer).
    sequence : int
        The batch row (0 for a new layer).
    layer_idx : int
        The layer: one the cache holds, or the next one (created).
    dtype : torch.dtype or None
        A new layer's dtype (default float32); an existing layer keeps its own.
    """
    kv = check_kv(kv)
    torch = _torch()
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype or None, got {type(dtype).__name__}")
    layer = _layer(past_key_values, layer_idx)
    key, value = (np.ascontiguousarray(to_host(x)) for x in (kv.key, kv.value))
    if layer is None:
        if len(past_key_values.layers) < layer_idx:
            raise ValueError(f"layer_idx: expected a layer the cache holds or the next one "
                             f"({len(past_key_values.layers)}), got {layer_idx}")
        check_sequence("sequence", sequence, 1)                     # a new layer holds batch row 0 only
        want = dtype or torch.float32
        k = torch.from_numpy(key.astype(np.float32))[None].to(want)
        v = torch.from_numpy(value.astype(np.float32))[None].to(want)
        past_key_values.update(k, v, layer_idx)
        return {"seq_len": kv.tokens}
    keys, values = layer.keys, layer.values
    b = check_sequence("sequence", sequence, keys.shape[0])
    check_kv_fits(kv, keys.shape[1], keys.shape[3], f"layer {layer_idx} (num_kv_heads, head_dim)",
                  v_head_dim=values.shape[3])
    if kv.tokens > keys.shape[2]:
        raise ValueError(f"past_key_values: expected seq_len >= {kv.tokens} in layer {layer_idx}, got {keys.shape[2]}")
    host_kv = KV(key, value, kv.positions, kv.rotated)
    k_codes, v_codes, _, _ = codes_for(host_kv, None, dtype=np.float32 if keys.dtype == torch.bfloat16 else
                                       torch.empty(0, dtype=keys.dtype).numpy().dtype)
    k = torch.from_numpy(np.ascontiguousarray(k_codes)).to(keys.dtype)
    v = torch.from_numpy(np.ascontiguousarray(v_codes)).to(values.dtype)
    with torch.no_grad():
        keys[b, :, :kv.tokens] = k
        values[b, :, :kv.tokens] = v
    return {"seq_len": kv.tokens}


def rule(past_key_values, *, layer_idx=0, dtype=None, **_) -> dict:
    """How this destination stores values (for `cacheattn.convert.error_bound`)."""
    torch = _torch()
    layer = _layer(past_key_values, layer_idx)
    t = layer.keys.dtype if layer is not None else (dtype or torch.float32)
    import ml_dtypes
    return dict(kind=None, dtype=np.dtype(ml_dtypes.bfloat16) if t == torch.bfloat16 else
                torch.empty(0, dtype=t).numpy().dtype)


def stores_rotated(**_) -> bool:
    """transformers caches post-RoPE keys."""
    return True
