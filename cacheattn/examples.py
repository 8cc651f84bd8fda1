"""Example problems for every operator, shared by the tour, the docs, the benchmarks, the tests and the
conformance kit.

A case (`PPLCase`, `StaticCase`, `OnnxCase`, `FTCase`, `TrtCase`) is a small frozen record of the attributes
and per-batch lengths; `build_*` turns it into the operator's NumPy arguments from its `seed`, and
`float64_*` evaluates the reference on float64 copies, the exact answer a result is compared with through
`within_tolerance`. Old cache contents are random plausible data (never zeros), so a kernel that reads the
wrong slot shows.

Examples
--------
>>> import numpy as np, cacheattn
>>> from cacheattn.examples import OnnxCase, build_onnx, float64_onnx, within_tolerance
>>> case = OnnxCase(batch=1, q_heads=4, kv_heads=2, q_len=3, kv_len=5, past_len=2, head_size=8, v_head_size=8,
...                 three_d=False, dtype="float16", mask="bool", mask_shape=(3, 7), is_causal=1, nonpad=None,
...                 softcap=0.0, scale=None, left_window_size=-1, right_window_size=-1, qk_matmul_output_mode=0,
...                 seed=1)
>>> inputs = build_onnx(case)
>>> got = cacheattn.onnx_attention(**inputs, **case.attrs())
>>> bool(within_tolerance(got.Y, float64_onnx(inputs, case)[0], "float16").all())
True
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TypeVar

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike, DTypeLike

import reference
from reference.cache_layout import DYNAMIC_LAYOUTS, STATIC_LAYOUTS
from reference.quant import stored_head_dim

CaseT = TypeVar("CaseT")       # any of the frozen case records below

# (atol, rtol) against a float64 evaluation of the reference. float16 carries 11 significand bits (unit
# roundoff 4.9e-4); the probabilities are rounded to it before P.V, so a few roundoffs add up.
TOLERANCE = {
    np.dtype(ml_dtypes.bfloat16): (3.1e-2, 3.1e-2),    # 8 unit roundoffs (2^-8), as float16's 4e-3 is 8 of 2^-11
    np.dtype(np.float16): (4e-3, 4e-3),
    np.dtype(np.float32): (2e-5, 2e-5),
    np.dtype(np.float64): (1e-12, 1e-12),
}


def within_tolerance(got: ArrayLike, want: ArrayLike, dtype: DTypeLike, scale: float = 1.0) -> np.ndarray:
    """Elementwise: is `got` within `dtype`'s tolerance of the float64 `want`?

    `|got - want| <= atol + rtol * |want|` with `(atol, rtol)` from `TOLERANCE[dtype]` times `scale`;
    NaN is never within.

    Parameters
    ----------
    got : array_like
        The result under test, any float dtype.
    want : array_like
        The float64 evaluation, broadcastable against `got`.
    dtype : str or numpy.dtype
        The dtype the result was computed in: float16, bfloat16, float32 or float64.
    scale : float, default 1.0
        Widens both tolerances (for a longer chain of roundings).

    Returns
    -------
    numpy.ndarray
        bool, the broadcast shape of `got` and `want`.

    Examples
    --------
    >>> from cacheattn.examples import within_tolerance
    >>> within_tolerance([1.003, 1.01], [1.0, 1.0], "float16").tolist()
    [True, False]
    """
    atol, rtol = (t * scale for t in TOLERANCE[np.dtype(dtype)])
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(g - w) <= atol + rtol * np.abs(w)


@dataclass(frozen=True)
class PPLCase:
    """One dynamic_batching call of OpenPPL (MultiHeadCacheAttention and its two halves).

    Sequence b has `past[b]` cached tokens and `seqlens[b]` current ones (decode steps, the first
    `decoding_batches`, have 1); the other fields are the operator's attributes, plus `dtype` (query and
    current K/V), `scale_dtype`, `mask` ("none", "2d", "3d") with `mask_pad` extra columns, and `seed`.
    `cacheattn.testing.strategies.ppl_cases` draws them.

    Examples
    --------
    >>> from cacheattn.examples import PPLCase, build_ppl
    >>> case = PPLCase(seqlens=(1, 3), past=(4, 2), decoding_batches=1, num_heads=4, num_kv_heads=2, head_dim=16,
    ...                dtype="float16", quant_bit=8, quant_group=8, scale_dtype="float16", cache_layout=1,
    ...                cache_mode=1, page_size=4, num_layer=2, layer_idx=1, is_causal=True, is_alibi=False,
    ...                mask="none", mask_pad=0, seed=3)
    >>> case.kvlens, build_ppl(case)["cachestarts"].shape
    ((5, 5), (2, 3))
    """
    """One MultiHeadCacheAttention call: attributes plus the per-batch lengths; tensors come from `seed`."""
    seqlens: tuple
    past: tuple                 # start_pos per batch
    decoding_batches: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    quant_bit: int
    quant_group: int
    scale_dtype: str
    cache_layout: int
    cache_mode: int
    page_size: int
    num_layer: int
    layer_idx: int
    is_causal: bool
    is_alibi: bool
    mask: str                   # "none", "2d", "3d"
    mask_pad: int               # extra mask columns beyond sum kvlens
    seed: int

    @property
    def batch(self):
        return len(self.seqlens)

    @property
    def kvlens(self):
        return tuple(s + p for s, p in zip(self.seqlens, self.past))

    def attrs(self) -> dict:
        """Keyword attributes of `cacheattn.multi_head_cache_attention`."""
        return dict(num_heads=self.num_heads, head_dim=self.head_dim, is_causal=self.is_causal,
                    is_alibi=self.is_alibi, num_kv_heads=self.num_kv_heads, num_layer=self.num_layer,
                    layer_idx=self.layer_idx, quant_bit=self.quant_bit, quant_group=self.quant_group,
                    cache_mode=self.cache_mode, cache_layout=self.cache_layout, page_size=self.page_size)


def cache_shape(layout_axes: str, extents: dict) -> tuple:
    """The shape of a cache laid out as `layout_axes` (e.g. "L T KV H D"), from `{axis name: extent}`."""
    return tuple(extents[n] for n in layout_axes.split())


def random_cache(rng: np.random.Generator, shape: tuple, quant_bit: int, dtype: DTypeLike) -> np.ndarray:
    """A cache full of plausible old data (never zeros): int8 codes (`quant_bit` 8), any bytes (4: every byte
    is two valid nibbles) or standard normal values in `dtype`."""
    if quant_bit == 8:
        return rng.integers(-127, 128, shape).astype(np.int8)
    if quant_bit == 4:
        return rng.integers(-128, 128, shape).astype(np.int8)      # any byte is two valid nibbles
    return rng.standard_normal(shape).astype(dtype)


def random_scale(rng: np.random.Generator, shape: tuple, dtype: DTypeLike) -> np.ndarray:
    """Plausible int8/int4 scales, uniform in [0.005, 0.055)."""
    return (rng.random(shape) * 0.05 + 0.005).astype(dtype)


def place_batches(rng: np.random.Generator, kvlens: tuple, case: PPLCase) -> tuple[np.ndarray, int]:
    """Where each sequence lives: `(cachestarts, MaxT)`.

    `cache_mode` 0: `(B,)` offsets of non-overlapping regions in shuffled order, with a little slack between
    them. `cache_mode` 1: a `(B, MaxP)` page table of shuffled whole pages (one spare page nobody owns), unused
    entries -1.
    """
    if case.cache_mode == 0:
        slack = [int(rng.integers(0, 3)) for _ in kvlens]
        regions = rng.permutation(len(kvlens))
        starts, offset = np.zeros(len(kvlens), np.int64), 0
        for b in regions:
            starts[b] = offset
            offset += kvlens[b] + slack[b]
        return starts, offset + 1
    pages = [-(-k // case.page_size) for k in kvlens]
    total = sum(pages) + 1                                          # one spare page nobody owns
    order = rng.permutation(total) * case.page_size
    table = np.full((len(kvlens), max(pages) + 1), -1, np.int64)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n]
        used += n
    return table, total * case.page_size


def build_ppl(case: PPLCase) -> dict:
    """The NumPy arguments of `cacheattn.multi_head_cache_attention` for `case`, by the document's names.

    Returns
    -------
    dict
        `query`, `current_key`, `current_value`, `seqstarts`, `kvstarts`, `cachestarts`, `start_pos`,
        `decoding_batches`, `max_seqlen`, `max_kvlen`, `cache` (random old data), `scale` (or None) and
        `attn_mask` (or None; about a tenth of it -inf). Pass `**build_ppl(case), **case.attrs()`.
    """
    rng = np.random.default_rng(case.seed)
    dtype = np.dtype(case.dtype)
    seqstarts = np.concatenate([[0], np.cumsum(case.seqlens)]).astype(np.int64)
    kvstarts = np.concatenate([[0], np.cumsum(case.kvlens)]).astype(np.int64)
    tokens, total_kv = int(seqstarts[-1]), int(kvstarts[-1])
    cachestarts, max_t = place_batches(rng, case.kvlens, case)
    stored = stored_head_dim(case.head_dim, case.quant_bit)
    extents = dict(L=case.num_layer, KV=2, T=max_t, H=case.num_kv_heads, D=stored)
    shape = cache_shape(DYNAMIC_LAYOUTS[case.cache_layout], extents)
    scale = None
    if case.quant_bit:
        scale = random_scale(rng, cache_shape(DYNAMIC_LAYOUTS[case.cache_layout],
                                              {**extents, "D": case.head_dim // case.quant_group}), case.scale_dtype)
    mask = None
    if case.mask != "none":
        lead = (case.num_heads,) if case.mask == "3d" else ()
        mask = (rng.standard_normal(lead + (tokens, total_kv + case.mask_pad)) * 0.5).astype(dtype)
        mask[rng.random(mask.shape) < 0.1] = -np.inf                 # some hidden keys too
    return dict(
        query=rng.standard_normal((tokens, case.num_heads, case.head_dim)).astype(dtype),
        current_key=rng.standard_normal((tokens, case.num_kv_heads, case.head_dim)).astype(dtype),
        current_value=rng.standard_normal((tokens, case.num_kv_heads, case.head_dim)).astype(dtype),
        seqstarts=seqstarts, kvstarts=kvstarts, cachestarts=cachestarts,
        start_pos=np.asarray(case.past, np.int64), decoding_batches=case.decoding_batches,
        max_seqlen=max(case.seqlens), max_kvlen=max(case.kvlens),
        cache=random_cache(rng, shape, case.quant_bit, dtype), scale=scale, attn_mask=mask)


def copy_inputs(inputs: dict) -> dict:
    """The same arguments with every NumPy array copied, so two calls start from the same cache."""
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}


@dataclass(frozen=True)
class StaticCase:
    """One static `KeyValueCache` call: `batch` of `max_batch` rows, `seqlen` tokens at `start_pos` in a cache of
    `max_seqlen` positions, and the operator's attributes. `cacheattn.testing.strategies.static_cases` draws
    them."""
    batch: int
    max_batch: int
    seqlen: int
    start_pos: int
    max_seqlen: int
    num_heads: int
    head_dim: int
    dtype: str
    quant_bit: int
    quant_group: int
    num_layer: int
    layer_idx: int
    num_repeat: int
    cache_layout: int
    seed: int


def build_static(case: StaticCase) -> dict:
    """The NumPy arguments of `cacheattn.key_value_cache` for `case`: `current_key`, `current_value`,
    `start_pos`, `cache` (random old data) and `scale` (float32, or None)."""
    rng = np.random.default_rng(case.seed)
    dtype = np.dtype(case.dtype)
    stored = stored_head_dim(case.head_dim, case.quant_bit)
    extents = dict(B=case.max_batch, L=case.num_layer, KV=2, T=case.max_seqlen, H=case.num_heads, D=stored)
    axes = STATIC_LAYOUTS[case.cache_layout]
    current = (case.batch, case.seqlen, case.num_heads, case.head_dim)
    scale = None
    if case.quant_bit:
        scale = random_scale(rng, cache_shape(axes, {**extents, "D": case.head_dim // case.quant_group}),
                             np.float32)
    return dict(current_key=rng.standard_normal(current).astype(dtype),
                current_value=rng.standard_normal(current).astype(dtype), start_pos=case.start_pos,
                cache=random_cache(rng, cache_shape(axes, extents), case.quant_bit, dtype), scale=scale)


def with_(case: CaseT, **changes) -> CaseT:
    """A copy of the (frozen) case with some fields changed: `with_(case, dtype="float32")`."""
    return replace(case, **changes)


def float64_ppl_attention(inputs: dict, case: PPLCase, key: ArrayLike, value: ArrayLike) -> np.ndarray:
    """A float64 evaluation of dynamic MultiHeadAttention for a PPL case, given the packed `key`/`value` the
    cache holds (exact, from `reference_cache_state`). Quantization is checked bit for bit elsewhere, so this
    isolates the attention arithmetic. Returns `(seqstarts[B], num_heads, head_dim)` float64."""
    f64 = np.float64
    mask = inputs["attn_mask"]
    return reference.dynamic_multi_head_attention(
        inputs["query"].astype(f64), np.asarray(key).astype(f64), np.asarray(value).astype(f64),
        inputs["seqstarts"], inputs["kvstarts"], inputs["decoding_batches"], inputs["max_seqlen"],
        inputs["max_kvlen"], None if mask is None else mask.astype(f64), num_heads=case.num_heads,
        head_dim=case.head_dim, is_causal=case.is_causal, is_alibi=case.is_alibi, num_kv_heads=case.num_kv_heads)


def reference_cache_state(inputs: dict, case: PPLCase) -> tuple:
    """`(key, value, cache, scale)`: the reference's packed key/value and the cache/scale after its store, run
    on copies of the inputs (which are left as they were)."""
    x = copy_inputs(inputs)
    key, value = reference.dynamic_key_value_cache(
        x["current_key"], x["current_value"], x["seqstarts"], x["kvstarts"], x["cachestarts"], x["start_pos"],
        x["max_seqlen"], x["max_kvlen"], x["cache"], x["scale"], num_layer=case.num_layer, layer_idx=case.layer_idx,
        quant_bit=case.quant_bit, quant_group=case.quant_group, cache_mode=case.cache_mode,
        cache_layout=case.cache_layout, page_size=case.page_size)
    return key, value, x["cache"], x["scale"]


@dataclass(frozen=True)
class OnnxCase:
    """One ONNX Attention call; tensors come from `seed`. `opset` is 25 when a window is set, else 24;
    `cacheattn.testing.strategies.onnx_cases` draws them."""
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    past_len: int               # 0: no past_key / past_value
    head_size: int
    v_head_size: int
    three_d: bool
    dtype: str
    mask: str                   # "none", "bool", "float"
    mask_shape: tuple           # broadcastable to (batch, q_heads, q_len, total), last dim maybe shorter
    is_causal: int
    nonpad: tuple | None        # nonpad_kv_seqlen (only without past)
    softcap: float
    scale: float | None
    left_window_size: int
    right_window_size: int
    qk_matmul_output_mode: int
    seed: int

    @property
    def total(self):
        return self.past_len + self.kv_len

    @property
    def opset(self):
        return 25 if (self.left_window_size, self.right_window_size) != (-1, -1) else 24

    def attrs(self) -> dict:
        """Keyword attributes of `cacheattn.onnx_attention` (3-D cases name the head counts)."""
        heads = dict(q_num_heads=self.q_heads, kv_num_heads=self.kv_heads) if self.three_d else {}
        return dict(is_causal=self.is_causal, softcap=self.softcap, scale=self.scale,
                    left_window_size=self.left_window_size, right_window_size=self.right_window_size,
                    qk_matmul_output_mode=self.qk_matmul_output_mode, opset=self.opset, **heads)


def onnx_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a dtype name, "bfloat16" being ml_dtypes' type."""
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def build_onnx(case: OnnxCase) -> dict:
    """The ONNX-named inputs for `case`: `Q`, `K`, `V` (3-D or 4-D), `attn_mask` (bool, or float with some
    -inf; or None), `past_key`, `past_value` (or None) and `nonpad_kv_seqlen` (or None)."""
    rng = np.random.default_rng(case.seed)
    dtype = onnx_dtype(case.dtype)

    def tensor(heads, seq, size):
        x = rng.standard_normal((case.batch, heads, seq, size))
        if case.three_d:
            x = x.transpose(0, 2, 1, 3).reshape(case.batch, seq, heads * size)
        return np.ascontiguousarray(x).astype(dtype)

    past = case.past_len > 0
    mask = None
    if case.mask == "bool":
        mask = rng.random(case.mask_shape) < 0.8
    elif case.mask == "float":
        mask = (rng.standard_normal(case.mask_shape) * 0.5).astype(dtype)
        mask[rng.random(case.mask_shape) < 0.1] = -np.inf
    pk = rng.standard_normal((case.batch, case.kv_heads, case.past_len, case.head_size)).astype(dtype)
    pv = rng.standard_normal((case.batch, case.kv_heads, case.past_len, case.v_head_size)).astype(dtype)
    return dict(Q=tensor(case.q_heads, case.q_len, case.head_size),
                K=tensor(case.kv_heads, case.kv_len, case.head_size),
                V=tensor(case.kv_heads, case.kv_len, case.v_head_size),
                attn_mask=mask, past_key=pk if past else None, past_value=pv if past else None,
                nonpad_kv_seqlen=None if case.nonpad is None else np.asarray(case.nonpad, np.int64))


