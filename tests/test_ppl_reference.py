"""The OpenPPL reference held to the invariants the documents imply."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheattn
from reference.alibi import alibi_slopes
from reference.cache_layout import DYNAMIC_LAYOUTS, STATIC_LAYOUTS, layer_views
from reference.ppl_dynamic_key_value_cache import cache_slots

from helpers import assert_bits_equal, assert_close, assert_same_values
from strategies import (
    REFERENCE,
    PPLCase,
    build_ppl,
    build_static,
    copy_inputs,
    float64_ppl_attention,
    ppl_cases,
    reference_cache_state,
    static_cases,
    with_,
)


def run(inputs, case, **overrides):
    """multi_head_cache_attention on copies; returns (attn_output, cache, scale) after the call."""
    x = copy_inputs(inputs)
    out = cacheattn.multi_head_cache_attention(**x, **{**case.attrs(), **overrides})
    return out, x["cache"], x["scale"]


def logical_tokens(cache, case, cachestarts, cache_layout=None, cache_mode=None):
    """(key, value) rows of every batch's positions [0, kvlen), read through the layout and page table."""
    layout = case.cache_layout if cache_layout is None else cache_layout
    mode = case.cache_mode if cache_mode is None else cache_mode
    k, v = layer_views(cache, DYNAMIC_LAYOUTS[layout], case.layer_idx)
    rows = [cache_slots(b, np.arange(n), cachestarts, mode, case.page_size) for b, n in enumerate(case.kvlens)]
    slots = np.concatenate(rows)
    return k[slots], v[slots]


@pytest.mark.spec("ppl-mhca/fused", "ppl-mhca/types", "ppl-mhca/head-dim", "ppl-mhca/shapes")
@settings(max_examples=REFERENCE)
@given(ppl_cases())
def test_reference_matches_float64_evaluation(case):
    inputs = build_ppl(case)
    key, value, _, _ = reference_cache_state(inputs, case)
    out, _, _ = run(inputs, case)
    assert out.dtype == np.dtype(case.dtype) and out.shape == inputs["query"].shape
    assert_close("attn_output", out, float64_ppl_attention(inputs, case, key, value), case.dtype)


@pytest.mark.spec("ppl-mhca/layouts", "ppl-mhca/layer-idx", "ppl-mhca/cache-in-out")
@settings(max_examples=REFERENCE)
@given(ppl_cases(modes=(0,)))
def test_cache_layouts_agree(case):
    inputs = build_ppl(case)
    results = []
    for layout in range(4):
        x = copy_inputs(inputs)
        for name in ("cache", "scale"):     # the same logical cache, re-laid out
            if x[name] is not None:
                src, dst = DYNAMIC_LAYOUTS[case.cache_layout].split(), DYNAMIC_LAYOUTS[layout].split()
                x[name] = np.ascontiguousarray(x[name].transpose([src.index(a) for a in dst]))
        out = cacheattn.multi_head_cache_attention(**x, **{**case.attrs(), "cache_layout": layout})
        results.append((out, logical_tokens(x["cache"], case, x["cachestarts"], cache_layout=layout)))
    for out, (k, v) in results[1:]:
        assert_same_values("attn_output", out, results[0][0])
        assert_bits_equal("key cache", k, results[0][1][0])
        assert_bits_equal("value cache", v, results[0][1][1])


