"""TensorRT-LLM `gpt_attention` (trtllm-gpt-attention.md, every section), as a NumPy reference.

Batch convention. The per-entry tensors (context_lengths, sequence_length, host_past_key_value_lengths,
host_request_types, encoder_input_lengths) have one entry per row of the batch:
- a context request is ONE entry ("a single beam is computed per input sequence"), whatever the beam width;
  its new tokens are context_lengths[e] (the whole prompt, or the current chunk of a chunked context);
- a generation request with beam width W = cache_indirection.shape[1] is W consecutive entries (its beams),
  one new token each, context_lengths[e] = its prompt length;
- context entries come first (C of them), then the generation entries.
- host_past_key_value_lengths[e] = P_e tokens already cached; sequence_length[e] = P_e + new tokens (the
  length after this step).
Entry e owns cache row e (row of the contiguous `past_key_value`, row of `kv_cache_block_offsets`). Generation
entry e = C + bi·W + w (sequence bi, beam w) reads cached token t from row C + bi·W for t < context_lengths[e]
(the prompt is shared by the beams, written once by beam 0) and from row C + bi·W + cache_indirection[bi, w, t]
otherwise -- TensorRT-LLM's masked-MHA rule `bi·W + indirection` with the C context rows in front.

Order of one call, per entry (a loop over entries, since lengths differ; heads and tokens are broadcast):
read the cached keys/values this entry's queries can see, THEN write the new ones (read before write: a chunk
that wraps a cyclic cache cannot overwrite what its own earlier queries see).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import rope
from .blas import matmul
from .packed_mask import unpack_attention_mask
from .softmax import masked_softmax

# TensorRT-LLM's enum values (tensorrt_llm.functional); cacheattn.trtllm re-exports them as IntEnums.
PADDING, CAUSAL, SLIDING_WINDOW_CAUSAL, BIDIRECTIONAL, CUSTOM_MASK = 0, 1, 2, 3, 6
LEARNED_ABSOLUTE, ROPE_GPTJ, ROPE_GPT_NEOX, LONG_ROPE, ALIBI, ALIBI_WITH_SCALE, RELATIVE, YARN = 0, 1, 2, 3, 4, 5, 6, 8
# RoPE position types and how they pair elements: long_rope (Phi-3) and yarn rotate GPT-NeoX's halves.
ROPE_STYLES = {ROPE_GPTJ: rope.GPTJ, ROPE_GPT_NEOX: rope.GPT_NEOX, LONG_ROPE: rope.GPT_NEOX, YARN: rope.GPT_NEOX}
SCALING_NONE, SCALING_LINEAR, SCALING_DYNAMIC, SCALING_LLAMA3 = 0, 1, 2, 4
CONTEXT, GENERATION = 0, 1
INT8_KV_CACHE, FP8_KV_CACHE = 64, 128
FP8_MAX = 448.0
INT8_MIN, INT8_MAX = -128, 127


def fp8_e4m3():
    import ml_dtypes
    return np.dtype(ml_dtypes.float8_e4m3fn)


def accumulation_dtype(dtype) -> np.dtype:
    """Scores in float32 (as the GPU kernels) for float16/bfloat16/float32, float64 for float64 inputs."""
    # spec: trtllm/context-fmha-fp32-acc
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# ---- INT8/FP8 KV caches: per-tensor scale s; store sat(round_half_even(x * (1/s))), load q * s ----------------

def quantize_kv(x: np.ndarray, kv_orig_quant_scale: float, quant_mode: int) -> np.ndarray:
    """x (float) -> int8 or float8_e4m3fn codes. "fp_value * (1.0 / kv_cache_scaling_factor)", in float32."""
    # spec: trtllm/int8-fp8-cache, trtllm/quant-inverse-scale
    scaled = x.astype(np.float32) * np.float32(kv_orig_quant_scale)
    if quant_mode & INT8_KV_CACHE:
        return np.clip(np.rint(scaled), INT8_MIN, INT8_MAX).astype(np.int8)    # rint: round half to even
    # e4m3fn has no infinity (out of range casts to NaN): saturate to +-448 first, then round to nearest even.
    return np.clip(scaled, -FP8_MAX, FP8_MAX).astype(fp8_e4m3())


def dequantize_kv(codes: np.ndarray, kv_quant_orig_scale: float) -> np.ndarray:
    """codes -> float32: "quantized_value * kv_cache_scaling_factor"."""
    # spec: trtllm/dequant
    if codes.dtype == fp8_e4m3():
        # e4m3 codes decoded by a table of all 256 values: the very floats .astype(np.float32) gives, about 4x
        # faster (ml_dtypes' cast is slow on large arrays).
        return np.take(_e4m3_values(), codes.view(np.uint8)) * np.float32(kv_quant_orig_scale)
    return codes.astype(np.float32) * np.float32(kv_quant_orig_scale)


@functools.cache
def _e4m3_values() -> np.ndarray:
    """(256,) float32: the value of every e4m3 code, indexed by its byte (NaN codes give NaN)."""
    return np.arange(256, dtype=np.uint8).view(fp8_e4m3()).astype(np.float32)


# ---- Sliding window / cyclic cache / StreamingLLM sinks ------------------------------------------------------

def paged_bubble(sinks: int, tokens_per_block: int) -> int:
    """Empty rows after the sink tokens in the paged cache: the sinks get whole blocks to themselves."""
    return (tokens_per_block - sinks % tokens_per_block) % tokens_per_block


def cyclic_slot(t: np.ndarray, window: int, sinks: int, bubble: int = 0) -> np.ndarray:
    """Cache slot of token position t: sinks stay put; the others cycle through the window's W - S slots."""
    # spec: trtllm/cyclic-cache, trtllm/sink-tokens
    t = np.asarray(t)
    return np.where(t < sinks, t, sinks + bubble + (t - sinks) % (window - sinks))


