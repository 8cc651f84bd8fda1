"""FasterTransformer decoder `CrossAttention` (fastertransformer-cross-attention.zh.md: DecoderCrossAttentionLayer).

The article splits the layer's forward into three parts; the body below keeps them in order:

    1. QKV generation    Q = input_query . Wq every step; K, V = encoder_output . Wk, Wv at step 1 only,
                         written WITHOUT bias into the caches (the GEMM, then a transpose into the layout)
    2. output generation cross_attention_dispatch -> the masked multi-head attention kernel: at step 1 it adds
                         the K/V bias (and IA3) and writes the result back into the caches; every step it adds
                         the query bias and attends over the first encoder_sequence_length[b] keys
    3. output linear     hidden_features = context . Wo (no bias: the caller adds it)

Facts the article leaves out (where the bias goes, `finished`, q_scaling, cross_attentions, IA3) follow
FasterTransformer's sources. Precision: GEMMs accumulate in float32 and round to T (cuBLAS with float32
compute); bias and IA3 are applied in T; scores, softmax and P.V are float32; context is rounded to T.

The batch-major key cache splits head_dim into chunks of x = 16 bytes / sizeof(T) elements:
K[b, h, d // x, t, d % x]. A kernel thread loads one 16-byte vector (QK_VEC) of a key; in this layout those x
elements are contiguous, and the same chunk of the *next* key sits x elements further on, so the threads
that read one chunk of consecutive keys touch one contiguous run of memory (coalesced), where the plain
[.., t, Dh] layout would put them Dh elements apart.
"""

from __future__ import annotations

import numpy as np

from .blas import matmul

CHUNK_BYTES = 16          # one vectorised load per thread
SUM_EPSILON = 1e-6        # inv_sum = 1 / (sum + 1e-6)


def chunk_elements(dtype) -> int:
    """x of the batch-major key cache: 16 bytes of T (8 for float16, 4 for float32)."""
    return CHUNK_BYTES // np.dtype(dtype).itemsize


# ------------------------------------------------------------------ cache layouts <-> logical [B, H, L, Dh]

def _chunks(a: np.ndarray) -> np.ndarray:
    """a [..., x] seen as [..., 1] opaque 16-byte chunks: NumPy then moves each chunk whole (as the kernels'
    16-byte loads do) instead of x elements at a time, several times faster. The bits are untouched. An array of
    Python objects (the docs lay out labels) is returned as it is."""
    return a if a.dtype.hasobject else a.view(np.dtype((np.void, a.shape[-1] * a.itemsize)))


