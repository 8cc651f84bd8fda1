"""ONNX `Attention` (opsets 23, 24, 25's windows) on the GPU, through the shared online-softmax core.

What ONNX adds to the core is one score function and its key range:
  - the mask is read in place: a bool or float tensor right-aligned against (batch, q_num_heads, q_seq,
    total_seq) with stride 0 on broadcast axes, so no broadcast copy exists; columns past its last dim
    are padding (hidden);
  - causal, window and nonpad bounds are computed from indices: query i sits at position offset_b + i,
    offset_b = past length, or nonpad_kv_seqlen[b] - q_seq, or 0;
  - softcap is applied to q.k*scale before the bias (so a -inf mask stays -inf), and a hidden key's
    score is -inf without ever using q.k (NaN or inf in a masked key cannot leak into the row).
3-D inputs are addressed through strides, never transposed. With past_key the present tensors are
written first (one copy kernel) and attention reads them; without past, attention reads K and V where
they are. qk_matmul_output needs the whole score matrix, so it has its own kernel, run only when asked.
bfloat16: numba has no bfloat16 arithmetic (nor does the simulator), so bfloat16 NumPy inputs are
widened to float32 on the host, computed in float32, and the outputs rounded back to bfloat16.
"""

from __future__ import annotations

import math
from collections import namedtuple
from functools import cache

import numpy as np
from numba import cuda

from ._attention_core import make_attention_kernel, plan_tiles
from ._cache import cache_source, make_cache_access, token_head_item
from ._launch import OFFSET_PAGE, caller_stream, ceil_div, element_strides, empty_like_kind, flat, launch, to_kind
from ._numerics import keep_float32

# What ONNX's score needs besides q.k: the mask read in place (element (b, h, i, j) at b*m_sb + h*m_sh + i*m_si + j,
# strides 0 on broadcast axes, mask_cols columns, mask_kind 0 none / 1 bool / 2 float), causal and window bounds,
# the alignment inputs (past_len, nonpad_kv_seqlen), softcap, and the query row starts (b * q_seq).
OnnxScoreArgs = namedtuple("OnnxScoreArgs", "mask m_sb m_sh m_si mask_cols mask_kind is_causal left right past_len "
                                            "nonpad has_nonpad softcap row_starts")


def make_onnx_score(acc_t):
    NEG_INF = acc_t(-math.inf)

    @cuda.jit(device=True, inline="always")
    def offset_of(args, b, seqlen):
        """Position of query 0 among the keys: past length, nonpad_kv_seqlen[b] - q_seq, or 0."""
        if args.past_len > 0:
            return args.past_len
        if args.has_nonpad != 0:
            return args.nonpad[b] - seqlen
        return 0

    @cuda.jit(device=True, inline="always")
    # spec: onnx/mask-kinds, onnx/mask-short, onnx/is-causal-top-left, onnx/nonpad
    def bias(args, b, h, i, j, seqlen, kvlen):
        """The additive bias of (query i, key j): mask value, or -inf when hidden."""
        position = offset_of(args, b, seqlen) + i
        if args.is_causal != 0 and j > position:
            return NEG_INF
        left, right = args.left, args.right
        if (left >= 0 and j < position - left) or (right >= 0 and j > position + right):
            return NEG_INF
        if args.has_nonpad != 0 and j >= args.nonpad[b]:
            return NEG_INF
        if args.mask_kind == 0:
            return acc_t(0.0)
        if j >= args.mask_cols:                             # a shorter mask is padded with False / -inf
            return NEG_INF
        # Widen first: testing a float16 value's truth directly is IR that NVVM rejects.
        m = acc_t(args.mask[b * args.m_sb + h * args.m_sh + i * args.m_si + j])
        if args.mask_kind == 1:                             # bool: True = attend
            return acc_t(0.0) if m != 0 else NEG_INF
        return m

    @cuda.jit(device=True, inline="always")
    # spec: onnx/softcap, onnx/pattern
    def capped(args, qk):
        softcap = args.softcap
        if softcap > 0:
            return softcap * math.tanh(qk / softcap)
        return qk

    @cuda.jit(device=True, inline="always")
    def score(args, qk, b, h, i, j, seqlen, kvlen):
        m = bias(args, b, h, i, j, seqlen, kvlen)
        if m == NEG_INF:
            return NEG_INF
        return capped(args, qk) + m

    @cuda.jit(device=True, inline="always")
    def key_range(args, b, i_first, i_last, seqlen, kvlen):
        offset = offset_of(args, b, seqlen)
        lo, hi = 0, kvlen
        if args.has_nonpad != 0:
            hi = min(hi, args.nonpad[b])
        if args.is_causal != 0:
            hi = min(hi, offset + i_last + 1)
        if args.right >= 0:
            hi = min(hi, offset + i_last + args.right + 1)
        if args.left >= 0:
            lo = max(lo, offset + i_first - args.left)
        return max(lo, 0), max(hi, 0)

    return score, key_range, bias, capped