def visible_keys(positions: np.ndarray, num_keys: int, *, mask_type: int, window: int, sinks: int,
                 dense: bool) -> np.ndarray:
    """(n, num_keys) bool: may the query at positions[i] see the key at position j?

    Causal alignment is bottom-right (a chunk's queries follow the cached prefix): key j is visible to the query
    at position p iff j <= p. The window keeps keys in (p - W, p]; with StreamingLLM sinks, the S first tokens
    plus the last W - S. The StreamingLLM context phase is dense (`dense`): no window there.
    """
    # spec: trtllm/sliding-window-context, trtllm/sink-tokens
    p = positions[:, None]                                                   # (n, 1)
    j = np.arange(num_keys)[None, :]                                         # (1, K)
    visible = np.ones((positions.shape[0], num_keys), bool)
    if mask_type in (CAUSAL, SLIDING_WINDOW_CAUSAL):
        visible &= j <= p
    # spec: trtllm/streaming-context-dense
    if not dense:
        visible &= (j > p - (window - sinks)) | (j < sinks)
    return visible


# ---- Relative attention bias: T5 buckets ---------------------------------------------------------------------

def t5_bucket(relative_position: np.ndarray, num_buckets: int, max_distance: int, bidirectional: bool) -> np.ndarray:
    """Bucket of relative_position = key position - query position, as HF T5 (log math in float32).

    Decoder (unidirectional): rp = max(i - j, 0); exact buckets below max_exact = num_buckets/2, then
    logarithmic up to max_distance, capped at num_buckets - 1. Bidirectional halves the buckets and adds
    num_buckets/2 for keys ahead of the query.
    """
    # spec: trtllm/rab-implicit
    rel = np.asarray(relative_position, np.int64)
    bucket = np.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        bucket += (rel > 0) * num_buckets
        rp = np.abs(rel)
    else:
        rp = -np.minimum(rel, 0)
    max_exact = num_buckets // 2
    far = np.maximum(rp, max_exact).astype(np.float32)                      # the log is taken only past max_exact
    log_ratio = np.log(far / np.float32(max_exact)) / np.float32(math.log(max_distance / max_exact))
    large = np.minimum(max_exact + (log_ratio * np.float32(num_buckets - max_exact)).astype(np.int64), num_buckets - 1)
    return bucket + np.where(rp < max_exact, rp, large)


# ---- Multi-block decoding: split the keys into tiles, combine the partial softmaxes --------------------------

