"""The kernel plan (`cacheattn.choose_kernel`): which rung OpenPPL's attention operators run when `rung` is not given.

Host-only checks of the choice (the lab's bench cases, the fallbacks and their reasons, every call rung 1 can
serve still served), then the default call itself on the kernels: one small problem for each rung the plan
picks, its launches recorded and its output held to a float64 evaluation by the conformance kit.
"""

import collections
import functools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheattn
import cacheattn.testing as kit
import kernels_numba.ppl_dynamic_multi_head_attention as ppl_kernels
from cacheattn.kernel_choice import AttentionShape, KernelPlan, choose_kernel
from cacheattn.lab import counters
from cacheattn.lab.cases import LAB_CASES
from kernels_numba import _attention_gqa_mma, _fit, _launch
from kernels_numba._attention_core import plan_tiles
from kernels_numba._cache import chunk_elements
from kernels_numba.ppl_dynamic_multi_head_attention import block_plan

from strategies import PPLCase, build_ppl

RUNG_KERNELS = {1: ["attention_kernel"], 3: ["vector_attention_kernel"],
                4: ["vector_attention_kernel", "combine_kernel"], 5: ["mma_attention_kernel"]}
DECODE_KERNELS = {5: ["gqa_decode_attention_kernel"]}     # a decode batch's rung 5: the register-fed kernel


def bench_shape(case):
    """A lab bench case (an OpenPPL paged GQA call, float16 query) in the plan's terms."""
    return AttentionShape(batch=case.batch, max_query_len=case.new_tokens, max_kv_len=case.kvlen,
                          num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                          query_dtype="float16", quant_bit=case.quant_bit, quant_group=case.quant_group,
                          page_size=case.page_size, decode_sequences=case.batch if case.new_tokens == 1 else 0,
                          causal=True)


@pytest.mark.parametrize("case", LAB_CASES, ids=[c.label for c in LAB_CASES])
def test_the_bench_cases_get_the_rungs_the_lab_counts_at_their_bound(case):
    """Decode at B = 64 fills the 132 SMs with 512 blocks (every cache format): the grid of rung 3, which then
    gives way to rung 5's register-fed decode kernel (the same bytes, a fraction of the instructions); B = 1 at
    32k splits the decode kernel's keys as rung 4's would be (33 splits, the lab's count); the float16 prefill
    goes to rung 6's FlashAttention-2 tiles, or rung 5's tensor cores where the operator does not offer rung 6."""
    chosen = choose_kernel(bench_shape(case), sms=132)
    if case.new_tokens > 1:
        assert chosen.rung == 6 and "FlashAttention-2" in chosen.reason
        assert choose_kernel(bench_shape(case), sms=132, rungs=(1, 2, 3, 4, 5)).rung == 5
    elif case.batch == 64:
        assert (chosen.rung, chosen.num_splits) == (5, 1) and "512 blocks fill 132 SMs; memory-bound" in chosen.reason
        assert "rung 5's decode kernel" in chosen.reason
        # Where the operator's rung 5 stages its keys (ONNX's), the same call stays on rung 3.
        assert choose_kernel(bench_shape(case), sms=132, register_decode=False).rung == 3
    else:
        assert (chosen.rung, chosen.num_splits) == (5, counters.split_steps(case)[5][0]) == (5, 33)
        assert "33 splits make 264" in chosen.reason and "rung 5's decode kernel" in chosen.reason
        staged = choose_kernel(bench_shape(case), sms=132, register_decode=False)
        assert (staged.rung, staged.num_splits) == (4, 33)
    assert chosen.threads == 128


WITHOUT_FLASH = (1, 2, 3, 4, 5)     # an operator that does not offer rung 6


def shape(**changes):
    """A GQA call of 32/8 heads at head_dim 128: a causal float16 prefill of 2048 tokens unless changed."""
    facts = dict(batch=1, max_query_len=2048, max_kv_len=2048, num_heads=32, num_kv_heads=8, head_dim=128,
                 query_dtype="float16", causal=True)
    return AttentionShape(**{**facts, **changes})