def float64_onnx(inputs: dict, case: OnnxCase, **overrides) -> tuple:
    """The reference on float64 copies, as `(Y, present_key, present_value, qk_matmul_output)`.

    `sqrt(scale)` is first rounded as the case's dtype holds it, so the evaluation differs from a run in that
    dtype only by its arithmetic. `overrides` replace attributes of the case.
    """
    dtype = onnx_dtype(case.dtype)
    root = float(np.asarray(np.sqrt(case.scale or 1 / np.sqrt(case.head_size))).astype(dtype))
    # Floating tensors (bfloat16's numpy kind is "V") widen to float64; bool masks and lengths stay.
    x = {k: v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind in "fV" else v
         for k, v in inputs.items()}
    attrs = {**case.attrs(), "scale": root * root, **overrides}
    return reference.onnx_attention(**x, **{k: v for k, v in attrs.items() if k != "opset"},
                                    return_qk_matmul_output=True)


# ---- FasterTransformer cross attention

@dataclass(frozen=True)
class FTCase:
    """One `cacheattn.cross_attention` step; tensors (weights, old caches and buffers too) come from `seed`.
    `cacheattn.testing.strategies.ft_cases` draws them."""
    lengths: tuple              # encoder_sequence_length per batch, in [1, mem_len]
    mem_len: int                # mem_max_seq_len
    head_num: int
    size_per_head: int
    d_model: int
    mem_d_model: int
    dtype: str
    is_batch_major_cache: bool
    step: int
    finished: tuple | None      # bool per batch, or None
    num_tasks: int              # 0: no IA3 weights
    ia3_tasks: tuple | None     # needs num_tasks > 0
    max_decoder_seq_len: int    # 0: no cross_attentions output
    context_buf: bool           # pass an old context buffer to write into
    q_scaling: float
    seed: int

    @property
    def batch(self):
        return len(self.lengths)

    def attrs(self) -> dict:
        """Keyword attributes of `cacheattn.cross_attention` (besides `weights`)."""
        return dict(head_num=self.head_num, size_per_head=self.size_per_head, q_scaling=self.q_scaling,
                    is_batch_major_cache=self.is_batch_major_cache)