def split_attention(scores: np.ndarray, values: np.ndarray, num_splits: int):
    """Partials of softmax(scores) @ values over `num_splits` contiguous key tiles.

    scores (H, n, K) biased and masked (-inf hidden); values (K, H, Dv). Returns m, l (splits, H, n) and
    o (splits, H, n, Dv): tile c's max score m_c, sum l_c = sum exp(s - m_c) and unnormalised o_c =
    sum exp(s - m_c) v. A tile with no visible key has m = -inf, l = 0, o = 0.
    """
    # spec: trtllm/multi-block
    ms, ls, os_ = [], [], []
    for tile in np.array_split(np.arange(scores.shape[-1]), num_splits):
        s = scores[..., tile]                                                # (H, n, k)
        m = s.max(axis=-1) if tile.size else np.full(s.shape[:-1], -np.inf, s.dtype)
        safe_m = np.where(np.isneginf(m), 0, m)                              # exp(-inf - 0) = 0, never NaN
        p = np.exp(s - safe_m[..., None])
        ms.append(m)
        ls.append(p.sum(axis=-1))
        os_.append(matmul(p, values[tile].astype(s.dtype).transpose(1, 0, 2)))  # (H, n, k) @ (H, k, Dv)
    return np.stack(ms), np.stack(ls), np.stack(os_)


def combine_partials(m: np.ndarray, l: np.ndarray, o: np.ndarray) -> np.ndarray:  # noqa: E741 (the m, l, o of the papers)
    """Exact softmax @ values from tile partials: M = max m_c, L = sum e^(m_c - M) l_c, O = sum e^(m_c - M) o_c / L.

    A row no tile sees (L = 0) gives zeros, as masked_softmax does.
    """
    # spec: trtllm/multi-block
    big_m = m.max(axis=0)                                                    # (H, n)
    safe = np.where(np.isneginf(big_m), 0, big_m)
    weight = np.where(np.isneginf(m), 0, np.exp(m - safe))                   # (splits, H, n)
    big_l = (weight * l).sum(axis=0)
    big_o = (weight[..., None] * o).sum(axis=0)                              # (H, n, Dv)
    return np.divide(big_o, big_l[..., None], out=np.zeros_like(big_o), where=big_l[..., None] > 0)


# ---- The cache: contiguous rows or a paged pool --------------------------------------------------------------