def test_fallbacks_say_why():
    decode = shape(batch=4, max_query_len=1, max_kv_len=100, decode_sequences=4)
    # Not whole warps: only rung 1's tile loops take any block size.
    assert choose_kernel(decode, threads=48, sms=132) == KernelPlan(
        1, 1, 48, "fallback to shared-memory tiles: rungs 2-5 need whole warps, threads is 48")
    # A prefill the CUDA cores would be bound on, with a float32 query the tensor cores cannot take.
    chosen = choose_kernel(shape(query_dtype="float32"), sms=132)
    assert chosen.rung == 3 and chosen.reason.endswith("no tensor cores: rung 5 takes a float16 query, got float32")
    assert "compute-bound" in chosen.reason
    # Float16, it goes to rung 6's FlashAttention-2 tiles (rung 5's tensor cores without it); at a head_dim rung 6
    # does not take and whose rung-5 tiles need fewer warps, to rung 5 with fewer warps.
    assert choose_kernel(shape(), sms=132).rung == 6
    assert choose_kernel(shape(), sms=132, rungs=WITHOUT_FLASH).rung == 5
    wide = choose_kernel(shape(head_dim=320), sms=132)
    assert (wide.rung, wide.threads) == (5, 64) and "head_dim 320 does not fit 128" in wide.reason


def test_asked_for_rungs_and_splits_are_kept_and_checked():
    decode = dict(max_query_len=1, max_kv_len=4096, num_heads=8, num_kv_heads=2, head_dim=64, decode_sequences=1)
    assert choose_kernel(shape(**decode), rung=2, sms=132) == KernelPlan(2, 1, 128, "rung=2 asked for")
    forced = choose_kernel(shape(**decode), num_splits=5, sms=132)
    assert (forced.rung, forced.num_splits) == (4, 5)
    # rung 4 without a count: the launcher's own heuristic, for the SMs given (2 blocks: 2 x 16 / 2 = 16 splits).
    assert choose_kernel(shape(**decode), rung=4, sms=16).num_splits == 16
    with pytest.raises(ValueError, match=r"^threads\b"):
        choose_kernel(shape(**decode), rung=3, threads=48)
    with pytest.raises(ValueError, match=r"^num_splits\b"):
        choose_kernel(shape(**decode), num_splits=65)
    with pytest.raises(ValueError, match=r"^rung\b"):
        choose_kernel(shape(**decode, query_dtype="float32"), rung=5)
    with pytest.raises(ValueError, match=r"^head_dim\b"):
        choose_kernel(shape(**{**decode, "head_dim": 704}), rung=1)


def test_the_plans_machine_code_figures_are_the_committed_sass():
    """The plan bounds rungs 3-6 with what their warps issue and wait on: the committed sm_90 SASS's shortest trip,
    what a warp runs once, exp2 and LSU a trip, the chain of round trips a trip waits on, and the blocks an SM
    holds (docs/kernel-ladder-sass.json; rung 5's decode is its register-fed kernel)."""
    from cacheattn.kernel_choice import SASS_WORK
    from cacheattn.lab import sass

    variants = sass.committed()["variants"]
    assert SASS_WORK == sass.plan_work(variants), "python -m cacheattn.lab.sass --write docs/kernel-ladder-sass.json"
    assert {rung for rung, _, _ in SASS_WORK} == set(sass.PLAN_RUNGS)
    assert variants["rung5-float16-decode"]["kernel"] == "gqa_decode_attention_kernel"


def test_a_term_one_candidate_lacks_never_hides_the_others_binding_term():
    """Candidate `known` has its SASS at this shape and is bound by issue; `unknown` has no SASS (no issue, latency
    or waves term) and a lower DRAM term. Leaving issue out of both would compare `known` by its DRAM term alone
    and prefer it; its bound is its issue term, so `unknown` wins on the lower bound, and `known` only where its
    whole bound is no higher."""
    from types import SimpleNamespace

    from cacheattn.kernel_choice import _better, _no_worse

    def bounds(**terms):
        return SimpleNamespace(resources={k: SimpleNamespace(value=v) for k, v in terms.items()},
                               bound_us=max(terms.values()))

    known = bounds(DRAM=100.0, issue=300.0, latency=50.0, waves=40.0, launch=3.0)
    unknown = bounds(DRAM=150.0, launch=3.0)
    assert _better(unknown, known) and not _better(known, unknown)
    assert not _no_worse(known, unknown)
    # the side that lacks terms wins only on a strictly lower bound; the other on a bound no higher
    tied = bounds(DRAM=300.0, launch=3.0)
    assert not _better(tied, known) and _better(known, tied)
    # with the same terms on both sides the terms after the bound break a tie
    assert _better(bounds(DRAM=300.0, issue=10.0, latency=1.0, waves=1.0),
                   bounds(DRAM=300.0, issue=20.0, latency=1.0, waves=1.0))


