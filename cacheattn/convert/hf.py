"""transformers' own cache: a `DynamicCache` (transformers 5.x) whose `layers[layer_idx]` hold `keys` and
`values` tensors [batch, num_kv_heads, seq_len, head_dim], written by `update(k, v, layer_idx)` after RoPE
(post-RoPE keys). torch is imported only when this module is used."""

from __future__ import annotations

import numpy as np

from ._core import KV, check_sequence, codes_for


def _torch():
    try:
        import torch
    except ImportError as e:                               # pragma: no cover - depends on the environment
        raise ImportError("cacheattn.convert's 'hf' format needs torch and transformers "
                          "(pip install -e '.[hf]')") from e
    return torch


def _layer(past_key_values, layer_idx):
    layers = getattr(past_key_values, "layers", None)
    if layers is None:
        raise TypeError(f"past_key_values: expected a transformers Cache (with .layers), got "
                        f"{type(past_key_values).__name__}")
    if not 0 <= layer_idx < len(layers) or getattr(layers[layer_idx], "keys", None) is None:
        return None
    return layers[layer_idx]


def export(past_key_values, *, sequence, layer_idx=0, seq_len=None) -> KV:
    """Batch row `sequence` of layer `layer_idx`: its first seq_len tokens (all of them by default)."""
    layer = _layer(past_key_values, layer_idx)
    if layer is None:
        raise ValueError(f"layer_idx: expected a layer the cache holds, got {layer_idx}")
    keys, values = layer.keys, layer.values                                # [B, Hkv, S, D]
    b = check_sequence("sequence", sequence, keys.shape[0])
    tokens = keys.shape[2] if seq_len is None else int(seq_len)
    if not 0 <= tokens <= keys.shape[2]:
        raise ValueError(f"seq_len: expected at most {keys.shape[2]} tokens, got {tokens}")
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
    layer the cache does not hold yet is created by `update` (batch row 0 only, dtype float32 unless given)."""
    torch = _torch()
    layer = _layer(past_key_values, layer_idx)
    if layer is None:
        if sequence != 0:
            raise ValueError(f"sequence: expected 0 for a layer the cache does not hold yet, got {sequence}")
        if len(past_key_values.layers) < layer_idx:
            raise ValueError(f"layer_idx: expected layers 0 ... {layer_idx - 1} to be filled first, got {layer_idx}")
        want = dtype or torch.float32
        k = torch.from_numpy(np.ascontiguousarray(kv.key, np.float32)).to(want)[None]
        v = torch.from_numpy(np.ascontiguousarray(kv.value, np.float32)).to(want)[None]
        past_key_values.update(k, v, layer_idx)
        return {"seq_len": kv.tokens}
    keys, values = layer.keys, layer.values
    b = check_sequence("sequence", sequence, keys.shape[0])
    if (kv.num_kv_heads, kv.head_dim) != (keys.shape[1], keys.shape[3]):
        raise ValueError(f"kv: expected {keys.shape[1]} heads of head_dim {keys.shape[3]}, got {kv.num_kv_heads} of "
                         f"{kv.head_dim}")
    if kv.tokens > keys.shape[2]:
        raise ValueError(f"past_key_values: expected seq_len >= {kv.tokens} in layer {layer_idx}, got {keys.shape[2]}")
    k_codes, v_codes, _, _ = codes_for(kv, None, dtype=np.float32 if keys.dtype == torch.bfloat16 else
                                       torch.empty(0, dtype=keys.dtype).numpy().dtype)
    with torch.no_grad():
        keys[b, :, :kv.tokens] = torch.from_numpy(np.ascontiguousarray(k_codes)).to(keys.dtype)
        values[b, :, :kv.tokens] = torch.from_numpy(np.ascontiguousarray(v_codes)).to(values.dtype)
    return {"seq_len": kv.tokens}


def rule(past_key_values, *, layer_idx=0, dtype=None, **_) -> dict:
    torch = _torch()
    layer = _layer(past_key_values, layer_idx)
    t = layer.keys.dtype if layer is not None else (dtype or torch.float32)
    import ml_dtypes
    return dict(kind=None, dtype=np.dtype(ml_dtypes.bfloat16) if t == torch.bfloat16 else
                torch.empty(0, dtype=t).numpy().dtype)


def stores_rotated(**_) -> bool:
    return True
