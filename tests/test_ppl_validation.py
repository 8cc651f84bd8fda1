"""Every class of bad input raises a ValueError/TypeError naming the document's parameter, before any kernel."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheattn
from kernels_numba import _launch

from strategies import REFERENCE, PPLCase, StaticCase, build_ppl, build_static, copy_inputs, ppl_cases, with_

BASE = PPLCase(seqlens=(1, 3), past=(4, 2), decoding_batches=1, num_heads=4, num_kv_heads=2, head_dim=16,
               dtype="float16", quant_bit=8, quant_group=8, scale_dtype="float16", cache_layout=1, cache_mode=1,
               page_size=4, num_layer=2, layer_idx=1, is_causal=True, is_alibi=False, mask="3d", mask_pad=2, seed=3)


def mhca_call(mutate, case=BASE):
    """Valid inputs for `case`, changed by mutate(inputs, attrs)."""
    inputs, attrs = build_ppl(case), case.attrs()
    mutate(inputs, attrs)
    return inputs, attrs


def set_(**changes):
    def mutate(inputs, attrs):
        for k, v in changes.items():
            (attrs if k in attrs or k == "backend" else inputs)[k] = v(inputs) if callable(v) else v
    return mutate


BAD_MHCA = [
    # (id, mutation, error type, parameter named in the message, case)
    ("query rank", set_(query=lambda x: x["query"][..., None]), ValueError, "query", BASE),
    ("query dtype", set_(query=lambda x: x["query"].astype(np.int32)), TypeError, "query", BASE),
    # seqstarts and current_key agree; the kernels would read query row seqstarts[B] - 1 past its end
    ("query a row short", set_(query=lambda x: x["query"][:-1]), ValueError, "query", BASE),
    ("query a row more", set_(query=lambda x: np.concatenate([x["query"], x["query"][:1]])), ValueError, "query",
     BASE),
    ("current_key dtype", set_(current_key=lambda x: x["current_key"].astype(np.float32)), TypeError,
     "current_key", BASE),
    ("current_key heads", set_(current_key=lambda x: x["current_key"][:, :1]), ValueError, "current_key", BASE),
    ("current_value shape", set_(current_value=lambda x: x["current_value"][:-1]), ValueError, "current_value",
     BASE),
    ("heads not divisible", set_(num_kv_heads=3), ValueError, "num_kv_heads", BASE),
    ("quant_group not dividing head_dim", set_(quant_group=5), ValueError, "quant_group", BASE),
    ("odd int4 group", set_(quant_group=3), ValueError, "quant_group",
     with_(BASE, quant_bit=4, head_dim=24, quant_group=4)),
    ("quant_bit 2", set_(quant_bit=2), ValueError, "quant_bit", BASE),
    ("cache_mode 2", set_(cache_mode=2), ValueError, "cache_mode", BASE),
    ("cache_layout 4", set_(cache_layout=4), ValueError, "cache_layout", BASE),
    ("page_size 0", set_(page_size=0), ValueError, "page_size", BASE),
    ("layer_idx past num_layer", set_(layer_idx=2), ValueError, "layer_idx", BASE),
    ("num_layer not the cache's", set_(num_layer=3, layer_idx=0), ValueError, "cache", BASE),
    ("kvlen != start_pos + seqlen", set_(start_pos=np.array([4, 3])), ValueError, "kvstarts", BASE),
    ("negative start_pos", set_(start_pos=np.array([-1, 2]), kvstarts=np.array([0, 0, 5])), ValueError,
     "start_pos", BASE),
    ("seqstarts not from 0", set_(seqstarts=np.array([1, 2, 4])), ValueError, "seqstarts", BASE),
    ("seqstarts decreasing", set_(seqstarts=np.array([0, 3, 1])), ValueError, "seqstarts", BASE),
    ("seqstarts total", set_(seqstarts=np.array([0, 1, 3])), ValueError, "seqstarts", BASE),
    ("seqstarts float", set_(seqstarts=np.array([0.0, 1.0, 4.0])), TypeError, "seqstarts", BASE),
    ("kvstarts length", set_(kvstarts=np.array([0, 5])), ValueError, "kvstarts", BASE),
    ("max_seqlen too small", set_(max_seqlen=2), ValueError, "max_seqlen", BASE),
    ("max_kvlen too small", set_(max_kvlen=4), ValueError, "max_kvlen", BASE),
    ("decoding_batches > B", set_(decoding_batches=3), ValueError, "decoding_batches", BASE),
    ("decoding_batches < 0", set_(decoding_batches=-1), ValueError, "decoding_batches", BASE),
    # BASE is a decode step (1 token) then a 3-token prefill: counting the prefill as decoding would drop its mask.
    ("a prefill counted as decoding", set_(decoding_batches=2), ValueError, "decoding_batches", BASE),
    ("decoding_batches float", set_(decoding_batches=1.0), TypeError, "decoding_batches", BASE),
    ("a leading prefill counted as decoding", set_(decoding_batches=1), ValueError, "decoding_batches",
     with_(BASE, seqlens=(2, 1), past=(3, 4), decoding_batches=0)),
    ("rung 7", set_(rung=7), ValueError, "rung", BASE),
    ("rung 6 with a float32 query", set_(rung=6), ValueError, "rung", with_(BASE, dtype="float32")),
    ("num_splits without rung 4", set_(rung=3, num_splits=2), ValueError, "num_splits", BASE),
    ("num_splits 0", set_(rung=4, num_splits=0), ValueError, "num_splits", BASE),
    ("num_splits past 64", set_(rung=4, num_splits=65), ValueError, "num_splits", BASE),
    ("num_splits float", set_(rung=4, num_splits=2.0), TypeError, "num_splits", BASE),
    ("rung 2 with a partial warp", set_(rung=2, threads=48), ValueError, "threads", BASE),
    ("rung 5 with a partial warp", set_(rung=5, threads=48), ValueError, "threads", BASE),
    ("rung 5 with a float32 query", set_(rung=5), ValueError, "rung", with_(BASE, dtype="float32")),
    ("rung 5 warps' merge past shared memory", set_(rung=5, threads=1024), ValueError, "head_dim",
     with_(BASE, head_dim=64)),
    ("rung 3 with a partial warp", set_(rung=3, threads=80), ValueError, "threads", BASE),
    # 32 warps' softmax states of one row of head_dim 352 need more than 48 KiB: refused before the cache store
    ("rung 2 warps' merge past shared memory", set_(rung=2, threads=1024), ValueError, "head_dim",
     with_(BASE, head_dim=352)),
    ("rung 4 warps' merge past shared memory", set_(rung=4, threads=1024), ValueError, "head_dim",
     with_(BASE, head_dim=352)),
    ("threads 0", set_(threads=0), ValueError, "threads", BASE),
    ("page outside MaxT", set_(cachestarts=lambda x: np.where(x["cachestarts"] == x["cachestarts"].max(),
                                                              10**6, x["cachestarts"])), ValueError, "cachestarts",
     BASE),
    ("last page runs past the end", set_(cachestarts=lambda x: np.where(
        x["cachestarts"] == x["cachestarts"].max(), x["cache"].shape[1] - 2, x["cachestarts"])), ValueError,
     "cachestarts", BASE),
    ("negative page", set_(cachestarts=lambda x: np.where(np.arange(x["cachestarts"].size).reshape(
        x["cachestarts"].shape) == 0, -4, x["cachestarts"])), ValueError, "cachestarts", BASE),
    ("too few pages", set_(cachestarts=lambda x: x["cachestarts"][:, :1]), ValueError, "cachestarts", BASE),
    ("offset past MaxT", set_(cachestarts=lambda x: x["cachestarts"] + x["cache"].shape[0]), ValueError,
     "cachestarts", with_(BASE, cache_mode=0, cache_layout=0)),
    ("offset cachestarts 2-D", set_(cachestarts=lambda x: x["cachestarts"][:, None]), ValueError, "cachestarts",
     with_(BASE, cache_mode=0)),
    # BASE's batch 0 stores position 4 (its page 1), batch 1 positions 2-4 (pages 0 and 1): sharing batch 0's
    # table makes both store position 4 into one slot; an offset page makes batch 1 store twice into one slot.
    ("two sequences write one paged slot", set_(cachestarts=lambda x: x["cachestarts"][[0, 0]]), ValueError,
     "cachestarts", BASE),
    ("a sequence writes one slot twice", set_(cachestarts=lambda x: np.stack(
        [x["cachestarts"][0], [x["cachestarts"][1, 0], x["cachestarts"][1, 0] + 2, -1]])), ValueError, "cachestarts",
     BASE),
    ("two sequences write one offset slot", set_(cachestarts=lambda x: x["cachestarts"][[0, 0]]), ValueError,
     "cachestarts", with_(BASE, cache_mode=0)),
    # Batch 0 reads positions 0-3 from its page 0 and writes position 4 into its page 1; batch 1 reads 0-1 and
    # writes 2-4. A write into a slot holding a cached position the call reads replaces a key it attends to.
    ("a sequence's written page mapped onto its own prefix page", set_(cachestarts=lambda x: np.stack(
        [[x["cachestarts"][0, 0], x["cachestarts"][0, 0], -1], x["cachestarts"][1]])), ValueError, "cachestarts",
     BASE),
    ("a sequence writes over another's cached position (paged)", set_(cachestarts=lambda x: np.stack(
        [x["cachestarts"][0], [x["cachestarts"][1, 0], x["cachestarts"][0, 0], -1]])), ValueError, "cachestarts",
     BASE),
    # offsets: batch 0's region ends where batch 1's begins, so batch 0 stores its position 4 over batch 1's
    # cached position 0
    ("a sequence writes over another's cached position (offsets)", set_(cachestarts=lambda x: np.array(
        [x["cachestarts"][1] - 4, x["cachestarts"][1]])), ValueError, "cachestarts", with_(BASE, cache_mode=0)),
    ("scale missing", set_(scale=None), ValueError, "scale", BASE),
    ("scale shape", set_(scale=lambda x: x["scale"][..., :1]), ValueError, "scale", BASE),
    ("scale dtype", set_(scale=lambda x: x["scale"].astype(np.float64)), TypeError, "scale", BASE),
    ("float cache with quant_bit", set_(cache=lambda x: x["cache"].astype(np.float16)), TypeError, "cache", BASE),
    ("int8 cache without quant", set_(quant_bit=0), TypeError, "cache", BASE),
    ("cache head count", set_(cache=lambda x: x["cache"][:, :, :, :1]), ValueError, "cache", BASE),
    ("attn_mask too narrow", set_(attn_mask=lambda x: x["attn_mask"][..., :8]), ValueError, "attn_mask", BASE),
    ("attn_mask rows", set_(attn_mask=lambda x: x["attn_mask"][:, :3]), ValueError, "attn_mask", BASE),
    ("attn_mask heads", set_(attn_mask=lambda x: x["attn_mask"][:2]), ValueError, "attn_mask", BASE),
    ("attn_mask dtype", set_(attn_mask=lambda x: x["attn_mask"].astype(np.float32)), TypeError, "attn_mask", BASE),
    ("is_causal not bool", set_(is_causal="yes"), TypeError, "is_causal", BASE),
    ("backend unknown", set_(backend="cuda"), ValueError, "backend", BASE),
]


@pytest.mark.spec("ppl-mhca/gqa-divisible", "ppl-mhca/scale-required", "ppl-mhca/max-lens", "ppl-mhca/mask-shape",
                  "ppl-mhca/mask-padded", "ppl-mhca/decoding-batches", "ppl-mhca/seqstarts", "ppl-mhca/kvstarts",
                  "ppl-mhca/quant-bit", "ppl-mhca/quant-group", "ppl-mhca/layouts", "ppl-mhca/offset-mode",
                  "ppl-mhca/paged-mode", "ppl-mhca/page-size", "ppl-mhca/shapes", "ppl-mhca/types")
@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("name,mutate,error,param,case", BAD_MHCA, ids=[b[0] for b in BAD_MHCA])
def test_bad_multi_head_cache_attention_input(name, mutate, error, param, case, backend):
    inputs, attrs = mhca_call(mutate, case)
    attrs.setdefault("backend", backend)
    before = {k: inputs[k].copy() for k in ("cache", "scale") if isinstance(inputs.get(k), np.ndarray)}
    with _launch.recorded_launches() as launches, pytest.raises(error, match=rf"^{param}\b"):
        cacheattn.multi_head_cache_attention(**inputs, **attrs)
    assert launches == [], "a kernel launch was attempted before validation failed"
    for k, x in before.items():
        assert x.tobytes() == inputs[k].tobytes(), f"{name}: the refused call changed {k}"


@pytest.mark.parametrize("launch", [{"rung": 1}, {"threads": 1024}], ids=["rung 1", "the plan at 32 warps"])
def test_head_dim_past_the_kernels_shared_memory_is_refused_before_the_cache_store(launch):
    """Rung 1's K/V tiles of head_dim 704 need more than 48 KiB even at 8 keys and one row, and so do the merge
    buffers of rungs 3 and 5 with 32 warps: the kernels refuse it by name (rung 1 asked for, or the plan finding
    no rung for that block size) before the store kernel writes the cache; the reference, which has no such
    limit, runs it."""
    inputs, attrs = mhca_call(lambda inputs, attrs: None, with_(BASE, head_dim=704))
    cache = inputs["cache"].copy()
    with _launch.recorded_launches() as launches, pytest.raises(ValueError, match=r"^head_dim\b"):
        cacheattn.multi_head_cache_attention(**inputs, **attrs, backend="numba", **launch)
    assert launches == [] and np.array_equal(inputs["cache"], cache)
    assert cacheattn.multi_head_cache_attention(**inputs, **attrs, backend="reference").shape == inputs["query"].shape


def test_base_case_is_valid():
    """The mutations above start from a valid call: anything that fails, fails for the mutation."""
    inputs, attrs = mhca_call(lambda inputs, attrs: None)
    assert cacheattn.multi_head_cache_attention(**inputs, **attrs).shape == inputs["query"].shape


def test_non_contiguous_cache_is_refused_for_kernels():
    inputs, attrs = mhca_call(lambda inputs, attrs: None, with_(BASE, quant_bit=0, dtype="float32"))
    inputs["cache"] = np.asfortranarray(inputs["cache"])
    with pytest.raises(ValueError, match=r"^cache: expected a C-contiguous"):
        cacheattn.multi_head_cache_attention(**inputs, **attrs, backend="numba")


STATIC = StaticCase(batch=2, max_batch=2, seqlen=3, start_pos=2, max_seqlen=6, num_heads=2, head_dim=8,
                    dtype="float32", quant_bit=8, quant_group=4, num_layer=2, layer_idx=0, num_repeat=2,
                    cache_layout=1, seed=5)
STATIC_ATTRS = dict(num_layer=2, layer_idx=0, quant_bit=8, quant_group=4, num_repeat=2, cache_layout=1)

BAD_STATIC = [
    ("start_pos past MaxS", dict(start_pos=4), ValueError, "start_pos"),
    ("start_pos two elements", dict(start_pos=np.array([1, 2])), ValueError, "start_pos"),
    ("start_pos negative", dict(start_pos=-1), ValueError, "start_pos"),
    ("batch past MaxB", dict(current_key=np.zeros((3, 3, 2, 8), np.float32),
                             current_value=np.zeros((3, 3, 2, 8), np.float32)), ValueError, "current_key"),
    ("num_repeat 0", dict(num_repeat=0), ValueError, "num_repeat"),
    ("cache_layout 2", dict(cache_layout=2), ValueError, "cache_layout"),
    ("current_value shape", dict(current_value=np.zeros((2, 3, 2, 4), np.float32)), ValueError, "current_value"),
    ("current_key float64", dict(current_key=np.zeros((2, 3, 2, 8)), current_value=np.zeros((2, 3, 2, 8))),
     TypeError, "current_key"),
    ("layer_idx negative", dict(layer_idx=-1), ValueError, "layer_idx"),
    ("quant_group not an int", dict(quant_group=4.0), TypeError, "quant_group"),
]


@pytest.mark.spec("ppl-kvc/start-pos", "ppl-kvc/layouts", "ppl-kvc/num-repeat", "ppl-kvc/layer-idx",
                  "ppl-kvc/quant-group")
@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("name,changes,error,param", BAD_STATIC, ids=[b[0] for b in BAD_STATIC])
def test_bad_key_value_cache_input(name, changes, error, param, backend):
    inputs = build_static(STATIC)
    attrs = dict(STATIC_ATTRS, backend=backend)
    for k, v in changes.items():
        (attrs if k in attrs else inputs)[k] = v
    with _launch.recorded_launches() as launches, pytest.raises(error, match=rf"^{param}\b"):
        cacheattn.key_value_cache(**inputs, **attrs)
    assert launches == []


def test_static_base_case_is_valid():
    key, value = cacheattn.key_value_cache(**build_static(STATIC), **STATIC_ATTRS)
    assert key.shape == value.shape == (2, 5, 4, 8)


def test_dynamic_mha_rejects_key_rows_not_matching_kvstarts():
    case = with_(BASE, quant_bit=0, mask="none")
    x = build_ppl(case)
    key = np.zeros((int(x["kvstarts"][-1]) + 1, 2, 16), np.float16)
    with pytest.raises(ValueError, match=r"^kvstarts\b"):
        cacheattn.dynamic_multi_head_attention(x["query"], key, key, x["seqstarts"], x["kvstarts"], 1, 3, 5,
                                               num_heads=4, head_dim=16, is_causal=True, num_kv_heads=2)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("short", ["key", "value"])
def test_dynamic_mha_refuses_key_or_value_rows_short_of_kvstarts(short, backend):
    """The kernels read key and value row kvstarts[b] + j side by side: one row short of kvstarts[B] in either
    is refused by name before any launch (key's rows are what kvstarts is checked against, so a short key names
    kvstarts)."""
    rng = np.random.default_rng(11)
    seqstarts, kvstarts = np.array([0, 1, 3]), np.array([0, 4, 9])
    query = rng.standard_normal((3, 4, 16)).astype(np.float32)
    kv = {name: rng.standard_normal((9, 2, 16)).astype(np.float32) for name in ("key", "value")}
    kv[short] = kv[short][:-1]
    named = "kvstarts" if short == "key" else "value"
    with _launch.recorded_launches() as launches, pytest.raises(ValueError, match=rf"^{named}: expected .*\b9\b"):
        cacheattn.dynamic_multi_head_attention(query, kv["key"], kv["value"], seqstarts, kvstarts, 1, 2, 5,
                                               num_heads=4, head_dim=16, is_causal=True, num_kv_heads=2,
                                               backend=backend)
    assert launches == []


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_a_query_row_short_of_seqstarts_is_refused_before_the_store(backend):
    """multi_head_cache_attention checks seqstarts against current_key; a query one row short is refused naming
    query and the expected count, before the store kernel writes the cache (the kernels would read past it)."""
    inputs, attrs = mhca_call(set_(query=lambda x: x["query"][:-1]))
    cache, scale = inputs["cache"].copy(), inputs["scale"].copy()
    with _launch.recorded_launches() as launches, pytest.raises(
            ValueError, match=r"^query: expected seqstarts\[B\] = 4 rows like current_key, got 3$"):
        cacheattn.multi_head_cache_attention(**inputs, **dict(attrs, backend=backend))
    assert launches == []
    assert np.array_equal(inputs["cache"], cache) and np.array_equal(inputs["scale"], scale)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("operator", ["multi_head_cache_attention", "dynamic_key_value_cache"])
@pytest.mark.parametrize("whose", ["its own", "another's"])
def test_a_store_over_a_cached_position_the_call_reads_is_refused(whose, operator, backend):
    """BASE's batch 0 reads positions 0-3 from its page 0 and stores position 4 into its page 1. Its page 1 mapped
    onto its own page 0, or batch 1's page 1 mapped onto it, stores a current token over cached position 0 of
    batch 0 while the call reads it: refused naming cachestarts, the writer and the position overwritten, before
    any kernel, the cache and scale bit-identical."""
    x = build_ppl(BASE)
    table = x["cachestarts"].copy()
    writer = 0 if whose == "its own" else 1
    table[writer, 1] = table[0, 0]
    x["cachestarts"] = table
    attrs = dict(BASE.attrs(), backend=backend)
    if operator == "dynamic_key_value_cache":
        x = {k: v for k, v in x.items() if k not in ("query", "decoding_batches", "attn_mask")}
        attrs = {k: v for k, v in attrs.items()
                 if k not in ("num_heads", "head_dim", "is_causal", "is_alibi", "num_kv_heads")}
    before = {k: x[k].copy() for k in ("cache", "scale")}
    with _launch.recorded_launches() as launches, pytest.raises(
            ValueError, match=rf"^cachestarts: .* got batch {writer} position 4 stored at slot {table[0, 0]}, which "
                              rf"holds batch 0's cached position 0 \(< start_pos\[0\] = 4\)"):
        getattr(cacheattn, operator)(**x, **attrs)
    assert launches == []
    for k, want in before.items():
        assert np.array_equal(x[k], want), f"the refused call changed {k}"


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("operator", ["multi_head_cache_attention", "dynamic_key_value_cache"])
def test_sequences_may_share_a_read_only_prefix_page(operator, backend):
    """Two sequences whose page tables share the page of a common prefix (positions they only read) are legal,
    and read it as if each had its own copy of that page; the shared page is left bit-identical."""
    case = with_(BASE, seqlens=(1, 2), past=(4, 4), decoding_batches=1, cache_layout=0, mask="none")
    shared = build_ppl(case)
    table = shared["cachestarts"]
    own_page = int(table[1, 0])
    copied = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in shared.items()}
    for x in (copied["cache"], copied["scale"]):          # layout 0: MaxT leads, a page is page_size rows
        x[own_page:own_page + case.page_size] = x[table[0, 0]:table[0, 0] + case.page_size]
    shared["cachestarts"] = np.stack([table[0], [table[0, 0], *table[1, 1:]]])
    prefix = shared["cache"][table[0, 0]:table[0, 0] + case.page_size].copy()
    outputs = []
    for x in (shared, copied):
        attrs = dict(case.attrs(), backend=backend)
        if operator == "dynamic_key_value_cache":      # the cache half alone: no query, no attention attributes
            x = {k: v for k, v in x.items() if k not in ("query", "decoding_batches", "attn_mask")}
            attrs = {k: v for k, v in attrs.items()
                     if k not in ("num_heads", "head_dim", "is_causal", "is_alibi", "num_kv_heads")}
        result = getattr(cacheattn, operator)(**x, **attrs)
        outputs.append(tuple(result) if operator == "dynamic_key_value_cache" else (result,))
    for got, want in zip(*outputs):
        np.testing.assert_array_equal(got, want)
    assert np.array_equal(shared["cache"][table[0, 0]:table[0, 0] + case.page_size], prefix)


def test_messages_name_the_kv_heads_and_print_shapes_as_python_does():
    inputs, attrs = mhca_call(set_(current_key=lambda x: x["current_key"][:, :1]))
    with pytest.raises(ValueError, match=r"^current_key: expected shape \(\*, 2, 16\) \(seqstarts\[B\], "
                                         r"num_kv_heads, head_dim\), got \(4, 1, 16\)$"):
        cacheattn.multi_head_cache_attention(**inputs, **attrs)
    inputs, attrs = mhca_call(set_(start_pos=np.array([4])))
    with pytest.raises(ValueError, match=r"^start_pos: expected shape \(2,\), got \(1,\)$"):
        cacheattn.multi_head_cache_attention(**inputs, **attrs)


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_dynamic_key_value_cache_refuses_two_writes_to_one_slot(backend):
    """The cache half alone checks the same: two sequences storing into one slot name cachestarts, and the cache
    is left as it was."""
    x = build_ppl(BASE)
    args = {k: x[k] for k in ("current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos",
                              "max_seqlen", "max_kvlen", "cache", "scale")}
    args["cachestarts"] = x["cachestarts"][[0, 0]]
    attrs = {k: v for k, v in BASE.attrs().items() if k not in ("num_heads", "head_dim", "is_causal", "is_alibi",
                                                                "num_kv_heads")}
    cache = x["cache"].copy()
    with _launch.recorded_launches() as launches, pytest.raises(ValueError, match=r"^cachestarts: .* both at slot"):
        cacheattn.dynamic_key_value_cache(**args, **attrs, backend=backend)
    assert launches == [] and np.array_equal(x["cache"], cache)


# ---- decoding_batches against seqstarts: the first decoding_batches sequences decode one token each

@settings(max_examples=max(REFERENCE // 3, 10))
@given(case=ppl_cases(), backend=st.sampled_from(["reference", "numba"]), data=st.data())
def test_a_longer_sequence_counted_as_decoding_is_refused_before_the_store(case, backend, data):
    """A drawn valid call whose decoding_batches is raised past a sequence of more than one query token (it would
    silently lose its causal mask) names decoding_batches and that sequence, launches nothing, and leaves the
    cache and scale bit-identical; with decoding_batches as drawn the same call runs."""
    longer = [b for b, n in enumerate(case.seqlens) if n > 1]
    if not longer:                              # every sequence decodes: the last one becomes a 2-token prefill
        batch = len(case.seqlens)
        case = with_(case, seqlens=case.seqlens[:-1] + (2,), decoding_batches=min(case.decoding_batches, batch - 1))
        longer = [batch - 1]
    first = longer[0]
    decoding = data.draw(st.integers(first + 1, len(case.seqlens)), label="decoding_batches")
    inputs, attrs = build_ppl(case), dict(case.attrs(), backend=backend)
    valid = cacheattn.multi_head_cache_attention(**copy_inputs(inputs), **dict(attrs, backend="reference"))
    assert np.isfinite(valid).all()
    before = {k: inputs[k].copy() for k in ("cache", "scale") if inputs[k] is not None}
    with _launch.recorded_launches() as launches, pytest.raises(
            ValueError, match=rf"^decoding_batches: expected the first {decoding} sequences .* got seqlen "
                              rf"{case.seqlens[first]} for batch {first} "):
        cacheattn.multi_head_cache_attention(**dict(inputs, decoding_batches=decoding), **attrs)
    assert launches == []
    for k, x in before.items():
        assert x.tobytes() == inputs[k].tobytes(), f"the refused call changed {k}"


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_dynamic_mha_refuses_a_prefill_counted_as_decoding(backend):
    """The attention half checks the same rule against its own seqstarts: sequences of 1, 3 and 1 query tokens
    with decoding_batches 2 name decoding_batches and batch 1; decoding_batches 1 runs, and so does 0 (a
    one-token sequence after the decoding ones is a prefill of one token)."""
    rng = np.random.default_rng(7)
    seqstarts, kvstarts = np.array([0, 1, 4, 5]), np.array([0, 5, 11, 14])
    query = rng.standard_normal((5, 4, 16)).astype(np.float32)
    key, value = (rng.standard_normal((14, 2, 16)).astype(np.float32) for _ in range(2))
    attrs = dict(num_heads=4, head_dim=16, is_causal=True, num_kv_heads=2, backend=backend)
    with _launch.recorded_launches() as launches, pytest.raises(
            ValueError, match=r"^decoding_batches: .* got seqlen 3 for batch 1 \(seqstarts\[2\] - seqstarts\[1\]\)"):
        cacheattn.dynamic_multi_head_attention(query, key, value, seqstarts, kvstarts, 2, 3, 6, **attrs)
    assert launches == []
    for decoding in (0, 1):
        out = cacheattn.dynamic_multi_head_attention(query, key, value, seqstarts, kvstarts, decoding, 3, 6,
                                                     **dict(attrs, backend="reference"))
        assert out.shape == query.shape and np.isfinite(out).all()


# ---- Errors that point at the mistake: the plan's arguments, dtypes that disagree; the plan shows its choice -----

FLOAT = with_(BASE, quant_bit=0, scale_dtype=None)


def _plan_split(case):
    """(the step's arguments, the layer's) of multi_head_cache_attention's call for `case`."""
    args = {**build_ppl(case), **case.attrs()}
    layer = cacheattn.ppl.LAYER_INPUTS
    return {k: v for k, v in args.items() if k not in layer}, {k: v for k, v in args.items() if k in layer}