@dataclass
class KVCache:
    """Where token slot s of cache row r lives, for both cache kinds.

    Contiguous: past_key_value (rows, 2, Hkv, max_seqlen, Dh), slot s at [r, kv, :, s].
    Paged: the pool (num_blocks, num_layers, 2, Hkv, tokens_per_block, Dh) seen as blocks
    (num_blocks * num_layers * 2, Hkv, tokens_per_block, Dh); slot s of row r, kv in {0: K, 1: V} lives in
    block kv_cache_block_offsets[0, r, kv, s // tokens_per_block] + 2 * layer_idx (the plugin's layer offset;
    the manager writes offset = block * num_layers * 2 + kv), at row s % tokens_per_block.
    """
    contiguous: np.ndarray | None
    blocks: np.ndarray | None
    block_offsets: np.ndarray | None
    layer_idx: int
    tokens_per_block: int

    def _where(self, rows, kv: int, slots: np.ndarray):
        # spec: trtllm/paged-blocks, trtllm/cache-per-layer
        block = self.block_offsets[0, rows, kv, slots // self.tokens_per_block] + 2 * self.layer_idx
        return block, slots % self.tokens_per_block

    def read(self, rows: np.ndarray, kv: int, slots: np.ndarray) -> np.ndarray:
        """(n, Hkv, Dh) stored codes of slots[i] in rows[i]."""
        # spec: trtllm/contiguous-shape
        if self.contiguous is not None:
            return self.contiguous[rows, kv, :, slots]                       # (n, Hkv, Dh)
        block, within = self._where(rows, kv, slots)
        return self.blocks[block, :, within]                                 # (n, Hkv, Dh)

    def write(self, row: int, kv: int, slots: np.ndarray, codes: np.ndarray) -> None:
        """Store codes (n, Hkv, Dh) at slots of `row`; slots are distinct (the caller keeps the last writer)."""
        if self.contiguous is not None:
            self.contiguous[row, kv, :, slots] = codes
        else:
            block, within = self._where(row, kv, slots)
            self.blocks[block, :, within] = codes


# ---- The operator ----------------------------------------------------------------------------------------------

def _last_writer(slots: np.ndarray) -> np.ndarray:
    """Indices of the tokens that end up in the cache when several wrap onto one slot: the latest of each."""
    # spec: trtllm/cyclic-overwrite
    reversed_first = np.unique(slots[::-1], return_index=True)[1]
    return np.sort(slots.shape[0] - 1 - reversed_first)


def _rope_freq(rotary_inv_freq, rotary_embedding_dim, rotary_embedding_base, rotary_embedding_scale_type,
               rotary_embedding_scale, rotary_embedding_max_positions, length, acc):
    """Frequencies for a sequence of `length` tokens (dynamic NTK scaling uses the length after this step)."""
    if rotary_inv_freq is not None:
        return np.asarray(rotary_inv_freq).astype(acc)                     # given by the caller: used as is
    base = rotary_embedding_base
    if rotary_embedding_scale_type == SCALING_DYNAMIC:
        base = rope.dynamic_ntk_base(base, rotary_embedding_dim, rotary_embedding_scale, length,
                                     rotary_embedding_max_positions)
    return rope.inv_freq(rotary_embedding_dim, base, acc)


def rope_plan(*, position_embedding_type, rotary_inv_freq, rotary_cos_sin, long_rope_rotary_inv_freq,
              long_rope_rotary_cos_sin, rotary_embedding_original_max_positions, rotary_embedding_max_positions,
              rotary_embedding_scale_type, streamingllm, lengths, is_context):
    """Per entry: (frequencies given or None, cos/sin table or None, read the table?). TensorRT-LLM's kernels read
    cos/sin from `rotary_cos_sin` at the token's position, and recompute them from the frequencies (times the
    m-scale) where the table cannot serve: dynamic scaling (the base depends on the length), a kv length past
    rotary_embedding_max_positions, StreamingLLM (keys rotated at their cache index on every load). long_rope
    switches to the long frequencies and table for a whole phase (the context requests, or the generation
    requests) once its longest sequence passes rotary_embedding_original_max_positions, as the plugin does."""
    plans = []
    for e, length in enumerate(lengths):
        freq, table = rotary_inv_freq, rotary_cos_sin
        if position_embedding_type == LONG_ROPE:
            same_phase = lengths[is_context == is_context[e]]
            if same_phase.max() > rotary_embedding_original_max_positions:
                freq, table = long_rope_rotary_inv_freq, long_rope_rotary_cos_sin
        recompute = (rotary_embedding_scale_type == SCALING_DYNAMIC or length > rotary_embedding_max_positions
                     or streamingllm)
        plans.append((freq, table, table is not None and not recompute))
    return plans


def _split_qkv(rows, qkv_bias, H, Hkv, Dh, dtype, acc):
    """The QKV split (MHA / MQA / GQA): [Q | K | V] along the hidden axis, H, Hkv and Hkv heads of Dh.

    The bias is added as the preprocessing step adds it, which writes the input dtype back.
    """
    # spec: trtllm/qkv-packing, trtllm/mha-mqa-gqa
    n = rows.shape[0]
    x = rows.astype(acc)                                                     # (n, (H + 2 Hkv) Dh)
    # spec: trtllm/generation-mmha
    if qkv_bias is not None:
        x = x + qkv_bias.astype(acc)
    x = x.astype(dtype).astype(acc)
    q = x[:, :H * Dh].reshape(n, H, Dh)                                      # (n, H, Dh)
    k = x[:, H * Dh:(H + Hkv) * Dh].reshape(n, Hkv, Dh)                      # (n, Hkv, Dh)
    v = x[:, (H + Hkv) * Dh:].reshape(n, Hkv, Dh)                            # (n, Hkv, Dh)
    return q, k, v


def _beam_rows(e, positions, *, num_context, beam_width, context_length, cache_indirection, window, sinks):
    """Cache row of each cached position read by generation entry e = C + bi * W + w: the prompt from beam 0's
    row (written once, shared by the beams), later tokens from the row cache_indirection[bi, w, t] names.
    Beam search never runs on a wrapped cache, so the indirection's token index is the position."""
    # spec: trtllm/cache-indirection
    bi, w = divmod(e - num_context, beam_width)
    first = num_context + bi * beam_width
    return np.where(positions < context_length, first,
                    first + cache_indirection[bi, w, cyclic_slot(positions, window, sinks)])


def _position_bias(position_embedding_type, positions, num_keys, *, alibi_slopes, relative_attention_bias,
                   max_distance, mask_type, acc):
    """(H, n, num_keys) bias added to the scaled scores, or None: ALiBi slope * (j - i), or the relative attention
    bias (regular table at [h, query position, key position], or T5 buckets of key - query position)."""
    j = np.arange(num_keys)[None, :]                                         # (1, K)
    i = positions[:, None]                                                   # (n, 1)
    # spec: trtllm/alibi
    if position_embedding_type in (ALIBI, ALIBI_WITH_SCALE):
        return alibi_slopes.astype(acc)[:, None, None] * (j - i).astype(acc)
    # spec: trtllm/rab, trtllm/rab-modes
    if position_embedding_type != RELATIVE:
        return None
    # spec: trtllm/rab-implicit
    if max_distance > 0:
        bidirectional = mask_type in (PADDING, BIDIRECTIONAL)               # encoders see keys ahead too
        buckets = t5_bucket(j - i, relative_attention_bias.shape[1], max_distance, bidirectional)   # (n, K)
        return relative_attention_bias[:, buckets].astype(acc)
    return relative_attention_bias[:, positions][:, :, :num_keys].astype(acc)


def _attend(q, k, v, visible, bias, *, norm_factor, softcap, fp8_fmha, kv_scales):
    """One entry's attention: q (n, H, Dh), k, v (K, Hkv, Dh) in acc, visible (n, K), bias (H, n, K) or None.

    Returns (n, H, Dh) in acc. Order: QK^T * norm_factor, softcap c*tanh(qk/c), + bias (ALiBi / relative),
    mask, softmax, @ V. GQA: query head h reads kv head h // (H / Hkv). FP8 context FMHA (`fp8_fmha`): Q, K, V
    rounded to e4m3 at the cache's per-tensor scale, the unnormalised probabilities exp(s - max) rounded to e4m3
    before P.V, the sum kept in float32.
    """
    acc = q.dtype
    n, H, Dh = q.shape
    Hkv = k.shape[1]
    # spec: trtllm/fp8-context-fmha
    if fp8_fmha:
        inv_s, s = kv_scales
        q, k, v = (quantize_kv(x, inv_s, FP8_KV_CACHE).astype(acc) for x in (q, k, v))
        norm_factor = norm_factor * float(s) * float(s)                     # (q/s)(k/s) -> q k
    # spec: trtllm/mha-mqa-gqa
    # GQA without repeating K/V: the G = H / Hkv query heads of each kv head stacked as the rows of one matrix,
    # (Hkv, G·n, Dh) against K/V (Hkv, K, Dh) (head h = kv·G + g), one BLAS product per kv head.
    q = q.reshape(n, Hkv, H // Hkv, Dh).transpose(1, 2, 0, 3).reshape(Hkv, -1, Dh)    # (Hkv, G·n, Dh)
    k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)                                # (Hkv, K, Dh)
    scores = matmul(q, k.swapaxes(-1, -2)).reshape(H, n, -1)                # (H, n, K) = QK^T
    scores *= acc.type(norm_factor)
    if softcap > 0:
        # Softcapping after the scaling, before any bias or mask: a masked -inf must stay -inf.
        cap = acc.type(softcap)
        np.multiply(cap, np.tanh(np.divide(scores, cap, out=scores), out=scores), out=scores)   # c·tanh(s / c)
    if bias is not None:
        scores += bias
    np.copyto(scores, -np.inf, where=~visible[None])                       # hidden keys: -inf
    if not fp8_fmha:
        probs = masked_softmax(scores, out=scores).reshape(Hkv, -1, scores.shape[-1])   # (Hkv, G·n, K)
        return matmul(probs, v).reshape(H, n, Dh).transpose(1, 0, 2)       # (n, H, Dh)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isneginf(row_max), 0, row_max)
    p = np.exp(np.subtract(scores, row_max, out=scores), out=scores)        # (H, n, K), unnormalised, <= 1
    total = p.sum(axis=-1, keepdims=True)
    p8 = p.astype(fp8_e4m3()).astype(acc)                                    # P rounded to e4m3 before P.V
    out = matmul(p8.reshape(Hkv, -1, p8.shape[-1]), v).reshape(H, n, Dh) * acc.type(kv_scales[1])
    out = np.divide(out, total, out=np.zeros_like(out), where=total > 0)
    return out.transpose(1, 0, 2)


def gpt_attention(*, qkv, past_key_value, attention_mask, sequence_length, host_past_key_value_lengths,
                  host_max_attention_window_sizes, host_sink_token_length, context_lengths, cache_indirection,
                  host_request_types, layer_idx, num_heads, num_kv_heads, hidden_size_per_head, q_scaling,
                  attn_logit_softcapping_scale=0.0, rotary_embedding_dim=0, rotary_embedding_base=10000.0,
                  rotary_embedding_scale_type=SCALING_NONE, rotary_embedding_short_m_scale=1.0,
                  rotary_embedding_long_m_scale=1.0, rotary_embedding_scale=1.0, rotary_embedding_max_positions=1024,
                  rotary_embedding_original_max_positions=1024, position_embedding_type=LEARNED_ABSOLUTE,
                  rotary_inv_freq=None, rotary_cos_sin=None, long_rope_rotary_inv_freq=None,
                  long_rope_rotary_cos_sin=None, logn_scaling=None, attention_packed_mask=None,
                  kv_orig_quant_scale=None, kv_quant_orig_scale=None, kv_cache_quant_mode=0, mask_type=CAUSAL,
                  alibi_slopes=None, kv_cache_block_offsets=None, do_cross_attention=False, cross_kv=None,
                  encoder_input_lengths=None, relative_attention_bias=None, max_distance=0, qkv_bias=None,
                  use_cache=True, remove_input_padding=True, paged_kv_cache=False, tokens_per_block=64,
                  streamingllm=False, use_fp8_context_fmha=False, kv_cache_pool=None, context_fmha_type=1,
                  multi_block_mode=True, max_context_length=None, host_context_lengths=None, cross_kv_length=None,
                  host_kv_cache_block_offsets=None):
    """(output, present_key_value); the cache (past_key_value or kv_cache_pool) is written in place.

    Inputs are validated by cacheattn.gpt_attention; here they are host NumPy arrays and plain ints.
    Shapes: see cacheattn.gpt_attention. The last six arguments choose kernels or size buffers on a GPU and
    do not change the result (context_fmha_type: see the docs page on accumulation); host copies are checked
    against their device tensors by the validation. attention_packed_mask, when given, is the mask the context
    requests read (TensorRT-LLM's context FMHA reads the packed one, generation reads attention_mask).
    """
    H, Hkv, Dh = num_heads, num_kv_heads, hidden_size_per_head
    dtype = np.dtype(qkv.dtype)
    acc = accumulation_dtype(dtype)
    num_entries = int(sequence_length.shape[0])
    past = host_past_key_value_lengths.astype(np.int64)
    lengths = sequence_length.astype(np.int64)
    is_context = host_request_types == CONTEXT
    # spec: trtllm/chunked-context, trtllm/beam-context, trtllm/generation-beam-tokens
    new_tokens = lengths - past                                              # prompt/chunk, or 1 per beam
    # spec: trtllm/inflight-order
    num_context = int(is_context.sum())
    beam_width = int(cache_indirection.shape[1]) if cache_indirection is not None else 1
    # spec: trtllm/window-per-layer, trtllm/window-repeat
    # One window per layer; a shorter list repeats over the layers.
    window = int(host_max_attention_window_sizes[layer_idx % len(host_max_attention_window_sizes)])
    sinks = int(host_sink_token_length[0])
    # spec: trtllm/int8-fp8-cache
    quantized = bool(kv_cache_quant_mode & (INT8_KV_CACHE | FP8_KV_CACHE))
    cache = None
    # spec: trtllm/cache-per-layer, trtllm/paged-blocks, trtllm/contiguous-shape
    if use_cache:
        pool_blocks = None if not paged_kv_cache else kv_cache_pool.reshape(-1, *kv_cache_pool.shape[3:])
        cache = KVCache(None if paged_kv_cache else past_key_value, pool_blocks, kv_cache_block_offsets,
                        layer_idx, tokens_per_block)
    bubble = paged_bubble(sinks, tokens_per_block) if paged_kv_cache else 0
    # spec: trtllm/norm-factor
    norm_factor = 1.0 / (q_scaling * math.sqrt(Dh))                          # scales QK^T only
    # spec: trtllm/rope
    rope_style = ROPE_STYLES.get(position_embedding_type)
    if rope_style is not None and rotary_embedding_scale_type == SCALING_LINEAR and rotary_inv_freq is None:
        rope_position_divisor = rotary_embedding_scale                      # linear scaling divides the position
    else:
        rope_position_divisor = 1.0                                         # (given frequencies carry it)
    rope_plans = rope_plan(
        position_embedding_type=position_embedding_type, rotary_inv_freq=rotary_inv_freq,
        rotary_cos_sin=rotary_cos_sin, long_rope_rotary_inv_freq=long_rope_rotary_inv_freq,
        long_rope_rotary_cos_sin=long_rope_rotary_cos_sin,
        rotary_embedding_original_max_positions=rotary_embedding_original_max_positions,
        rotary_embedding_max_positions=rotary_embedding_max_positions,
        rotary_embedding_scale_type=rotary_embedding_scale_type, streamingllm=streamingllm, lengths=lengths,
        is_context=is_context) if rope_style is not None else None
    # The context requests' custom mask from the packed one, rows packed like the new tokens.
    context_mask = None
    if attention_packed_mask is not None:
        context_mask = unpack_attention_mask(attention_packed_mask, new_tokens, lengths)

    # spec: trtllm/padded-packed, trtllm/packed-lengths, trtllm/padded-qkv-shape, trtllm/packed-qkv-shape
    # Packed ([num_tokens, hidden]) or padded ([batch_beam, max_seqlen, hidden]) QKV: entry e's tokens are
    # packed rows starts[e]:starts[e+1], or padded rows qkv[e, :new_tokens[e]].
    starts = np.concatenate([[0], np.cumsum(new_tokens)])
    tokens_of = [slice(starts[e], starts[e + 1]) if remove_input_padding else (e, slice(0, new_tokens[e]))
                 for e in range(num_entries)]
    output = np.zeros(qkv.shape[:-1] + (H * Dh,), dtype)                   # padding rows stay zero
    encoder_starts = None
    if do_cross_attention:
        if remove_input_padding and cross_kv is not None and cross_kv.ndim == 3:
            cross_kv = cross_kv[0]                                           # [1, num_tokens, 2 Hkv Dh]
        context_encoder_lengths = np.where(is_context, encoder_input_lengths, 0)
        encoder_starts = np.concatenate([[0], np.cumsum(context_encoder_lengths)])

    # spec: trtllm/dequant, trtllm/quant-inverse-scale, trtllm/generation-mmha
    def load(codes):
        return (dequantize_kv(codes, kv_quant_orig_scale) if quantized else codes).astype(acc, copy=False)

    def store(x):
        return quantize_kv(x, kv_orig_quant_scale, kv_cache_quant_mode) if quantized else x.astype(dtype)

    for e in range(num_entries):
        P, n, N = int(past[e]), int(new_tokens[e]), int(lengths[e])
        q, k_new, v_new = _split_qkv(qkv[tokens_of[e]], qkv_bias, H, Hkv, Dh, dtype, acc)
        positions = np.arange(P, N)                                          # query i sits at position P + i
        bias = None

        # spec: trtllm/cross-attention
        if do_cross_attention:
            # Cross attention: keys are the encoder's L_e tokens, written to the cache in the context phase
            # (no RoPE, not causal), only read in generation.
            L, slots = int(encoder_input_lengths[e]), np.arange(int(encoder_input_lengths[e]))
            if is_context[e]:
                enc = (cross_kv[encoder_starts[e]:encoder_starts[e + 1]] if remove_input_padding
                       else cross_kv[e, :L])                                 # (L, 2 Hkv Dh): [K | V]
                keys = enc[:, :Hkv * Dh].reshape(L, Hkv, Dh).astype(acc)
                vals = enc[:, Hkv * Dh:].reshape(L, Hkv, Dh).astype(acc)
                if cache is not None:
                    cache.write(e, 0, slots, store(keys))
                    cache.write(e, 1, slots, store(vals))
            else:
                keys, vals = load(cache.read(np.full(L, e), 0, slots)), load(cache.read(np.full(L, e), 1, slots))
            visible = np.ones((n, L), bool)
        else:
            # Which key positions each query sees (mask type, window, sinks); custom masks replace the causal rule.
            # spec: trtllm/streaming-context-dense
            dense = streamingllm and bool(is_context[e])
            visible = visible_keys(positions, N, mask_type=PADDING if mask_type == CUSTOM_MASK else mask_type,
                                   window=window, sinks=sinks, dense=dense)
            if mask_type == CUSTOM_MASK and context_mask is not None and is_context[e]:
                visible &= context_mask[starts[e]:starts[e + 1], :N]           # (n, N) bool from the packed mask
            elif mask_type == CUSTOM_MASK:
                visible &= attention_mask[tokens_of[e]][:, :N]                  # (n, N) bool, True = attend

            # RoPE of the new tokens at their positions; StreamingLLM generation rotates them at the position in
            # the cache, min(past, W).
            # spec: trtllm/rope, trtllm/generation-mmha
            if rope_style is not None:
                given_freq, table, from_table = rope_plans[e]
                freq = _rope_freq(given_freq, rotary_embedding_dim, rotary_embedding_base,
                                  rotary_embedding_scale_type, rotary_embedding_scale, rotary_embedding_max_positions,
                                  N, acc)
                # Recomputed coefficients carry the m-scale: the short one while the newest position is within
                # rotary_embedding_original_max_positions, the long one past it (1 unless long_rope / yarn).
                m_scale = (rotary_embedding_short_m_scale if N - 1 <= rotary_embedding_original_max_positions
                           else rotary_embedding_long_m_scale)

                def rotate(x, at, freq=freq, table=table if from_table else None, m_scale=m_scale):
                    if table is not None:
                        cos, sin = rope.table_coefficients(table, at, rotary_embedding_dim, acc)
                    else:
                        cos, sin = rope.coefficients(at / rope_position_divisor, freq, acc, m_scale)
                    return rope.rotate_with(x, cos, sin, rope_style).astype(dtype).astype(acc)

                # spec: trtllm/streaming-positions
                at = np.full(n, min(P, window)) if streamingllm and not is_context[e] else positions
                q, k_rot = rotate(q, at), rotate(k_new, at)
            else:
                k_rot = k_new
            if logn_scaling is not None:
                # Qwen's logn attention: Q times the factor of its absolute position, after RoPE.
                q = (q * logn_scaling[positions].astype(acc)[:, None, None]).astype(dtype).astype(acc)

            # Cached keys the queries can see: read them (dequantized) from the beam's row, at the cyclic slot.
            needed = np.flatnonzero(visible[:, :P].any(axis=0))              # cached positions in view
            # All P in view (no window cut: the usual decode step): the reads fill keys[:P], nothing is left to
            # zero. Otherwise the positions out of view keep zero keys (masked anyway).
            every = needed.size == P
            keys = np.empty((N, Hkv, Dh), acc) if every else np.zeros((N, Hkv, Dh), acc)
            vals = np.empty((N, Hkv, Dh), acc) if every else np.zeros((N, Hkv, Dh), acc)
            into = slice(0, P) if every else needed                          # where the read positions go
            if needed.size:
                rows = np.full(needed.shape, e)
                # spec: trtllm/cache-indirection, trtllm/beam-context
                if not is_context[e]:
                    rows = _beam_rows(e, needed, num_context=num_context, beam_width=beam_width,
                                      context_length=context_lengths[e], cache_indirection=cache_indirection,
                                      window=window, sinks=sinks)
                # spec: trtllm/cyclic-cache
                slots = cyclic_slot(needed, window, sinks, bubble)
                keys[into] = load(cache.read(rows, 0, slots))
                vals[into] = load(cache.read(rows, 1, slots))
                # spec: trtllm/streaming-positions
                if streamingllm and rope_style is not None:
                    # StreamingLLM caches K without RoPE and rotates it at its index in the cache.
                    keys[into] = rotate(keys[into], cyclic_slot(needed, window, sinks))
            # The current tokens attend with their own (unquantized) K/V.
            keys[P:], vals[P:] = k_rot, v_new

            # Write the new K/V (after RoPE; StreamingLLM: before it) at their cyclic slots, latest writer wins.
            if cache is not None:
                # spec: trtllm/cyclic-overwrite
                slots = cyclic_slot(positions, window, sinks, bubble)
                kept = _last_writer(slots)
                k_stored = k_new if streamingllm else k_rot
                cache.write(e, 0, slots[kept], store(k_stored[kept]))
                cache.write(e, 1, slots[kept], store(v_new[kept]))

            bias = _position_bias(position_embedding_type, positions, N, alibi_slopes=alibi_slopes,
                                  relative_attention_bias=relative_attention_bias, max_distance=max_distance,
                                  mask_type=mask_type, acc=acc)

        # spec: trtllm/fp8-context-fmha
        fp8_fmha = use_fp8_context_fmha and bool(is_context[e])
        # GQA: query head h reads kv head h // (H / Hkv); _attend stacks the query heads of each kv head.
        out = _attend(q, keys, vals, visible, bias, norm_factor=norm_factor,
                      softcap=attn_logit_softcapping_scale, fp8_fmha=fp8_fmha,
                      kv_scales=(kv_orig_quant_scale, kv_quant_orig_scale))
        output[tokens_of[e]] = out.reshape(n, H * Dh).astype(dtype)

    present = past_key_value if (use_cache and not paged_kv_cache) else None
    return output, present
