"""Example inputs for the OpenPPL operators, shared by the tour, the docs, the benchmarks and the tests.

A case names the attributes and per-batch lengths; `build_*` turns it into NumPy tensors from its seed.
Old cache contents are random plausible data (never zeros), so a kernel that reads the wrong slot shows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

import reference
from reference.cache_layout import DYNAMIC_LAYOUTS, STATIC_LAYOUTS


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
    """The case with some fields changed."""
    return replace(case, **changes)


def float64_ppl_attention(inputs: dict, case, key, value):
    """A float64 evaluation of dynamic MultiHeadAttention for a PPL case, given the key/value the cache
    holds (exact, from the reference's KeyValueCache). Quantization is checked bit for bit elsewhere, so
    this isolates the attention arithmetic."""
    f64 = np.float64
    mask = inputs["attn_mask"]
    return reference.dynamic_multi_head_attention(
        inputs["query"].astype(f64), np.asarray(key).astype(f64), np.asarray(value).astype(f64),
        inputs["seqstarts"], inputs["kvstarts"], inputs["decoding_batches"], inputs["max_seqlen"],
        inputs["max_kvlen"], None if mask is None else mask.astype(f64), num_heads=case.num_heads,
        head_dim=case.head_dim, is_causal=case.is_causal, is_alibi=case.is_alibi, num_kv_heads=case.num_kv_heads)


def reference_cache_state(inputs: dict, case: PPLCase):
    """The reference's packed key/value and the cache/scale after its store, on copies of the inputs."""
    x = copy_inputs(inputs)
    key, value = reference.dynamic_key_value_cache(
        x["current_key"], x["current_value"], x["seqstarts"], x["kvstarts"], x["cachestarts"], x["start_pos"],
        x["max_seqlen"], x["max_kvlen"], x["cache"], x["scale"], num_layer=case.num_layer, layer_idx=case.layer_idx,
        quant_bit=case.quant_bit, quant_group=case.quant_group, cache_mode=case.cache_mode,
        cache_layout=case.cache_layout, page_size=case.page_size)
    return key, value, x["cache"], x["scale"]
