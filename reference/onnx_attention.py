"""ONNX `Attention`, opsets 23 and 24 (onnx-attention-23-24.zh.md; English text:
`onnx.defs.get_schema("Attention", 24).doc`), plus opset 25's left/right window.

The schema draws this dataflow; the body below follows it step by step, with the onnx
1.23.x reference's errata (softcap comes *before* the mask, so a -inf mask stays -inf):

      Q             K              V
      |             |              |
   Q*sqrt(scale) K*sqrt(scale)     |        (each scaled in the input dtype)
      |             |              |
      |          Transpose         |
      ----MatMul----               |        -> qk_matmul_output_mode 0
            |                      |
         softcap (if > 0)          |        -> mode 1
            |                      |
  attn_bias-Add                    |        -> mode 2   (mask, causal, window, padding)
            |                      |
         Softmax                   |        -> mode 3   (in softmax_precision if given)
            |                      |
            --------MatMul----------
                      |
                      Y

Where the text and the reference disagree, the node test cases decide: mode 1 is the
softcapped score and mode 2 the score plus bias (the reference's stage order); is_causal
and attn_mask may be combined at opset 23 too. Where no case decides, the text does:
mode 0 is the raw matmul even when softcap is set. A row whose bias is entirely -inf
gives zeros (Y and mode 3), never NaN.
"""

from __future__ import annotations

import numpy as np

from .blas import matmul
from .softmax import masked_softmax

# TensorProto element types that softmax_precision may name.
SOFTMAX_PRECISIONS = {1: np.float32, 10: np.float16, 11: np.float64}
BFLOAT16 = 16


def _dtype_of_precision(code):
    if code == BFLOAT16:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(SOFTMAX_PRECISIONS[code])


def _to_4d(x, num_heads):
    """(batch, seq, heads * size) -> (batch, heads, seq, size); 4-D input passes through."""
    if x.ndim == 4:
        return x
    batch, seq, hidden = x.shape
    return x.reshape(batch, seq, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)


def _matmul(a, b):
    """MatMul in the inputs' dtype (numpy promotes bfloat16; the result is cast back, as ONNX types it)."""
    return matmul(a, b).astype(a.dtype, copy=False)


def key_offsets(batch, q_len, past_len, nonpad_kv_seqlen):
    """(batch,) position of each batch's first query among the keys: the causal/window alignment.

    With past_key: past length (the queries follow the cache). Without past but with
    nonpad_kv_seqlen: nonpad_kv_seqlen[b] - q_len (the queries are the last valid tokens of
    an external cache). Otherwise 0: top-left alignment.
    """
    if past_len:
        return np.full(batch, past_len, np.int64)
    if nonpad_kv_seqlen is not None:
        return np.asarray(nonpad_kv_seqlen, np.int64).reshape(-1) - q_len
    return np.zeros(batch, np.int64)


def attention_bias(attn_mask, batch, q_len, kv_len, offsets, nonpad_kv_seqlen, *, is_causal,
                   left_window_size, right_window_size, dtype):
    """The additive bias, broadcastable to (batch, q_num_heads, q_len, kv_len), in `dtype`; None when there is
    nothing to add (no mask, no causal, no window, no padding)."""
    if attn_mask is None and not is_causal and left_window_size < 0 and right_window_size < 0 \
            and nonpad_kv_seqlen is None:
        return None
    neg_inf, zero = dtype.type(-np.inf), dtype.type(0)
    # spec: onnx/bias-sources, onnx/mask-shape, onnx/opset23-one-bias
    bias = np.zeros((1, 1, q_len, kv_len), dtype)
    if attn_mask is not None:
        # spec: onnx/mask-short, onnx/nonpad-mask-length
        # A mask shorter than the total key length is padded with False / -inf.
        pad = kv_len - attn_mask.shape[-1]
        if pad > 0:
            fill = False if attn_mask.dtype == np.bool_ else -np.inf
            attn_mask = np.pad(attn_mask, [(0, 0)] * (attn_mask.ndim - 1) + [(0, pad)], constant_values=fill)
        # spec: onnx/mask-kinds
        # bool: True = attend. Select, never multiply: 0 * -inf would be NaN.
        mask = np.where(attn_mask, zero, neg_inf) if attn_mask.dtype == np.bool_ else attn_mask.astype(dtype)
        bias = bias + mask                                                        # right-aligned broadcast
    i = np.arange(q_len)[:, None]                                                 # (q, 1)
    j = np.arange(kv_len)[None, :]                                                # (1, kv)
    # Without nonpad_kv_seqlen every batch has the same offset: one (q, kv) plane of hidden keys serves them all.
    planes = batch if nonpad_kv_seqlen is not None else 1
    position = offsets[:planes, None, None, None] + i                             # (planes, 1, q, 1)
    hidden = np.zeros((planes, 1, q_len, kv_len), bool)
    # spec: onnx/is-causal-top-left, onnx/causal-with-mask, onnx/self-cross
    if is_causal:
        hidden |= j > position                                                    # key after the query
    if left_window_size >= 0:
        hidden |= j < position - left_window_size                                 # too far back
    if right_window_size >= 0:
        hidden |= j > position + right_window_size                                # too far ahead
    # spec: onnx/nonpad, onnx/cache-outside
    if nonpad_kv_seqlen is not None:
        hidden |= j >= np.asarray(nonpad_kv_seqlen).reshape(-1, 1, 1, 1)          # padding keys
    return np.where(hidden, neg_inf, bias).astype(dtype, copy=False)


