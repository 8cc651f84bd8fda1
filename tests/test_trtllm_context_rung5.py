"""TensorRT-LLM's context phase on rung 5 (kernels_numba/trtllm_context.py: the fused context FMHA on mma.sync) under
the simulator: the conformance kit's checks (float64 evaluation, outputs poisoned, caches bit for bit, every slot the
call must not read NaN) on float16 context calls, and which kernel the default picks: rung 5 for a float16 context,
rung 1 where rung 5 cannot serve (the reason said by `context_rung`). One warp a block: the simulator's cost is
blocks x threads."""

from dataclasses import replace

import pytest
from test_trtllm_kernels import BASE, kernels, launched

import cacheattn
import cacheattn.testing as kit
from kernels_numba import _launch
from kernels_numba.trtllm_context import context_rung

from strategies import KERNEL, build_trt

FP16 = replace(BASE, dtype="float16")
# Float16 context calls over what the context phase reads: the scratch (new tokens, 16-byte loads when its rows are
# whole chunks) and the cache (a chunked context's earlier tokens: contiguous or paged, cyclic, INT8 / FP8 codes),
# and what its score applies (causal, window, packed custom mask, T5 / regular bias, ALiBi, softcap, logn on Q).
CONTEXT = {
    # in flight: generation beams on rung 3 beside two context requests, one of them chunked; the packed mask
    "inflight-packed-mask-t5": replace(FP16, mask_type=6, position=6, relative="t5", packed_mask=True),
    "paged-fp8-chunk-layer1": replace(FP16, paged=True, tokens_per_block=4, quant=128, layer_idx=1, num_layers=2,
                                      generations=(), beam_width=1, position=4, softcap=3.0),
    # head_size 32: cached INT8 rows in 16-byte loads, two scratch loads a chunk; a chunk wrapping a window of 6
    "contiguous-int8-window-neox-dh32": replace(FP16, head_size=32, quant=64, contexts=((3, 7),), generations=(),
                                                beam_width=1, window=6, capacity=6, position=2, rotary_dim=32),
    "cross-padded": replace(FP16, capacity=3, window=3, num_heads=1, num_kv_heads=1, contexts=((0, 1), (0, 2)),
                            generations=(), beam_width=1, encoder_lengths=(1, 3), packed=False),
}


@pytest.mark.parametrize("name", list(CONTEXT))
def test_context_on_rung_5(name):
    case = CONTEXT[name]
    names = launched(build_trt(case), threads=32)
    assert "mma_attention_kernel" in names and "attention_kernel" not in names, names
    kit.check_case("gpt_attention", kernels(32), case)


def test_drawn_float16_calls_conform():
    """The kit's drawn calls (every feature) in float16: their context entries on rung 5 unless the call's
    features keep them on rung 1."""
    report = kit.check_gpt_attention(kernels(32), max_examples=max(KERNEL // 6, 2), dtypes=("float16",), seed=5)
    assert report.examples >= 1


FALLBACKS = {
    "float32": (replace(BASE, generations=(), beam_width=1), {}, "float16 query"),
    "bfloat16": (replace(BASE, dtype="bfloat16", generations=(), beam_width=1), {}, "float16 query"),
    "rung-1-forced": (FP16, dict(rung=1), "rung=1"),
    "head-size-512": (replace(FP16, head_size=512, generations=(), beam_width=1), dict(threads=128),
                      "shared memory"),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallbacks_stay_on_rung_1(name):
    """Recorded launches (nothing runs): the fused context launch is rung 1's kernel, and the reason says why."""
    case, launch, why = FALLBACKS[name]
    names = launched(build_trt(case), **{"threads": 32, **launch})
    assert "attention_kernel" in names and "mma_attention_kernel" not in names, names
    rung, reason = context_rung(rung=launch.get("rung"), rounds_as=case.dtype, head_size=case.head_size,
                                threads=launch.get("threads", 32), fused_generation=False, num_splits=None)
    assert rung == 1 and why in reason, reason


def test_unfused_context_is_not_rung_5():
    """context_fmha_type 0 keeps its own path (scores in global memory); the generation entry still takes rung 3."""
    names = launched(build_trt(replace(FP16, context_fmha_type=0)), threads=32)
    assert "mma_attention_kernel" not in names and "scores_kernel" in names, names


def test_rung_5_asked_for():
    """rung=5 runs the context on tensor cores; on a call it cannot serve it raises, naming rung, before any
    launch (a float32 qkv on either backend, a head size too wide for its tiles)."""
    assert "mma_attention_kernel" in launched(build_trt(FP16), threads=32, rung=5)
    for case, launch in ((BASE, {}), (replace(FP16, head_size=512, generations=(), beam_width=1),
                                      dict(threads=128))):
        for backend in ("reference", "numba") if case.dtype == "float32" else ("numba",):
            with _launch.recorded_launches() as launches, pytest.raises(ValueError, match="^rung"):
                cacheattn.gpt_attention(**build_trt(case), backend=backend, rung=5, **launch)
            assert launches == []
    with pytest.raises(ValueError, match="^num_splits"):     # rung 3 never splits (rung 5's decode kernel may)
        cacheattn.gpt_attention(**build_trt(FP16), backend="numba", rung=3, num_splits=2)


def test_context_rung_reasons():
    # a chunked context: rung 6 (keys from the scratch only) does not serve it
    common = dict(rounds_as="float16", head_size=64, threads=128, num_splits=None, keys_elsewhere="a chunked context")
    assert context_rung(rung=None, fused_generation=False, **common)[0] == 5
    rung, reason = context_rung(rung=None, fused_generation=True, **common)
    assert rung == 1 and "generation entries" in reason
    rung, reason = context_rung(rung=None, fused_generation=False, **{**common, "num_splits": 2})
    assert rung == 1 and "num_splits=2" in reason
    assert context_rung(rung=3, fused_generation=False, **common)[0] == 5     # 3 names the generation's kernel