@pytest.mark.parametrize("name", ["query", "cache", "layer_idx"])
def test_a_per_layer_argument_given_to_the_plan_names_the_plan_and_sends_it_to_run(name):
    step, layer = _plan_split(BASE)
    with pytest.raises(TypeError, match=rf"^{name}: expected in plan\.run\(\.\.\.\), got in plan_multi_head_cache_"
                                        rf"attention: it is per layer.*plan\.run\({name}=\.\.\.\)"):
        cacheattn.plan_multi_head_cache_attention(**step, **{name: layer[name]})


def test_an_unknown_or_missing_argument_of_the_plan_names_the_plan():
    step, _ = _plan_split(BASE)
    with pytest.raises(TypeError, match=r"^num_kv_head: expected an argument of plan_multi_head_cache_attention, got "
                                        r"an unknown name; did you mean num_kv_heads\b"):
        cacheattn.plan_multi_head_cache_attention(**step, num_kv_head=2)
    del step["head_dim"]
    with pytest.raises(TypeError, match=r"^head_dim: expected a value, got none: plan_multi_head_cache_attention "
                                        r"requires it; pass head_dim=\.\.\.$"):
        cacheattn.plan_multi_head_cache_attention(**step)
    with pytest.raises(TypeError, match=r"^plan_multi_head_cache_attention: expected at most 7 positional arguments "
                                        r"\(seqstarts, .*, max_kvlen\), got 8; per-layer tensors go to plan\.run"):
        cacheattn.plan_multi_head_cache_attention(*range(8), num_heads=4, head_dim=16, is_causal=True)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("name,case,changes,rest", [
    ("current_key", FLOAT, dict(current_key=lambda x: x["current_key"].astype(np.float32),
                                current_value=lambda x: x["current_value"].astype(np.float32)),
     r"expected query's dtype float16, got float32: the call follows query; pass both as float32 or both as "
     r"float16$"),
    ("cache", BASE, dict(cache=lambda x: x["cache"].astype(np.float16)),
     r"expected int8 codes for quant_bit 8, got float16: pass the cache as int8 \(its scales in scale\), or "
     r"quant_bit=0 for a float cache$"),
], ids=["current_key", "cache"])
def test_a_dtype_disagreement_names_both_arrays_and_how_to_agree(name, case, changes, rest, backend):
    inputs, attrs = mhca_call(set_(**changes), case)
    before = {k: v.copy() for k, v in inputs.items() if isinstance(v, np.ndarray)}
    with _launch.recorded_launches() as launches, pytest.raises(TypeError, match=rf"^{name}: {rest}"):
        cacheattn.multi_head_cache_attention(**inputs, **attrs, backend=backend)
    assert launches == []
    for k, x in before.items():
        assert x.dtype == inputs[k].dtype and x.tobytes() == inputs[k].tobytes(), f"the refused call changed {k}"


