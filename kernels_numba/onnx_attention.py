"""ONNX `Attention` (opsets 23, 24, 25's windows) on the GPU, through the shared online-softmax core.

What ONNX adds to the core is one score function and its key range:
  - the mask is read in place: a bool or float tensor right-aligned against (batch, q_num_heads, q_seq,
    total_seq) with stride 0 on broadcast axes, so no broadcast copy exists; columns past its last dim
    are padding (hidden);
  - causal, window and nonpad bounds are computed from indices: query i sits at position offset_b + i,
    offset_b = past length, or nonpad_kv_seqlen[b] - q_seq, or 0;
  - softcap is applied to q.k*scale before the bias (so a -inf mask stays -inf), and a hidden key's
    score is -inf without ever using q.k (NaN or inf in a masked key cannot leak into the row).
3-D inputs are addressed through strides, never transposed. With past_key the present tensors must be written:
rungs 3 and 4 read past_key / past_value and K / V where they are (a key walker: keys 0 .. past - 1 from the
past, then the call's own) and, where one block reads each key once (a decode's GQA group per block, every key
visible), write each row into present as they load it, so present costs no second read of the past. Otherwise
one copy kernel writes present, and rung 1 reads it. Without past, attention reads K and V where they are.
qk_matmul_output needs the whole score matrix, so it has its own kernel, run only when asked.

Rungs 3 and 4 (`_attention_vector`): lane groups per key with 16-byte vector loads where every row of both
sources is aligned (else one load per element), the same score and key range as rung 1; rung 4 splits each
block's keys and `_split_k.combine_kernel` finishes. They accumulate in float32, so float64 runs on rung 1.
Rung 5 (`_attention_mma`, float16) walks the keys as rung 3 does; rung 6 (`_attention_flash`, float16 or bfloat16
bits) copies K/V tiles from present (or a 4-D K / V without past), whose contiguous rows it reads as one page.
bfloat16: numba has no bfloat16 arithmetic (nor does the simulator), so the kernels take a bfloat16 tensor as its
bits (uint16: an ml_dtypes array's view, or the `bits` of a `cacheattn.bfloat16` GPU tensor), widen each element
with a shift (exact) and compute in float32, and store each result rounded to nearest even
(`_numerics.element_io`); rungs 1, 3 and 4 and the qk_matmul_output kernels, no float32 copy of any input.
"""

from __future__ import annotations

import math
from collections import namedtuple
from functools import cache

import numpy as np
from numba import cuda

from ._attention_core import make_attention_kernel, plan_tiles
from ._attention_flash import make_flash_attention_kernel, rows_per_block
from ._attention_flash import why_not as flash_why_not
from ._attention_mma import make_mma_attention_kernel, plan_mma_rows
from ._attention_vector import keys_per_step, make_vector_attention_kernel, plan_vector_rows
from ._cache import _address, cache_source, make_cache_access, token_head_item, vector_loads_ok
from ._launch import (
    OFFSET_PAGE,
    bfloat16_bits,
    bfloat16_like,
    caller_stream,
    ceil_div,
    element_strides,
    empty_like_kind,
    flat,
    launch,
    to_kind,
)
from ._numerics import BFLOAT16_BITS, bits_io, element_io, keep_float32, to_float64, widen_bfloat16
from ._split_k import choose_splits, combine_kernel
from ._vector import VECTOR_BYTES, float_from_bits, half_from_bits, load16

# What ONNX's score needs besides q.k: the mask read in place (element (b, h, i, j) at b*m_sb + h*m_sh + i*m_si + j,
# strides 0 on broadcast axes, mask_cols columns, mask_kind 0 none / 1 bool / 2 float: Q's dtype, bfloat16 as its bits),
# causal and window bounds, the alignment inputs (past_len, nonpad_kv_seqlen), softcap, and the query row starts
# (b * q_seq).
OnnxScoreArgs = namedtuple("OnnxScoreArgs", "mask m_sb m_sh m_si mask_cols mask_kind is_causal left right past_len "
                                            "nonpad has_nonpad softcap row_starts")


