"""The lab's cases of operators other than OpenPPL's (cacheattn/lab/cases.py): TensorRT-LLM's generation step, ONNX
decode with past, FasterTransformer's cross-attention step; their floors, the split counts their full launches run
at, what their default calls run, and their counts on cut-down launches."""

import os
from dataclasses import replace

import numpy as np
import pytest

import cacheattn
from cacheattn.examples import build_trt
from cacheattn.lab import counters
from cacheattn.lab.cases import (
    ALL_LAB_CASES,
    FT_CROSS,
    LAB_CASES,
    ONNX_DECODE,
    OPERATOR_CASES,
    TRT_CONTEXT,
    TRT_DECODE,
    FTBenchCase,
    TrtBenchCase,
)
from cacheattn.lab.recorder import DRAM_READ, DRAM_WRITE, SECTORS_LD
from kernels_numba import _launch

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def test_the_trtllm_floor_is_kv_once_the_new_token_stored_q_and_o():
    # 64 sequences x 8 kv heads, 4096 cached keys of 128 elements: float16 256 bytes a row, INT8 / FP8 128.
    for case, row in zip(OPERATOR_CASES[:3], (256, 128, 128)):
        assert case.row_bytes == row and case.kvlen == 4097
        kv = 2 * 64 * 8 * 4096 * row
        new = 2 * 64 * 8 * 128 * 2                      # the new token's K and V, float16 in qkv
        store = 2 * 64 * 8 * row                        # ... written once to the cache in its format
        q = 64 * 32 * 128 * 2
        assert case.must_move == dict(kv=kv, new_kv=new, store=store, q=q, o=q)
        assert case.floor_bytes == kv + new + store + 2 * q
        assert case.flops == 4 * 128 * 32 * 64 * 4097
    with pytest.raises(ValueError, match="kv_cache"):
        _ = TrtBenchCase("bad", 1, 8, kv_cache="int4").cache


def test_the_onnx_and_ft_floors():
    # ONNX: past K/V read once, the new token's read, present (4097 rows) written once, Q, Y.
    kv_rows = 64 * 8 * 256                              # sequences x kv heads x bytes of a float16 row
    q = 64 * 32 * 128 * 2
    assert ONNX_DECODE.must_move == dict(kv=2 * kv_rows * 4096, new_kv=2 * kv_rows, present=2 * kv_rows * 4097,
                                         q=q, o=q)
    # FasterTransformer: 64 rows x 16 heads x 1024 encoder positions of 64 float16, K and V; q and the context.
    q = 64 * 16 * 64 * 2
    assert FT_CROSS.must_move == dict(kv=2 * 64 * 16 * 1024 * 128, q=q, o=q)
    assert FT_CROSS.flops == 4 * 64 * 16 * 64 * 1024
    with pytest.raises(ValueError, match="num_kv_heads"):
        FTBenchCase("bad", 1, 8, num_heads=4, num_kv_heads=2)


def test_the_trtllm_context_floor_is_qkv_once_the_cache_store_and_o():
    # One prompt of 4096 tokens: the packed QKV (32 + 2 x 8 heads of 128 float16) read once, K and V stored into the
    # float16 cache once, the output written once; nothing cached before it. FLOPs: the causal triangle.
    tokens = 4096
    assert TRT_CONTEXT.must_move == dict(qkv=tokens * 48 * 128 * 2, store=2 * tokens * 8 * 256, kv=0,
                                         o=tokens * 32 * 128 * 2)
    assert TRT_CONTEXT.flops == 4 * 128 * 32 * tokens * (tokens + 1) // 2
    assert (TRT_CONTEXT.kvlen, TRT_CONTEXT.rungs) == (4096, (1, 5, 6))


