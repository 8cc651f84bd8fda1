"""ONNX Attention on the kernel ladder's fast rungs: decode with past (and prefill) on rung 3, rung 4 (split-K) and
the plan's default, against a float64 evaluation; which kernels launch; the rung= / num_splits= / threads= checks."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings

import cacheattn
import cacheattn.testing as kit
from cacheattn.examples import OnnxCase, build_onnx, float64_onnx
from cacheattn.onnx import kernel_plan
from kernels_numba import _launch

from helpers import assert_bits_equal, assert_close
from strategies import deep_only, onnx_cases

BASE = OnnxCase(batch=2, q_heads=4, kv_heads=2, q_len=1, kv_len=1, past_len=1, head_size=16, v_head_size=16,
                three_d=False, dtype="float16", mask="none", mask_shape=(), is_causal=0, nonpad=None, softcap=0.0,
                scale=None, left_window_size=-1, right_window_size=-1, qk_matmul_output_mode=0, seed=3)

# One query a batch. Lengths: a past of 1; keys not a multiple of a block's step (16 keys at head_size 16 in float16
# with one warp, 8 in float32: the default splits calls with more); K longer than the query, partly hidden by causal.
DECODE = {
    "bool mask, GQA 4/2, fp16, past 1": replace(BASE, mask="bool", mask_shape=(2, 1, 1, 2)),
    "float mask (short), causal, softcap 2, fp32 3-D, past 11": replace(
        BASE, dtype="float32", three_d=True, mask="float", mask_shape=(4, 1, 10), is_causal=1, softcap=2.0,
        past_len=11, seed=4),
    "nonpad (5, 11), GQA 4/1, fp16, no past, v_head_size 8": replace(
        BASE, kv_heads=1, past_len=0, kv_len=11, nonpad=(5, 11), v_head_size=8, scale=0.3, seed=5),
    "causal, MHA 2/2, fp32, past 6 + 3 new keys": replace(
        BASE, q_heads=2, kv_heads=2, dtype="float32", is_causal=1, past_len=6, kv_len=3, seed=6),
}
RUNGS = {"rung 3": dict(rung=3), "rung 4, 3 splits": dict(rung=4, num_splits=3), "default": {}}


def _run(case, **launch):
    inputs = build_onnx(case)
    return inputs, cacheattn.onnx_attention(**inputs, **case.attrs(), backend="numba", threads=32, **launch)


def _launched(case, **launch):
    with _launch.recorded_launches() as launches:
        _run(case, **launch)
    return [kernel.py_func.__name__ for kernel, _ in launches]


@pytest.mark.spec("onnx/cache-inside", "onnx/present-shape", "onnx/mask-kinds", "onnx/mask-short", "onnx/nonpad",
                  "onnx/softcap", "onnx/gqa", "onnx/is-causal-top-left")
@pytest.mark.parametrize("launch", list(RUNGS))
@pytest.mark.parametrize("name", list(DECODE))
def test_decode_on_rungs_3_and_4(name, launch):
    """Y close to a float64 evaluation, the present tensors bit for bit (past then K / V); outputs start as NaN
    (conftest), so an unwritten element fails. One warp a block: the simulator's cost is blocks x threads."""
    case = DECODE[name]
    inputs, got = _run(case, **RUNGS[launch])
    want = float64_onnx(inputs, case)
    assert_close("Y", got.Y, want[0], case.dtype)
    dtype = got.Y.dtype
    for label, got_present, want_present in (("present_key", got.present_key, want[1]),
                                             ("present_value", got.present_value, want[2])):
        assert_bits_equal(label, got_present, want_present.astype(dtype))


@pytest.mark.parametrize("name", list(DECODE))
def test_decode_launches(name):
    """Which kernels run (recorded, nothing runs): the vector kernel on rung 3, its split partials and the combine on
    rung 4; the default, at these few keys, rung 3 unsplit."""
    case = DECODE[name]
    # present (past then K / V, 4-D): rung 1 reads it, so two copy kernels write it first. The vector kernel stores
    # each row into present as it loads it, where every key is loaded once: not for the causal call whose query
    # sees 7 of its 9 keys.
    present = ["copy_kernel"] * 2 if case.past_len or case.three_d else []
    copies = present if name == "causal, MHA 2/2, fp32, past 6 + 3 new keys" else []
    assert _launched(case, rung=3) == copies + ["vector_attention_kernel"]
    assert _launched(case, rung=4, num_splits=3) == copies + ["vector_attention_kernel", "combine_kernel"]
    # The default: a few keys on a few blocks are held by their launch, so the plan neither splits them (the
    # combine's launch would cost more than the split buys) nor leaves rung 3 for the tensor cores on a tie.
    assert _launched(case) == copies + ["vector_attention_kernel"]
    assert _launched(case, rung=1) == present + ["attention_kernel"]