def test_a_split_must_pay_for_its_partials_and_its_combine_launch():
    """Two requests of 128 cached tokens leave 116 of 132 SMs idle, but splitting their keys buys less than the
    combine's launch and the partials cost: the plan keeps one block per GQA group and says why. One request at
    32k keys still splits 33 ways: the keys' round trips over 8 blocks cost far more than a launch."""
    short = shape(batch=2, max_query_len=1, max_kv_len=129, decode_sequences=2)
    chosen = choose_kernel(short, sms=132)
    assert (chosen.rung, chosen.num_splits) == (5, 1)
    assert "partials and combine launch cost more than they buy" in chosen.reason
    staged = choose_kernel(short, sms=132, register_decode=False)
    assert (staged.rung, staged.num_splits) == (3, 1) and "unsplit" in staged.reason
    long = choose_kernel(shape(max_query_len=1, max_kv_len=32769, decode_sequences=1), sms=132)
    assert (long.rung, long.num_splits) == (5, 33)
    # the reason prints bounds as bounds, the binding term first and the next two
    assert "≥ 43.7 µs (bound: DRAM; then latency" in long.reason


def test_the_prefill_reason_is_its_honest_bound():
    """The 4k prefill on rung 5 is held by issue (its key loop's shortest path on every trip), not by shared
    memory: over a millisecond, not 332 µs."""
    prefill = LAB_CASES[4]
    chosen = choose_kernel(bench_shape(prefill), sms=132, rungs=WITHOUT_FLASH)
    assert chosen.rung == 5 and "compute-bound, ≥ 1,9" in chosen.reason and "(bound: issue;" in chosen.reason
    # rung 6, the default, at a fifth of it, is held by shared memory (2.5 wavefronts a mma: each ldmatrix'd
    # fragment feeds one), its issue and the tensor cores close behind
    flash = choose_kernel(bench_shape(prefill), sms=132)
    assert flash.rung == 6 and "compute-bound, ≥ 358.2 µs (bound: shared; then tensor" in flash.reason


def test_the_plan_is_cached_per_shape():
    import timeit
    decode = bench_shape(LAB_CASES[0])
    choose_kernel(decode, sms=132)
    per_call = min(timeit.repeat(lambda: choose_kernel(decode, sms=132), number=200, repeat=3)) / 200
    assert per_call < 20e-6


def test_an_operator_offering_fewer_rungs_gets_its_best_of_them():
    """`rungs=`: FasterTransformer's cross attention offers rungs 1, 3 and 4; the float16 prefill that goes to the
    tensor cores takes its CUDA-core rung instead, and a long decode on one request still splits, on rung 4 (where
    all rungs are offered, rung 5's decode kernel splits it)."""
    offered = (1, 3, 4)
    assert choose_kernel(shape(), sms=132).rung == 6
    chosen = choose_kernel(shape(), sms=132, rungs=offered)
    assert chosen.rung == 3 and "compute-bound" in chosen.reason
    long = shape(max_query_len=1, max_kv_len=32769, decode_sequences=1)
    assert choose_kernel(long, sms=132, rungs=offered) == choose_kernel(long, sms=132, register_decode=False)
    assert choose_kernel(long, sms=132).rung == 5
    # Without rung 4 the same decode runs unsplit on rung 3, and says so.
    unsplit = choose_kernel(long, sms=132, rungs=(1, 3))
    assert (unsplit.rung, unsplit.num_splits) == (3, 1) and "rung 4 (split-K) not offered" in unsplit.reason
    with pytest.raises(ValueError, match=r"^rung\b.*offer rungs \(1, 3, 4\)"):
        choose_kernel(shape(), rung=5, rungs=offered)
    with pytest.raises(ValueError, match=r"^num_splits\b"):
        choose_kernel(long, num_splits=4, rungs=(1, 3))
    for bad in ((), (3, 4), (1, 7)):
        with pytest.raises(ValueError, match=r"^rungs\b"):
            choose_kernel(shape(), rungs=bad)


@pytest.mark.parametrize("field,value", [("num_kv_heads", 3), ("batch", -1), ("head_dim", 0), ("quant_bit", 2),
                                         ("decode_sequences", 2)])
