"""cacheattn.convert: every format round-trips one sequence, every pair of formats converts within the
destination's quantization step, attention over the converted cache matches, and no byte outside the converted
sequence's slots changes (each destination is filled with random bytes first, and read back through the
format's own NumPy indexing in convert_formats.native, not through the converter)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from convert_formats import (
    BATCH,
    SEQUENCE,
    TABLES,
    as_bytes,
    build,
    free_pages,
    make,
    native,
    owned_mask,
    random_kv,
    read_native,
    stored,
)
from hypothesis import assume, given, settings

from cacheattn import convert
from reference import rope as rope_ref

from strategies import CONVERT, CONVERT_VARIANTS, convert_shapes, convert_variants


def snapshot(layout):
    return {n: as_bytes(a) for n, a in layout.byte_arrays().items()}, \
        {n: np.array(a, copy=True) for n, a in layout.arrays.items() if n in TABLES}


def assert_untouched(layout, before, positions, tokens):
    """Bytes outside the sequence's slots, and the page-table rows of other sequences, are bit-identical."""
    data, tables = before
    for name, old in data.items():
        new = as_bytes(layout.byte_arrays()[name])
        outside = ~owned_mask(layout, name, positions, tokens)
        changed = np.flatnonzero((new != old) & outside)
        assert changed.size == 0, f"{layout.format} {name}: {changed.size} bytes outside the sequence changed"
    for name, old in tables.items():
        new = layout.arrays[name]
        if name in ("cachestarts", "block_tables"):
            keep = np.arange(BATCH) != SEQUENCE
            assert np.array_equal(new[keep], old[keep]), name
        elif name == "kv_cache_block_offsets":
            keep = np.arange(BATCH) != SEQUENCE
            assert np.array_equal(new[:, keep], old[:, keep]), name
        elif name == "kv_indices":
            ptr = layout.arrays["kv_indptr"]
            keep = np.ones(len(new), bool)
            keep[ptr[SEQUENCE]:ptr[SEQUENCE + 1]] = False
            assert np.array_equal(new[keep], old[keep]), name
        elif name == "kv_last_page_len":
            assert np.array_equal(np.delete(new, SEQUENCE), np.delete(old, SEQUENCE)), name
        else:
            assert np.array_equal(new, old), name


def held(layout, positions):
    """Indices of the tokens (at `positions`) a destination keeps: all, or a cyclic cache's last writers."""
    if layout.format != "trtllm":
        return np.arange(len(positions))
    o = layout.options
    slots = np.where(positions < o["sinks"], positions,
                     o["sinks"] + (positions - o["sinks"]) % (o["window"] - o["sinks"]))
    last = {}
    for i, s in enumerate(slots):
        last[int(s)] = i
    return np.array(sorted(last.values()), np.int64)