PREFILL = replace(BASE, q_len=3, kv_len=3, past_len=5, three_d=True, is_causal=1, mask="bool", mask_shape=(3, 8))


def test_prefill_on_rung_3():
    """A GQA prefill (3 queries, 3-D, causal, past 5, bool mask) on rung 3 asked for; by default a float16 prefill
    runs on the tensor cores (rung 6: its bound is no worse than rung 5's), a float32 one on rung 1. A 4-D prefill
    asked to split runs unsplit on rung 3."""
    case = PREFILL
    inputs, got = _run(case, rung=3)
    want = float64_onnx(inputs, case)
    assert_close("Y", got.Y, want[0], case.dtype)
    assert_bits_equal("present_key", got.present_key, want[1].astype(got.Y.dtype))
    assert _launched(case) == ["copy_kernel"] * 2 + ["flash_attention_kernel"]
    assert _launched(replace(case, dtype="float32")) == ["copy_kernel"] * 2 + ["attention_kernel"]
    inputs32 = build_onnx(replace(case, dtype="float32"))
    plan = kernel_plan(inputs32["Q"], inputs32["K"], inputs32["V"], inputs32["past_key"], q_num_heads=4,
                       kv_num_heads=2)
    assert plan.rung == 1 and "prefill" in plan.reason, plan
    # unsplit, and its one block per GQA group stores present itself (every key is visible to the last query)
    assert _launched(replace(case, three_d=False), rung=4) == ["vector_attention_kernel"]


@pytest.mark.parametrize("case", [
    PREFILL,
    replace(PREFILL, three_d=False, mask="float", mask_shape=(2, 1, 3, 8), softcap=2.0, left_window_size=2, seed=7),
], ids=["3-D, causal, bool mask", "4-D, float mask, softcap, left window"])
def test_prefill_on_rung_5(case):
    """A float16 prefill on rung 5's tensor cores, asked for: Y close to the float64 evaluation, the present
    tensors (written by the copy kernels) bit for bit."""
    inputs, got = _run(case, rung=5)
    want = float64_onnx(inputs, case)
    assert_close("Y", got.Y, want[0], case.dtype)
    for label, got_present, want_present in (("present_key", got.present_key, want[1]),
                                             ("present_value", got.present_value, want[2])):
        assert_bits_equal(label, got_present, want_present.astype(got.Y.dtype))
    assert _launched(case, rung=5) == ["copy_kernel"] * 2 + ["mma_attention_kernel"]


def test_rung_5_needs_a_float16_query():
    case = replace(PREFILL, dtype="float32")
    with pytest.raises(ValueError, match="rung: 5"):
        cacheattn.onnx_attention(**build_onnx(case), **case.attrs(), rung=5)


def test_float64_and_partial_warps_run_on_rung_1():
    """The vector kernels accumulate in float32 and need whole warps: such calls take rung 1 by default."""
    case = replace(DECODE["causal, MHA 2/2, fp32, past 6 + 3 new keys"], dtype="float64")
    assert _launched(case)[-1] == "attention_kernel"
    inputs = build_onnx(case)
    plan = kernel_plan(inputs["Q"], inputs["K"], inputs["V"], inputs["past_key"])
    assert plan.rung == 1 and "float64" in plan.reason
    with _launch.recorded_launches() as launches:
        cacheattn.onnx_attention(**build_onnx(BASE), **BASE.attrs(), backend="numba", threads=48)
    assert launches[-1][0].py_func.__name__ == "attention_kernel"


@pytest.mark.parametrize("launch,match", [
    (dict(rung=2), "rung"), (dict(rung=7), "rung"), (dict(rung=3, num_splits=2), "num_splits"),
    (dict(num_splits=0), "num_splits"), (dict(rung=4, threads=48), "threads"), (dict(threads=16), "threads")])
def test_bad_launch_raises(launch, match):
    """Checked on either backend, before anything runs."""
    inputs = build_onnx(BASE)
    for backend in ("reference", "numba"):
        with pytest.raises(ValueError, match=match):
            cacheattn.onnx_attention(**inputs, **BASE.attrs(), backend=backend, **launch)


# ---- rung 6, the FlashAttention-2 prefill: float16 and bfloat16 over present, 64 query rows a block ------------