def test_every_case_gets_a_plan_and_its_default_call():
    plans = {p.case.label: p for p in counters.plans()}
    assert list(plans) == [case.label for case in ALL_LAB_CASES]
    for case in OPERATOR_CASES[:3]:
        plan = plans[case.label]
        assert plan.rungs == (1, 3, 4, 5) and plan.points == (128, 256) and plan.split_points == ()
        # 512 blocks (64 sequences x 8 GQA groups) fill 132 SMs: no split at any rung; rung 5's decode kernel.
        assert [plan.splits(r) for r in plan.rungs] == [1, 1, 1, 1]
        default = counters.default_call(plan)
        assert (default["rung"], default["num_splits"], default["counted as"]) == (5, 1, "5")
        assert "decode kernel" in default["reason"]
    # ONNX and FasterTransformer: the rungs their calls offer (rung 1 alone without `rung=`); multi-head cross
    # attention is counted on one head a block (the cut-down grid keeps the GQA group: 4 heads, or 1).
    for case in (ONNX_DECODE, FT_CROSS):
        plan = plans[case.label]
        assert plan.rungs == case.rungs and plan.rungs[0] == 1
        if plan.rungs == (1,):
            assert counters.default_call(plan)["rung"] == 1
    assert plans[ONNX_DECODE.label].counted.num_heads == 4 and plans[FT_CROSS.label].counted.num_heads == 1
    # TensorRT-LLM's context step is counted as a prefill (the parabola through PREFILL_POINTS new tokens); its
    # default call runs rung 6 (the FlashAttention-2 prefill), the operator's own decision.
    context = plans[TRT_CONTEXT.label]
    assert context.prefill and context.points == counters.PREFILL_POINTS and context.grid_scale == 8
    default = counters.default_call(context)
    assert (default["rung"], default["num_splits"], default["counted as"]) == (6, 1, "6")
    assert "FlashAttention-2" in default["reason"]
    assert plans[FT_CROSS.label].grid_scale == 64 * 16 / 2
    # OpenPPL's default is cacheattn.choose_kernel's choice among the rungs OpenPPL offers, recorded beside them.
    from cacheattn import choose_kernel as kernel_plan
    from cacheattn.ppl import RUNGS
    for case in LAB_CASES:
        chosen = kernel_plan(case.shape(), sms=132, rungs=RUNGS)
        default = counters.default_call(plans[case.label])
        assert (default["rung"], default["num_splits"], default["reason"]) == \
               (chosen.rung, chosen.num_splits, chosen.reason)
        assert default["counted as"] == str(chosen.rung)


def test_the_trtllm_split_count_is_the_one_its_default_call_launches():
    # Recorded launches run nothing: a call of 4 sequences x 2 GQA groups (8 blocks) would split its 2001 keys into
    # ceil(2 x 132 / 8) = 33 key ranges on rung 4; rung 5's decode kernel, its default, takes 64 keys a step (4
    # warps x 16), so no more than ceil(2001 / 64) = 32, and the case says so.
    case = TrtBenchCase("small", 4, 2000, num_heads=8, num_kv_heads=2, head_dim=128)
    assert (case.splits(4), case.splits(5), case.default_plan()["rung"]) == (33, 32, 5)
    with _launch.recorded_launches() as launches:
        cacheattn.gpt_attention(**build_trt(case.trt_case()), backend="numba", threads=128)
    names = [kernel.py_func.__name__ for kernel, _ in launches]
    assert names == ["preprocess_kernel", "gqa_decode_attention_kernel", "combine_kernel"]
    assert launches[1][1][1][5] == case.default_plan()["num_splits"]          # out_geom's num_splits
    # Rung 1's multi-block mode splits too (for its own key tile): its combine kernel runs.
    assert case.splits(1) > 1
    with _launch.recorded_launches() as launches:
        cacheattn.gpt_attention(**build_trt(case.trt_case()), backend="numba", threads=128, rung=1)
    assert [kernel.py_func.__name__ for kernel, _ in launches] == ["preprocess_kernel", "attention_kernel",
                                                                   "combine_kernel"]


@pytest.mark.skipif(not SIM, reason="the lab counts in numba's CUDA simulator")
def test_the_ft_linear_fit_predicts_a_step_it_did_not_count():
    # head_dim 32, one warp, 2 rows: encoder lengths of 64 and 128 predict 192.
    case = replace(FT_CROSS, head_dim=32, label="small ft")
    plan = counters.Plan(case, counters.cut_down(case), (64, 128), rungs=case.rungs)
    counted = [counters._count((plan, 1, n, 32, 1)) for n in (64, 128, 192)]
    for name in counted[0]:
        predicted = counters.fit((64, 128), [c[name] for c in counted[:2]], 192)
        # The preprocess's warps span several heads (a thread per 16-byte chunk), K's and V's among them: their
        # block-offset loads may share a sector or not as the pool's table grows with the keys: one sector either way.
        assert predicted == pytest.approx(counted[2][name], abs=1 if name == SECTORS_LD else 1e-6), name
    # The attention kernel's K/V loads: every byte of 2 rows x 192 positions x K and V, once.
    assert counted[2]["kv_must_see"] == counted[2]["kv_ld_bytes_requested"] == 2 * 192 * 2 * case.row_bytes
    assert counted[2]["hazards"] == 0