def make_onnx_score(acc_t, bfloat16: bool = False):
    """(score, key_range, bias, capped) device functions over OnnxScoreArgs; bfloat16: a float mask holds bfloat16
    bits (decided when the kernel is built, so the other dtypes' code is what it was)."""
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
        raw = args.mask[b * args.m_sb + h * args.m_sh + i * args.m_si + j]
        if bfloat16:                                        # a bool mask, or a float one as bfloat16 bits
            if args.mask_kind == 1:
                return acc_t(0.0) if raw != 0 else NEG_INF
            return acc_t(widen_bfloat16(raw))
        m = acc_t(raw)
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
    """float64 for float64 elements, else float32; dtype a NumPy dtype or "bfloat16" (bits)."""
    return np.float64 if element_io(dtype)[0] is to_float64 else np.float32


def _kind(x) -> str:
    """The kernels' key for x's elements: "bfloat16" for bfloat16 bits (uint16), else its dtype's str."""
    return BFLOAT16_BITS if np.dtype(x.dtype) == np.uint16 else np.dtype(x.dtype).str


def _itemsize(dtype) -> int:
    return 2 if dtype == BFLOAT16_BITS else np.dtype(dtype).itemsize


def _alloc_dtype(x):
    """What a new tensor of x's elements is allocated as: "bfloat16" (bits, poisoned as a bfloat16 NaN) for
    bfloat16 bits, else x's dtype (`_launch.empty_like_kind`)."""
    return BFLOAT16_BITS if _kind(x) == BFLOAT16_BITS else x.dtype


def _host_type(kind):
    """The scalar type a host value of these elements has (bfloat16's from ml_dtypes)."""
    if kind == BFLOAT16_BITS:
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(kind).type