def test_the_plan_prints_each_phases_choice():
    """Before the kernels plan, each phase says the choice is to come; after a layer on them, one line per phase
    (decode, prefill) with the rung, split count, block size and reason of the one launch serving both."""
    step, layer = _plan_split(BASE)
    plan = cacheattn.plan_multi_head_cache_attention(**step)
    lines = repr(plan).splitlines()
    assert lines[0] == ("MultiHeadCacheAttentionPlan(2 sequences: 1 decode, 1 prefill; max_seqlen 3, max_kvlen 5; 4 "
                        "heads over 2 kv heads, head_dim 16; kernel keywords rung=None, num_splits=None, threads=None)")
    assert [line.split(":")[0] for line in lines[1:]] == ["  decode", "  prefill"]
    assert all("not chosen yet" in line for line in lines[1:])
    plan.run(**layer, backend="numba")
    chosen = plan._kernel_plans["numba", np.dtype(np.float16), np.dtype(np.int8)]
    decode, prefill = repr(plan).splitlines()[1:]
    said = (f"rung {chosen.rung}, {chosen.num_splits} split{'s' if chosen.num_splits > 1 else ''}, "
            f"{chosen.threads} threads: {chosen.reason}")
    assert decode == f"  decode (float16 query, int8 cache, numba): {said}"
    assert prefill == f"  prefill (float16 query, int8 cache, numba): {said} (one launch with the decode)"
