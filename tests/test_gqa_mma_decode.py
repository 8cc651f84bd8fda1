"""Rung 5's decode kernel (`kernels_numba._attention_gqa_mma`): the permuted fragments against NumPy, which calls
take it (the host's decision and its reason), and its output on float16, int8 and int4 caches against the float64
evaluation through the conformance kit (outputs NaN-poisoned, caches bit for bit the reference's).

The kernel runs in the simulator on small shapes: head_dim 32 to 128, two sequences whose key counts are not
multiples of 16, GQA groups of 1 to 16 heads, pages that hold a 16-key trip and pages that do not, the offset
cache, one and two warps (two merge their states)."""

import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheattn
import cacheattn.testing as kit
import kernels_numba.ppl_dynamic_multi_head_attention as ppl_kernels
from kernels_numba import _launch
from kernels_numba._attention_gqa_mma import HEAD_DIMS, decode_kernel_choice, k_dims, v_dim
from kernels_numba._dequant import INT4_PAIR_ELEMENTS
from kernels_numba._mma import MMA_K, MMA_M, MMA_N, a_position, b_position, c_position

from strategies import KERNEL, PPLCase, build_ppl, ppl_cases, with_

RNG = np.random.default_rng(20261125)


# ------------------------------------------------------------------------------ the permutations, in NumPy