@cache
def _attention_kernel(dtype, head_dim, v_head_dim, q_heads, kv_heads, q_len):
    acc_t = _acc_type(dtype)
    widen, narrow = bits_io(dtype)
    row_offsets, load = make_cache_access(0, 1, keep_float32, keep_float32, acc_t, element=widen)
    score, key_range, _, _ = make_onnx_score(acc_t, dtype == BFLOAT16_BITS)
    heads_per_block, q_tile, key_tile = plan_tiles(q_heads, kv_heads, q_len, head_dim, v_head_dim,
                                                   elem_bytes=np.dtype(acc_t).itemsize)
    kernel = make_attention_kernel(row_offsets, load, score, key_range, head_dim_k=head_dim, head_dim_v=v_head_dim,
                                   heads_per_block=heads_per_block, q_tile=q_tile, key_tile=key_tile,
                                   group=q_heads // kv_heads, acc_dtype=acc_t, widen_q=widen, narrow_out=narrow)
    return kernel, heads_per_block, q_tile


# Where the keys of one of K / V live for rungs 3 and 4: keys 0 .. past_len - 1 in `past` (B, kv_heads, past, size),
# key t of head h of batch b at b*p_sb + h*p_sh + t*p_st; keys past_len .. in the call's own `new` tensor, 4-D
# (B, kv_heads, S, size) or 3-D (B, S, kv_heads * size), at b*n_sb + (t - past_len)*n_st + h*n_sh. Both flat;
# without a past, `past` is `new` and past_len 0. write_present 1: each loaded row is also stored at
# b*r_sb + h*r_sh + t*r_st of `present` (flat; `present_words` the same memory as uint32, for whole-chunk stores).
OnnxKV = namedtuple("OnnxKV", "past new past_len p_sb p_sh p_st n_sb n_st n_sh "
                              "write_present present present_words r_sb r_sh r_st")


@cuda.jit(device=True, inline="always")
def _kv_begin(src, b, t0):
    return t0


# spec: onnx/cache-inside
@cuda.jit(device=True, inline="always")
def _kv_at(src, b, t0, j, h):
    """(element index, code) of key t0 + j of kv head h: the past's keys come first. The code's bit 0 says which
    tensor holds the row (0 past, 1 new); the rest is 1 + the row's element index in present when the load
    should store it there, else 0."""
    t = t0 + j
    code = np.int64(0)
    if src.write_present != 0:
        code = 2 * (b * src.r_sb + h * src.r_sh + t * src.r_st + 1)
    if t < src.past_len:
        return b * src.p_sb + h * src.p_sh + t * src.p_st, code
    return b * src.n_sb + (t - src.past_len) * src.n_st + h * src.n_sh, code + 1


@cuda.jit(device=True, inline="always")
def _kv_advance(src, t0, step):
    return t0 + step


@cuda.jit(device=True, inline="always")
def _kv_row(src, b, t, h):
    """Key t, never stored: the vector kernel reads it in place of keys past the visible range."""
    row, code = _kv_at(src, b, t, 0, h)
    return row, code & 1


# The vector kernel's key walker over OnnxKV: the state is the key index itself (no pages to step through).
KV_WALKER = (_kv_begin, _kv_at, _kv_advance)


def make_onnx_chunk_load(elements: int, vector: bool, bfloat16: bool = False):
    """load_chunk(src, row, code, d0, regs, at, dims) of the vector kernel over an OnnxKV: elements d0 ..
    d0 + elements - 1 (those below dims) of a row of `past` (code bit 0 clear) or `new` (set) into regs[at:], as
    float32 (what rung 1 loads: no rounding), and stored unchanged into present where the code says (`_kv_at`).
    vector: one 16-byte load (8 float16 or 4 float32 values) unpacked in registers, stored as 4 words.
    bfloat16: the tensors hold bfloat16 bits, widened by a shift."""
    bits = 128 // elements
    per_word = 32 // bits
    field_mask = (1 << bits) - 1

    @cuda.jit(device=True, inline="always")
    def load_chunk(src, row, code, d0, regs, at, dims):
        data = src.new if code & 1 else src.past
        target = (code >> 1) - 1                     # the row's element index in present; -1: not stored
        if not vector:
            for e in range(elements):
                if d0 + e < dims:
                    value = data[row + d0 + e]
                    regs[at + e] = widen_bfloat16(value) if bfloat16 else np.float32(value)
                    if target >= 0:
                        src.present[target + d0 + e] = value
            return
        loaded = load16(data, row + d0)
        if target >= 0:
            word = (target + d0) // per_word
            for j in range(VECTOR_BYTES // 4):
                src.present_words[word + j] = loaded[j]
        for j in range(VECTOR_BYTES // 4):
            for k in range(per_word):               # little-endian: element e is the e-th field from bit 0
                field = (loaded[j] >> (bits * k)) & field_mask
                if bits == 32:
                    regs[at + j * per_word + k] = float_from_bits(field)
                elif bfloat16:
                    regs[at + j * per_word + k] = widen_bfloat16(field)
                else:
                    regs[at + j * per_word + k] = half_from_bits(field)

    return load_chunk


def vector_rows(q_heads, kv_heads, q_len, head_dim, v_dim, itemsize, threads):
    """(heads_per_block, q_tile, keys a block takes per step) of the rung-3 kernel for this call."""
    chunk, width = VECTOR_BYTES // itemsize, max(head_dim, v_dim)
    heads_per_block, q_tile = plan_vector_rows(q_heads, kv_heads, q_len, width, chunk, threads // 32)
    return heads_per_block, q_tile, keys_per_step(width, chunk, threads // 32)


@cache
def _vector_kernel(dtype, head_dim, v_dim, q_heads, kv_heads, q_len, threads, vector, partials=False):
    """Rung 3's kernel (rung 4's split kernel with partials) for float16 / float32 inputs or bfloat16 bits."""
    itemsize = _itemsize(dtype)
    bfloat16 = dtype == BFLOAT16_BITS
    narrow = bits_io(dtype)[1]
    score, key_range, _, _ = make_onnx_score(np.float32, bfloat16)
    heads_per_block, q_tile, _ = vector_rows(q_heads, kv_heads, q_len, head_dim, v_dim, itemsize, threads)
    chunk_load = make_onnx_chunk_load(VECTOR_BYTES // itemsize, vector, bfloat16)
    kernel = make_vector_attention_kernel(_kv_row, chunk_load, score,
                                          key_range, head_dim_k=head_dim, head_dim_v=v_dim,
                                          chunk=VECTOR_BYTES // itemsize, heads_per_block=heads_per_block,
                                          q_tile=q_tile, group=q_heads // kv_heads, warps=threads // 32,
                                          partials=partials, walker=KV_WALKER,
                                          query=_bfloat16_query if bfloat16 else None, narrow_out=narrow)
    return kernel, heads_per_block, q_tile


@cuda.jit(device=True, inline="always")
def _bfloat16_query(q_geom, b, i, h, d):
    """Element d of query i, head h, widened from bfloat16 bits (the vector kernel's `query`)."""
    q, q_starts, q_sb, q_si, q_sh = q_geom
    return widen_bfloat16(q[b * q_sb + (q_starts[b] + i) * q_si + h * q_sh + d])


@cache
def _mma_kernel(head_dim, v_dim, q_heads, kv_heads, q_len, threads, vector):
    """Rung 5's kernel (tensor cores, float16 Q) over the same key walk and 16-byte chunks as rung 3: K and V
    staged through shared memory from the past and the call's own K / V, read where they are."""
    score, key_range, _, _ = make_onnx_score(np.float32)
    heads_per_block, positions, row_tiles = plan_mma_rows(q_heads, kv_heads, q_len, threads // 32,
                                                         max(head_dim, v_dim))
    kernel = make_mma_attention_kernel(_kv_row, make_onnx_chunk_load(VECTOR_BYTES // 2, vector), score, key_range,
                                       head_dim_k=head_dim, head_dim_v=v_dim, chunk=VECTOR_BYTES // 2,
                                       heads_per_block=heads_per_block, positions=positions, row_tiles=row_tiles,
                                       group=q_heads // kv_heads, warps=threads // 32, q_registers=True)
    return kernel, heads_per_block, positions * row_tiles


@cache
def _flash_kernel(kind, head_dim, q_heads, kv_heads, threads):
    """Rung 6's kernel (`_attention_flash`: 64 query rows a block, K/V tiles copied by cp.async) over present (or
    a 4-D K / V without past), contiguous rows read as one page that never ends; ONNX's score and key range as
    rung 5's; kind "float16" or bfloat16 bits (a float mask then holds bfloat16 bits too)."""
    bfloat16 = kind == BFLOAT16_BITS
    score, key_range, _, _ = make_onnx_score(np.float32, bfloat16)
    return make_flash_attention_kernel(score, key_range, head_dim=head_dim, group=q_heads // kv_heads,
                                       warps=threads // 32, dtype="bfloat16" if bfloat16 else "float16")


def flash_refusal(kind, head_dim, v_dim, k_src, v_src, threads) -> str:
    """Why rung 6 cannot take this launch ('' when it can): it multiplies float16 or bfloat16 (the plan checked
    that), one head size for K and V, and copies whole 16-byte chunks of rows as they are, so every row of present
    must be 16-byte aligned (known here only)."""
    if kind not in (np.dtype(np.float16).str, BFLOAT16_BITS):
        return f"a {np.dtype(kind).name} query (rung 6 multiplies float16 or bfloat16)"
    if head_dim != v_dim:
        return f"head_size {head_dim} and v_head_size {v_dim} differ (rung 6 holds one head size)"
    # the alignment test of the 16-byte loads, on the rows' bytes (bfloat16 bits as float16 of the same size)
    if not all(vector_loads_ok(src._replace(data=src.data.view(np.float16)), 0, head_dim) for src in (k_src, v_src)):
        return "rows of K / V (present) not 16-byte aligned"
    return flash_why_not(head_dim, threads)


def _kv_source(new, past, heads, present=None):
    """OnnxKV over past (or None) and the call's own K or V, 3-D or 4-D, read where they are; with `present`
    (B, heads, past + S, size), every row loaded is stored there too."""
    i64 = np.int64
    if present is None:
        stored = (i64(0), flat(new), flat(new).view(np.uint8)[:4].view(np.uint32), i64(0), i64(0), i64(0))
    else:
        _, _, total, size = present.shape
        stored = (i64(1), flat(present), flat(present).view(np.uint32), i64(heads * total * size), i64(total * size),
                  i64(size))
    if new.ndim == 3:
        batch, seq, hidden = new.shape
        n_sb, n_st, n_sh = seq * hidden, hidden, hidden // heads
    else:
        batch, _, seq, size = new.shape
        n_sb, n_st, n_sh = heads * seq * size, size, seq * size
    if past is None:
        return OnnxKV(flat(new), flat(new), i64(0), i64(0), i64(0), i64(0), i64(n_sb), i64(n_st), i64(n_sh), *stored)
    _, _, past_len, size = past.shape
    return OnnxKV(flat(past), flat(new), i64(past_len), i64(heads * past_len * size), i64(past_len * size), i64(size),
                  i64(n_sb), i64(n_st), i64(n_sh), *stored)


def _walked_sources(K, V, past_key, past_value, kv_heads, head_dim, v_dim, present):
    """(k, v, vector) for rungs 3 to 5: the OnnxKV walks of K and V (storing into present = (present_key,
    present_value), or (None, None)), and whether both read in 16-byte loads."""
    k_kv, v_kv = _kv_source(K, past_key, kv_heads, present[0]), _kv_source(V, past_value, kv_heads, present[1])
    return k_kv, v_kv, _vector_ok(k_kv, head_dim) and _vector_ok(v_kv, v_dim)


def _vector_ok(src: OnnxKV, size: int) -> bool:
    """Whether every row of both tensors of `src` can be read in 16-byte loads: aligned data, rows of whole
    16-byte chunks, every stride a multiple of 16 bytes (decided on the host, once per launch)."""
    itemsize = src.new.dtype.itemsize
    strides = (src.p_sb, src.p_sh, src.p_st, src.n_sb, src.n_st, src.n_sh)
    return (size * itemsize) % VECTOR_BYTES == 0 and all(_address(x) % VECTOR_BYTES == 0 for x in (src.past, src.new)) \
        and all((int(x) * itemsize) % VECTOR_BYTES == 0 for x in strides)


@cache
# spec: onnx/qk-output-modes
def _qk_kernels(dtype, head_dim, mode):
    """Kernels for qk_matmul_output (batch, q_heads, q_seq, total_seq): one thread per element writes
    mode 0: q.k*scale, 1: softcapped, 2: + bias (modes 3 too); then, for mode 3 only, one thread per row
    turns its row into softmax probabilities in place (a row with no visible key gives zeros)."""
    acc_t = _acc_type(dtype)
    widen, narrow = element_io(dtype)
    row_offsets, load = make_cache_access(0, 1, keep_float32, keep_float32, acc_t, element=widen)
    _, _, bias, capped = make_onnx_score(acc_t, dtype == BFLOAT16_BITS)
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
            dot += acc_t(widen(q[q_row + d])) * load(k_src, row, sc_row, d)
        s = dot * sm_scale
        if mode >= 1:
            s = capped(args, s)
        if mode >= 2:
            s = s + bias(args, b, h, i, t, seqlen, kvlen)
        out[b, h, i, t] = narrow(s)

    @cuda.jit
    def softmax_rows_kernel(starts, kvlen, out):
        b, i, h, _ = token_head_item(starts, out.shape[1], 1)
        if i < 0:
            return
        row_max = NEG_INF
        for t in range(kvlen):
            row_max = max(row_max, acc_t(widen(out[b, h, i, t])))
        total = acc_t(0.0)
        if row_max != NEG_INF:
            for t in range(kvlen):
                total += math.exp(acc_t(widen(out[b, h, i, t])) - row_max)
        for t in range(kvlen):
            s = acc_t(widen(out[b, h, i, t]))
            out[b, h, i, t] = narrow(math.exp(s - row_max) / total if total > 0 else acc_t(0.0))

    return scores_kernel, softmax_rows_kernel


@cache
def _copy_kernel(dtype):
    """Kernel: present[b, h, t, :] = past[b, h, t, :] for t < past_len, else K[b, t - past_len, h, :]."""
    widen, narrow = element_io(dtype)
    row_offsets, load = make_cache_access(0, 1, keep_float32, keep_float32, _acc_type(dtype), element=widen)

    @cuda.jit
    def copy_kernel(past_src, new_src, past_len, starts, num_heads, head_dim, present):
        b, t, h, d = token_head_item(starts, num_heads, head_dim)
        if t < 0:
            return
        src, t_src = (past_src, t) if t < past_len else (new_src, t - past_len)
        row, sc_row = row_offsets(src, b, t_src, h)
        present[b, h, t, d] = narrow(load(src, row, sc_row, d))     # bfloat16 round-trips exactly

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
    present = empty_like_kind(like, (batch, heads, total, size), _alloc_dtype(new))
    new_src = _source(new, heads, batch, like)
    past_src = new_src if past is None else _source(past, heads, batch, like)
    starts = to_kind(like, np.arange(batch + 1, dtype=np.int64) * total)
    grid = (max(1, ceil_div(total * heads * size, threads)), batch)
    launch(_copy_kernel(_kind(new)), grid, threads, stream, past_src, new_src, np.int64(past_len),
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
                   return_qk_matmul_output=False, threads=128, rung=1, num_splits=None):
    """(Y, present_key, present_value, qk_matmul_output or None). Inputs are validated by `cacheattn`.

    softmax_precision is accepted and the softmax runs in float32 (float64 for float64 inputs). rung: 1 shared-memory
    tiles, 3 lane groups with vector loads, 4 rung 3 with split-K (num_splits; None: `choose_splits`), 5 tensor
    cores (float16), 6 FlashAttention-2 tiles (float16 or bfloat16; rung 5 for float16, rung 1 for bfloat16 where
    present's rows are not 16-byte aligned or K and V differ in head size: `flash_refusal`); a float64 call runs on
    rung 1 whatever is asked (rungs 3 to 6 accumulate in float32), and so does rung 4 with a 4-D query longer than
    1 (the combine writes (token, head) rows), split once: rung 3.
    """
    attrs = dict(is_causal=is_causal, kv_num_heads=kv_num_heads, q_num_heads=q_num_heads,
                 qk_matmul_output_mode=qk_matmul_output_mode, scale=scale, softcap=softcap,
                 left_window_size=left_window_size, right_window_size=right_window_size,
                 return_qk_matmul_output=return_qk_matmul_output, threads=threads, rung=rung, num_splits=num_splits)
    if np.dtype(Q.dtype).name != "bfloat16":
        return _attention(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, **attrs)
    # bfloat16: every float tensor as its bits (a bool mask as it is), the outputs back as Q's kind of bfloat16
    bits = [x if x is None or np.dtype(x.dtype) == np.bool_ else bfloat16_bits(x)
            for x in (Q, K, V, attn_mask, past_key, past_value)]
    outs = _attention(*bits, nonpad_kv_seqlen, **attrs)
    return tuple(None if o is None else bfloat16_like(Q, o) for o in outs)


def _attention(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, *, is_causal, kv_num_heads, q_num_heads,
               qk_matmul_output_mode, scale, softcap, left_window_size, right_window_size, return_qk_matmul_output,
               threads, rung, num_splits):
    stream = caller_stream(Q, K)
    kind = _kind(Q)
    four_d = Q.ndim == 4
    batch = Q.shape[0]
    q_heads = Q.shape[1] if four_d else q_num_heads
    kv_heads = K.shape[1] if four_d else kv_num_heads
    q_len = Q.shape[2] if four_d else Q.shape[1]
    head_dim = Q.shape[-1] if four_d else Q.shape[-1] // q_heads
    v_dim = V.shape[-1] if four_d else V.shape[-1] // kv_heads

    if np.dtype(Q.dtype) == np.float64:
        rung = 1
    past_len = 0 if past_key is None else past_key.shape[2]
    total = past_len + (K.shape[2] if four_d else K.shape[1])
    every_key_read = nonpad_kv_seqlen is None and left_window_size < 0 and right_window_size < 0 and \
        (not is_causal or past_len + q_len >= total)      # causal: the last query row sees the last key
    if rung in (3, 4) and (past_key is not None or not four_d) and every_key_read and \
            _one_block_per_group(Q, q_heads, kv_heads, q_len, head_dim, v_dim, threads):
        # every key is loaded by the one block of its GQA group: the attention kernel writes present
        present_key = empty_like_kind(Q, (batch, kv_heads, total, head_dim), _alloc_dtype(K))
        present_value = empty_like_kind(Q, (batch, kv_heads, total, v_dim), _alloc_dtype(V))
        k_src, v_src = (_source(x, kv_heads, batch, Q) for x in (present_key, present_value))
        written = (present_key, present_value)
    else:
        present_key, k_src = _present(K, past_key, kv_heads, batch, Q, threads, stream)
        present_value, v_src = _present(V, past_value, kv_heads, batch, Q, threads, stream)
        written = (None, None)

    root = _host_type(kind)(math.sqrt(1 / math.sqrt(head_dim) if scale is None else scale))
    sm_scale = _acc_type(kind)(float(root) ** 2)     # sqrt(scale), held in Q's dtype, on each side
    nonpad = nonpad_kv_seqlen if nonpad_kv_seqlen is not None else to_kind(Q, np.zeros(batch, np.int64))
    starts = to_kind(Q, np.arange(batch + 1, dtype=np.int64) * q_len)
    args = OnnxScoreArgs(*_mask_args(attn_mask, Q), is_causal=np.int64(is_causal), left=np.int64(left_window_size),
                         right=np.int64(right_window_size), past_len=np.int64(past_len), nonpad=nonpad,
                         has_nonpad=np.int64(nonpad_kv_seqlen is not None), softcap=_acc_type(kind)(softcap),
                         row_starts=starts)

    y_shape = (batch, q_heads, q_len, v_dim) if four_d else (batch, q_len, q_heads * v_dim)
    Y = empty_like_kind(Q, y_shape, _alloc_dtype(Q))
    zero_starts = to_kind(Q, np.zeros(batch, np.int64))
    lens = to_kind(Q, np.full(batch, q_len, np.int64)), to_kind(Q, np.full(batch, total, np.int64))
    q_geom, y_geom = (flat(Q), zero_starts, *_q_geometry(Q, q_heads)), (flat(Y), zero_starts, *_q_geometry(Y, q_heads))
    if rung == 6:
        # Rung 6 where its copies can serve (alignment is known here only), else rung 5 for float16, rung 1 for
        # bfloat16: the plan's reason names rung 6, the call runs its fallback.
        if flash_refusal(kind, head_dim, v_dim, k_src, v_src, threads):
            rung = 1 if kind == BFLOAT16_BITS else 5
    if rung == 6:
        kernel = _flash_kernel(kind, head_dim, q_heads, kv_heads, threads)
        grid = (max(1, ceil_div(q_len, rows_per_block(threads))), q_heads, batch)
        bits = (flat(Q).view(np.uint16), zero_starts, *_q_geometry(Q, q_heads))
        out_bits = (flat(Y).view(np.uint16), zero_starts, *_q_geometry(Y, q_heads))
        launch(kernel, grid, threads, stream, bits, out_bits, *lens, k_src, v_src, args, np.float32(sm_scale))
    elif rung == 5:
        k_kv, v_kv, vector = _walked_sources(K, V, past_key, past_value, kv_heads, head_dim, v_dim, (None, None))
        kernel, heads_per_block, q_tile = _mma_kernel(head_dim, v_dim, q_heads, kv_heads, min(q_len, 16), threads,
                                                      vector)
        grid = (max(1, ceil_div(q_len, q_tile)), q_heads // heads_per_block, batch)
        launch(kernel, grid, threads, stream, q_geom, y_geom, *lens, k_kv, v_kv, args, np.float32(sm_scale))
    elif rung in (3, 4):
        _attend_vector(rung, num_splits, Q, K, V, past_key, past_value, written, Y, q_geom, y_geom, lens, args,
                       sm_scale, q_heads, kv_heads, head_dim, v_dim, total, threads, stream)
    else:
        kernel, heads_per_block, q_tile = _attention_kernel(kind, head_dim, v_dim, q_heads,
                                                            kv_heads, min(q_len, 16))   # one kernel past 16
        grid = (max(1, ceil_div(q_len, q_tile)), q_heads // heads_per_block, batch)
        launch(kernel, grid, threads, stream, q_geom, y_geom, *lens, k_src, v_src, args, sm_scale)

    qk = None
    if return_qk_matmul_output:
        qk = empty_like_kind(Q, (batch, q_heads, q_len, total), _alloc_dtype(Q))
        scores_kernel, softmax_rows_kernel = _qk_kernels(kind, head_dim, qk_matmul_output_mode)
        grid = (max(1, ceil_div(q_len * q_heads * total, threads)), batch)
        launch(scores_kernel, grid, threads, stream, (flat(Q), *_q_geometry(Q, q_heads)), k_src,
               np.int64(q_heads // kv_heads), np.int64(q_len), np.int64(total), args, sm_scale, qk)
        if qk_matmul_output_mode == 3:
            grid = (max(1, ceil_div(q_len * q_heads, threads)), batch)
            launch(softmax_rows_kernel, grid, threads, stream, starts, np.int64(total), qk)
    return Y, present_key, present_value, qk


def _one_block_per_group(Q, q_heads, kv_heads, q_len, head_dim, v_dim, threads) -> bool:
    """Whether rung 3's grid gives each GQA group of a sequence one block (per split): then each key is loaded
    by one lane of one block, and that load may store it into present."""
    heads_per_block, q_tile, _ = vector_rows(q_heads, kv_heads, min(q_len, 16), head_dim, v_dim,
                                             np.dtype(Q.dtype).itemsize, threads)
    return heads_per_block == q_heads // kv_heads and q_len <= q_tile


# spec: onnx/cache-inside
def _attend_vector(rung, num_splits, Q, K, V, past_key, past_value, present, Y, q_geom, y_geom, lens, args, sm_scale,
                   q_heads, kv_heads, head_dim, v_dim, total, threads, stream):
    """Y on rung 3, or rung 4's split partials and the combine: K/V read from past and K / V where they are;
    present = (present_key, present_value) to store every row into as it is loaded, or (None, None)."""
    batch, q_len = Q.shape[0], (Q.shape[2] if Q.ndim == 4 else Q.shape[1])
    k_kv, v_kv, vector = _walked_sources(K, V, past_key, past_value, kv_heads, head_dim, v_dim, present)
    itemsize = np.dtype(Q.dtype).itemsize
    key = (_kind(Q), head_dim, v_dim, q_heads, kv_heads, min(q_len, 16), threads, vector)
    heads_per_block, q_tile, step = vector_rows(q_heads, kv_heads, min(q_len, 16), head_dim, v_dim, itemsize, threads)
    grid = (max(1, ceil_div(q_len, q_tile)), q_heads // heads_per_block, batch)
    splits = 1
    # The combine writes (token, head) rows: Y's layout when 3-D or one query a batch.
    if rung == 4 and (Q.ndim == 3 or q_len == 1):
        splits = num_splits or choose_splits(grid[0] * grid[1] * grid[2], total, step)
    inputs = (lens[0], lens[1], k_kv, v_kv, args, np.float32(sm_scale))
    if splits == 1:
        kernel, _, _ = _vector_kernel(*key)
        launch(kernel, grid, threads, stream, q_geom, y_geom, *inputs)
        return
    rows = batch * q_len * q_heads
    o_part = empty_like_kind(Q, (splits * rows * v_dim,), np.float32)
    m_part, l_part = (empty_like_kind(Q, (splits * rows,), np.float32) for _ in range(2))
    token_starts = to_kind(Q, np.arange(batch + 1, dtype=np.int64) * q_len)
    i64 = np.int64
    split_geom = (o_part, token_starts, i64(0), i64(q_heads * v_dim), i64(v_dim), i64(splits), i64(rows * v_dim),
                  i64(rows), i64(q_heads), m_part, l_part)
    kernel, _, _ = _vector_kernel(*key, partials=True)
    launch(kernel, grid[:2] + (batch * splits,), threads, stream, q_geom, split_geom, *inputs)
    launch(combine_kernel(_kind(Q), q_heads, v_dim), (max(1, ceil_div(q_len * q_heads * v_dim, threads)),
           batch), threads, stream, o_part, m_part, l_part, i64(splits), token_starts, token_starts, flat(Y))