def split_keys(keys: np.ndarray, x: int) -> np.ndarray:
    """[B, H, L, Dh] -> the batch-major key cache [B, H, Dh/x, L, x] (a new array)."""
    batch, heads, length, dim = keys.shape
    chunked = keys.reshape(batch, heads, length, dim // x, x)              # [B, H, L, Dh/x, x]
    return np.ascontiguousarray(_chunks(chunked).transpose(0, 1, 3, 2, 4)).view(keys.dtype)   # [B, H, Dh/x, L, x]


def join_keys(key_cache: np.ndarray) -> np.ndarray:
    """The batch-major key cache [B, H, Dh/x, L, x] -> [B, H, L, Dh] (a new array)."""
    batch, heads, chunks, length, x = key_cache.shape
    joined = np.ascontiguousarray(_chunks(key_cache).transpose(0, 1, 3, 2, 4))    # [B, H, L, Dh/x, 1 chunk]
    return joined.view(key_cache.dtype).reshape(batch, heads, length, chunks * x)


def logical_caches(key_cache, value_cache, is_batch_major_cache: bool):
    """(keys, values), each [B, H, L, Dh], of either cache layout: views where it allows (V batch-major, both plain)."""
    if is_batch_major_cache:
        return join_keys(key_cache), value_cache                         # V is [B, H, L, Dh] already
    return key_cache.transpose(0, 2, 1, 3), value_cache.transpose(0, 2, 1, 3)   # views of [B, L, H, Dh]


def cache_layout(keys, values, is_batch_major_cache: bool, x: int):
    """Logical [B, H, L, Dh] keys and values laid out as (key_cache, value_cache) of the chosen layout."""
    if is_batch_major_cache:
        return split_keys(keys, x), np.ascontiguousarray(values)
    return (np.ascontiguousarray(keys.transpose(0, 2, 1, 3)),            # [B, L, H, Dh]
            np.ascontiguousarray(values.transpose(0, 2, 1, 3)))


def _store(key_cache, value_cache, keys, values, is_batch_major_cache):
    """Write logical [B, H, L, Dh] keys/values into the caller's caches, in place."""
    x = key_cache.shape[-1] if is_batch_major_cache else 0
    key_cache[...], value_cache[...] = cache_layout(keys, values, is_batch_major_cache, x)


def _gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a . b accumulated in float32 (float64 for a float64 evaluation), rounded to a's dtype."""
    acc = np.float64 if a.dtype == np.float64 else np.float32
    return matmul(a.astype(acc, copy=False), b.astype(acc, copy=False)).astype(a.dtype, copy=False)


def _bias(weight, size, dtype):
    """A DenseWeight's bias, or zeros when it has none (FasterTransformer skips a null bias pointer)."""
    return np.zeros(size, dtype) if weight.bias is None else np.asarray(weight.bias)


def cross_attention(input_query, encoder_output, encoder_sequence_length, step, key_cache, value_cache,
                    finished=None, ia3_tasks=None, context_buf=None, cross_attentions=None, *, weights, head_num,
                    size_per_head, q_scaling=1.0, is_batch_major_cache=True):
    """One decoder step of cross attention. Returns (hidden_features [B, d_model], context [B, H*Dh]).

    key_cache / value_cache (and context_buf, cross_attentions when given) are written in place.
    """
    # spec: ft/input-query, ft/encoder-output, ft/encoder-lengths
    dtype = input_query.dtype
    acc = np.float64 if dtype == np.float64 else np.float32
    batch, mem_len = encoder_output.shape[:2]
    heads, dim = head_num, size_per_head
    hidden = heads * dim
    lengths = np.asarray(encoder_sequence_length)
    done = np.zeros(batch, bool) if finished is None else np.asarray(finished, bool)
    use_ia3 = ia3_tasks is not None

    # ---- 1. QKV generation
    # spec: ft/q-every-step
    # Q every step, without its bias: the attention kernel adds it.
    q_buf = _gemm(input_query, weights.query_weight.kernel)                       # [B, H*Dh]
    # spec: ft/step, ft/kv-from-encoder, ft/kv-once, ft/store-first-step
    if step == 1:
        # K and V of the whole encoder output, once: one GEMM over B*L rows each, no bias.
        memory = encoder_output.reshape(batch * mem_len, -1)                      # [B*L, mem_d_model]
        keys = _gemm(memory, weights.key_weight.kernel).reshape(batch, mem_len, heads, dim)
        values = _gemm(memory, weights.value_weight.kernel).reshape(batch, mem_len, heads, dim)
        # The transpose kernel lays [B, L, H, Dh] out into the cache layout, every row and position.
        _store(key_cache, value_cache, keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3),
               is_batch_major_cache)

    # ---- 2. output generation (cross_attention_dispatch -> masked multi-head attention kernel)
    context = np.zeros((batch, hidden), dtype) if context_buf is None else context_buf
    q_bias = _bias(weights.query_weight, hidden, dtype).reshape(heads, dim)
    k_bias = _bias(weights.key_weight, hidden, dtype).reshape(heads, 1, dim)
    v_bias = _bias(weights.value_weight, hidden, dtype).reshape(heads, 1, dim)
    inv_sqrt_dh = acc(1.0 / (np.sqrt(dim) * q_scaling))
    for b in range(batch):
        # spec: ft/finished
        if done[b]:
            continue      # the kernel returns early: context row, probabilities and cache stay as they are
        n = int(lengths[b])                   # keys past the length are not visited (not masked: not read)
        # spec: ft/read-from-cache, ft/caches
        # Row b of the caches as [1, H, L, Dh]: views where the layout allows, else a copy of this row only.
        keys, values = logical_caches(key_cache[b:b + 1], value_cache[b:b + 1], is_batch_major_cache)
        k, v = keys[0, :, :n], values[0, :, :n]                                   # [H, n, Dh]
        if step == 1:
            # The GEMM left the cache unbiased; the first step biases it (then IA3), in T, and writes it back.
            k, v = k + k_bias, v + v_bias
            if use_ia3:
                task = int(ia3_tasks[b])
                k = k * weights.ia3_key_weight.kernel[task].reshape(heads, 1, dim)
                v = v * weights.ia3_value_weight.kernel[task].reshape(heads, 1, dim)
            keys[0, :, :n], values[0, :, :n] = k, v
            # spec: ft/store-first-step
            _store(key_cache[b:b + 1], value_cache[b:b + 1], keys, values, is_batch_major_cache)
        q = q_buf[b].reshape(heads, dim) + q_bias                                 # [H, Dh], in T
        # Scores in float32, scaled by 1 / (sqrt(Dh) * q_scaling): each head's query row against its keys.
        q_row = q.astype(acc).reshape(heads, 1, dim)                              # [H, 1, Dh]
        qk = matmul(q_row, k.astype(acc, copy=False).swapaxes(-1, -2))[:, 0] * inv_sqrt_dh   # [H, n]
        logits = np.exp(qk - qk.max(axis=-1, keepdims=True))
        inv_sum = acc(1.0) / (logits.sum(axis=-1, keepdims=True) + acc(SUM_EPSILON))
        probs = logits * inv_sum                                                  # [H, n]
        if cross_attentions is not None:
            cross_attentions[b, :, step - 1, :n] = probs                          # row step - 1; [n, L) untouched
        out = matmul(probs.reshape(heads, 1, n), v.astype(acc, copy=False))[:, 0]   # [H, 1, n] @ [H, n, Dh]
        context[b] = out.reshape(hidden).astype(dtype)

    # ---- 3. output linear: over every row, finished ones too (their context row is whatever it held)
    # spec: ft/output-linear, ft/hidden-features
    hidden_features = _gemm(context, weights.attention_output_weight.kernel)     # [B, d_model], no bias
    return hidden_features, context