def _acc_type(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


@cache
def _attention_kernel(dtype, head_dim, v_head_dim, q_heads, kv_heads, q_len):
    acc_t = _acc_type(dtype)
    row_offsets, load = make_cache_access(0, 1, keep_float32, keep_float32, acc_t)
    score, key_range, _, _ = make_onnx_score(acc_t)
    heads_per_block, q_tile, key_tile = plan_tiles(q_heads, kv_heads, q_len, head_dim, v_head_dim,
                                                   elem_bytes=np.dtype(acc_t).itemsize)
    kernel = make_attention_kernel(row_offsets, load, score, key_range, head_dim_k=head_dim, head_dim_v=v_head_dim,
                                   heads_per_block=heads_per_block, q_tile=q_tile, key_tile=key_tile,
                                   group=q_heads // kv_heads, acc_dtype=acc_t)
    return kernel, heads_per_block, q_tile


@cache
# spec: onnx/qk-output-modes
def _qk_kernels(dtype, head_dim, mode):
    """Kernels for qk_matmul_output (batch, q_heads, q_seq, total_seq): one thread per element writes
    mode 0: q.k*scale, 1: softcapped, 2: + bias (modes 3 too); then, for mode 3 only, one thread per row
    turns its row into softmax probabilities in place (a row with no visible key gives zeros)."""
    acc_t = _acc_type(dtype)
    row_offsets, load = make_cache_access(0, 1, keep_float32, keep_float32, acc_t)
    _, _, bias, capped = make_onnx_score(acc_t)
    NEG_INF = acc_t(-math.inf)

    @cuda.jit
    def scores_kernel(q_geom, k_src, group, seqlen, kvlen, args, sm_scale, out):
        q, q_sb, q_si, q_sh = q_geom
        b, i, h, t = token_head_item(args.row_starts, out.shape[1], kvlen)
        if i < 0:
            return
        row, sc_row = row_offsets(k_src, b, t, h // group)
        q_row = b * q_sb + i * q_si + h * q_sh
        dot = acc_t(0.0)
        for d in range(head_dim):
            dot += acc_t(q[q_row + d]) * load(k_src, row, sc_row, d)
        s = dot * sm_scale
        if mode >= 1:
            s = capped(args, s)
        if mode >= 2:
            s = s + bias(args, b, h, i, t, seqlen, kvlen)
        out[b, h, i, t] = s

    @cuda.jit
    def softmax_rows_kernel(starts, kvlen, out):
        b, i, h, _ = token_head_item(starts, out.shape[1], 1)
        if i < 0:
            return
        row_max = NEG_INF
        for t in range(kvlen):
            row_max = max(row_max, acc_t(out[b, h, i, t]))
        total = acc_t(0.0)
        if row_max != NEG_INF:
            for t in range(kvlen):
                total += math.exp(acc_t(out[b, h, i, t]) - row_max)
        for t in range(kvlen):
            out[b, h, i, t] = math.exp(acc_t(out[b, h, i, t]) - row_max) / total if total > 0 else acc_t(0.0)

    return scores_kernel, softmax_rows_kernel


@cache
def _copy_kernel(dtype):
    """Kernel: present[b, h, t, :] = past[b, h, t, :] for t < past_len, else K[b, t - past_len, h, :]."""
    row_offsets, load = make_cache_access(0, 1, keep_float32, keep_float32, _acc_type(dtype))

    @cuda.jit
    def copy_kernel(past_src, new_src, past_len, starts, num_heads, head_dim, present):
        b, t, h, d = token_head_item(starts, num_heads, head_dim)
        if t < 0:
            return
        src, t_src = (past_src, t) if t < past_len else (new_src, t - past_len)
        row, sc_row = row_offsets(src, b, t_src, h)
        present[b, h, t, d] = load(src, row, sc_row, d)

    return copy_kernel


def _source(x, heads, batch, like):
    """Cache source over a 3-D (B, T, H*D) or 4-D (B, H, T, D) K/V/past tensor."""
    zeros = to_kind(like, np.zeros((batch, 1), np.int64))
    if x.ndim == 3:
        x = x.reshape(x.shape[0], x.shape[1], heads, x.shape[2] // heads)
        return cache_source(x, None, zeros, OFFSET_PAGE, "B T H D")
    return cache_source(x, None, zeros, OFFSET_PAGE, "B H T D")


def _q_geometry(x, heads):
    """(s_b, s_i, s_h) element strides of a 3-D (B, S, H*D) or 4-D (B, H, S, D) tensor."""
    if x.ndim == 3:
        batch, seq, hidden = x.shape
        return np.int64(seq * hidden), np.int64(hidden), np.int64(hidden // heads)
    batch, h, seq, dim = x.shape
    return np.int64(h * seq * dim), np.int64(dim), np.int64(seq * dim)


# spec: onnx/cache-inside, onnx/present-shape
def _present(new, past, heads, batch, like, threads, stream):
    """present = concat(past, new) as (B, H, T, D); a 4-D `new` without past is returned as is."""
    if past is None and new.ndim == 4:
        return new, _source(new, heads, batch, like)
    size = new.shape[-1] // heads if new.ndim == 3 else new.shape[-1]
    past_len = 0 if past is None else past.shape[2]
    new_len = new.shape[1] if new.ndim == 3 else new.shape[2]
    total = past_len + new_len
    present = empty_like_kind(like, (batch, heads, total, size), new.dtype)
    new_src = _source(new, heads, batch, like)
    past_src = new_src if past is None else _source(past, heads, batch, like)
    starts = to_kind(like, np.arange(batch + 1, dtype=np.int64) * total)
    grid = (max(1, ceil_div(total * heads * size, threads)), batch)
    launch(_copy_kernel(np.dtype(new.dtype).str), grid, threads, stream, past_src, new_src, np.int64(past_len),
           starts, heads, size, present)
    return present, _source(present, heads, batch, like)


def _mask_args(attn_mask, like):
    """(mask, s_b, s_h, s_i, cols, kind): right-aligned element strides, 0 on broadcast axes."""
    if attn_mask is None:
        return (to_kind(like, np.zeros(1, np.float32)), *(np.int64(0),) * 4, np.int64(0))
    shape = (1,) * (4 - attn_mask.ndim) + tuple(int(s) for s in attn_mask.shape)
    s_b, s_h, s_i, _ = (0 if extent == 1 else stride for extent, stride in zip(shape, element_strides(shape)))
    kind = 1 if np.dtype(attn_mask.dtype) == np.bool_ else 2
    return (flat(attn_mask), np.int64(s_b), np.int64(s_h), np.int64(s_i), np.int64(shape[-1]), np.int64(kind))


def onnx_attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *,
                   is_causal=0, kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0, scale=None,
                   softcap=0.0, softmax_precision=None, left_window_size=-1, right_window_size=-1,
                   return_qk_matmul_output=False, threads=128):
    """(Y, present_key, present_value, qk_matmul_output or None). Inputs are validated by `cacheattn`.

    softmax_precision is accepted and the softmax runs in float32 (float64 for float64 inputs).
    """
    attrs = dict(is_causal=is_causal, kv_num_heads=kv_num_heads, q_num_heads=q_num_heads,
                 qk_matmul_output_mode=qk_matmul_output_mode, scale=scale, softcap=softcap,
                 left_window_size=left_window_size, right_window_size=right_window_size,
                 return_qk_matmul_output=return_qk_matmul_output, threads=threads)
    if np.dtype(Q.dtype).name == "bfloat16":
        return _bfloat16_via_float32(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, **attrs)
    return _attention(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, **attrs)


def _attention(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, *, is_causal, kv_num_heads, q_num_heads,
               qk_matmul_output_mode, scale, softcap, left_window_size, right_window_size, return_qk_matmul_output,
               threads):
    stream = caller_stream(Q, K)
    four_d = Q.ndim == 4
    batch = Q.shape[0]
    q_heads = Q.shape[1] if four_d else q_num_heads
    kv_heads = K.shape[1] if four_d else kv_num_heads
    q_len = Q.shape[2] if four_d else Q.shape[1]
    head_dim = Q.shape[-1] if four_d else Q.shape[-1] // q_heads
    v_dim = V.shape[-1] if four_d else V.shape[-1] // kv_heads

    present_key, k_src = _present(K, past_key, kv_heads, batch, Q, threads, stream)
    present_value, v_src = _present(V, past_value, kv_heads, batch, Q, threads, stream)
    total = present_key.shape[2]
    past_len = 0 if past_key is None else past_key.shape[2]

    root = np.dtype(Q.dtype).type(math.sqrt(1 / math.sqrt(head_dim) if scale is None else scale))
    sm_scale = _acc_type(Q.dtype)(float(root) ** 2)     # sqrt(scale), held in Q's dtype, on each side
    nonpad = nonpad_kv_seqlen if nonpad_kv_seqlen is not None else to_kind(Q, np.zeros(batch, np.int64))
    starts = to_kind(Q, np.arange(batch + 1, dtype=np.int64) * q_len)
    args = OnnxScoreArgs(*_mask_args(attn_mask, Q), is_causal=np.int64(is_causal), left=np.int64(left_window_size),
                         right=np.int64(right_window_size), past_len=np.int64(past_len), nonpad=nonpad,
                         has_nonpad=np.int64(nonpad_kv_seqlen is not None), softcap=_acc_type(Q.dtype)(softcap),
                         row_starts=starts)

    y_shape = (batch, q_heads, q_len, v_dim) if four_d else (batch, q_len, q_heads * v_dim)
    Y = empty_like_kind(Q, y_shape, Q.dtype)
    kernel, heads_per_block, q_tile = _attention_kernel(np.dtype(Q.dtype).str, head_dim, v_dim, q_heads, kv_heads,
                                                        min(q_len, 16))   # one kernel for every length past 16
    zero_starts = to_kind(Q, np.zeros(batch, np.int64))
    lens = to_kind(Q, np.full(batch, q_len, np.int64)), to_kind(Q, np.full(batch, total, np.int64))
    grid = (max(1, ceil_div(q_len, q_tile)), q_heads // heads_per_block, batch)
    launch(kernel, grid, threads, stream, (flat(Q), zero_starts, *_q_geometry(Q, q_heads)),
           (flat(Y), zero_starts, *_q_geometry(Y, q_heads)), *lens, k_src, v_src, args, sm_scale)

    qk = None
    if return_qk_matmul_output:
        qk = empty_like_kind(Q, (batch, q_heads, q_len, total), Q.dtype)
        scores_kernel, softmax_rows_kernel = _qk_kernels(np.dtype(Q.dtype).str, head_dim, qk_matmul_output_mode)
        grid = (max(1, ceil_div(q_len * q_heads * total, threads)), batch)
        launch(scores_kernel, grid, threads, stream, (flat(Q), *_q_geometry(Q, q_heads)), k_src,
               np.int64(q_heads // kv_heads), np.int64(q_len), np.int64(total), args, sm_scale, qk)
        if qk_matmul_output_mode == 3:
            grid = (max(1, ceil_div(q_len * q_heads, threads)), batch)
            launch(softmax_rows_kernel, grid, threads, stream, starts, np.int64(total), qk)
    return Y, present_key, present_value, qk


def _bfloat16_via_float32(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, **attrs):
    """bfloat16 NumPy inputs: compute in float32, round the outputs back to bfloat16."""
    if not isinstance(Q, np.ndarray):
        raise TypeError("Q: bfloat16 runs on the kernels only from NumPy arrays (simulator); numba has no "
                        "bfloat16 arithmetic. Pass float16/float32 GPU arrays, or backend='reference'.")
    bf16 = Q.dtype

    def widen(x):
        return None if x is None else x if x.dtype == np.bool_ else x.astype(np.float32)

    # sqrt(scale) is held in Q's dtype on each side, as the reference does: round it to bfloat16 first.
    head_dim = Q.shape[-1] if Q.ndim == 4 else Q.shape[-1] // attrs["q_num_heads"]
    scale = 1 / math.sqrt(head_dim) if attrs["scale"] is None else attrs["scale"]
    attrs["scale"] = float(np.asarray(math.sqrt(scale)).astype(bf16)) ** 2
    outs = _attention(widen(Q), widen(K), widen(V), widen(attn_mask), widen(past_key), widen(past_value),
                      nonpad_kv_seqlen, **attrs)
    return tuple(None if o is None else o.astype(bf16) for o in outs)