def onnx_attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *,
                   is_causal=0, kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0, scale=None,
                   softcap=0.0, softmax_precision=None, left_window_size=-1, right_window_size=-1,
                   return_qk_matmul_output=False):
    """Returns (Y, present_key, present_value, qk_matmul_output or None)."""
    three_d = Q.ndim == 3
    # spec: onnx/q-shape, onnx/kv-shape, onnx/num-heads-3d
    # 3-D inputs are (batch, seq, heads * size): reshape and transpose to (batch, heads, seq, size).
    q = _to_4d(Q, q_num_heads)                                                    # (B, Hq, S, D)
    k = _to_4d(K, kv_num_heads)                                                   # (B, Hkv, L, D)
    v = _to_4d(V, kv_num_heads)                                                   # (B, Hkv, L, Dv)
    batch, heads, q_len, head_size = q.shape

    # spec: onnx/scale, onnx/pattern
    # "scale: default 1/sqrt(head_size) ... Q and K are scaled by sqrt(scale) before the matmul"
    scale = 1 / np.sqrt(head_size) if scale is None else scale
    root = q.dtype.type(np.sqrt(scale))                                           # in the input dtype

    # spec: onnx/cache-inside, onnx/past-shape, onnx/present-shape
    # KV cache inside the operator: present = concat(past, current) on the sequence axis.
    present_key = k if past_key is None else np.concatenate([past_key, k], axis=2)       # (B, Hkv, T, D)
    present_value = v if past_value is None else np.concatenate([past_value, v], axis=2)  # (B, Hkv, T, Dv)
    kv_len = present_key.shape[2]
    past_len = 0 if past_key is None else past_key.shape[2]

    offsets = key_offsets(batch, q_len, past_len, nonpad_kv_seqlen)
    bias = attention_bias(attn_mask, batch, q_len, kv_len, offsets, nonpad_kv_seqlen, is_causal=bool(is_causal),
                          left_window_size=left_window_size, right_window_size=right_window_size, dtype=q.dtype)

    # spec: onnx/gqa
    # GQA / MQA: each kv head serves q_num_heads / kv_num_heads consecutive query heads. Stacking the G query heads
    # of a kv head as the rows of one matrix, (B, Hkv, G·S, D) against K/V (B, Hkv, T, D), gives the products of
    # repeating K/V along the head axis without copying them, in one BLAS product per kv head.
    kv_heads = present_key.shape[1]
    group = heads // kv_heads
    q_rows = (q * root).reshape(batch, kv_heads, group * q_len, head_size)       # (B, Hkv, G·S, D), scaled

    # spec: onnx/qk-output-modes, onnx/qk-output-shape
    # qk_matmul_output is copied out at its stage when asked for, so each later stage may overwrite the one
    # before it in place (a long prompt's scores are the largest arrays here).
    keep = qk_matmul_output_mode if return_qk_matmul_output else None
    raw = _matmul(q_rows, (present_key * root).swapaxes(-1, -2))                  # (B, Hkv, G·S, T)
    raw = raw.reshape(batch, heads, q_len, kv_len)                                # (B, Hq, S, T), mode 0
    qk = raw.astype(q.dtype) if keep == 0 else None
    # spec: onnx/softcap
    # softcap before the mask: softcap * tanh(x / softcap) would turn -inf into -softcap.
    capped = raw if softcap <= 0 else (np.tanh(raw / raw.dtype.type(softcap)) * raw.dtype.type(softcap))
    qk = capped.astype(q.dtype) if keep == 1 else qk
    biased = capped if bias is None else np.add(capped, bias, out=capped)         # mode 2
    # spec: onnx/softmax-precision
    if softmax_precision is not None:
        biased = biased.astype(_dtype_of_precision(softmax_precision))
    qk = biased.astype(q.dtype) if keep == 2 else qk
    probs = masked_softmax(biased, out=biased)
    if bias is not None:
        # A row with no visible key (its bias all -inf) gives zeros, decided on the bias, not the scores.
        no_key = np.isneginf(bias.max(axis=-1, keepdims=True))
        if no_key.any():                              # (a copy with `where` visits every score: only when needed)
            np.copyto(probs, probs.dtype.type(0), where=no_key)                   # mode 3
    qk = probs.astype(q.dtype) if keep == 3 else qk

    # spec: onnx/y-shape, onnx/types
    p_rows = probs.astype(q.dtype, copy=False).reshape(batch, kv_heads, group * q_len, kv_len)   # (B, Hkv, G·S, T)
    y = _matmul(p_rows, present_value).reshape(batch, heads, q_len, -1)           # (B, Hq, S, Dv)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(batch, q_len, -1)                     # (B, S, Hq * Dv)
    return y, present_key, present_value, qk