# 20 queries after a past of 50: 70 keys, a full 64-key tile and a partial one; one warp (16 rows), so blocks 0
# and 1 hold 16 and 4 rows. GQA 2/1, head_size 16.
FLASH = replace(BASE, batch=1, q_heads=2, kv_heads=1, q_len=20, kv_len=20, past_len=50, is_causal=1, seed=21)
FLASH_CASES = {
    "float16, 4-D, causal": FLASH,
    "bfloat16, 4-D, causal": replace(FLASH, dtype="bfloat16", seed=22),
    "float16, 3-D, not causal, bool mask, head_size 32": replace(
        FLASH, three_d=True, is_causal=0, head_size=32, v_head_size=32, mask="bool", mask_shape=(20, 70), seed=23),
    "bfloat16, 3-D, float mask, softcap, left window": replace(
        FLASH, dtype="bfloat16", three_d=True, q_heads=4, kv_heads=2, mask="float", mask_shape=(1, 4, 20, 70),
        softcap=2.0, left_window_size=30, seed=24),
    "float16, no past, 4-D: K / V read where they are": replace(FLASH, past_len=0, kv_len=70, q_len=70, seed=25),
}


def _check_flash(case):
    """Y within the dtype's tolerance of the float64 evaluation (Y starts as NaN: conftest), present bit for bit,
    and rung 6's kernel launched."""
    inputs, got = _run(case, rung=6)
    want = float64_onnx(inputs, case)
    assert_close("Y", got.Y, want[0], case.dtype)
    for label, got_present, want_present in (("present_key", got.present_key, want[1]),
                                             ("present_value", got.present_value, want[2])):
        assert_bits_equal(label, got_present, want_present.astype(got.Y.dtype))
    assert _launched(case, rung=6)[-1] == "flash_attention_kernel"


@pytest.mark.spec("onnx/cache-inside", "onnx/is-causal-top-left", "onnx/gqa")
def test_prefill_on_rung_6():
    """The quick tier's one: 8 bfloat16 queries after a past of 12, one partial tile of 20 keys."""
    _check_flash(replace(FLASH_CASES["bfloat16, 4-D, causal"], q_len=8, kv_len=8, past_len=12))


@deep_only
@pytest.mark.spec("onnx/mask-kinds", "onnx/softcap")
@pytest.mark.parametrize("name", list(FLASH_CASES))
def test_prefill_on_rung_6_deep(name):
    _check_flash(FLASH_CASES[name])


def _on_rung_6(*args, **attrs):
    """onnx_attention on the kernels, rung 6 asked for where the call is a prefill (one query: as by default)."""
    Q = args[0] if args else attrs["Q"]
    prefill = (Q.shape[2] if Q.ndim == 4 else Q.shape[1]) > 1
    return cacheattn.onnx_attention(*args, **attrs, backend="numba", threads=32, **({"rung": 6} if prefill else {}))


@deep_only
@settings(max_examples=4, deadline=None)
@given(onnx_cases(dtypes=("float16", "bfloat16")).map(lambda case: replace(case, head_size=16, v_head_size=16)))
def test_drawn_calls_conform_on_rung_6(case):
    """The conformance kit's drawn calls (every feature) in float16 and bfloat16 at head size 16, rung 6's
    smallest: prefills on rung 6 asked for, checked as the kit checks a call."""
    kit.check_case("onnx_attention", _on_rung_6, kit.OnnxRequest(case, return_qk_matmul_output=False))


def test_rung_6_plan():
    """A long prefill (2048 queries, 32 heads of 128) on rung 6 by default, float16 and bfloat16 alike, the
    reason its bound; with V's head size differing, rung 6 is refused when asked for and left out by the plan,
    which says why; a float32 Q cannot ask for it."""
    import ml_dtypes

    for dtype in (np.float16, ml_dtypes.bfloat16):
        Q = np.zeros((1, 32, 2048, 128), dtype)
        K = V = np.zeros((1, 8, 2048, 128), dtype)
        plan = kernel_plan(Q, K, V, is_causal=1, sms=132)
        assert plan.rung == 6 and "FlashAttention-2" in plan.reason, plan
    V64 = np.zeros((1, 8, 2048, 64), np.float16)
    Q16, K16 = Q.astype(np.float16), K.astype(np.float16)
    plan = kernel_plan(Q16, K16, V64, is_causal=1, sms=132)
    assert plan.rung != 6 and "not rung 6" in plan.reason, plan
    with pytest.raises(ValueError, match="rung: 6"):
        kernel_plan(Q16, K16, V64, rung=6)
    case = replace(FLASH, dtype="float32")
    with pytest.raises(ValueError, match="rung: 6"):
        cacheattn.onnx_attention(**build_onnx(case), **case.attrs(), rung=6)