def test_shape_facts_are_checked(field, value):
    facts = dict(batch=1, max_query_len=1, max_kv_len=8, num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        AttentionShape(**{**facts, field: value})


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 80), query_len=st.sampled_from([1, 1, 2, 5, 17, 300]), kv_len=st.integers(1, 40000),
       group=st.sampled_from([1, 2, 4, 8, 16, 32]), kv_heads=st.sampled_from([1, 2, 8]),
       head_dim=st.sampled_from([8, 24, 64, 80, 128, 256, 512, 704, 1024]),
       dtype=st.sampled_from(["float16", "float32"]), quant_bit=st.sampled_from([0, 8, 4]),
       threads=st.sampled_from([None, None, 32, 48, 64, 96, 128, 256, 1024]), sms=st.sampled_from([8, 108, 132]))
def test_every_call_rung_1_serves_is_served_by_a_rung_that_fits(batch, query_len, kv_len, group, kv_heads, head_dim,
                                                                dtype, quant_bit, threads, sms):
    """Never a refusal where the old default (rung 1) ran; never rung 2 (rung 3 serves every call it can); and
    the chosen rung's own planner accepts the call at the chosen block size."""
    facts = AttentionShape(batch=batch, max_query_len=query_len, max_kv_len=max(kv_len, query_len),
                           num_heads=group * kv_heads, num_kv_heads=kv_heads, head_dim=head_dim, query_dtype=dtype,
                           quant_bit=quant_bit, quant_group=8 if quant_bit else 0, causal=True)
    try:
        plan_tiles(facts.num_heads, kv_heads, query_len, head_dim, head_dim)
    except ValueError:
        return                                        # rung 1 cannot run it: nothing to keep
    chosen = choose_kernel(facts, threads=threads, sms=sms)
    assert chosen.rung in (1, 3, 4, 5, 6) and chosen.reason
    assert threads is None or chosen.threads == threads
    assert (chosen.num_splits > 1) == (chosen.rung == 4) and chosen.num_splits <= 64
    assert chosen.rung < 5 or dtype == "float16"
    if chosen.rung == 6:
        assert query_len > 1 and quant_bit == 0 and head_dim <= 128
        return
    chunk = chunk_elements(quant_bit, facts.cache_dtype, chosen.rung) if chosen.rung in (3, 4) else None
    block_plan(chosen.rung, facts.num_heads, kv_heads, query_len, head_dim, chosen.threads, chunk)


# ------------------------------------------------------------------------------------------ the default call

def case(seqlens, past, dtype="float16", **changes):
    fields = dict(seqlens=seqlens, past=past, decoding_batches=sum(s == 1 for s in seqlens), num_heads=4,
                  num_kv_heads=2, head_dim=8, dtype=dtype, quant_bit=0, quant_group=8, scale_dtype=dtype,
                  cache_layout=0, cache_mode=1, page_size=4, num_layer=1, layer_idx=0, is_causal=True,
                  is_alibi=False, mask="none", mask_pad=0, seed=len(seqlens) + sum(past))
    return PPLCase(**{**fields, **changes})


# One small problem per rung the plan picks, with the block size a caller would pass (None: the plan's). Decode
# with short contexts stays on rung 3 at a head_dim rung 5's decode kernel does not take (8), and goes to it at
# 32; 70 keys at one warp a block (32 keys a step) split 3 ways; a float16 prefill takes the tensor cores; 48
# threads are not whole warps.
DEFAULT_CALLS = {
    "decode, int8 cache": (case((1, 1), (6, 11), quant_bit=8), None, 3),
    "decode, int4 cache, head_dim 32": (case((1, 1), (6, 19), quant_bit=4, head_dim=32), None, 5),
    "decode, float32": (case((1, 1), (3, 9), "float32", cache_layout=2), None, 3),
    "long decode, one warp": (case((1,), (69,), quant_bit=4), 32, 4),
    "decode and prefill, float16": (case((1, 3), (5, 0), is_alibi=True), None, 5),
    "decode, 48 threads": (case((1, 2), (5, 3), mask="3d", mask_pad=1), 48, 1),
}


@pytest.fixture
def free_launches(monkeypatch):
    """The bound model with launches that cost nothing: a simulator-sized decode of 70 keys gains from splitting
    only then (on an H100 the combine's launch costs more than the split buys, and the plan keeps it whole), which
    is how these tests still reach rung 4's split launch through the default call."""
    from dataclasses import replace

    from cacheattn import bounds
    from cacheattn.kernel_choice import _plan

    monkeypatch.setattr(bounds, "H100_SXM", replace(bounds.H100_SXM, launch_s=0.0))
    _plan.cache_clear()
    yield
    _plan.cache_clear()


