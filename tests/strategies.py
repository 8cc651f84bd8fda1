"""Hypothesis strategies for every test module: the attribute space is drawn, the tensors come from a seed.

Sizes are awkward on purpose: sequences of length 1, pasts of 0, head_dim 24, page sizes that do not
divide the lengths, GQA groups of 3, unused page-table entries holding -1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from hypothesis import strategies as st

from reference.cache_layout import DYNAMIC_LAYOUTS, STATIC_LAYOUTS

# Example counts: reference tests are cheap; simulator kernel tests cost about a second per launch.
REFERENCE = 60
KERNEL = 12


@dataclass(frozen=True)
class PPLCase:
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

    def attrs(self):
        """Keyword attributes of cacheattn.multi_head_cache_attention."""
        return dict(num_heads=self.num_heads, head_dim=self.head_dim, is_causal=self.is_causal,
                    is_alibi=self.is_alibi, num_kv_heads=self.num_kv_heads, num_layer=self.num_layer,
                    layer_idx=self.layer_idx, quant_bit=self.quant_bit, quant_group=self.quant_group,
                    cache_mode=self.cache_mode, cache_layout=self.cache_layout, page_size=self.page_size)


@st.composite
def ppl_cases(draw, *, max_batch=3, max_seqlen=5, max_past=9, quant_bits=(0, 8, 4), dtypes=("float16", "float32"),
              layouts=(0, 1, 2, 3), modes=(0, 1), masks=("none", "2d", "3d"), alibi=(False, True)):
    batch = draw(st.integers(1, max_batch))
    decoding_batches = draw(st.integers(0, batch))
    seqlens = tuple(1 if b < decoding_batches else draw(st.integers(1, max_seqlen)) for b in range(batch))
    past = tuple(draw(st.integers(0, max_past)) for _ in range(batch))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([8, 16, 24]))
    quant_bit = draw(st.sampled_from(quant_bits))
    groups = [g for g in (2, 4, 8) if head_dim % g == 0] if quant_bit else [8]
    num_layer = draw(st.integers(1, 2))
    return PPLCase(
        seqlens=seqlens, past=past, decoding_batches=decoding_batches,
        num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 3])), num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=draw(st.sampled_from(dtypes)), quant_bit=quant_bit, quant_group=draw(st.sampled_from(groups)),
        scale_dtype=draw(st.sampled_from(["float16", "float32"])), cache_layout=draw(st.sampled_from(layouts)),
        cache_mode=draw(st.sampled_from(modes)), page_size=draw(st.sampled_from([1, 3, 4, 8])),
        num_layer=num_layer, layer_idx=draw(st.integers(0, num_layer - 1)), is_causal=draw(st.booleans()),
        is_alibi=draw(st.sampled_from(alibi)), mask=draw(st.sampled_from(masks)), mask_pad=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**32 - 1)))


def cache_shape(layout_axes: str, extents: dict) -> tuple:
    return tuple(extents[n] for n in layout_axes.split())


def random_cache(rng, shape, quant_bit, dtype):
    """A cache full of plausible old data (never zeros): quantized codes or normal floats."""
    if quant_bit == 8:
        return rng.integers(-127, 128, shape).astype(np.int8)
    if quant_bit == 4:
        return rng.integers(-128, 128, shape).astype(np.int8)      # any byte is two valid nibbles
    return rng.standard_normal(shape).astype(dtype)


def random_scale(rng, shape, dtype):
    return (rng.random(shape) * 0.05 + 0.005).astype(dtype)


def place_batches(rng, kvlens, case: PPLCase):
    """(cachestarts, MaxT): non-overlapping, shuffled regions; pages for cache_mode 1 (unused entries -1)."""
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
    """NumPy inputs of multi_head_cache_attention for a case, in the document's argument names."""
    rng = np.random.default_rng(case.seed)
    dtype = np.dtype(case.dtype)
    seqstarts = np.concatenate([[0], np.cumsum(case.seqlens)]).astype(np.int64)
    kvstarts = np.concatenate([[0], np.cumsum(case.kvlens)]).astype(np.int64)
    tokens, total_kv = int(seqstarts[-1]), int(kvstarts[-1])
    cachestarts, max_t = place_batches(rng, case.kvlens, case)
    stored = case.head_dim // 2 if case.quant_bit == 4 else case.head_dim
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
    """Fresh copies of the in-out tensors, so two calls start from the same cache."""
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}


@dataclass(frozen=True)
class StaticCase:
    """One static KeyValueCache call."""
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


@st.composite
def static_cases(draw, quant_bits=(0, 8, 4)):
    batch = draw(st.integers(1, 3))
    seqlen = draw(st.integers(1, 4))
    start_pos = draw(st.integers(0, 5))
    head_dim = draw(st.sampled_from([8, 16, 24]))
    quant_bit = draw(st.sampled_from(quant_bits))
    num_layer = draw(st.integers(1, 2))
    return StaticCase(batch=batch, max_batch=batch + draw(st.integers(0, 1)), seqlen=seqlen, start_pos=start_pos,
                      max_seqlen=start_pos + seqlen + draw(st.integers(0, 2)), num_heads=draw(st.integers(1, 3)),
                      head_dim=head_dim, dtype=draw(st.sampled_from(["float16", "float32"])), quant_bit=quant_bit,
                      quant_group=draw(st.sampled_from([g for g in (2, 4, 8) if head_dim % g == 0])),
                      num_layer=num_layer, layer_idx=draw(st.integers(0, num_layer - 1)),
                      num_repeat=draw(st.integers(1, 3)), cache_layout=draw(st.sampled_from([0, 1])),
                      seed=draw(st.integers(0, 2**32 - 1)))


def build_static(case: StaticCase) -> dict:
    rng = np.random.default_rng(case.seed)
    dtype = np.dtype(case.dtype)
    stored = case.head_dim // 2 if case.quant_bit == 4 else case.head_dim
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


def with_(case, **changes):
    return replace(case, **changes)