def test_float64_refuses_rungs_3_and_4():
    case = replace(BASE, dtype="float64")
    with pytest.raises(ValueError, match="rung"):
        cacheattn.onnx_attention(**build_onnx(case), **case.attrs(), rung=3)


# ---- bfloat16: the kernels read its bits and round their results back, no float32 copy of any input -------------

BF16_DECODE = replace(BASE, batch=1, dtype="bfloat16", three_d=True, mask="float", mask_shape=(4, 1, 7), is_causal=1,
                      softcap=2.0, past_len=5, kv_len=2, seed=11)
BF16_PREFILL = replace(PREFILL, dtype="bfloat16", three_d=False, mask="float", mask_shape=(2, 1, 3, 8),
                       qk_matmul_output_mode=3, seed=12)


def _check_bfloat16(case, **launch):
    """Y (and qk_matmul_output on rung 1) within bfloat16's tolerance of the float64 evaluation, present bit for
    bit, every output bfloat16; the kernels were handed bits (uint16), never a float32 copy of a bfloat16 input."""
    inputs = build_onnx(case)
    with _launch.recorded_launches() as launches:
        cacheattn.onnx_attention(**inputs, **case.attrs(), backend="numba", threads=32, **launch)
    arrays = [a for _, args in launches for a in _flat_args(args) if hasattr(a, "dtype")]
    sizes = {x.size for x in inputs.values() if x is not None and x.dtype.name == "bfloat16"}
    assert not [a for a in arrays if a.dtype == np.float32 and a.size in sizes], \
        "a float32 tensor the size of a bfloat16 input (a copy) was launched on"
    assert any(a.dtype == np.uint16 for a in arrays)
    qk = launch.get("rung") == 1
    got = cacheattn.onnx_attention(**inputs, **case.attrs(), backend="numba", threads=32,
                                   return_qk_matmul_output=qk, **launch)
    want = float64_onnx(inputs, case)
    assert all(x.dtype.name == "bfloat16" for x in got if x is not None)
    assert_close("Y", got.Y, want[0], case.dtype)
    if qk:
        assert_close("qk_matmul_output", got.qk_matmul_output, want[3], case.dtype)
    for label, got_present, want_present in (("present_key", got.present_key, want[1]),
                                             ("present_value", got.present_value, want[2])):
        assert_bits_equal(label, got_present, want_present.astype(got.Y.dtype))


def _flat_args(args):
    for a in args:
        if isinstance(a, tuple):
            yield from _flat_args(a)
        else:
            yield a


@pytest.mark.spec("onnx/cache-inside", "onnx/mask-kinds", "onnx/softcap")
def test_bfloat16_decode_on_rung_3():
    """A 3-D decode with a bfloat16 float mask (some -inf), causal, softcap, past 5 + 2 new keys."""
    _check_bfloat16(BF16_DECODE, rung=3)


@deep_only
@pytest.mark.parametrize("launch", [dict(rung=4, num_splits=3), dict(rung=1)], ids=["rung 4, 3 splits", "rung 1"])
def test_bfloat16_decode_on_rungs_1_and_4(launch):
    _check_bfloat16(BF16_DECODE, **launch)


@pytest.mark.spec("onnx/qk-output-modes")
def test_bfloat16_prefill_on_rung_1():
    """A 4-D GQA prefill (3 queries, past 5, causal) with a float mask; qk_matmul_output after softmax (mode 3) on
    rung 1 asked for. The plan's choice for a bfloat16 prefill is rung 6 (rung 5 takes float16); at head size 12
    (not rung 6's) rung 1."""
    _check_bfloat16(BF16_PREFILL, rung=1)
    inputs = build_onnx(BF16_PREFILL)
    plan = kernel_plan(inputs["Q"], inputs["K"], inputs["V"], inputs["past_key"])
    assert plan.rung == 6, plan
    inputs = build_onnx(replace(BF16_PREFILL, head_size=12, v_head_size=12))
    plan = kernel_plan(inputs["Q"], inputs["K"], inputs["V"], inputs["past_key"])
    assert plan.rung == 1 and "prefill" in plan.reason, plan
    decode = build_onnx(BF16_DECODE)
    plan = kernel_plan(decode["Q"], decode["K"], decode["V"], decode["past_key"], q_num_heads=4, kv_num_heads=2)
    assert plan.rung in (3, 4), plan