def test_a_tiny_split_does_not_pay_for_its_launch():
    problem, threads, _ = DEFAULT_CALLS["long decode, one warp"]
    facts = AttentionShape(batch=1, max_query_len=1, max_kv_len=70, num_heads=4, num_kv_heads=2, head_dim=8,
                           query_dtype="float16", quant_bit=4, quant_group=8, page_size=4, decode_sequences=1)
    chosen = choose_kernel(facts, threads=threads, sms=132)
    assert (chosen.rung, chosen.num_splits) == (3, 1) and "cost more than they buy" in chosen.reason


def spied(monkeypatch):
    """The names of the kernels the OpenPPL attention launcher runs, in order."""
    names = []
    real = ppl_kernels.launch

    def launch(kernel, *args):
        names.append(kernel.py_func.__name__)
        return real(kernel, *args)
    monkeypatch.setattr(ppl_kernels, "launch", launch)
    return names


def on_device(device, function, **launch):
    """`function` on the kernels with NumPy arrays (CuPy ones on a GPU, in-place tensors copied back)."""
    fn = functools.partial(function, backend="numba", **launch)
    if not device.gpu:
        return fn

    def call(*args, **attrs):
        moved = [device.put(a) for a in args]
        out = fn(*moved, **attrs)
        for host, there in zip(args, moved):
            if there is not host:
                host[...] = device.get(there)
        return device.get(out)
    return call


def test_the_default_calls_cover_every_rung_the_plan_picks():
    assert sorted({rung for _, _, rung in DEFAULT_CALLS.values()}) == [1, 3, 4, 5]


@pytest.mark.parametrize("label", DEFAULT_CALLS)
def test_the_default_call_runs_the_planned_rung_and_conforms(device, monkeypatch, request, label):
    """The attention operators without `rung`: the kernels the plan names run (recorded as they launch), and the
    kit holds the output to a float64 evaluation and the cache to the reference's bits. The unfused operator
    shares the dispatch, and its default runs on the kit's problems in test_ppl_kernels.py; here it takes the
    fallback case only."""
    problem, threads, rung = DEFAULT_CALLS[label]
    if rung == 4:
        request.getfixturevalue("free_launches")
    launch = {} if threads is None else {"threads": threads}
    ops = ["multi_head_cache_attention"] + (["dynamic_multi_head_attention"] if rung == 1 else [])
    decode = all(n == 1 for n in problem.seqlens)
    expected = DECODE_KERNELS.get(rung, RUNG_KERNELS[rung]) if decode else RUNG_KERNELS[rung]
    for op in ops:
        names = spied(monkeypatch)
        kit.check_case(op, on_device(device, getattr(cacheattn, op), **launch), problem)
        assert names == expected, (op, names)
        monkeypatch.undo()


def test_the_plan_is_what_the_operator_runs(free_launches):
    """The operator asks the plan with the call's facts: the same rung and split count as `plan` on them."""
    problem, threads, rung = DEFAULT_CALLS["long decode, one warp"]
    facts = AttentionShape(batch=1, max_query_len=1, max_kv_len=70, num_heads=4, num_kv_heads=2, head_dim=8,
                           query_dtype="float16", quant_bit=4, quant_group=8, page_size=4, decode_sequences=1)
    chosen = choose_kernel(facts, threads=threads)
    with _launch.recorded_launches() as launches:
        cacheattn.multi_head_cache_attention(**build_ppl(problem), **problem.attrs(), backend="numba",
                                             threads=threads)
    assert chosen.rung == rung == 4 and launches[1][1][1][5] == chosen.num_splits == 3   # out_geom's num_splits


def test_a_head_dim_rung_1_cannot_hold_runs_on_the_vector_loads(device, monkeypatch, free_launches):
    """Head_dim 704: rung 1's K/V tiles do not fit its shared memory (the old default refused the call), while
    rung 3's lanes take three 16-byte chunks of every row each (split 3 ways here: 2 blocks for 132 SMs); the plan
    serves the call, and it conforms."""
    problem = case((1,), (8,), head_dim=704)
    with pytest.raises(ValueError, match=r"^head_dim\b"):
        plan_tiles(4, 2, 1, 704, 704)
    names = spied(monkeypatch)
    kit.check_case("multi_head_cache_attention", on_device(device, cacheattn.multi_head_cache_attention), problem)
    assert names == RUNG_KERNELS[4], names