def to_paged(inputs, case, page_size, rng):
    """The same logical cache as an offset-mode case, scattered over shuffled pages of page_size."""
    pages = [-(-k // page_size) for k in case.kvlens]
    order = rng.permutation(sum(pages) + 2) * page_size
    table = np.full((case.batch, max(pages)), -1, np.int64)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n]
        used += n
    x = copy_inputs(inputs)
    axes = DYNAMIC_LAYOUTS[case.cache_layout]
    t_axis = axes.split().index("T")
    for name in ("cache", "scale"):
        if x[name] is None:
            continue
        shape = list(x[name].shape)
        shape[t_axis] = (sum(pages) + 2) * page_size
        paged = np.zeros(shape, x[name].dtype)
        for layer in range(case.num_layer):
            src_k, src_v = layer_views(x[name], axes, layer)
            dst_k, dst_v = layer_views(paged, axes, layer)
            for b, kvlen in enumerate(case.kvlens):
                src = cache_slots(b, np.arange(kvlen), inputs["cachestarts"], 0, page_size)
                dst = cache_slots(b, np.arange(kvlen), table, 1, page_size)
                dst_k[dst], dst_v[dst] = src_k[src], src_v[src]
        x[name] = paged
    x["cachestarts"] = table
    return x


@pytest.mark.spec("ppl-mhca/offset-mode", "ppl-mhca/paged-mode", "ppl-mhca/page-size")
@settings(max_examples=REFERENCE)
@given(ppl_cases(modes=(0,)), st.sampled_from([1, 2, 3, 5]), st.integers(0, 2**32 - 1))
def test_offset_cache_equals_paged_cache(case, page_size, seed):
    inputs = build_ppl(case)
    offset_out, offset_cache, _ = run(inputs, case)
    paged = to_paged(inputs, case, page_size, np.random.default_rng(seed))
    paged_out = cacheattn.multi_head_cache_attention(**paged, **{**case.attrs(), "cache_mode": 1,
                                                                  "page_size": page_size})
    assert_same_values("attn_output", paged_out, offset_out)
    paged_case = with_(case, cache_mode=1, page_size=page_size)
    for got, want in zip(logical_tokens(paged["cache"], paged_case, paged["cachestarts"]),
                         logical_tokens(offset_cache, case, inputs["cachestarts"])):
        assert_bits_equal("cache tokens", got, want)


@pytest.mark.spec("ppl-mhca/gqa")
@settings(max_examples=REFERENCE)
@given(ppl_cases().filter(lambda c: c.num_heads > c.num_kv_heads))
def test_gqa_equals_mha_with_repeated_heads(case):
    inputs = build_ppl(case)
    gqa_out, _, _ = run(inputs, case)
    group = case.num_heads // case.num_kv_heads
    x = copy_inputs(inputs)
    h_axis = DYNAMIC_LAYOUTS[case.cache_layout].split().index("H")
    for name, axis in (("current_key", 1), ("current_value", 1), ("cache", h_axis), ("scale", h_axis)):
        if x[name] is not None:
            x[name] = np.repeat(x[name], group, axis=axis)
    mha_out = cacheattn.multi_head_cache_attention(**x, **{**case.attrs(), "num_kv_heads": case.num_heads})
    assert_same_values("attn_output", gqa_out, mha_out)


@pytest.mark.spec("ppl-mhca/alibi")
def test_alibi_slopes_known_values():
    assert alibi_slopes(8).tolist() == [2.0**-n for n in range(1, 9)]
    # 12 heads: the 8-head slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (odd steps of a 16-head model).
    want = [2.0**-n for n in range(1, 9)] + [2.0 ** -(n / 2) for n in (1, 3, 5, 7)]
    assert np.allclose(alibi_slopes(12), want, rtol=1e-7)


@pytest.mark.spec("ppl-mhca/alibi", "ppl-mhca/mask-offsets")
@settings(max_examples=REFERENCE)
@given(ppl_cases(alibi=(True,), masks=("none", "2d")))
def test_alibi_equals_explicit_bias_mask(case):
    inputs = build_ppl(case)
    alibi_out, _, _ = run(inputs, case)
    # The same bias, written out as a (num_heads, sum seqlens, sum kvlens) attn_mask in the query dtype.
    dtype = np.dtype(case.dtype)
    c = 2 ** math.floor(math.log2(case.num_heads))
    slopes = [2 ** (-8 * n / c) for n in range(1, c + 1)]
    slopes += [2 ** (-4 * n / c) for n in range(1, 2 * (case.num_heads - c), 2)]
    user = inputs["attn_mask"]
    mask = np.zeros((case.num_heads, inputs["seqstarts"][-1], inputs["kvstarts"][-1] + case.mask_pad), dtype)
    for b, (s, kvlen) in enumerate(zip(case.seqlens, case.kvlens)):
        r0, c0 = inputs["seqstarts"][b], inputs["kvstarts"][b]
        for i in range(s):
            for j in range(kvlen):
                distance = j - (kvlen - s + i)
                for h in range(case.num_heads):
                    bias = dtype.type(slopes[h]) * dtype.type(distance)
                    if user is not None:
                        bias = bias + user[r0 + i, c0 + j]
                    mask[h, r0 + i, c0 + j] = -np.inf if distance > 0 else bias
    x = copy_inputs(inputs)
    x["attn_mask"] = mask
    explicit_out = cacheattn.multi_head_cache_attention(**x, **{**case.attrs(), "is_alibi": False,
                                                                "is_causal": False})
    assert_bits_equal("attn_output", alibi_out, explicit_out)


@pytest.mark.spec("ppl-mhca/seqstarts", "ppl-mhca/kvstarts", "ppl-mhca/mask-offsets", "ppl-mhca/start-pos")
@settings(max_examples=REFERENCE)
@given(ppl_cases(masks=("none",)))
def test_batched_requests_equal_each_request_alone(case):
    inputs = build_ppl(case)
    together, _, _ = run(inputs, case)
    for b in range(case.batch):
        x = copy_inputs(inputs)
        rows = slice(inputs["seqstarts"][b], inputs["seqstarts"][b + 1])
        alone = dict(x, query=x["query"][rows], current_key=x["current_key"][rows],
                     current_value=x["current_value"][rows], seqstarts=np.array([0, case.seqlens[b]]),
                     kvstarts=np.array([0, case.kvlens[b]]), cachestarts=x["cachestarts"][b:b + 1],
                     start_pos=x["start_pos"][b:b + 1], decoding_batches=int(b < case.decoding_batches),
                     max_seqlen=case.seqlens[b], max_kvlen=case.kvlens[b])
        out = cacheattn.multi_head_cache_attention(**alone, **case.attrs())
        assert_same_values(f"batch {b} alone", out, together[rows])


@settings(max_examples=REFERENCE)
@given(ppl_cases(max_batch=1, masks=("none",)).map(lambda c: with_(c, past=(0,), decoding_batches=0,
                                                                    is_causal=True)),
       st.integers(0, 2**32 - 1))
@pytest.mark.spec("ppl-mhca/causal", "ppl-mhca/decoding-batches", "ppl-mhca/start-pos")
def test_prefill_equals_chunked_prefill_equals_decode(case, seed):
    """One prompt attended three ways: all at once, in random chunks, one token per call."""
    inputs = build_ppl(with_(case, seqlens=(case.seqlens[0] + 2,)))
    n = int(inputs["seqstarts"][-1])
    full, _, _ = run(inputs, with_(case, seqlens=(n,)))
    rng = np.random.default_rng(seed)
    cuts = sorted(set(rng.integers(1, n, size=2).tolist())) if n > 1 else []
    for bounds in ([0, *cuts, n], list(range(n + 1))):
        x = copy_inputs(inputs)
        pieces = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            step = dict(x, query=x["query"][lo:hi], current_key=x["current_key"][lo:hi],
                        current_value=x["current_value"][lo:hi], seqstarts=np.array([0, hi - lo]),
                        kvstarts=np.array([0, hi]), start_pos=np.array([lo]), decoding_batches=int(hi - lo == 1),
                        max_seqlen=hi - lo, max_kvlen=hi)
            pieces.append(cacheattn.multi_head_cache_attention(**step, **case.attrs()))
        assert_close(f"{len(bounds) - 1} calls", np.concatenate(pieces), full, case.dtype)


@pytest.mark.spec("ppl-kvc/store", "ppl-kvc/extract", "ppl-kvc/dequant", "ppl-kvc/layouts", "ppl-kvc/num-repeat",
                  "ppl-kvc/layer-idx", "ppl-kvc/start-pos", "ppl-kvc/outputs", "ppl-kvc/in-out")
@settings(max_examples=REFERENCE)
@given(static_cases())
def test_static_key_value_cache_equals_dynamic(case):
    inputs = build_static(case)
    x = copy_inputs(inputs)
    key, value = cacheattn.key_value_cache(**x, num_layer=case.num_layer, layer_idx=case.layer_idx,
                                           quant_bit=case.quant_bit, quant_group=case.quant_group,
                                           num_repeat=case.num_repeat, cache_layout=case.cache_layout)
    # The static cache, seen as a dynamic layout-0 cache (MaxB*MaxS, L, 2, H, Dh): batch b starts at b*MaxS.
    src = STATIC_LAYOUTS[case.cache_layout].split()

    def as_dynamic(t):
        t = t.transpose([src.index(a) for a in "B T L KV H D".split()])
        return np.ascontiguousarray(t).reshape(-1, *t.shape[2:])

    y = copy_inputs(inputs)
    kvlen = case.start_pos + case.seqlen
    dyn_cache = as_dynamic(y["cache"])
    dyn_scale = None if y["scale"] is None else as_dynamic(y["scale"])
    dkey, dvalue = cacheattn.dynamic_key_value_cache(
        y["current_key"].reshape(-1, case.num_heads, case.head_dim),
        y["current_value"].reshape(-1, case.num_heads, case.head_dim),
        np.arange(case.batch + 1) * case.seqlen, np.arange(case.batch + 1) * kvlen,
        np.arange(case.batch) * case.max_seqlen, np.full(case.batch, case.start_pos), case.seqlen, kvlen,
        dyn_cache, dyn_scale, num_layer=case.num_layer, layer_idx=case.layer_idx, quant_bit=case.quant_bit,
        quant_group=case.quant_group, num_repeat=case.num_repeat, cache_layout=0, cache_mode=0)
    assert_bits_equal("key", key.reshape(dkey.shape), dkey)
    assert_bits_equal("value", value.reshape(dvalue.shape), dvalue)
    assert_bits_equal("cache", as_dynamic(x["cache"]), dyn_cache)


def written_elements(case, inputs):
    """Boolean masks (cache, scale) of the elements a call may write: positions [start_pos, kvlen) of each batch."""
    marks = []
    for name in ("cache", "scale"):
        if inputs[name] is None:
            marks.append(None)
            continue
        mark = np.zeros(inputs[name].shape, bool)
        k, v = layer_views(mark, DYNAMIC_LAYOUTS[case.cache_layout], case.layer_idx)
        for b, (p, kvlen) in enumerate(zip(case.past, case.kvlens)):
            slots = cache_slots(b, np.arange(p, kvlen), inputs["cachestarts"], case.cache_mode, case.page_size)
            k[slots] = v[slots] = True
        marks.append(mark)
    return marks


@pytest.mark.spec("ppl-mhca/cache-in-out", "ppl-mhca/layer-idx")
@settings(max_examples=REFERENCE)
@given(ppl_cases())
def test_untouched_cache_bits_stay(case):
    inputs = build_ppl(case)
    _, cache, scale = run(inputs, case)
    for name, after, mark in zip(("cache", "scale"), (cache, scale), written_elements(case, inputs)):
        if mark is not None:
            assert_bits_equal(f"{name} outside the written slots", after[~mark], inputs[name][~mark])


def test_fully_masked_row_gives_zeros_not_nan():
    case = PPLCase(seqlens=(3, 1), past=(2, 4), decoding_batches=0, num_heads=4, num_kv_heads=2, head_dim=8,
                   dtype="float32", quant_bit=0, quant_group=8, scale_dtype="float32", cache_layout=0, cache_mode=0,
                   page_size=4, num_layer=1, layer_idx=0, is_causal=True, is_alibi=False, mask="2d", mask_pad=1,
                   seed=7)
    inputs = build_ppl(case)
    inputs["attn_mask"][0, :] = -np.inf
    out, _, _ = run(inputs, case)
    assert np.array_equal(out[0], np.zeros_like(out[0]))
    assert np.isfinite(out).all()
