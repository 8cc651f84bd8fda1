"""What TensorRT-LLM's context and generation kernels share (trtllm-gpt-attention.md): the entry table's columns and
the enum values, the cache's sources, slots and addresses, INT8 / FP8 (e4m3) codes, RoPE, a new token's Q/K/V element
as the preprocess forms it, and the device functions the attention loops take:

- `make_trt_access`: where key t of entry b lives (the scratch for the new tokens, else the cache: contiguous or
  paged, cyclic with sinks and the paged bubble, beams through cache_indirection) and how one element loads
  (dequantized; StreamingLLM's keys rotated at their cache index);
- `make_trt_score`: the score of query i and key j (custom mask, causal / window / sinks, softcap, then ALiBi or
  the relative bias) and the range of keys worth walking;
- `make_generation_chunk_load`: a 16-byte chunk of a cached row (the vector rungs' load; rung 5's context kernel
  reads its cached keys through it too).

`trtllm_context` and `trtllm_generation` build their kernels on these; `trtllm_gpt_attention` (the launcher) on
all three.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
from numba import cuda

from ._cache import _address
from ._numerics import keep_float32, narrow_bfloat16, round_to_bfloat16, rounder, widen_bfloat16
from ._vector import VECTOR_BYTES, float_from_bits, half_from_bits, load16

# TensorRT-LLM enum values (tensorrt_llm.functional), as cacheattn.trtllm validates them.
PADDING, CAUSAL, SLIDING_WINDOW_CAUSAL, BIDIRECTIONAL = 0, 1, 2, 3
ROPE_GPTJ, ROPE_GPT_NEOX, LONG_ROPE, ALIBI, ALIBI_WITH_SCALE, RELATIVE, YARN = 1, 2, 3, 4, 5, 6, 8
SCALING_LINEAR, SCALING_DYNAMIC = 1, 2
CONTEXT = 0
INT8_KV_CACHE, FP8_KV_CACHE = 64, 128
FP8_MAX = 448.0

# Per-entry table columns (int64): where the entry's tokens are in qkv/output, its lengths, its cache rows, the
# m-tile its rows start at in the packed mask, the RoPE cos/sin table it reads (-1: none, 0: rotary_cos_sin,
# 1: long_rope's long table).
TOKEN_START, PAST, NEW, FIRST_ROW, BEAM, SEQUENCE, PROMPT, IS_CONTEXT, MASK_TILE, ROPE_TABLE = range(10)
TABLE_COLUMNS = 10

# Where cached token slots live. Contiguous: row r, slot s at r*s_row + kv*s_kv + h*s_head + s*Dh.
# Paged: block = offsets[r, kv, s // tokens_per_block] + layer_blocks, at block*s_block + h*s_head + (s % tpb)*Dh.
KVSource = namedtuple("KVSource", "cache scratch table offsets indirection kv paged tokens_per_block layer_blocks "
                                  "s_row s_kv s_head s_block window sinks bubble scale "
                                  "rotate inv_freq position_divisor")


# ---- FP8 e4m3 (fn) from the bits: the simulator has no fp8 type, the cache holds the codes as bytes -----------

@cuda.jit(device=True, inline="always")
def e4m3_encode(x):
    """float32 -> e4m3fn code (0..255): saturate to +-448, round to nearest even (subnormals too); NaN -> 0x7F."""
    if x != x:
        return np.int32(0x7F)
    sign = np.int32(0x80) if (x < 0 or (x == 0 and math.copysign(1.0, x) < 0)) else np.int32(0)
    a = min(abs(np.float64(x)), FP8_MAX)
    if a < 2.0 ** -6:                                   # subnormal: multiples of 2^-9 (8 rounds up to the normal 2^-6)
        return sign | np.int32(round(a * 512.0))
    exponent, power = 8, 256.0                          # largest 2^e <= a, e in [-6, 8]
    while power > a:
        power *= 0.5
        exponent -= 1
    mantissa = np.int32(round((a / power - 1.0) * 8.0))  # exact scaled fraction, round() is half to even
    if mantissa == 8:                                   # rounded up to the next power of two
        mantissa = np.int32(0)
        exponent += 1
    return sign | np.int32((exponent + 7) << 3) | mantissa


@cuda.jit(device=True, inline="always")
def e4m3_decode(code):
    """e4m3fn code (0..255) -> its exact value as float32 (0x7F / 0xFF are NaN)."""
    c = np.int32(code) & 0xFF
    exponent, mantissa = (c >> 3) & 0xF, c & 7
    if exponent == 15 and mantissa == 7:
        value = math.nan                                # signed like the code, as ml_dtypes widens it
    elif exponent == 0:
        value = np.float64(mantissa) * 2.0 ** -9
    else:
        value = np.float64(8 + mantissa) * 2.0 ** (exponent - 10)
    return np.float32(-value if c & 0x80 else value)


def make_kv_codec(quant: int, acc_t, bits: bool = False):
    """(encode(x, inv_scale), decode(code, scale)): the cache's storage of a K/V element and its load as acc_t.

    INT8: sat(rint(float32(x) * (1/s))), load float32(q) * s. FP8: e4m3(sat(float32(x) * (1/s))), load e4m3 * s.
    Unquantized: the value itself (the cache array's dtype rounds it on store); bits: a cache of bfloat16 bits,
    stored rounded to nearest even and widened by a shift."""

    @cuda.jit(device=True, inline="always")
    def encode(x, inv_scale):
        if quant == INT8_KV_CACHE:
            q = round(np.float32(np.float32(x) * inv_scale))
            return np.int32(min(max(q, -128), 127))
        if quant == FP8_KV_CACHE:
            return e4m3_encode(np.float32(np.float32(x) * inv_scale))
        if bits:
            return narrow_bfloat16(x)
        return x

    @cuda.jit(device=True, inline="always")
    def decode(code, scale):
        if quant == INT8_KV_CACHE:
            return acc_t(np.float32(np.float32(code) * scale))
        if quant == FP8_KV_CACHE:
            return acc_t(np.float32(e4m3_decode(code) * scale))
        if bits:
            return acc_t(widen_bfloat16(code))
        return acc_t(code)

    return encode, decode


# ---- The cache: slots, rows, addresses -----------------------------------------------------------------------

@cuda.jit(device=True, inline="always")
def cyclic_slot(t, window, sinks):
    """Slot of token position t: sinks stay put, the rest cycle through the window's W - S slots."""
    # spec: trtllm/cyclic-cache, trtllm/sink-tokens
    if t < sinks:
        return t
    return sinks + (t - sinks) % (window - sinks)


def make_cache_address(head_size: int):
    @cuda.jit(device=True, inline="always")
    def cache_address(src, row, slot, h):
        """Element 0 of kv head h at cache slot `slot` (before the paged bubble) of cache row `row`.
        Consecutive slots are head_size elements apart in both layouts."""
        if slot >= src.sinks:
            slot += src.bubble                          # paged: the sinks have their blocks to themselves
        if src.paged != 0:
            block = src.offsets[row, src.kv, slot // src.tokens_per_block] + src.layer_blocks
            return block * src.s_block + h * src.s_head + (slot % src.tokens_per_block) * head_size
        return row * src.s_row + src.kv * src.s_kv + h * src.s_head + slot * head_size

    return cache_address


def make_rope(rope_style: int, rotary_dim: int, round_dtype, acc_t, tables: bool = True):
    """(pair_of, rotate): RoPE of one element given its pair partner, the result rounded to the input dtype.

    rotate's `rope` is a namedtuple with the fields table (the entry table), inv_freq (entries, rotary_dim/2 + 1:
    the frequencies, then the entry's m-scale) and position_divisor, plus cos_sin and cos_sin_long (flat float32)
    when `tables`: entry b reads cos/sin of pair i at position p from element 2 (p rotary_dim/2 + i) of cos_sin
    (table[b, ROPE_TABLE] 0) or of cos_sin_long (1: long_rope past its original positions), else (-1, and always
    without `tables`) computes m_scale (cos, sin)((p / position_divisor) inv_freq[b, i])."""
    # spec: trtllm/rope
    HALF = rotary_dim // 2

    @cuda.jit(device=True, inline="always")
    def pair_of(d):
        """(frequency index, is the pair's first element, partner element) of element d < rotary_dim."""
        if rope_style == ROPE_GPTJ:                     # interleaved pairs (2i, 2i + 1)
            first = d % 2 == 0
            return d // 2, first, d + 1 if first else d - 1
        first = d < HALF                                # GPT-NeoX: halves (i, i + rotary_dim / 2)
        return d % HALF, first, d + HALF if first else d - HALF

    coefficients, turn = make_rope_pairs(rotary_dim, round_dtype, acc_t, tables)

    @cuda.jit(device=True, inline="always")
    def rotate(x, other, first, rope, b, position, pair):
        """x rotated with its partner by entry b's coefficients of `pair` at `position`, formed in acc_t."""
        cos, sin = coefficients(rope, b, position, pair)
        return turn(x, other, first, cos, sin)

    return pair_of, rotate


def make_rope_pairs(rotary_dim: int, round_dtype, acc_t, tables: bool = True):
    """(coefficients, turn) of `make_rope`, apart so that a thread holding both elements of a pair computes the
    pair's cos and sin once: coefficients(rope, b, position, pair) -> (cos, sin); turn(x, other, first, cos, sin)
    -> x rotated with its partner, rounded to the input dtype (the same arithmetic, in the same order, as rotate)."""
    HALF = rotary_dim // 2

    @cuda.jit(device=True, inline="always")
    def coefficients(rope, b, position, pair):
        if tables:
            at = rope.table[b, ROPE_TABLE]
            if at >= 0:
                k = 2 * (position * HALF + pair)
                table = rope.cos_sin if at == 0 else rope.cos_sin_long
                return acc_t(table[k]), acc_t(table[k + 1])
        angle = acc_t(np.float64(position) / rope.position_divisor) * acc_t(rope.inv_freq[b, pair])
        m = acc_t(rope.inv_freq[b, HALF])
        return acc_t(math.cos(angle)) * m, acc_t(math.sin(angle)) * m

    @cuda.jit(device=True, inline="always")
    def turn(x, other, first, cos, sin):
        if first:
            return round_dtype(x * cos - other * sin)
        return round_dtype(x * cos + other * sin)

    return coefficients, turn


# A cached key's `where`: its cyclic slot and entry in one int64 (entry + 1, so that 0 stays the scratch's mark),
# which StreamingLLM needs to rotate the key at its index in the cache. int64 before the shift whatever the slot's
# type: a sink's slot is its walk index, which the simulator keeps as numpy's int32 of the thread indices, and a
# shift of an int32 by 32 would drop it.
@cuda.jit(device=True, inline="always")
def cached_place(slot, b):
    return (np.int64(slot) << 32) | (b + 1)


@cuda.jit(device=True, inline="always")
def entry_and_slot(where):
    """(entry, cyclic slot) of a cached key's `where` (`cached_place`)."""
    return (where & 0xFFFFFFFF) - 1, where >> 32


def make_trt_access(quant: int, num_kv_heads: int, head_size: int, acc_t, round_dtype=keep_float32,
                    rope_style: int = 0, rotary_dim: int = 0):
    """Device functions (row_offsets, load) of the core for a TensorRT-LLM K or V source (KVSource).

    row_offsets(src, b, t, h) -> (element index, where): where = 0 for the scratch, else (slot << 32) | (b + 1):
    the cached key's cyclic slot and entry, which StreamingLLM needs to rotate it at its index in the cache
    (rope_style != 0 only for StreamingLLM; `src.rotate` says whether this source is K). round_dtype bfloat16's:
    the scratch and cache hold bfloat16 bits."""
    bits = round_dtype is round_to_bfloat16
    _, decode = make_kv_codec(quant, acc_t, bits)
    cache_address = make_cache_address(head_size)
    pair_of, rotate = make_rope(rope_style, rotary_dim, round_dtype, acc_t, tables=False)   # StreamingLLM recomputes

    @cuda.jit(device=True, inline="always")
    def row_offsets(src, b, t, h):
        table = src.table
        past = table[b, PAST]
        if t >= past:                                   # a new token: its unquantized K/V from the scratch
            return ((table[b, TOKEN_START] + t - past) * num_kv_heads + h) * head_size, 0
        row = b
        slot = cyclic_slot(t, src.window, src.sinks)
        if table[b, IS_CONTEXT] == 0:
            # Beam search: the prompt from the sequence's first row, later tokens from the beam the indirection names.
            row = table[b, FIRST_ROW]
            if t >= table[b, PROMPT]:
                row += src.indirection[table[b, SEQUENCE], table[b, BEAM], slot]
        return cache_address(src, row, slot, h), cached_place(slot, b)

    @cuda.jit(device=True, inline="always")
    def load(src, index, where, d):
        if where == 0:
            return acc_t(widen_bfloat16(src.scratch[index + d])) if bits else acc_t(src.scratch[index + d])
        x = decode(src.cache[index + d], src.scale)
        if rope_style == 0 or src.rotate == 0 or d >= rotary_dim:
            return x
        b, slot = entry_and_slot(where)
        pair, first, partner = pair_of(d)
        other = decode(src.cache[index + partner], src.scale)
        return rotate(x, other, first, src, b, slot, pair)

    return row_offsets, load


@cuda.jit(device=True, inline="always")
def t5_bucket(relative_position, num_buckets, max_distance, bidirectional):
    """T5's bucket of key position - query position, its log math in float32 as the reference's."""
    # spec: trtllm/rab-implicit
    bucket = 0
    if bidirectional != 0:
        num_buckets //= 2
        if relative_position > 0:
            bucket += num_buckets
        distance = abs(relative_position)
    else:
        distance = -min(relative_position, 0)
    max_exact = num_buckets // 2
    if distance < max_exact:                            # exact buckets for the near keys
        return bucket + distance
    ratio = np.float32(np.float32(distance) / np.float32(max_exact))
    log_ratio = np.float32(np.float32(math.log(ratio)) / np.float32(math.log(max_distance / max_exact)))
    large = max_exact + np.int64(np.float32(log_ratio * np.float32(num_buckets - max_exact)))
    return bucket + min(large, num_buckets - 1)


@cuda.jit(device=True, inline="always")
def packed_mask_bit(packed, first_tile, row, col, words_per_row):
    """Bit (row, col) of a sequence whose rows start at m-tile first_tile in TensorRT-LLM's packed mask: the word
    of MMA thread t = warp*32 + lane_row*4 + pair in its 64 x 64 tile, bit 4k + 2 half + low (reference/
    packed_mask.py has the layout)."""
    r, c = row % 64, col % 64
    warp, within = r // 16, r % 16
    thread = warp * 32 + (within % 8) * 4 + (c % 8) // 2
    word = (first_tile + row // 64) * (words_per_row // 2) * 128 + (col // 64) * 128 + thread
    return (packed[word] >> (4 * (c // 8) + 2 * (within // 8) + c % 2)) & 1


# What a score can compile in beyond the causal limit (a run-time check): the attention window (and sinks), a custom
# mask (dense or packed), softcap, ALiBi and a relative attention bias. A kernel built for a call compiles in only
# those its arguments use (`score_features`), so no branch of an absent feature costs its instructions or loads.
SCORE_FEATURES = frozenset({"window", "mask", "softcap", "alibi", "relative"})


def score_features(args, longest_keys: int) -> frozenset:
    """The features (SCORE_FEATURES) of a call's ScoreArgs `args` (host values): the window where some query can
    see past it (a key range longer than the window), a mask, softcap, ALiBi, a relative bias where set."""
    used = {"window": int(longest_keys) > int(args.window), "mask": int(args.mask_cols) > 0 or
            int(args.packed_words) > 0, "softcap": float(args.softcap) > 0, "alibi": int(args.alibi_on) != 0,
            "relative": int(args.relative) != 0}
    return frozenset(name for name, on in used.items() if on)


def make_trt_score(acc_t, bits: bool = False, features=SCORE_FEATURES):
    """(score, key_range) of the core: custom mask, causal / window / sinks visibility, softcap, then ALiBi or
    the relative attention bias (a regular (H, L, L) table or implicit T5 buckets) (ScoreArgs); bits: the bias
    holds bfloat16 bits (qkv's dtype); features: those compiled in (the rest the call does not use)."""
    NEG_INF = acc_t(-math.inf)
    WINDOW, MASK, SOFTCAP, ALIBI, RELATIVE = (name in features for name in
                                              ("window", "mask", "softcap", "alibi", "relative"))

    @cuda.jit(device=True, inline="always")
    def bias_value(x):
        return acc_t(widen_bfloat16(x)) if bits else acc_t(x)

    @cuda.jit(device=True, inline="always")
    def score(args, qk, b, h, i, j, seqlen, kvlen):
        # query i sits at position past + i (bottom-right causal); 32-bit, so that a 32-bit key compares once
        p = np.int32(args.table[b, PAST] + i)
        if args.causal != 0 and j > p:
            return NEG_INF
        if WINDOW:
            dense = args.streaming != 0 and args.table[b, IS_CONTEXT] != 0   # StreamingLLM prefill: no window
            if not dense and j <= p - (args.window - args.sinks) and j >= args.sinks:
                return NEG_INF                          # out of the window and not a sink
        if MASK:
            if args.packed_words > 0 and args.table[b, IS_CONTEXT] != 0:
                if packed_mask_bit(args.packed, args.table[b, MASK_TILE], i, j, args.packed_words) == 0:
                    return NEG_INF                      # the context entries' custom mask, packed
            elif args.mask_cols > 0 and not args.mask[(args.table[b, TOKEN_START] + i) * args.mask_cols + j]:
                return NEG_INF                          # custom mask: row = query token, True = attend
        s = qk
        if SOFTCAP and args.softcap > 0:                # after the scaling, before the bias
            s = args.softcap * math.tanh(s / args.softcap)
        if ALIBI and args.alibi_on != 0:
            s = s + acc_t(args.alibi[h]) * acc_t(j - p)
        if RELATIVE:
            if args.relative == 1:                      # regular: relative_attention_bias[h, p, j]
                s = s + bias_value(args.bias[(h * args.bias_len + p) * args.bias_len + j])
            elif args.relative == 2:                    # implicit: relative_attention_bias[h, bucket(j - p)]
                bucket = t5_bucket(j - p, args.bias_len, args.max_distance, args.bidirectional)
                s = s + bias_value(args.bias[h * args.bias_len + bucket])
        return s

    @cuda.jit(device=True, inline="always")
    def key_range(args, b, i_first, i_last, seqlen, kvlen):
        past = args.table[b, PAST]
        hi = kvlen
        if args.causal != 0:
            hi = min(hi, past + i_last + 1)
        lo = 0
        if args.sinks == 0 and args.streaming == 0:     # with sinks the first keys stay in view
            lo = max(0, past + i_first - args.window + 1)
        return lo, hi

    return score, key_range


ScoreArgs = namedtuple("ScoreArgs", "table alibi alibi_on softcap causal window sinks streaming mask mask_cols "
                                    "bias relative bias_len max_distance bidirectional packed packed_words")


def acc_type(dtype):
    """The kernels' accumulator: float64 for a float64 call, else float32 ("bfloat16": its bits)."""
    return np.float32 if isinstance(dtype, str) and dtype == "bfloat16" else \
        np.float64 if np.dtype(dtype) == np.float64 else np.float32



# ---- A new token's Q, K, V element: the preprocess writes it, the generation kernel forms its query from it ----

def make_new_token(dtype, num_heads, num_kv_heads, head_size, rotary_dim, rope_style, has_bias):
    """(element, rotated) device functions of a new token's Q/K/V element, read from `src.qkv` (a Preprocess, or
    anything with its fields qkv, bias and the RoPE ones make_rope's rotate reads): the preprocess kernel's, and
    the generation kernel's, which forms its query rows from qkv itself (trtllm_generation)."""
    acc_t = acc_type(dtype)
    round_dtype = rounder(dtype)
    widen = widen_bfloat16 if round_dtype is round_to_bfloat16 else acc_t     # bfloat16: qkv and bias as bits
    pair_of, rotate = make_rope(rope_style, rotary_dim, round_dtype, acc_t)
    H, HKV, DH = num_heads, num_kv_heads, head_size
    HEADS = H + 2 * HKV

    @cuda.jit(device=True, inline="always")
    def element(pre, token, hh, d):
        """qkv + bias, written in the input dtype (as the preprocessing does), held in acc_t."""
        x = acc_t(widen(pre.qkv[(token * HEADS + hh) * DH + d]))
        if has_bias:
            x = round_dtype(x + acc_t(widen(pre.bias[hh * DH + d])))
        return x

    @cuda.jit(device=True, inline="always")
    def rotated(pre, b, token, position, hh, d):
        """Element d of head hh after RoPE at `position` (Q and K heads; V and d >= rotary_dim pass through)."""
        x = element(pre, token, hh, d)
        if rope_style == 0 or hh >= H + HKV or d >= rotary_dim:
            return x
        pair, first, partner = pair_of(d)
        return rotate(x, element(pre, token, hh, partner), first, pre, b, position, pair)

    return element, rotated


# The preprocess a thread per 16-byte chunk of a head row (8 float16 or bfloat16 values) instead of a thread per
# element: one vector load of qkv (and of the bias), each RoPE pair's cos and sin computed once for both of its
# elements, vector stores. GPT-J's pairs (2i, 2i + 1) lie in one chunk; GPT-NeoX's (d, d + rotary_dim / 2) in two,
# which one thread owns together ("paired" items), so rotary_dim / 2 must be a whole number of chunks.
CHUNK = 8


def chunked_preprocess_ok(dtype, head_size: int, rope_style: int, rotary_dim: int) -> bool:
    """Whether the chunked preprocess serves these compile-time facts (the launcher checks alignment besides):
    16-bit values (float16, bfloat16 as bits), rows of whole chunks, GPT-NeoX halves of whole chunks."""
    bits = isinstance(dtype, str) and dtype == "bfloat16"
    return ((bits or np.dtype(dtype) == np.float16) and head_size % CHUNK == 0
            and (rope_style != ROPE_GPT_NEOX or (rotary_dim // 2) % CHUNK == 0))


def preprocess_items(chunked: bool, head_size: int, rope_style: int, rotary_dim: int) -> int:
    """Threads of the preprocess per head of a token: an element each, or a chunk each (GPT-NeoX: the chunks of
    the first half of the rotary dims each with its partner chunk, the chunks past rotary_dim alone)."""
    if not chunked:
        return head_size
    return head_size // CHUNK - (rotary_dim // 2 // CHUNK if rope_style == ROPE_GPT_NEOX else 0)


def make_new_chunks(dtype, num_heads, num_kv_heads, head_size, rotary_dim, rope_style, has_bias):
    """(chunk_starts, new_chunks) device functions of the chunked preprocess (`chunked_preprocess_ok`).

    chunk_starts(item) -> (d0, d1): the first elements of the item's chunks in its head row (d1 -1: one chunk).
    new_chunks(pre, b, token, position, hh, d0, d1, x, y): elements d0.. (and d1.. at x[CHUNK:]) of head hh of the
    new token as `make_new_token`'s element (x) and rotated (y) form them, bit for bit: qkv + bias rounded to the
    input dtype, then RoPE at `position` for Q and K heads, each pair's coefficients computed once."""
    acc_t = acc_type(dtype)
    round_dtype = rounder(dtype)
    bf16 = round_dtype is round_to_bfloat16
    coefficients, turn = make_rope_pairs(rotary_dim, round_dtype, acc_t)
    H, HKV, DH = num_heads, num_kv_heads, head_size
    HEADS = H + 2 * HKV
    PAIRED = rotary_dim // 2 // CHUNK if rope_style == ROPE_GPT_NEOX else 0     # paired items of a head
    SPAN = 2 * CHUNK

    @cuda.jit(device=True, inline="always")
    def chunk_starts(item):
        if PAIRED > 0 and item < PAIRED:               # without pairs d1 is -1 at compile time
            return item * CHUNK, (item + PAIRED) * CHUNK
        return (item + PAIRED) * CHUNK, -1

    @cuda.jit(device=True, inline="always")
    def value(word, k):
        field = (word >> (16 * k)) & 0xFFFF             # little-endian: element 2j + k is word j's k-th half
        return acc_t(widen_bfloat16(field)) if bf16 else acc_t(half_from_bits(field))

    @cuda.jit(device=True, inline="always")
    def load_chunk(pre, token, hh, d0, x, at):
        """x[at:at + CHUNK] = qkv + bias of elements d0.. of head hh (make_new_token's element)."""
        words = load16(pre.qkv, (token * HEADS + hh) * DH + d0)
        if has_bias:
            bias = load16(pre.bias, hh * DH + d0)
        for j in range(CHUNK // 2):
            for k in range(2):
                v = value(words[j], k)
                if has_bias:
                    v = round_dtype(v + value(bias[j], k))
                x[at + 2 * j + k] = v

    @cuda.jit(device=True, inline="always")
    def new_chunks(pre, b, token, position, hh, d0, d1, x, y):
        load_chunk(pre, token, hh, d0, x, 0)
        if PAIRED > 0 and d1 >= 0:
            load_chunk(pre, token, hh, d1, x, CHUNK)
        for e in range(SPAN):
            y[e] = x[e]
        if rope_style == 0 or hh >= H + HKV:
            return                                      # V heads pass through
        if rope_style == ROPE_GPT_NEOX:
            if PAIRED > 0 and d1 >= 0:                                # pairs (d0 + e, d1 + e): pair index d0 + e
                for e in range(CHUNK):
                    cos, sin = coefficients(pre, b, position, d0 + e)
                    y[e] = turn(x[e], x[CHUNK + e], True, cos, sin)
                    y[CHUNK + e] = turn(x[CHUNK + e], x[e], False, cos, sin)
            return
        for e in range(0, CHUNK, 2):                    # GPT-J: pairs (2i, 2i + 1), pair index i
            if d0 + e < rotary_dim:
                cos, sin = coefficients(pre, b, position, (d0 + e) // 2)
                y[e] = turn(x[e], x[e + 1], True, cos, sin)
                y[e + 1] = turn(x[e + 1], x[e], False, cos, sin)

    return chunk_starts, new_chunks


# ---- 16-byte chunks of a cached row ---------------------------------------------------------------------------

# The e4m3 bits shifted into a float16's place give the e4m3 value / 256 (float16's exponent bias is 8 more): the
# folded FP8 scale carries the 256, exactly.
FP8_AS_HALF = 256.0


def chunk_elements(cache_itemsize: int) -> int:
    """Elements in one 16-byte chunk of the cache: 8 float16, 4 float32, 16 INT8 or e4m3 codes."""
    return VECTOR_BYTES // cache_itemsize


def vector_loads_ok(cache_array, head_size: int) -> bool:
    """Whether every cache row can be read in 16-byte loads: rows are head_size elements apart in both layouts
    (slots, heads, blocks and rows are multiples of a row), so a row of a whole number of 16-byte chunks and data
    starting on a 16-byte boundary make every chunk aligned (decided on the host, once per launch)."""
    itemsize = np.dtype(cache_array.dtype).itemsize
    return itemsize <= 4 and (head_size * itemsize) % VECTOR_BYTES == 0 and _address(cache_array) % VECTOR_BYTES == 0


def fold_factor(quant: int) -> float:
    """What a folded load leaves out of a cached value besides the per-tensor scale: 256 for e4m3 read as float16."""
    return FP8_AS_HALF if quant == FP8_KV_CACHE else 1.0


def make_generation_chunk_load(quant: int, elements: int, vector: bool, fold: bool, round_dtype, num_kv_heads: int,
                               head_size: int, rope_style: int = 0, rotary_dim: int = 0, new_in_cache: bool = False):
    """Device function load_chunk(src, row, where, d0, regs, at, dims) of the vector kernel: elements d0 ..
    d0 + elements - 1 of a K or V row (those below dims) into regs[at:], as float32.

    where 0: the new token, from the scratch (unquantized; divided by the folded scale when `fold`; never with
    new_in_cache, which compiles that path out). Else a cached row: with `vector` one 16-byte load unpacked in
    registers, else one load per element. `fold` (INT8 / FP8 caches): the codes as float32 (e4m3: value / 256),
    the caller multiplies by the scale; else each value as the rung-1 kernel loads it (`make_trt_access`: code *
    scale rounded to float32). StreamingLLM's keys (rope_style != 0, src.rotate) are rotated at their cache index
    as the rung-1 kernel rotates them: after the vector load, with the pair partner from the same chunk (GPT-J) or
    from a second vector load rotary_dim / 2 away (GPT-NeoX, when that is a whole number of chunks), else element
    by element. round_dtype bfloat16's: the scratch and an unquantized cache hold bfloat16 bits (widened by a
    shift)."""
    bf16 = round_dtype is round_to_bfloat16
    _, load = make_trt_access(quant, num_kv_heads, head_size, np.float32, round_dtype, rope_style, rotary_dim)
    pair_of, rotate = make_rope(rope_style, rotary_dim, round_dtype, np.float32, tables=False)
    fold = fold and quant != 0
    factor = np.float32(fold_factor(quant))
    bits = 8 if quant else 128 // elements             # 16-byte chunks: float16 or float32 values, 8-bit codes
    per_word = 32 // bits
    words = elements // per_word
    field_mask = (1 << bits) - 1
    nan = np.float32(math.nan)
    half = rotary_dim // 2
    rotate_in_registers = vector and rope_style != 0 and (rope_style == ROPE_GPTJ or half % elements == 0)

    @cuda.jit(device=True, inline="always")
    def code_value(code):
        """A cached code's value without the per-tensor scale (e4m3: / 256); NaN for e4m3's NaN codes."""
        c = np.int32(code) & 0xFF
        if quant == INT8_KV_CACHE:
            return np.float32(np.int32(c ^ 0x80) - 0x80)     # the byte's two's complement
        if c & 0x7F == 0x7F:
            return nan
        return half_from_bits(np.uint32(((c & 0x80) << 8) | ((c & 0x7F) << 7)))

    @cuda.jit(device=True, inline="always")
    def unpack(src, loaded, regs, at):
        """The chunk's 16 loaded bytes (four words) as values in regs[at:]."""
        for j in range(words):
            for k in range(per_word):                   # little-endian: element e is the e-th field from bit 0
                field = (loaded[j] >> (bits * k)) & field_mask
                if quant == 0:
                    x = float_from_bits(field) if bits == 32 else widen_bfloat16(field) if bf16 else \
                        half_from_bits(field)
                elif fold:
                    x = code_value(field)
                elif quant == INT8_KV_CACHE:            # the reference's decode: code * scale in float32
                    x = np.float32(code_value(field) * src.scale)
                else:
                    x = np.float32(code_value(field) * factor * src.scale)
                regs[at + j * per_word + k] = x

    @cuda.jit(device=True, inline="always")
    def load_chunk(src, row, where, d0, regs, at, dims):
        if not new_in_cache and where == 0:             # the new token, unquantized
            inv = np.float32(1.0) / (src.scale * factor) if fold else np.float32(1.0)
            for e in range(elements):
                if d0 + e < dims:
                    x = widen_bfloat16(src.scratch[row + d0 + e]) if bf16 else np.float32(src.scratch[row + d0 + e])
                    regs[at + e] = x * inv if fold else x
            return
        rotated = rope_style != 0 and src.rotate != 0 and d0 < rotary_dim
        if not vector or (rotated and not rotate_in_registers):
            for e in range(elements):
                if d0 + e < dims:
                    regs[at + e] = code_value(src.cache[row + d0 + e]) if fold else load(src, row, where, d0 + e)
            return
        unpack(src, load16(src.cache, row + d0), regs, at)
        if rotate_in_registers and rotated:
            partner = cuda.local.array(elements, np.float32)
            if rope_style == ROPE_GPTJ:                 # pairs (2i, 2i + 1): both in this chunk
                for e in range(elements):
                    partner[e] = regs[at + (e ^ 1)]
            else:                                       # halves: the chunk rotary_dim / 2 away
                unpack(src, load16(src.cache, row + (d0 + half if d0 < half else d0 - half)), partner, 0)
            b, slot = entry_and_slot(where)
            for e in range(elements):
                if d0 + e < rotary_dim:
                    pair, first, _ = pair_of(d0 + e)
                    regs[at + e] = rotate(regs[at + e], partner[e], first, src, b, slot, pair)

    return load_chunk