FACTS = dict(batch=2, max_query_len=5, max_kv_len=10, num_heads=4, num_kv_heads=2, head_dim=64)
BAD_SHAPES = [
    # (changes, error, field, the rest of the message)
    (dict(max_query_len=50), ValueError, "max_query_len",
     r"expected <= max_kv_len \(10: a sequence's keys are its cached tokens plus its new ones\), got 50; swapped\? "
     r"Pass keys_apart=True where the keys are given apart from the queries \(cross attention\)$"),
    (dict(query_dtype="banana"), TypeError, "query_dtype",
     r"expected one of \('float16', 'bfloat16', 'float32'\) \(a name or NumPy dtype\), got 'banana'$"),
    (dict(query_dtype="float64"), TypeError, "query_dtype", r"expected one of .*, got float64$"),
    (dict(cache_dtype="bool"), TypeError, "cache_dtype",
     r"expected one of \('float16', 'bfloat16', 'float32', 'int8'\)"),
    (dict(quant_bit=8), ValueError, "quant_group", r"expected a divisor of head_dim \(64\) for quant_bit 8"),
    (dict(quant_bit=8, quant_group=6), ValueError, "quant_group", r"expected a divisor of head_dim .*, got 6$"),
    (dict(quant_bit=4, quant_group=1), ValueError, "quant_group", r"expected an even group for quant_bit 4"),
    (dict(quant_bit=True), ValueError, "quant_bit", r"expected one of \(0, 4, 8\), got True$"),
    (dict(decode_sequences=1, max_query_len=0), ValueError, "max_query_len", r"expected >= 1 with decode_sequences 1"),
    (dict(max_kv_len=-1), ValueError, "max_kv_len", r"expected an int >= 0, got -1$"),
    (dict(num_heads=0), ValueError, "num_heads", r"expected an int >= 1, got 0$"),
    (dict(batch=2.0), TypeError, "batch", r"expected an int, got float 2.0$"),
]


@pytest.mark.parametrize("changes,error,field,rest", BAD_SHAPES, ids=[b[2] + " " + str(b[0]) for b in BAD_SHAPES])
def test_a_shape_names_the_field_at_fault(changes, error, field, rest):
    with pytest.raises(error, match=rf"^{field}: {rest}"):
        AttentionShape(**{**FACTS, **changes})


def test_what_the_operators_plan_is_a_valid_shape():
    """An empty step (no sequence, no key), keys given apart from fewer queries than keys (cross attention), an
    int4 cache whose group divides head_dim, dtypes as names or NumPy types: accepted, the dtypes normalised."""
    assert AttentionShape(**{**FACTS, "batch": 0, "max_query_len": 0, "max_kv_len": 0}).batch == 0
    # a decode query whose keys, given apart, are none (OpenPPL's dynamic attention, ONNX without K rows)
    assert AttentionShape(**{**FACTS, "max_query_len": 1, "max_kv_len": 0, "decode_sequences": 2,
                             "keys_apart": True}).decode_sequences == 2
    cross = AttentionShape(**{**FACTS, "max_query_len": 50, "keys_apart": True})
    assert cross.keys_apart is True and choose_kernel(cross, sms=132).rung in (1, 3, 4, 5, 6)
    quantized = AttentionShape(**{**FACTS, "quant_bit": 4, "quant_group": 8, "query_dtype": np.float32,
                                  "cache_dtype": "float16"})
    assert quantized.cache_dtype == np.int8 and quantized.query_dtype == np.float32


def test_a_kernel_plan_prints_its_rung_split_count_and_reason():
    one = AttentionShape(batch=1, max_query_len=1, max_kv_len=32769, decode_sequences=1, num_heads=32,
                         num_kv_heads=8, head_dim=128)
    chosen = choose_kernel(one, sms=132)
    text = repr(chosen)
    assert "\n" not in text
    assert text.startswith(f"KernelPlan(rung={chosen.rung}, num_splits={chosen.num_splits}, threads=128, reason=")
    assert repr(chosen.reason) in text and "33 splits make 264" in chosen.reason


# Each rung's own answer for a call (`kernels_numba._fit.RungFit`), at the headline decode: 64 requests at 4097
# keys, 32/8 heads at head_dim 128, a float16 cache, 128 threads.
HEADLINE = dict(batch=64, max_query_len=1, max_kv_len=4097, num_heads=32, num_kv_heads=8, head_dim=128,
                query_dtype="float16", decode_sequences=64)