def build_ft(case: FTCase) -> dict:
    """The arguments of `cacheattn.cross_attention` for `case`, by FasterTransformer's names, `weights` (an
    `AttentionWeight`) included; caches and buffers hold plausible old data."""
    from reference.ft_cross_attention import chunk_elements

    from ._types import AttentionWeight, DenseWeight

    rng = np.random.default_rng(case.seed)
    dtype = np.dtype(case.dtype)
    batch, length, heads, dim = case.batch, case.mem_len, case.head_num, case.size_per_head
    hidden = heads * dim

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    def dense(rows, cols):      # weights scaled by 1/sqrt(rows): projections stay O(1) in float16
        return DenseWeight(normal(rows, cols, scale=rows ** -0.5), normal(cols, scale=0.5))

    ia3 = (None, None)
    if case.num_tasks:
        ia3 = tuple(DenseWeight((1 + rng.standard_normal((case.num_tasks, hidden)) * 0.25).astype(dtype))
                    for _ in range(2))
    weights = AttentionWeight(dense(case.d_model, hidden), dense(case.mem_d_model, hidden),
                              dense(case.mem_d_model, hidden), dense(hidden, case.d_model), *ia3)
    x = chunk_elements(dtype)
    if case.is_batch_major_cache:
        k_shape, v_shape = (batch, heads, dim // x, length, x), (batch, heads, length, dim)
    else:
        k_shape = v_shape = (batch, length, heads, dim)
    cross = None
    if case.max_decoder_seq_len:
        cross = rng.random((batch, heads, case.max_decoder_seq_len, length)).astype(np.float32)
    return dict(
        input_query=normal(batch, case.d_model), encoder_output=normal(batch, length, case.mem_d_model),
        encoder_sequence_length=np.asarray(case.lengths, np.int64), step=case.step,
        key_cache=normal(*k_shape), value_cache=normal(*v_shape),
        finished=None if case.finished is None else np.asarray(case.finished, bool),
        ia3_tasks=None if case.ia3_tasks is None else np.asarray(case.ia3_tasks, np.int64),
        context_buf=normal(batch, hidden) if case.context_buf else None, cross_attentions=cross, weights=weights)


def float64_ft(inputs: dict, case: FTCase) -> tuple:
    """The reference on float64 copies of every floating tensor (weights too): `(hidden_features, context,
    key_cache, value_cache, cross_attentions)`, the last four as the call left them."""
    from ._types import AttentionWeight, DenseWeight

    def wide(a):
        return a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a

    x = {k: wide(v) for k, v in inputs.items()}
    x["weights"] = AttentionWeight(*(None if w is None else DenseWeight(wide(w.kernel), wide(w.bias))
                                     for w in inputs["weights"]))
    hidden, context = reference.cross_attention(**x, **case.attrs())
    return hidden, context, x["key_cache"], x["value_cache"], x["cross_attentions"]


# ---- TensorRT-LLM gpt_attention ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrtCase:
    """One gpt_attention call. Context requests come first, one entry each; a generation sequence is
    `beam_width` entries (its beams), one token each. Tensors come from `seed`."""
    contexts: tuple             # (past, new tokens) per context request; past > 0 is a chunked context
    generations: tuple          # (prompt length, past) per generation sequence
    beam_width: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str
    capacity: int               # cache_indirection.shape[2]: the cache's token capacity
    window: int                 # host_max_attention_window_sizes[layer_idx]
    sinks: int = 0
    streamingllm: bool = False
    paged: bool = False
    tokens_per_block: int = 4
    packed: bool = True
    quant: int = 0              # QuantMode: 0, 64 (INT8) or 128 (FP8)
    fp8_context_fmha: bool = False
    position: int = 0           # PositionEmbeddingType value
    rotary_dim: int = 0
    rotary_scale_type: int = 0
    rotary_scale: float = 1.0
    mask_type: int = 1
    softcap: float = 0.0
    q_scaling: float = 1.0
    relative: str = "none"      # "regular" (H, L, L) or "t5" (H, num_buckets), with position 6
    qkv_bias: bool = False
    num_layers: int = 1
    layer_idx: int = 0
    seed: int = 0
    encoder_lengths: tuple = ()  # cross attention: encoder_input_lengths per entry (empty: self attention)
    context_fmha_type: int = 1
    rope_table: bool = False    # rotary_inv_freq and rotary_cos_sin from the host helpers (always for 3 and 8)
    logn: bool = False          # logn_scaling (Qwen), seq_length 3: factors above 1 from position 3 on
    packed_mask: bool = False   # custom_mask also as attention_packed_mask (the context requests read it)

    @property
    def past(self):
        return [p for p, _ in self.contexts] + [p for _, p in self.generations for _ in range(self.beam_width)]

    @property
    def new(self):
        return [n for _, n in self.contexts] + [1] * (len(self.generations) * self.beam_width)

    @property
    def context_lengths(self):
        return [n for _, n in self.contexts] + [c for c, _ in self.generations for _ in range(self.beam_width)]

    @property
    def entries(self):
        return len(self.contexts) + len(self.generations) * self.beam_width

    @property
    def lengths(self):
        return [p + n for p, n in zip(self.past, self.new)]

    def __repr__(self):
        # The inputs added with the rest of TensorRT-LLM's signature show only when set: a reproducer stays short and
        # reads as it did for calls without them.
        shown = [f for f in fields(self)
                 if f.name not in ("rope_table", "logn", "packed_mask") or getattr(self, f.name) != f.default]
        return f"TrtCase({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"


def _trt_slots(case: TrtCase) -> int:
    """Cache slots a row needs: the capacity, plus the paged bubble after the sinks."""
    bubble = reference.trtllm_gpt_attention.paged_bubble(case.sinks, case.tokens_per_block) if case.paged else 0
    return case.capacity + bubble


def trt_kv_scale(quant: int) -> float:
    """The per-tensor scale s of the examples' INT8/FP8 caches (N(0, 1) data stays well inside the range)."""
    return {64: 0.04, 128: 0.02}.get(quant, 1.0)


def random_trt_cache(rng, shape, case: TrtCase):
    """Plausible old cache contents (never zeros): N(0, 1) keys and values as int8 codes, e4m3 codes or floats.
    Codes drawn uniformly over all of int8 would be keys of about 3 x the new ones' size, whose logits float16
    cannot round as finely as the tolerances assume."""
    x = rng.standard_normal(shape)
    if case.quant == 64:
        return np.clip(np.rint(x / trt_kv_scale(64)), -127, 127).astype(np.int8)
    if case.quant == 128:
        return (x / trt_kv_scale(128)).astype(reference.trtllm_gpt_attention.fp8_e4m3())
    return x.astype(case.dtype)


def build_trt(case: TrtCase) -> dict:
    """Keyword arguments of cacheattn.gpt_attention for a case (NumPy)."""
    rng = np.random.default_rng(case.seed)
    dtype = np.dtype(case.dtype)
    H, Hkv, Dh, E = case.num_heads, case.num_kv_heads, case.head_size, case.entries
    hidden = (H + 2 * Hkv) * Dh
    new = np.asarray(case.new, np.int64)
    if case.packed:
        qkv = rng.standard_normal((int(new.sum()), hidden)).astype(dtype)
    else:
        qkv = rng.standard_normal((E, int(new.max()), hidden)).astype(dtype)
    slots = _trt_slots(case)
    args = dict(qkv=qkv, past_key_value=None, sequence_length=np.asarray(case.lengths, np.int32),
                host_past_key_value_lengths=np.asarray(case.past, np.int32),
                host_max_attention_window_sizes=np.full(case.num_layers, case.window, np.int32),
                host_sink_token_length=np.asarray([case.sinks], np.int32),
                context_lengths=np.asarray(case.context_lengths, np.int32),
                cache_indirection=rng.integers(0, case.beam_width, (max(1, len(case.generations)), case.beam_width,
                                                                     case.capacity)).astype(np.int32),
                host_request_types=np.asarray([0] * len(case.contexts) + [1] * (E - len(case.contexts)), np.int32),
                layer_idx=case.layer_idx, num_heads=H, num_kv_heads=Hkv, hidden_size_per_head=Dh,
                q_scaling=case.q_scaling, attn_logit_softcapping_scale=case.softcap,
                rotary_embedding_dim=case.rotary_dim, rotary_embedding_scale_type=case.rotary_scale_type,
                rotary_embedding_scale=case.rotary_scale, rotary_embedding_max_positions=8,
                position_embedding_type=case.position, kv_cache_quant_mode=case.quant, mask_type=case.mask_type,
                remove_input_padding=case.packed, paged_kv_cache=case.paged, tokens_per_block=case.tokens_per_block,
                streamingllm=case.streamingllm, use_fp8_context_fmha=case.fp8_context_fmha,
                context_fmha_type=case.context_fmha_type)
    if case.quant:
        s = trt_kv_scale(case.quant)
        args.update(kv_orig_quant_scale=np.asarray([1 / s], np.float32),
                    kv_quant_orig_scale=np.asarray([s], np.float32))
    if case.paged:
        # A pool with one spare block; every (entry, block index) gets its own block, as a manager hands them out,
        # and the table holds the manager's offsets block * num_layers * 2 + kv.
        per_seq = -(-slots // case.tokens_per_block)
        num_blocks = E * per_seq + 1
        pool_shape = (num_blocks, case.num_layers, 2, Hkv, case.tokens_per_block, Dh)
        args["kv_cache_pool"] = random_trt_cache(rng, pool_shape, case)
        blocks = rng.permutation(num_blocks)[:E * per_seq].reshape(E, per_seq)
        kv = np.arange(2)[None, :, None]
        args["kv_cache_block_offsets"] = (blocks[:, None, :] * case.num_layers * 2 + kv)[None].astype(np.int32)
    else:
        args["past_key_value"] = random_trt_cache(rng, (E, 2, Hkv, slots, Dh), case)
    if case.position in (4, 5):
        args["alibi_slopes"] = reference.alibi.alibi_slopes(H)
    if case.position == 6:
        longest = max(case.lengths)
        if case.relative == "t5":
            args.update(relative_attention_bias=rng.standard_normal((H, 8)).astype(dtype), max_distance=12)
        else:
            args["relative_attention_bias"] = rng.standard_normal((H, longest + 1, longest + 1)).astype(dtype)
    if case.mask_type == 6:
        rows = (qkv.shape[0],) if case.packed else qkv.shape[:2]
        args["attention_mask"] = rng.random(rows + (max(case.lengths),)) < 0.7
        if case.packed_mask:
            args["attention_packed_mask"] = reference.packed_mask.pack_attention_mask(args["attention_mask"], new,
                                                                                        case.lengths)
    _trt_rope_inputs(args, case, rng)
    if case.logn:
        args["logn_scaling"] = reference.rope.logn_scaling(3, max(case.lengths) + 1)
    if case.qkv_bias:
        args["qkv_bias"] = (rng.standard_normal(hidden) * 0.5).astype(dtype)
    if case.encoder_lengths:
        # Cross attention: the context requests bring their encoder K/V ([K | V] per token), packed like qkv or
        # padded to the longest encoder; generation requests read them back from the cache.
        encoder = np.asarray(case.encoder_lengths, np.int32)
        width = 2 * Hkv * Dh
        if case.packed:
            cross_kv = rng.standard_normal((int(encoder[:len(case.contexts)].sum()), width))
        else:
            cross_kv = rng.standard_normal((E, int(encoder.max()), width))
        args.update(do_cross_attention=True, cross_kv=cross_kv.astype(dtype), encoder_input_lengths=encoder)
    return args


def _trt_rope_inputs(args: dict, case: TrtCase, rng) -> None:
    """The host-built RoPE inputs: long_rope (3) and yarn (8) always carry their frequencies and tables (original
    max positions 4, so long_rope switches tables within the drawn lengths), rope_gptj / rope_gpt_neox with
    rope_table the plugin's table (dynamic scaling: the table alone, which the kernels then do not read)."""
    rot = case.rotary_dim
    num_pos = max(case.lengths) + 1
    if case.position == 3:
        args.update(reference.rope.long_rope_tables(num_pos, 4, rot, 10000.0, rng.uniform(1.0, 3.0, rot // 2),
                                                    rng.uniform(2.0, 6.0, rot // 2)))
    elif case.position == 8:
        args.update(reference.rope.yarn_tables(num_pos, rot, 10000.0, 4.0, 4))
    elif case.position in (1, 2) and case.rope_table:
        freq, table = reference.rope.plugin_tables(num_pos, rot, 10000.0, case.rotary_scale, case.rotary_scale_type)
        args["rotary_cos_sin"] = table
        if case.rotary_scale_type != 2:
            args["rotary_inv_freq"] = freq


def float64_trt(inputs: dict) -> tuple:
    """gpt_attention on float64 copies of the floating inputs (an INT8/FP8 cache keeps its codes, the scales and
    ALiBi slopes their float32): the exact evaluation the tests compare with. Returns (output, cache after)."""
    import cacheattn
    widened = ("qkv", "qkv_bias", "relative_attention_bias", "cross_kv", "past_key_value", "kv_cache_pool")

    def exact(name, value):
        if not isinstance(value, np.ndarray):
            return value
        quantized_cache = name in ("past_key_value", "kv_cache_pool") and value.dtype.itemsize == 1
        return value.astype(np.float64) if name in widened and not quantized_cache else value.copy()

    x = {name: exact(name, value) for name, value in inputs.items()}
    out, _ = cacheattn.gpt_attention(**x)
    return out, x["kv_cache_pool"] if x.get("kv_cache_pool") is not None else x["past_key_value"]