def _lane_owner(quant_bit, head_dim, lanes):
    """The lane of a row's `lanes` that loads each head dim: the row cut into 16-byte chunks (the lane's whole
    slice where it is shorter), chunk i loaded by lane i % lanes."""
    bits = quant_bit or 16
    chunk = min(head_dim // lanes, 128 // bits)
    return np.arange(head_dim) // chunk % lanes


def _k_index_dim(quant_bit, head_dim, ks):
    """{reduction index 0..15 of k-step ks: head dim} as the lanes' B fragments of K (and Q's A) hold them."""
    out = {}
    for lane in range(32):
        dims = k_dims(quant_bit, head_dim, lane % 4, ks)
        for i in range(4):
            row, _ = b_position(lane, i)
            assert out.setdefault(row, dims[i]) == dims[i]          # every lane of a quad agrees
    return out


@pytest.mark.parametrize("quant_bit", [0, 8, 4])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_permuted_k_steps_still_sum_q_k(quant_bit, head_dim):
    """The k-steps' reduction indices map onto every head dim once, each lane's onto the chunks of the row it loads
    (the quad's lanes interleaving their 16-byte chunks), and the mma's sums over the permuted fragments are
    Q Kᵀ."""
    steps = head_dim // MMA_K
    maps = [_k_index_dim(quant_bit, head_dim, ks) for ks in range(steps)]
    assert sorted(d for m in maps for d in m.values()) == list(range(head_dim))
    owner = _lane_owner(quant_bit, head_dim, 4)
    for quad in range(4):
        dims = sorted(d for ks in range(steps) for d in k_dims(quant_bit, head_dim, quad, ks))
        assert dims == np.flatnonzero(owner == quad).tolist()
    q = RNG.standard_normal((MMA_M, head_dim))
    k = RNG.standard_normal((MMA_N, head_dim))
    s = np.zeros((MMA_M, MMA_N))
    for m in maps:
        a = np.zeros((MMA_M, MMA_K))
        b = np.zeros((MMA_K, MMA_N))
        for lane in range(32):               # the fragments each lane would load, placed where the mma reads them
            for i in range(8):
                row, col = a_position(lane, i)
                a[row, col] = q[row, m[col]]
            for i in range(4):
                row, col = b_position(lane, i)
                b[row, col] = k[col, m[row]]
        s += a @ b
    np.testing.assert_allclose(s, q @ k.T, rtol=1e-12, atol=1e-12)


def test_int4_k_steps_take_the_unpacked_pairs():
    """An int4 word of 8 codes unpacks to the pairs (0, 4), (1, 5), (2, 6), (3, 7): k-steps 2w and 2w + 1 take
    them in that order as (b0, b1)."""
    for ks in range(4):
        w, h = divmod(ks, 2)
        dims = k_dims(4, 128, 0, ks)
        assert (dims[0] - 8 * w, dims[1] - 8 * w) == INT4_PAIR_ELEMENTS[2 * h]
        assert (dims[2] - 8 * w, dims[3] - 8 * w) == INT4_PAIR_ELEMENTS[2 * h + 1]


@pytest.mark.parametrize("quant_bit", [0, 8, 4])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_permuted_output_columns_unpermute_to_p_v(quant_bit, head_dim):
    """Column g of the n8 tiles runs over the dims lane g loads of a value row (the row's 16-byte chunks shared
    out among the 8 lanes in turn), in the order it loads them; the C fragments, written back at v_dim, are
    P V."""
    owner = _lane_owner(quant_bit, head_dim, 8)
    for g in range(8):
        assert [v_dim(quant_bit, head_dim, g, vt) for vt in range(head_dim // 8)] == \
            np.flatnonzero(owner == g).tolist()
    p = RNG.standard_normal((MMA_M, MMA_K))
    v = RNG.standard_normal((MMA_K, head_dim))
    out = np.full((MMA_M, head_dim), np.nan)
    for vt in range(head_dim // 8):
        b = np.zeros((MMA_K, MMA_N))
        for lane in range(32):
            for i in range(4):
                row, col = b_position(lane, i)
                b[row, col] = v[row, v_dim(quant_bit, head_dim, col, vt)]
        tile = p @ b
        for lane in range(32):
            for i in range(4):
                row, col = c_position(lane, i)
                out[row, v_dim(quant_bit, head_dim, col, vt)] = tile[row, col]
    np.testing.assert_allclose(out, p @ v, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------- which calls it takes

def _case(**kw):
    base = dict(seqlens=(1, 1), past=(20, 37), decoding_batches=2, num_heads=4, num_kv_heads=1, head_dim=32,
                dtype="float16", quant_bit=8, quant_group=8, scale_dtype="float16", cache_layout=0, cache_mode=1,
                page_size=16, num_layer=1, layer_idx=0, is_causal=True, is_alibi=False, mask="none", mask_pad=0,
                seed=1)
    return PPLCase(**{**base, **kw})


def _launched(case, **launch):
    """The kernels a rung-5 call launches (recorded, not run); one split unless `launch` asks for more."""
    launch = {"num_splits": 1, **launch}
    with _launch.recorded_launches() as launches:
        cacheattn.multi_head_cache_attention(**build_ppl(case), **case.attrs(), backend="numba", rung=5, **launch)
    return [kernel.py_func.__name__ for kernel, _ in launches]


@pytest.mark.parametrize("what,changes,kernel", [
    ("decode", {}, "gqa_decode_attention_kernel"),
    ("prefill", dict(seqlens=(1, 3), decoding_batches=1), "mma_attention_kernel"),
    ("head_dim 16", dict(head_dim=16), "mma_attention_kernel"),
    ("float32 scales", dict(scale_dtype="float32"), "mma_attention_kernel"),
])
def test_rung_5_takes_the_decode_kernel_where_it_serves(what, changes, kernel):
    assert _launched(_case(**changes), threads=64) == ["store_kernel", kernel], what


def test_a_query_not_16_byte_aligned_takes_the_staged_kernel():
    """The decode kernel reads the query in 16-byte loads: a query view starting 2 bytes into its buffer runs the
    staged kernel, and conforms."""
    case = _case(quant_bit=0)
    inputs = build_ppl(case)
    query = inputs["query"]
    shifted = np.empty(query.size + 1, query.dtype)[1:].reshape(query.shape)     # 2 bytes past an aligned start
    shifted[...] = query
    with _launch.recorded_launches() as launches:
        cacheattn.multi_head_cache_attention(**{**inputs, "query": shifted}, **case.attrs(), backend="numba", rung=5,
                                             num_splits=1)
    assert [kernel.py_func.__name__ for kernel, _ in launches] == ["store_kernel", "mma_attention_kernel"]


def test_the_choice_says_why_not():
    src = ppl_kernels.packed_source(np.zeros((4, 1, 32), np.float16), np.zeros((1, 1), np.int64))
    facts = dict(query_dtype=np.float16, max_seqlen=1, head_dim=32, num_heads=4, num_kv_heads=1, quant_bit=0,
                 quant_group=32, scale_dtype=np.float16, value_dtype=np.float16, threads=128, vector=True,
                 key_src=src, value_src=src)
    assert decode_kernel_choice(**facts)[0]
    for change, why in [(dict(max_seqlen=3), "not a decode batch"), (dict(head_dim=48), "head_dim 48"),
                        (dict(vector=False), "aligned"), (dict(threads=1024), "shared memory"),
                        (dict(value_src=src._replace(starts=np.zeros((1, 1), np.int64))), "page tables")]:
        serves, reason = decode_kernel_choice(**{**facts, **change})
        assert not serves and reason.startswith("staged rung 5: ") and why in reason, (change, reason)
    # bfloat16: a query and cache of its bits; a cache of another dtype, or quantized, is refused
    bf16 = ppl_kernels.packed_source(np.zeros((4, 1, 32), np.uint16), np.zeros((1, 1), np.int64))
    bf16 = bf16._replace(data=bf16.data.view(ml_dtypes.bfloat16))
    assert decode_kernel_choice(**{**facts, "query_dtype": "bfloat16", "key_src": bf16, "value_src": bf16})[0]
    int8 = src._replace(data=np.zeros(src.data.shape, np.int8))
    for change, why in [(dict(), "a float16 cache of quant_bit 0 for a bfloat16 query"),
                        (dict(quant_bit=8, key_src=int8, value_src=int8), "quantized cache (quant_bit 8) with a "
                                                                          "bfloat16 query")]:
        serves, reason = decode_kernel_choice(**{**facts, "query_dtype": ml_dtypes.bfloat16, **change})
        assert not serves and why in reason, (change, reason)


# -------------------------------------------------------------------------------------- the kernel, run

def _kernel(op, threads, num_splits=1):
    return functools.partial(getattr(cacheattn, op), backend="numba", threads=threads, rung=5, num_splits=num_splits)


# (what, changes to _case, threads): every format and head_dim, trips that end mid-page, pages of 8 and 24 keys
# (a trip in two pages: every key looked up), the offset cache, groups of 1 to 16 heads (16: rows grp + 8 too),
# two warps merging, ALiBi with a mask, split-K (3 and 5 splits).
RUNS = [
    ("float16 group 16, 2 warps merge", dict(quant_bit=0, head_dim=64, num_heads=16), 64),
    ("int8 head_dim 128, page 24, 3 splits", dict(head_dim=128, page_size=24, past=(30, 4)), 32),
    ("int4, page 8, group 2", dict(quant_bit=4, page_size=8, num_heads=4, num_kv_heads=2, past=(12, 3)), 32),
    ("int4 head_dim 128, offset cache, group 8",
     dict(quant_bit=4, head_dim=128, cache_mode=0, num_heads=8, past=(5, 20)), 32),
    ("int8 group 16, ALiBi and a mask", dict(num_heads=16, is_alibi=True, mask="2d", quant_group=4), 32),
    ("float16 group 1, layout 2", dict(quant_bit=0, num_heads=2, num_kv_heads=2, cache_layout=2, past=(3, 18)), 32),
    # split-K: whole trips of the visible keys a split, some splits empty, the combine after them
    ("float16, ALiBi and a mask, page 8, 5 splits", dict(quant_bit=0, is_alibi=True, mask="2d", page_size=8,
                                                          past=(40, 9)), 32),
]


@pytest.mark.parametrize("what,changes,threads", RUNS, ids=[r[0] for r in RUNS])
def test_decode_kernel_conforms(what, changes, threads):
    case = _case(**changes, seed=len(what))
    splits = int(what.split(" splits")[0].rsplit(" ", 1)[1]) if " splits" in what else 1
    kernels = ["gqa_decode_attention_kernel"] + ["combine_kernel"] * (splits > 1)
    assert _launched(case, threads=threads, num_splits=splits)[-len(kernels):] == kernels
    kit.check_case("multi_head_cache_attention", _kernel("multi_head_cache_attention", threads, splits), case)


def test_rung_5_splits_a_few_long_sequences_by_itself():
    """Without num_splits rung 5 splits the decode kernel's keys where its blocks leave SMs idle (2 blocks here,
    18 and 38 keys: one trip of 16 a warp a step), as rung 4 does; the plan says the same count."""
    from cacheattn import choose_kernel
    case = _case()
    with _launch.recorded_launches() as launches:
        cacheattn.multi_head_cache_attention(**build_ppl(case), **case.attrs(), backend="numba", rung=5, threads=32)
    assert [kernel.py_func.__name__ for kernel, _ in launches] == ["store_kernel", "gqa_decode_attention_kernel",
                                                                    "combine_kernel"]
    assert launches[1][1][1][5] == 3                    # out_geom's num_splits: ceil(38 / 16)
    shape = cacheattn.AttentionShape(batch=2, max_query_len=1, max_kv_len=38, num_heads=4, num_kv_heads=1,
                                          head_dim=32, query_dtype="float16", quant_bit=8, quant_group=8,
                                          decode_sequences=2)
    assert choose_kernel(shape, rung=5, threads=32, sms=132).num_splits == 3


def test_packed_keys_decode_on_it_too(monkeypatch):
    """dynamic_multi_head_attention shares the launcher: packed float16 key/value (an offset source) on it."""
    names, real = [], ppl_kernels.launch
    monkeypatch.setattr(ppl_kernels, "launch", lambda kernel, *args: names.append(kernel.py_func.__name__) or
                        real(kernel, *args))
    case = _case(quant_bit=0, past=(9, 30), seed=7)
    kit.check_case("dynamic_multi_head_attention", _kernel("dynamic_multi_head_attention", 32), case)
    assert set(names) == {"gqa_decode_attention_kernel"}, names


@pytest.mark.skipif(KERNEL < 12, reason="a longer hunt: CACHEATTN_EXAMPLES=2 or more")
@settings(max_examples=KERNEL // 3)
@given(case=ppl_cases(max_seqlen=1, max_past=40, dtypes=("float16",)), head_dim=st.sampled_from([32, 64]),
       page_size=st.sampled_from([3, 8, 16, 32]))
def test_drawn_decode_calls_conform(case, head_dim, page_size):
    """The kit's drawn decode calls (masks, ALiBi, layouts, modes, groups, formats, quant groups) at a head_dim the
    kernel takes, with float16 scales and pages that do and do not hold a trip."""
    case = with_(case, head_dim=head_dim, scale_dtype="float16", page_size=page_size)
    assert _launched(case, threads=32)[-1] == "gqa_decode_attention_kernel"
    kit.check_case("multi_head_cache_attention", _kernel("multi_head_cache_attention", 32), case)


@pytest.mark.parametrize("quant_bit", [0, 8])
def test_decode_loads_whole_sectors(quant_bit):
    """Recorded as Nsight Compute counts it: every K/V load request (and a quantized cache's scale loads) of the
    decode kernel uses every byte of the 32-byte sectors it touches, at head_dim 128 where a lane's slice is
    several 16-byte chunks (float16 K: 4, V: 2; int8 K: 2, its group scales traded within the quad), and so do
    a float16 cache's query loads. The output still conforms, and the recorder finds no race, uninitialized shared
    read or out-of-bounds index (the shuffles and the warp vote of the transposed scores included)."""
    from cacheattn import lab

    case = _case(quant_bit=quant_bit, head_dim=128, past=(40, 33), seed=11 + quant_bit)
    with lab.record() as rec:
        kit.check_case("multi_head_cache_attention", _kernel("multi_head_cache_attention", 64), case)
    assert any(launch.kernel == "gqa_decode_attention_kernel" for launch in rec.launches)
    assert not rec.hazards, rec.report()
    arrays = {}
    for launch in rec.launches:
        if launch.kernel == "gqa_decode_attention_kernel":
            for name, figures in launch.arrays.items():
                total = arrays.setdefault(name, {"ld_sectors": 0, "ld_bytes_requested": 0})
                for key in total:
                    total[key] += figures[key]
    wanted = ["k_src.data=v_src.data"] + (["k_src.scales=v_src.scales"] if quant_bit else ["q_geom[0]"])
    for name in wanted:
        figures = arrays[name]
        assert figures["ld_sectors"] > 0 and figures["ld_bytes_requested"] == 32 * figures["ld_sectors"], \
            (name, figures)