def test_rung_1_answers_its_tiles_grid_and_shared_memory():
    from kernels_numba import _attention_core

    fit = _attention_core.fit(AttentionShape(**HEADLINE), 128)
    # A whole GQA group of 4 heads a block, one position, 32 keys a tile: 8 groups x 64 requests.
    assert (fit.rung, fit.fits, fit.blocks, fit.heads_per_block, fit.positions, fit.keys_per_step) == (
        1, True, 512, 4, 1, 32)
    assert fit.shared_bytes == 4 * (32 * 256 + 4 * (128 + 32 + 128 + 3)) + 8 * 4 * 32 <= _attention_core.SHARED_BYTES
    # Any block size runs rung 1's tile loops.
    assert _attention_core.fit(AttentionShape(**HEADLINE), 48).fits
    wide = AttentionShape(**{**HEADLINE, "head_dim": 704})
    with pytest.raises(ValueError) as raised:
        plan_tiles(32, 8, 1, 704, 704)
    assert _attention_core.fit(wide, 128) == _fit.RungFit(1, "tiles", 128, False, str(raised.value))
    assert str(raised.value).startswith("head_dim: 704/704")


def test_rungs_3_and_4_answer_the_vector_grid_and_keys_a_step():
    from kernels_numba import _attention_vector

    fit = _attention_vector.fit(AttentionShape(**HEADLINE), 128)
    # float16 rows in 16-byte chunks: 16 lanes a key, 2 keys a lane group's tile, 2 groups a warp, 4 warps.
    assert (fit.rung, fit.fits, fit.blocks, fit.heads_per_block, fit.positions, fit.keys_per_step) == (
        3, True, 512, 4, 1, 16)
    assert fit.shared_bytes == 4 * 4 * (32 + 4 * 130)
    # int4 in 8-byte chunks: 8 lanes a key, so a warp takes twice the keys a step.
    int4 = AttentionShape(**HEADLINE, quant_bit=4, quant_group=128)
    assert _attention_vector.fit(int4, 128).keys_per_step == 32
    # Rung 4 is the same grid, its refusals named as its own.
    assert _attention_vector.fit(AttentionShape(**HEADLINE), 48, rung=4) == _fit.RungFit(
        4, "vector", 48, False, "threads: expected a multiple of 32 for rung 4 (whole warps), got 48")
    wide = AttentionShape(**{**HEADLINE, "head_dim": 4096})
    with pytest.raises(ValueError) as raised:
        block_plan(3, 32, 8, 1, 4096, 128, chunk_elements(0, np.float16, 3))
    refused = _attention_vector.fit(wide, 128)
    assert (refused.fits, refused.why_not) == (False, str(raised.value))
    assert refused.why_not.startswith("head_dim: 4096")


