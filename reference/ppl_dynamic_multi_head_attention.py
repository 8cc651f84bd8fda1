"""OpenPPL pmx `dynamic_batching.MultiHeadAttention`, the attention half of MultiHeadCacheAttention
(ppl-multi-head-cache-attention.md).

Batch b's queries are rows seqstarts[b]:seqstarts[b+1] of `query`; its keys and
values are rows kvstarts[b]:kvstarts[b+1] of `key`/`value` (past + current, as
KeyValueCache returns them). The first `decoding_batches` batches decode.
"""

from __future__ import annotations

import numpy as np

from .alibi import alibi_slopes
from .blas import matmul
from .softmax import masked_softmax


def attention_bias(b, seqlen, kvlen, q_rows, kv_cols, decoding_batches, attn_mask, *, num_heads, is_causal,
                   is_alibi, dtype):
    """Bias for batch b broadcastable to (H, S, K), in float32 (float64 for float64 inputs), or None when there
    is nothing to add: (H, S, K) with ALiBi or a 3-D mask, else (1, S, K), the same for every head.

    Alignment is bottom-right: query i is the token at position kvlen - seqlen + i, so it
    may see keys j <= kvlen - seqlen + i (its past plus the current tokens up to itself).
    """
    i = np.arange(seqlen)[:, None]                                        # (S, 1)
    j = np.arange(kvlen)[None, :]                                         # (1, K)
    last_visible = kvlen - seqlen + i                                     # (S, 1)
    # spec: ppl-mhca/causal, ppl-mhca/decoding-batches
    # "is_causal: Whether apply casual mask when sequence length > 1"; decoding batches need none.
    causal = (is_causal and seqlen > 1 and b >= decoding_batches) or is_alibi   # ALiBi always carries it
    # spec: ppl-mhca/mask-offsets, ppl-mhca/mask-shape, ppl-mhca/mask-padded
    mask = None if attn_mask is None else attn_mask[..., q_rows, kv_cols]  # (S, K) or (H, S, K)
    if not causal and mask is None:
        return None
    acc = np.promote_types(dtype, np.float32)
    if is_alibi:
        # spec: ppl-mhca/alibi
        # ALiBi bias slope * (j - last_visible), plus the user mask, is formed in the query dtype.
        slopes = alibi_slopes(num_heads).astype(dtype)[:, None, None]     # (H, 1, 1)
        bias = slopes * (j - last_visible).astype(dtype)                  # (H, S, K), query dtype
        if mask is not None:
            bias = bias + mask.astype(dtype)
        bias = bias.astype(acc)
    elif mask is None:
        bias = np.zeros((1, seqlen, kvlen), acc)                          # causal only: one (S, K) for all heads
    else:
        bias = mask.reshape(-1, seqlen, kvlen).astype(acc)                # (1 or H, S, K), a copy of the mask
    if causal:
        np.copyto(bias, -np.inf, where=j > last_visible)                  # keys after the query's position
    return bias


def dynamic_multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                                 attn_mask=None, *, num_heads, head_dim, is_causal, is_alibi=False, num_kv_heads=0):
    """attn_output (seqstarts[B], num_heads, head_dim) in query's dtype.

    query: (seqstarts[B], num_heads, head_dim); key, value: (kvstarts[B], num_kv_heads, head_dim).
    attn_mask: (sum seqlens, >= sum kvlens) or (num_heads, sum seqlens, >= sum kvlens).
    """
    # spec: ppl-mhca/kv-heads-default
    num_kv_heads = num_kv_heads or num_heads                              # "Default is 0 ... num_heads is used"
    group = num_heads // num_kv_heads
    # spec: ppl-mhca/types
    # Scores, softmax and P.V accumulate in float32 for T1 in {float16, float32}; float64 inputs (the
    # tests' exact evaluation) keep float64 throughout.
    acc = np.promote_types(query.dtype, np.float32)
    attn_output = np.empty(query.shape, query.dtype)

    # A loop over batches, since each has its own lengths; heads and tokens are one matmul each.
    for b in range(len(seqstarts) - 1):
        q_rows = slice(seqstarts[b], seqstarts[b + 1])
        kv_rows = slice(kvstarts[b], kvstarts[b + 1])
        seqlen, kvlen = q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start
        # spec: ppl-mhca/gqa
        # GQA: "repeat key and value num_heads/num_kv_heads times": query head h reads kv head h // group. The G
        # query heads of a kv head stacked as the rows of one matrix, (Hkv, G·S, Dh) against K/V (Hkv, K, Dh), give
        # the products of the repeat without copying K and V, in one BLAS product per kv head.
        q = query[q_rows].astype(acc, copy=False).reshape(seqlen, num_kv_heads, group, head_dim)
        q = q.transpose(1, 2, 0, 3).reshape(num_kv_heads, group * seqlen, head_dim)       # (Hkv, G·S, Dh)
        k = key[kv_rows].astype(acc, copy=False).transpose(1, 0, 2)                       # (Hkv, K, Dh)
        v = value[kv_rows].astype(acc, copy=False).transpose(1, 0, 2)                     # (Hkv, K, Dh)

        # spec: ppl-mhca/head-dim, ppl-mhca/shapes
        scores = matmul(q, k.swapaxes(-1, -2)).reshape(num_heads, seqlen, kvlen)   # (H, S, K), h = Hkv·G + g
        scores /= acc.type(np.sqrt(head_dim))
        bias = attention_bias(b, seqlen, kvlen, q_rows, kv_rows, decoding_batches, attn_mask,
                              num_heads=num_heads, is_causal=is_causal, is_alibi=is_alibi, dtype=query.dtype)
        if bias is not None:
            scores += bias
        probs = masked_softmax(scores, out=scores).astype(value.dtype, copy=False)   # in acc, cast to value dtype
        # probs @ value, products accumulated in float32 (acc) as the GPU kernels do.
        probs = probs.astype(acc, copy=False).reshape(num_kv_heads, group * seqlen, kvlen)  # (Hkv, G·S, K)
        out = matmul(probs, v).reshape(num_heads, seqlen, head_dim)                 # (H, S, Dh)
        attn_output[q_rows] = out.transpose(1, 0, 2)                                # (S, H, Dh)
    return attn_output