def assert_bits(name, got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.array_equal(got.view(np.uint8) if got.dtype.itemsize == 1 else got.view(f"u{got.dtype.itemsize}"),
                          want.view(np.uint8) if want.dtype.itemsize == 1 else want.view(f"u{want.dtype.itemsize}")), \
        f"{name}: not bit-identical"


def attention(q, key, value):
    """float64 softmax(q k^T / sqrt(D)) v over all tokens; q (Hq, D), key/value (Hkv, T, D); GQA by h // group."""
    group = q.shape[0] // key.shape[0]
    k = np.repeat(key.astype(np.float64), group, axis=0)
    v = np.repeat(value.astype(np.float64), group, axis=0)
    s = np.einsum("hd,htd->ht", q, k) / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return np.einsum("ht,htd->hd", p / p.sum(axis=1, keepdims=True), v)


def attention_bound(q, key, value, key_bound, value_bound):
    """|attention(K', V') - attention(K, V)| when |K' - K| <= key_bound and |V' - V| <= value_bound elementwise:
    each score moves by at most delta = sum_d |q_d| kb_d / sqrt(D), so each softmax weight by a factor within
    e^(+-2 delta), and the output by at most max |dV| + (e^(2 delta) - 1) * 2 max |V|."""
    group = q.shape[0] // key.shape[0]
    kb = np.repeat(key_bound.max(axis=1), group, axis=0)                        # (Hq, D)
    delta = float((np.abs(q) * kb).sum(axis=1).max()) / np.sqrt(q.shape[1])
    return float(value_bound.max()) + np.expm1(2 * delta) * 2 * float(np.abs(value).max()) + 1e-9


def fill_source(variant, shape, rng):
    """A source layout holding a random sequence; returns (layout, its export Cache, the exported KV)."""
    kv = random_kv(rng, shape["heads"], shape["head_dim"], shape["tokens"])
    src = make(variant, shape, kv, rng, shape["tokens"])
    info = convert.import_(variant[0], kv, sequence=SEQUENCE, layer_idx=src.layer_idx,
                           **{k: v for k, v in src.args.items()}, **free_pages(src))
    assert info is not None
    cache = src.export_cache(kv.tokens, kv.positions)
    exported = convert._call(cache.module.export, cache.arguments, sequence=SEQUENCE, layer_idx=src.layer_idx)
    return src, cache, exported


@settings(max_examples=CONVERT, deadline=None)
@given(variant=convert_variants(), shape=convert_shapes())
def test_import_then_export_round_trips_and_touches_only_the_sequence(variant, shape):
    rng = np.random.default_rng(shape["seed"])
    kv = random_kv(rng, shape["heads"], shape["head_dim"], shape["tokens"])
    layout = make(variant, shape, kv, rng, kv.tokens)
    before = snapshot(layout)
    convert.import_(variant[0], kv, sequence=SEQUENCE, layer_idx=layout.layer_idx, **layout.args, **free_pages(layout))
    got = convert._call(convert._module(variant[0]).export, layout.export_cache(kv.tokens, kv.positions).arguments,
                        sequence=SEQUENCE, layer_idx=layout.layer_idx)
    keep = held(layout, kv.positions)
    np.testing.assert_array_equal(got.positions, kv.positions[keep])
    # What the format stores, read through its own indexing, is what export returns...
    for i, (want, have) in enumerate(zip(stored(got), read_native(layout, got.positions, got.tokens))):
        assert_bits(f"{variant} stored[{i}]", have, want)
    # ... within the destination's rule of the values given (exact where it holds them exactly) ...
    kb, vb = convert.error_bound(layout.cache(), convert.KV(kv.key[:, keep], kv.value[:, keep], kv.positions[keep]))
    assert np.all(np.abs(got.key.astype(np.float64) - kv.key[:, keep]) <= kb), variant
    assert np.all(np.abs(got.value.astype(np.float64) - kv.value[:, keep]) <= vb), variant
    assert_untouched(layout, before, got.positions, got.tokens)
    # ... and export -> import -> export of the same format is bit-exact (the codes are copied as they are).
    again = make(variant, shape, kv, np.random.default_rng(shape["seed"] + 1), got.tokens)
    convert.import_(variant[0], got, sequence=SEQUENCE, layer_idx=again.layer_idx, **again.args, **free_pages(again))
    twice = convert._call(convert._module(variant[0]).export, again.export_cache(got.tokens, got.positions).arguments,
                          sequence=SEQUENCE, layer_idx=again.layer_idx)
    for i, (a, b) in enumerate(zip(stored(twice), stored(got))):
        assert_bits(f"{variant} round trip [{i}]", a, b)
    assert_bits("key", twice.key, got.key)


@settings(max_examples=3 * CONVERT, deadline=None)
@given(src_variant=convert_variants(), dst_variant=convert_variants(),
       shape=convert_shapes())
def test_every_pair_converts_within_the_destination_step(src_variant, dst_variant, shape):
    rng = np.random.default_rng(shape["seed"])
    src, src_cache, kv = fill_source(src_variant, shape, rng)
    # A cyclic source holds positions with a gap; only formats that keep positions by the cyclic rule would
    # need them (TensorRT-LLM): there, convert sources that hold positions 0 ... T-1.
    assume(dst_variant[0] != "trtllm" or np.array_equal(kv.positions, np.arange(kv.tokens)))
    dst = make(dst_variant, shape, kv, rng, kv.tokens)
    before = snapshot(dst)
    rope = convert.Rope(shape["head_dim"])
    wanted = convert._call(dst.cache().module.stores_rotated, dst.args)
    convert.convert(src_cache, dst.cache(), sequence=SEQUENCE, layer_idx=src.layer_idx, dst_layer_idx=dst.layer_idx,
                    rope=rope, free_pages=dst.free_pages)
    keep = held(dst, kv.positions)
    got = convert._call(dst.cache().module.export, dst.export_cache(len(kv.positions), kv.positions).arguments,
                        sequence=SEQUENCE, layer_idx=dst.layer_idx)
    # The expected values: the source's, rotated (or rotated back) at their true positions where the two
    # formats disagree on RoPE, float64.
    key = kv.key.astype(np.float64)
    turned = wanted is not None and kv.rotated is not None and wanted != kv.rotated
    if turned:
        freq = rope_ref.inv_freq(shape["head_dim"], 10000.0, np.float64)
        at = kv.positions.astype(np.float64) * (1 if wanted else -1)
        key = rope_ref.rotate(key.transpose(1, 0, 2), at, freq, rope_ref.GPT_NEOX).transpose(1, 0, 2)
    key, value = key[:, keep], kv.value.astype(np.float64)[:, keep]
    if turned:                       # rotation changes the values: both are requantized, from float32 keys
        kb, vb = convert.error_bound(dst.cache(), convert.KV(key.astype(np.float32), value.astype(np.float32),
                                                             kv.positions[keep]))
        kb = kb + 1e-6 * np.abs(key).max()
    else:
        kb, vb = convert.error_bound(dst.cache(), convert.KV(kv.key[:, keep], kv.value[:, keep], kv.positions[keep],
                                                             kv.rotated, _quant_subset(kv, keep)))
    assert got.tokens == len(keep), (got.tokens, len(keep))
    assert np.all(np.abs(got.key - key) <= kb), (src_variant, dst_variant, float(np.abs(got.key - key).max()))
    assert np.all(np.abs(got.value - value) <= vb), (src_variant, dst_variant)
    # Attention over the converted cache equals attention over the source within what those steps allow.
    q = rng.standard_normal((2 * shape["heads"], shape["head_dim"]))
    out, want = attention(q, got.key, got.value), attention(q, key, value)
    assert np.abs(out - want).max() <= attention_bound(q, key, value, kb, vb), (src_variant, dst_variant)
    for i, (want_s, have) in enumerate(zip(stored(got), read_native(dst, got.positions, got.tokens))):
        assert_bits(f"{dst_variant} stored[{i}]", have, want_s)
    assert_untouched(dst, before, got.positions, got.tokens)
    # OpenPPL and TensorRT-LLM destinations: what their operators' own cache reads see is what export gave.
    seen = operator_read(dst, got)
    if seen is not None:
        np.testing.assert_array_equal(seen[0], got.key.astype(seen[0].dtype))
        np.testing.assert_array_equal(seen[1], got.value.astype(seen[1].dtype))


def operator_read(layout, got):
    """(K, V) (Hkv, T, D) as the destination operator's reference reads its cache: OpenPPL's
    dynamic_key_value_cache read steps, TensorRT-LLM's KVCache.read at the cyclic slots, dequantized."""
    o, a = layout.options, layout.args
    if layout.format == "ppl":
        # The read half of dynamic_key_value_cache: the layer's views, the slots, the dequantization.
        from reference.cache_layout import DYNAMIC_LAYOUTS, layer_views
        from reference.ppl_dynamic_key_value_cache import cache_slots
        from reference.quant import dequantize
        axes = DYNAMIC_LAYOUTS[a["cache_layout"]]
        slots = cache_slots(SEQUENCE, np.arange(got.tokens), a["cachestarts"], a["cache_mode"], a["page_size"])
        rows = [view[slots] for view in layer_views(a["cache"], axes, layout.layer_idx)]      # (T, H, D stored)
        if a["quant_bit"]:
            scales = [view[slots] for view in layer_views(a["scale"], axes, layout.layer_idx)]
            rows = [dequantize(r, sc, a["quant_bit"], a["quant_group"], a["scale"].dtype)
                    for r, sc in zip(rows, scales)]
        return tuple(r.transpose(1, 0, 2) for r in rows)
    if layout.format == "trtllm":
        from reference import trtllm_gpt_attention as trt
        pool = a.get("kv_cache_pool")
        cache = trt.KVCache(a.get("past_key_value"), None if pool is None else pool.reshape(-1, *pool.shape[3:]),
                            a.get("kv_cache_block_offsets"), layout.layer_idx, a["tokens_per_block"])
        bubble = trt.paged_bubble(o["sinks"], 4) if o["paged"] else 0
        slots = trt.cyclic_slot(got.positions, o["window"], o["sinks"], bubble)
        rows = np.full(slots.shape, SEQUENCE)
        read = [cache.read(rows, kv, slots) for kv in (0, 1)]                       # (T, Hkv, D) codes
        if o["quant"]:
            s = float(a["kv_quant_orig_scale"][0])
            read = [trt.dequantize_kv(r, s) for r in read]
        return tuple(r.transpose(1, 0, 2) for r in read)
    return None


def _quant_subset(kv, keep):
    q = kv.quant
    if q is None:
        return None
    group = q.kind.endswith("group")
    return convert.Quant(q.kind, q.key_codes[:, keep], q.value_codes[:, keep],
                         q.key_scale[:, keep] if group else q.key_scale,
                         q.value_scale[:, keep] if group else q.value_scale, q.quant_group)


def test_native_indexing_covers_what_the_formats_document():
    """The test's own readers (convert_formats.native) exist for every format the converter offers."""
    rng = np.random.default_rng(0)
    seen = set()
    for fmt, options in CONVERT_VARIANTS:
        if fmt in seen:
            continue
        seen.add(fmt)
        layout = build(fmt, options, heads=2, head_dim=16, tokens=5, rng=rng)
        assert len(native(layout, np.arange(5), 5)) >= 2
    assert seen == set(convert.FORMATS) - ({"hf"} - {v[0] for v in CONVERT_VARIANTS})


# ---------------------------------------------------------------------------------------------- cyclic caches

@pytest.mark.parametrize("streamingllm", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_a_cyclic_tensorrt_llm_cache_exports_the_tokens_it_holds_at_their_positions(streamingllm, paged):
    """gpt_attention (the reference) fills a cyclic cache, window 6, over 11 prompt tokens; export gives the
    tokens it still holds at their positions (the last 6: 5 ... 10; StreamingLLM with 2 sinks: 0, 1, 7 ... 10),
    with the keys the operator stored (post-RoPE; StreamingLLM: un-rotated, and rotated at the true positions
    when converted to ONNX)."""
    rng = np.random.default_rng(3)
    H, Hkv, D, N, W, tpb = 2, 1, 8, 11, 6, 4
    S = 2 if streamingllm else 0
    qkv = rng.standard_normal((N, (H + 2 * Hkv) * D)).astype(np.float32)
    common = dict(host_max_attention_window_sizes=np.array([W], np.int32),
                  host_sink_token_length=np.array([S], np.int32), streamingllm=streamingllm,
                  paged_kv_cache=paged, tokens_per_block=tpb)
    if paged:
        pool = np.zeros((4, 1, 2, Hkv, tpb, D), np.float32)
        offsets = (np.array([[2, 0, 3]]) * 2)[:, None, :] + np.arange(2)[None, :, None]   # (1, 2, 3)
        cache_args = dict(kv_cache_pool=pool, kv_cache_block_offsets=offsets[None].astype(np.int32))
        operator_args = dict(past_key_value=None)
    else:
        cache_args = dict(past_key_value=np.zeros((1, 2, Hkv, 8, D), np.float32))
        operator_args = {}
    capacity = 12 if paged else 8
    from cacheattn import PositionEmbeddingType, gpt_attention
    gpt_attention(qkv=qkv, sequence_length=np.array([N], np.int32), host_past_key_value_lengths=np.zeros(1, np.int32),
                  context_lengths=np.array([N], np.int32), cache_indirection=np.zeros((1, 1, capacity), np.int32),
                  host_request_types=np.zeros(1, np.int32), layer_idx=0, num_heads=H, num_kv_heads=Hkv,
                  hidden_size_per_head=D, q_scaling=1.0, rotary_embedding_dim=D,
                  position_embedding_type=PositionEmbeddingType.rope_gpt_neox, backend="reference",
                  **common, **cache_args, **operator_args)
    kv = convert.export("trtllm", sequence_length=np.array([N]), sequence=0, **common, **cache_args)
    np.testing.assert_array_equal(kv.positions, [0, 1, 7, 8, 9, 10] if streamingllm else [5, 6, 7, 8, 9, 10])
    assert kv.rotated is (not streamingllm)
    k_new = qkv[:, H * D:(H + Hkv) * D].reshape(N, Hkv, D)
    freq = rope_ref.inv_freq(D, 10000.0, np.float32)
    rotated = rope_ref.rotate(k_new, np.arange(N), freq, rope_ref.GPT_NEOX)
    want = (k_new if streamingllm else rotated)[kv.positions].transpose(1, 0, 2)
    np.testing.assert_allclose(kv.key, want, rtol=0, atol=1e-6)
    past_key = np.full((1, Hkv, 8, D), np.nan, np.float32)
    past_value = np.full((1, Hkv, 8, D), np.nan, np.float32)
    src = convert.Cache("trtllm", sequence_length=np.array([N]), **common, **cache_args)
    convert.convert(src, convert.Cache("onnx", past_key=past_key, past_value=past_value), sequence=0,
                    rope=convert.Rope(D))
    np.testing.assert_allclose(past_key[0, :, :6], rotated[kv.positions].transpose(1, 0, 2), rtol=0, atol=2e-6)
    assert np.isnan(past_key[0, :, 6:]).all()


# ---------------------------------------------------------------------------------------------- bad input

def _ppl_cache():
    cache = np.zeros((16, 1, 2, 2, 8), np.float32)
    return dict(cache=cache, cachestarts=np.array([[0, 4], [8, 12]]), cache_mode=1, page_size=4)


@pytest.mark.parametrize("change, name", [
    (dict(cache_layout=7), "cache_layout"),
    (dict(cachestarts=np.array([[0, 4], [8, 40]])), "cachestarts"),
    (dict(sequence=2), "sequence"),
    (dict(free_pages=[1]), "free_pages"),
    (dict(free_pages=[1, 99]), "free_pages"),
    (dict(quant_bit=8), "cache"),
])
def test_bad_input_names_the_argument_and_writes_nothing(change, name):
    args = dict(_ppl_cache(), sequence=1)
    args.update(change)
    kv = random_kv(np.random.default_rng(0), 2, 8, 7)
    before = args["cache"].copy()
    table = args["cachestarts"].copy()
    free = list(args.get("free_pages", []))
    with pytest.raises((ValueError, TypeError), match=f"^{name}:"):
        convert.import_("ppl", kv, **args)
    assert np.array_equal(args["cache"], before) and np.array_equal(args["cachestarts"], table)
    assert args.get("free_pages", []) == free


def test_rope_is_required_to_rotate_streamingllm_keys():
    kv = convert.KV(np.ones((1, 2, 4), np.float32), np.ones((1, 2, 4), np.float32), np.arange(2), rotated=False)
    past = np.zeros((1, 1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="^rope:"):
        convert.match_rope(kv, True, None)
    out = convert.match_rope(kv, True, convert.Rope(4))
    convert.import_("onnx", out, past_key=past, past_value=past.copy(), sequence=0)
    assert out.rotated and not np.array_equal(past[0, 0, 1], kv.key[0, 1])
    back = convert.match_rope(out, False, convert.Rope(4))
    np.testing.assert_allclose(back.key, kv.key, atol=1e-6)


def test_unknown_format_is_named():
    with pytest.raises(ValueError, match="^format:"):
        convert.export("tgi", sequence=0)


def _bad_cases():
    """(format, arguments, the argument the error must name) for each format's own mistakes."""
    f32 = np.float32
    trt = dict(host_max_attention_window_sizes=np.array([64]), host_sink_token_length=np.array([0]))
    paged = dict(kv_cache_pool=np.zeros((4, 1, 2, 2, 4, 8), f32),
                 kv_cache_block_offsets=np.zeros((1, 2, 2, 2), np.int32), paged_kv_cache=True, tokens_per_block=4,
                 **trt)
    vllm = dict(key_cache=np.zeros((4, 2, 2, 4, 4), f32), value_cache=np.zeros((4, 2, 8, 4), f32),
                block_tables=np.zeros((2, 2), np.int32))
    fi = dict(paged_kv_cache=np.zeros((4, 2, 4, 2, 8), f32), kv_indptr=np.array([0, 1, 3]),
              kv_indices=np.array([0, 1, 2]), kv_last_page_len=np.array([1, 1]))
    past = dict(past_key=np.zeros((2, 2, 4, 8), f32), past_value=np.zeros((2, 2, 4, 8), f32))
    return [
        ("trtllm", dict(past_key_value=np.zeros((2, 2, 2, 8, 8), f32), kv_cache_quant_mode=64, **trt),
         "kv_quant_orig_scale"),
        ("trtllm", dict(past_key_value=np.zeros((2, 2, 2, 8, 8), f32), kv_cache_quant_mode=32, **trt),
         "kv_cache_quant_mode"),
        ("trtllm", dict(paged, free_pages=[1, 9]), "free_pages"),
        ("trtllm", dict(paged, tokens_per_block=3), "tokens_per_block"),
        ("trtllm", dict(past_key_value=np.zeros((2, 2, 2, 4, 8), f32), **trt), "host_max_attention_window_sizes"),
        ("vllm", dict(vllm, kv_cache_dtype="int4"), "kv_cache_dtype"),
        ("vllm", dict(vllm, key_cache=np.zeros((4, 2, 4, 4, 2), f32)), "key_cache"),
        ("vllm", dict(vllm, block_tables=np.array([[0, 1], [2, 7]], np.int32)), "block_tables"),
        ("flashinfer", dict(fi, kv_layout="NDH"), "kv_layout"),
        ("flashinfer", dict(fi, kv_indptr=np.array([0, 2, 3])), "kv_indptr"),
        ("flashinfer", dict(fi, kv_indices=np.array([0, 1, 9])), "kv_indices"),
        ("onnx", dict(past, past_key=np.zeros((2, 2, 3, 8), f32)), "past_value"),
        ("onnx", dict(past_key=np.zeros((2, 2, 6, 8), f32), past_value=np.zeros((2, 2, 6, 8), f32)), "past_key"),
        ("ft", dict(key_cache=np.zeros((2, 2, 4, 8, 2), f32), value_cache=np.zeros((2, 2, 8, 8), f32)), "key_cache"),
        ("onnx", dict(past, layer_idx=1), "layer_idx"),
    ]


@pytest.mark.parametrize("fmt, arguments, name", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_format_names_its_bad_argument_before_writing(fmt, arguments, name):
    kv = random_kv(np.random.default_rng(1), 2, 8, 7)
    before = {n: np.array(a, copy=True) for n, a in arguments.items() if isinstance(a, np.ndarray)}
    free = list(arguments.get("free_pages", []))
    with pytest.raises((ValueError, TypeError), match=f"^{name}:"):
        convert.import_(fmt, kv, sequence=1, **arguments)
    for n, a in before.items():
        assert np.array_equal(arguments[n], a), n
    assert arguments.get("free_pages", []) == free


def test_a_transformers_cache_leaves_through_vllm_and_returns_to_the_model():
    """A tiny Llama (random weights) prefills a prompt into its DynamicCache; every layer goes to a vLLM paged cache
    and back into a fresh DynamicCache (created by import_ through Cache.update); the next token's logits from the
    returned cache equal those from the original, bit for bit."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.tensor([[5, 17, 3, 40, 22, 9, 31]])
    with torch.no_grad():
        first = model(prompt, use_cache=True)
        cache = first.past_key_values
        following = torch.tensor([[int(first.logits[0, -1].argmax())]])
        want = model(following, past_key_values=copy.deepcopy(cache)).logits
    returned = transformers.DynamicCache()
    head_dim = config.hidden_size // config.num_attention_heads
    for layer in range(config.num_hidden_layers):
        key_cache = np.full((4, 2, head_dim // 4, 4, 4), np.nan, np.float32)
        value_cache = np.full((4, 2, head_dim, 4), np.nan, np.float32)
        tables = np.zeros((1, 2), np.int32)
        vllm = convert.Cache("vllm", key_cache=key_cache, value_cache=value_cache, block_tables=tables,
                             seq_lens=np.array([prompt.shape[1]]))
        convert.convert(convert.Cache("hf", past_key_values=cache), vllm, sequence=0, layer_idx=layer,
                        free_pages=[3, 1])
        convert.convert(vllm, convert.Cache("hf", past_key_values=returned), sequence=0, layer_idx=layer)
    with torch.no_grad():
        got = model(following, past_key_values=returned).logits
    assert torch.equal(got, want)