def test_rung_5_staged_answers_its_row_tiles_and_refuses_as_its_launcher():
    from kernels_numba import _attention_mma

    fit = _attention_mma.fit(AttentionShape(**HEADLINE), 128)
    # 4 heads x 4 positions fill an mma tile's 16 rows; a decode holds one row tile, its 4 warps split the keys.
    assert (fit.rung, fit.variant, fit.fits, fit.blocks, fit.heads_per_block, fit.row_tiles, fit.keys_per_step) == (
        5, "staged", True, 512, 4, 1, 64)
    prefill = _attention_mma.fit(shape(), 128)
    assert (prefill.row_tiles, prefill.positions, prefill.blocks) == (4, 16, 2048 // 16 * 8)
    assert prefill.shared_bytes <= _attention_mma.SHARED_BYTES
    # head_dim 320 fits 64 threads, not 128: the launcher's message.
    with pytest.raises(ValueError) as raised:
        block_plan(5, 32, 8, 2048, 320, 128)
    assert _attention_mma.fit(shape(head_dim=320), 128) == _fit.RungFit(5, "staged", 128, False, str(raised.value))
    assert _attention_mma.fit(shape(head_dim=320), 64).fits
    assert _attention_mma.fit(shape(query_dtype="float32"), 128).why_not.startswith("rung: 5")


def test_rung_5_decode_answers_its_grid_or_why_it_stages():
    fit = _attention_gqa_mma.fit(AttentionShape(**HEADLINE), 128)
    # A block a GQA group of a request, each of 4 warps a trip of 16 keys a step.
    assert (fit.rung, fit.variant, fit.fits, fit.blocks, fit.heads_per_block, fit.keys_per_step) == (
        5, "decode", True, 512, 4, 64)
    assert 0 < fit.shared_bytes <= _attention_gqa_mma.SHARED_BYTES
    staged = _attention_gqa_mma.fit(AttentionShape(**{**HEADLINE, "head_dim": 96}), 128)
    assert (staged.fits, staged.why_not) == (False, "head_dim 96 is not one of (32, 64, 128)")
    assert not _attention_gqa_mma.fit(shape(), 128).fits


def test_rung_2_answers_when_asked_for():
    from kernels_numba import _attention_warp

    fit = _attention_warp.fit(AttentionShape(**HEADLINE), 128)
    assert (fit.fits, fit.blocks, fit.heads_per_block, fit.keys_per_step) == (True, 512, 4, 4)
    assert _attention_warp.fit(AttentionShape(**HEADLINE), 48).why_not.startswith("threads: ")


def test_the_plan_asks_each_offered_rung_once_a_new_shape(monkeypatch):
    """choose_kernel asks each candidate kernel for its answer once per new shape (at a block size every kernel
    fits), and a cached shape asks none; a kernel not offered is not asked, nor rung 5's staged kernel where its
    decode kernel serves the call, nor rung 1 where a faster rung serves it. The answers are kept per the facts a
    fit reads: a shape one key longer asks no kernel again."""
    from cacheattn import kernel_choice

    asked = collections.Counter()
    for kernel, fit in list(kernel_choice.rung_fits().items()):
        def counted(s, threads, kernel=kernel, fit=fit):
            asked[kernel] += 1
            return fit(s, threads)
        monkeypatch.setitem(kernel_choice.rung_fits(), kernel, counted)

    def asks(facts, rung_=None, **options):
        """{kernel: times asked} for a plan of `facts` with no plan and no answer kept."""
        kernel_choice._plan.cache_clear()
        kernel_choice._answer.cache_clear()
        asked.clear()
        chosen = choose_kernel(facts, sms=132, **options)
        assert rung_ is None or chosen.rung == rung_
        return dict(asked)

    decode = AttentionShape(**HEADLINE)
    assert asks(decode, 5) == {(3, "vector"): 1, (5, "decode"): 1}
    choose_kernel(decode, sms=132)
    choose_kernel(replace(decode, max_kv_len=decode.max_kv_len + 1), sms=132)
    assert sum(asked.values()) == 2
    assert asks(shape(), 6) == {(3, "vector"): 1, (5, "staged"): 1, (6, "flash"): 1}
    assert asks(shape(), 5, rungs=WITHOUT_FLASH) == {(3, "vector"): 1, (5, "staged"): 1}
    assert asks(decode, 3, register_decode=False) == {(3, "vector"): 1, (5, "staged"): 1}
    assert asks(shape(), 3, rungs=(1, 3, 4)) == {(3, "vector"): 1}
    # The fallback: no rung of whole warps serves 48 threads, so rung 1 is asked too.
    assert asks(decode, 1, threads=48) == {(3, "vector"): 1, (5, "staged"): 1, (1, "tiles"): 1}
    # A rung asked for: its own kernel, and rung 5's decode kernel on a decode batch.
    assert asks(decode, 5, rung=5) == {(5, "staged"): 1, (5, "decode"): 1}
    kernel_choice._answer.cache_clear()


def test_bfloat16_plans_as_two_byte_elements():
    """The kernels read bfloat16 as its bits: a bfloat16 query moves the bytes of a float16 one and plans as it does
    on rungs 1 to 4 and on rung 5's decode kernel (bfloat16 mma); rung 5's staged kernel says it takes float16."""
    heads = dict(batch=2, max_query_len=1, max_kv_len=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                 decode_sequences=2)
    bf16, f16 = AttentionShape(**heads, query_dtype="bfloat16"), AttentionShape(**heads, query_dtype="float16")
    assert bf16.query_dtype.name == "bfloat16" and bf16.bytes_to_move == f16.bytes_to_move
    assert choose_kernel(bf16, rungs=(1, 3, 4)) == choose_kernel(f16, rungs=(1, 3, 4))
    assert choose_kernel(bf16) == choose_kernel(f16) and choose_kernel(bf16).rung == 5
    assert choose_kernel(bf16, rung=5) == choose_kernel(f16, rung=5)
    with pytest.raises(ValueError, match=r"^rung: 5 .* needs a float16 query, got bfloat16"):
        choose_kernel(bf16, rung=5, register_decode=False)
    # a quantized cache keeps a bfloat16 query off the decode kernel (its codes dequantize to float16 pairs)
    quantized = replace(bf16, cache_dtype="int8", quant_bit=8, quant_group=8)
    assert choose_kernel(quantized).rung != 5
    assert "with a bfloat16 query" in _attention_gqa_mma.fit(quantized, 128).why_not
