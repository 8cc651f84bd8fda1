"""ONNX `Attention` (opsets 23, 24; opset 25's windows): `cacheattn.onnx_attention`.

Inputs and attributes keep the ONNX names; validation names the ONNX input or attribute
at fault, then NumPy arrays go to `reference.onnx_attention` and GPU arrays (or
backend="numba") to the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import reference

from . import _arrays as arrays
from ._validate import check_choice, check_flag, check_int, check_shape

T1 = ("float16", "float32", "float64", "bfloat16")
OPSETS = (23, 24, 25)


class AttentionOutputs(NamedTuple):
    """The four ONNX outputs, in ONNX order; qk_matmul_output is None unless asked for."""
    Y: object
    present_key: object
    present_value: object
    qk_matmul_output: object


def _dtype_name(x) -> str:
    return np.dtype(x.dtype).name


def _check_float(name, x, like=None):
    if _dtype_name(x) not in T1:
        raise TypeError(f"{name}: expected dtype in {T1}, got {_dtype_name(x)}")
    if like is not None and np.dtype(x.dtype) != np.dtype(like[1].dtype):
        raise TypeError(f"{name}: expected the dtype of {like[0]} ({_dtype_name(like[1])}), got {_dtype_name(x)}")


def _heads(name, x, num_heads, attr):
    """(heads, seq, size) of a 3-D or 4-D Q/K/V."""
    if x.ndim == 4:
        if num_heads is not None and num_heads != x.shape[1]:
            raise ValueError(f"{attr}: expected {x.shape[1]} (the head axis of 4-D {name}) or None, got {num_heads}")
        return int(x.shape[1]), int(x.shape[2]), int(x.shape[3])
    if num_heads is None:
        raise ValueError(f"{attr}: required with 3-D {name} (batch, seq, heads * size), got None")
    check_int(attr, num_heads, low=1)
    if x.shape[2] % num_heads:
        raise ValueError(f"{name}: expected a hidden size divisible by {attr} = {num_heads}, got {x.shape[2]}")
    return num_heads, int(x.shape[1]), int(x.shape[2]) // num_heads


def validate(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, *, is_causal, kv_num_heads, q_num_heads,
             qk_matmul_output_mode, scale, softcap, softmax_precision, left_window_size, right_window_size, opset):
    """Checks every input and attribute; returns the host nonpad_kv_seqlen (or None)."""
    check_choice("opset", opset, OPSETS)
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        if getattr(x, "ndim", None) not in (3, 4):
            raise ValueError(f"{name}: expected a 3-D or 4-D tensor, got shape {tuple(getattr(x, 'shape', ()))}")
    if not Q.ndim == K.ndim == V.ndim:
        raise ValueError(f"K: expected the rank of Q ({Q.ndim}) for K and V, got K {K.ndim}-D, V {V.ndim}-D")
    _check_float("Q", Q)
    _check_float("K", K, ("Q", Q))
    _check_float("V", V, ("Q", Q))
    if opset == 25 and Q.ndim == 4 and (q_num_heads is not None or kv_num_heads is not None):
        raise ValueError("q_num_heads: opset 25 forbids q_num_heads / kv_num_heads with 4-D inputs")
    q_heads, q_len, head_size = _heads("Q", Q, q_num_heads, "q_num_heads")
    kv_heads, kv_len, k_size = _heads("K", K, kv_num_heads, "kv_num_heads")
    v_heads, v_len, v_size = _heads("V", V, kv_num_heads, "kv_num_heads")
    batch = int(Q.shape[0])
    if K.shape[0] != batch or V.shape[0] != batch:
        raise ValueError(f"K: expected batch_size {batch} (Q's) for K and V, got {K.shape[0]} and {V.shape[0]}")
    if k_size != head_size:
        raise ValueError(f"K: expected head_size {head_size} (Q's), got {k_size}")
    if (v_heads, v_len) != (kv_heads, kv_len):
        raise ValueError(f"V: expected {kv_heads} heads and kv_sequence_length {kv_len} (K's), got {v_heads}, {v_len}")
    if q_heads % kv_heads:
        raise ValueError(f"kv_num_heads: expected a divisor of q_num_heads ({q_heads}), got {kv_heads}")

    past_len = 0
    # spec: onnx/past-together
    if (past_key is None) != (past_value is None):
        missing = "past_value" if past_value is None else "past_key"
        raise ValueError(f"{missing}: past_key and past_value come together; got only one of them")
    if past_key is not None:
        _check_float("past_key", past_key, ("Q", Q))
        _check_float("past_value", past_value, ("Q", Q))
        check_shape("past_key", past_key, (batch, kv_heads, None, head_size), "(batch, kv_num_heads, past, head_size)")
        past_len = int(past_key.shape[2])
        check_shape("past_value", past_value, (batch, kv_heads, past_len, v_size),
                    "(batch, kv_num_heads, past_sequence_length, v_head_size)")
    total = past_len + kv_len

    nonpad = None
    if nonpad_kv_seqlen is not None:
        if opset < 24:
            raise ValueError(f"nonpad_kv_seqlen: an opset 24 input, got it at opset {opset}")
        # spec: onnx/nonpad-no-past
        if past_key is not None:
            raise ValueError("nonpad_kv_seqlen: not allowed with past_key / past_value (two KV-cache use cases)")
        nonpad = arrays.index_array("nonpad_kv_seqlen", nonpad_kv_seqlen)
        check_shape("nonpad_kv_seqlen", nonpad, (batch,), "(batch_size,)")
        if (nonpad < 0).any() or (nonpad > kv_len).any():
            raise ValueError(f"nonpad_kv_seqlen: expected values in [0, {kv_len}], got {nonpad.tolist()}")

    if attn_mask is not None:
        if _dtype_name(attn_mask) != "bool" and np.dtype(attn_mask.dtype) != np.dtype(Q.dtype):
            raise TypeError(f"attn_mask: expected bool or Q's dtype ({_dtype_name(Q)}), got {_dtype_name(attn_mask)}")
        target = (batch, q_heads, q_len, total)
        shape = tuple(int(s) for s in attn_mask.shape)
        lead_ok = 1 <= len(shape) <= 4 and all(s in (1, t) for s, t in zip(shape[-2::-1], target[-2::-1]))
        if not lead_ok or shape[-1] > total:
            raise ValueError(f"attn_mask: expected a shape broadcastable to {target} (last dim may be shorter), "
                             f"got {shape}")
        if nonpad is not None and shape[-1] < nonpad.max(initial=0):
            raise ValueError(f"attn_mask: expected a last dim >= max(nonpad_kv_seqlen) = {nonpad.max()}, "
                             f"got {shape[-1]}")

    check_flag("is_causal", is_causal)
    check_choice("qk_matmul_output_mode", qk_matmul_output_mode, (0, 1, 2, 3))
    if scale is not None and not (isinstance(scale, (int, float, np.floating)) and scale > 0):
        raise ValueError(f"scale: expected a positive float or None, got {scale!r}")
    if not isinstance(softcap, (int, float, np.floating)) or softcap < 0:
        raise ValueError(f"softcap: expected a float >= 0 (0 disables it), got {softcap!r}")
    if softmax_precision is not None:
        check_choice("softmax_precision", softmax_precision, (1, 10, 11, 16))
    for name, size in (("left_window_size", left_window_size), ("right_window_size", right_window_size)):
        check_int(name, size, low=-1)
        if opset < 25 and size != -1:
            raise ValueError(f"{name}: an opset 25 attribute, got {size} at opset {opset}")
    return nonpad


@arrays.accepts_torch
def onnx_attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *, is_causal=0,
                   kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0, scale=None, softcap=0.0,
                   softmax_precision=None, left_window_size=-1, right_window_size=-1, opset=24,
                   return_qk_matmul_output=False, backend="auto", threads=128):
    """ONNX Attention. Returns AttentionOutputs(Y, present_key, present_value, qk_matmul_output).

    Q: (batch, q_num_heads, q_seq, head_size) or (batch, q_seq, q_num_heads * head_size); K, V likewise with
    kv_num_heads (3-D inputs need q_num_heads and kv_num_heads). attn_mask: bool (True = attend) or Q's dtype
    (added), broadcastable to (batch, q_num_heads, q_seq, total_seq), last dim possibly shorter (padded).
    present_key/present_value are (batch, kv_num_heads, total_seq, size). qk_matmul_output is computed only when
    return_qk_matmul_output is set.
    """
    data = dict(Q=Q, K=K, V=V, attn_mask=attn_mask, past_key=past_key, past_value=past_value)
    engine = arrays.resolve_backend(backend, data)
    attrs = dict(is_causal=check_flag("is_causal", is_causal), kv_num_heads=kv_num_heads, q_num_heads=q_num_heads,
                 qk_matmul_output_mode=qk_matmul_output_mode, scale=scale, softcap=softcap,
                 softmax_precision=softmax_precision, left_window_size=left_window_size,
                 right_window_size=right_window_size)
    nonpad = validate(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, opset=opset, **attrs)
    check_choice("return_qk_matmul_output", int(bool(return_qk_matmul_output)), (0, 1))
    if engine == "reference":
        return AttentionOutputs(*arrays.run_reference(data, (), lambda h: reference.onnx_attention(
            h["Q"], h["K"], h["V"], h["attn_mask"], h["past_key"], h["past_value"], nonpad,
            return_qk_matmul_output=return_qk_matmul_output, **attrs)))
    data = {name: arrays.as_kernel_array(x) for name, x in data.items()}
    return AttentionOutputs(*arrays.kernels().onnx_attention(
        data["Q"], data["K"], data["V"], data["attn_mask"], data["past_key"], data["past_value"],
        None if nonpad is None else arrays.kernel_index(data["Q"], nonpad_kv_seqlen, nonpad),
        return_qk_matmul_output=return_qk_matmul_output, threads=threads, **attrs))