@pytest.mark.skipif(not SIM, reason="the lab counts in numba's CUDA simulator")
@pytest.mark.parametrize("kv_cache,rung", [("int8", 3), ("fp8", 4), ("float16", 3)])
def test_the_trtllm_linear_fit_predicts_a_step_it_did_not_count(kv_cache, rung):
    # head_dim 32, one warp: a small launch of the same kernels. Counted at 64 and 128 keys, predicts 192.
    case = replace(TRT_DECODE, kv_cache=kv_cache, head_dim=32, label=f"small {kv_cache}")
    plan = counters.Plan(case, counters.cut_down(case), (64, 128), rungs=case.rungs)
    counted = [counters._count((plan, rung, n, 32, 1)) for n in (64, 128, 192)]
    for name in (SECTORS_LD, DRAM_READ, DRAM_WRITE, "kv_ld_bytes_requested", "kv_ld_sectors", "kv_must_see",
                 "barriers"):
        predicted = counters.fit((64, 128), [c[name] for c in counted[:2]], 192)
        # The preprocess's warps span several heads (a thread per 16-byte chunk), K's and V's among them: their
        # block-offset loads may share a sector or not as the pool's table grows with the keys: one sector either way.
        assert predicted == pytest.approx(counted[2][name], abs=1 if name == SECTORS_LD else 1e-6), name
    last = counted[-1]
    assert last["hazards"] == 0
    # The vector rungs load every K/V byte of the cache once per block, whole sectors: 2 sequences x 192 keys, of
    # which a quantized cache's new token comes from the float16 scratch (the cache holds its codes).
    assert last["kv_must_see"] == 2 * 192 * 2 * case.row_bytes
    if rung != 1:
        from_cache = 192 if kv_cache == "float16" else 191
        assert last["kv_ld_bytes_requested"] == 2 * from_cache * 2 * case.row_bytes == 32 * last["kv_ld_sectors"]
    # Every byte of the pool the step reads comes from DRAM once: at least the cached K/V.
    assert last[DRAM_READ] >= 2 * 2 * 191 * case.row_bytes
    assert np.isfinite(list(last.values())).all()


def test_the_committed_run_keeps_the_other_operators_beside_openppls():
    # OpenPPL's cases under "cases" (what the ladder page's rungs and its plot read), the others under
    # "operators", every one with its default call and the rungs its call offers.
    result = counters.committed()
    assert list(result["cases"]) == [case.label for case in LAB_CASES]
    assert list(result["operators"]) == [case.label for case in OPERATOR_CASES]
    for label, shown in counters.every_case(result):
        plan = next(p for p in counters.plans() if p.case.label == label)
        assert list(shown["rungs"]) == [str(r) for r in plan.rungs]
        assert shown["default"] == counters.default_call(plan, shown["threads"])
        assert shown["default"]["counted as"] in shown["rungs"]
        assert all(r["full"]["hazards"] == 0 for r in shown["rungs"].values())


@pytest.mark.skipif(not SIM, reason="the lab counts in numba's CUDA simulator")
def test_the_committed_trtllm_counts_are_current():
    # A kernel change that moves a count of TensorRT-LLM's generation must come with a new file (python -m
    # cacheattn lab --case trtllm-decode-fp8 --update docs/kernel-ladder-counts.json): its default rung's first point.
    plan = next(p for p in counters.plans() if p.case.label == OPERATOR_CASES[2].label)
    shown = counters.committed()["operators"][plan.case.label]["rungs"]["5"]
    assert counters._count((plan, 5, shown["points"][0], 128, 1)) == shown["counted"][0]


@pytest.mark.skipif(not SIM, reason="the lab counts in numba's CUDA simulator")
def test_the_committed_trtllm_context_counts_are_current():
    # As for the generation step: rung 5's first point (16 new tokens), the default call's column.
    plan = next(p for p in counters.plans() if p.case.label == TRT_CONTEXT.label)
    shown = counters.committed()["operators"][plan.case.label]["rungs"]["5"]
    assert counters._count((plan, 5, shown["points"][0], 128, 1)) == shown["counted"][0]
