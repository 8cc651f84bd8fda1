"""TensorRT-LLM's generation entries on rung 5's decode kernel (kernels_numba/trtllm_generation.py, "Rung 5"): the
kit's checks on the calls it takes, the new token of a quantized cache read exactly, and the calls it leaves to
rungs 3 and 4, with why."""

from __future__ import annotations

import inspect
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trtllm_kernels import kernels

import cacheattn
import cacheattn.examples
import cacheattn.testing as kit
from cacheattn import trtllm
from kernels_numba import _launch
from kernels_numba.trtllm_gpt_attention import LAYER_INPUTS, prepare_step

from strategies import DEEP, KERNEL, TrtCase, build_trt, deep_only, trt_cases

# Two generation sequences of one token over a paged cache of whole 16-key trips (head_size 32: a lane's K slice is
# one 16-byte load of float16), a GQA group of 2.
DECODE = TrtCase(contexts=(), generations=((3, 20), (2, 37)), beam_width=1, num_heads=4, num_kv_heads=2,
                 head_size=32, dtype="float16", capacity=40, window=40, paged=True, tokens_per_block=16, seed=5)

ON_RUNG_5 = {
    # e4m3 codes in a second layer's blocks; pages of 8 keys (every key looked up); ALiBi and softcap call the
    # score function on every key; the new token from the scratch
    "paged8-fp8-layer1-alibi-softcap": replace(DECODE, quant=128, tokens_per_block=8, num_layers=2, layer_idx=1,
                                               position=4, softcap=3.0),
    # a contiguous cache (one page a row, V s_kv on), a GQA group of 4, split two ways: the last split adds the new
    # token (after its two warps merge)
    "contiguous-int8-group4-split": replace(DECODE, quant=64, paged=False, num_heads=8),
    # a context chunk that wraps its cyclic cache writes every new token after attention: a float16 generation
    # entry's new token then comes from the scratch too
    "inflight-wrapping-chunk-fp16": replace(DECODE, contexts=((3, 6),), generations=((2, 4),), window=5, capacity=5,
                                            tokens_per_block=4),
    # bfloat16: the bits through the same fragments into the bfloat16 mma, P and the output rounded to bfloat16
    "paged-bf16-relative-bias": replace(DECODE, dtype="bfloat16", position=6, relative="regular"),
    "contiguous-bf16-group4-split": replace(DECODE, dtype="bfloat16", paged=False, num_heads=8, head_size=64),
    # cross attention: the encoder's 6 and 20 keys from the cache's slots, none from the scratch (an int8 cache
    # would otherwise take its last key from there)
    "cross-attention-int8": replace(DECODE, mask_type=0, encoder_lengths=(6, 20), quant=64),
}

# The slot map (sinks, a wrapped cyclic window, beams): the keys' slots are not their positions. Each case has a trip
# whose 16 keys follow each other in one page (the whole-trip loads, from a slot the map gives) and trips that do
# not (looked up key by key).
SLOT_MAPPED = {
    # 4 sinks with a paged bubble of 12: walk trip 16.. (keys 20..35) at slots 32..47, one whole block; trip 0
    # holds the sinks' end, the last the window's wrap
    "sinks-paged-bubble": replace(DECODE, generations=((3, 39), (2, 20)), sinks=4, window=36, capacity=40,
                                  streamingllm=True, num_heads=2, num_kv_heads=1),
    # past the window of 32: keys 16..47 at slots 16..31, 0..15 (two whole trips); the other sequence wraps inside
    # a trip; the new token of an int8 cache from the scratch
    "wrapped-window-int8": replace(DECODE, generations=((3, 47), (2, 40)), window=32, capacity=32, quant=64,
                                   num_heads=2, num_kv_heads=1),
    # two beams of a prompt of 18: keys 0..15 from the sequence's first row (a whole trip on the other beam's
    # row), later ones from the row cache_indirection names, key by key; a contiguous cache
    "beams-contiguous": replace(DECODE, generations=((18, 37),), beam_width=2, paged=False, num_heads=2,
                                num_kv_heads=1),
    # sinks on pages of 8 keys (every key looked up), e4m3 codes, split two ways
    "sinks-paged8-fp8-split": replace(DECODE, generations=((3, 30),), sinks=2, window=20, capacity=24,
                                      streamingllm=True, tokens_per_block=8, quant=128),
}
# bfloat16 through the slot map: two beams on a contiguous cache
SLOT_MAPPED["beams-contiguous-bf16"] = replace(SLOT_MAPPED["beams-contiguous"], dtype="bfloat16")
ON_RUNG_5.update(SLOT_MAPPED)
DEEP_CASES = ("contiguous-bf16-group4-split",   # over 2 s in the simulator: paged-bf16 stands for it
              "sinks-paged8-fp8-split",         # the quick tier keeps one case of each slot map
              "beams-contiguous-bf16")
DEEP_TIER = pytest.mark.skipif(not DEEP, reason="the deep tier: CACHEATTN_EXAMPLES=2 or more (.ci/run)")

TWO_WARPS = ("contiguous-int8-group4-split", "contiguous-bf16-group4-split")
SPLIT = TWO_WARPS + ("sinks-paged8-fp8-split",)


def launched(case: TrtCase, **launch) -> list:
    """Names of the kernels a numba call launches (recorded, not run)."""
    with _launch.recorded_launches() as launches:
        cacheattn.gpt_attention(**build_trt(case), backend="numba", **launch)
    return [kernel.py_func.__name__ for kernel, _ in launches]


@pytest.mark.spec("trtllm/generation-mmha")
@pytest.mark.parametrize("name", [pytest.param(name, marks=DEEP_TIER) if name in DEEP_CASES else name
                                  for name in ON_RUNG_5])
def test_rung_5_decode_conforms(name):
    """The kit's checks (float64 evaluation, caches bit for bit, unread slots NaN) with the generation entries on the
    decode kernel: asked for (rung 5), and chosen by rung None where multi-block mode does not split the keys. One
    warp a block (the simulator's cost is blocks x threads), two where the warps' merge meets the new token."""
    case = ON_RUNG_5[name]
    threads = 64 if name in TWO_WARPS else 32
    launch = dict(rung=5, num_splits=2 if name in SPLIT else 1)
    if name in SLOT_MAPPED:
        register, reason = _step_choice(case, **launch)
        assert register and "rung 5's decode kernel" in reason, reason
    expected = ["gqa_decode_attention_kernel"] + ["combine_kernel"] * (name in SPLIT)
    names = launched(case, threads=threads, **launch)
    assert names[names.index("gqa_decode_attention_kernel"):][:len(expected)] == expected, names
    if not case.contexts:
        assert launched(case, threads=threads, multi_block_mode=False) == ["preprocess_kernel",
                                                                           "gqa_decode_attention_kernel"]
    kit.check_case("gpt_attention", kernels(threads, **launch), case)


@pytest.mark.parametrize("quant", [64])
def test_quantized_new_token_is_the_unquantized_one(quant, monkeypatch):
    """The document attends with the new token's own K/V, not its cache codes. With coarse codes (a scale that
    leaves N(0, 1) data 3 or 4 levels a side) and two keys a sequence, reading the new token from the cache would
    miss the float16 tolerance: the kernel must take it from the scratch."""
    monkeypatch.setattr(cacheattn.examples, "trt_kv_scale", lambda q: {64: 0.5, 128: 0.25}.get(q, 1.0))
    case = replace(DECODE, generations=((1, 1), (2, 3)), quant=quant)
    assert "gqa_decode_attention_kernel" in launched(case, threads=32, rung=5)
    kit.check_case("gpt_attention", kernels(32, rung=5), case)


@deep_only
@pytest.mark.spec("trtllm/generation-mmha")
def test_bfloat16_new_token_from_the_scratch():
    """A context chunk that wraps its cyclic cache writes the new tokens after attention: a bfloat16 generation
    entry's new token comes from the scratch, as bfloat16 bits, added by warp 0 after the warps' merge (two warps).
    The context entry takes its own rung (rung 5's staged kernel is float16's), so the plan's choice runs it."""
    case = replace(ON_RUNG_5["inflight-wrapping-chunk-fp16"], dtype="bfloat16")
    launch = dict(multi_block_mode=False)
    assert "gqa_decode_attention_kernel" in launched(case, threads=64, **launch)
    kit.check_case("gpt_attention", kernels(64, **launch), case)


FALLBACKS = {
    "streamingllm-rope": (replace(DECODE, streamingllm=True, sinks=2, window=30, position=1, rotary_dim=8),
                          "StreamingLLM with RoPE rotates each cached key"),
    "float32": (replace(DECODE, dtype="float32"), "query float32"),
    "bfloat16-int8": (replace(DECODE, dtype="bfloat16", quant=64), "quantized cache (quant_bit 8) with a bfloat16"),
    "head-size-16": (replace(DECODE, head_size=16), "head_dim 16"),
}


def _step_choice(case: TrtCase, **launch) -> tuple:
    """(register, reason) of the step's generation entries, as the kernels' `gpt_attention` plans them."""
    bound = inspect.signature(trtllm.gpt_attention).bind(**build_trt(case))
    bound.apply_defaults()
    call = trtllm.validate({k: v for k, v in bound.arguments.items()
                            if k not in ("backend", "threads", "rung", "num_splits")})
    step = {k: v for k, v in call.items() if k not in LAYER_INPUTS}
    step.update({"threads": 64, "rung": None, "num_splits": None, "rounds_as": None, "num_sms": None, **launch})
    window = int(call["host_max_attention_window_sizes"][0])
    prepared = prepare_step(like=call["qkv"], window=window, **step)
    return prepared.register_generation, prepared.generation_reason


@pytest.mark.parametrize("name", FALLBACKS)
def test_calls_the_decode_kernel_leaves_to_rung_3(name):
    """What it cannot serve runs the vector kernel (rung 5 asked for; float32, which rung 5 refuses, by default
    with multi-block mode off) and the step says why."""
    case, why = FALLBACKS[name]
    launch = dict(multi_block_mode=False) if case.dtype == "float32" else dict(rung=5)   # rung 5: 16-bit qkv
    names = launched(case, threads=64, **launch)
    assert "gqa_decode_attention_kernel" not in names and "vector_attention_kernel" in names, names
    register, reason = _step_choice(case, **launch)
    assert not register and why in reason, reason


def test_few_blocks_split_the_decode_kernel():
    """One long sequence leaves SMs idle: multi-block mode splits the decode kernel's keys (rung None), as rung 4's
    would be, and the combine finishes; with multi-block mode off it runs whole."""
    case = replace(DECODE, generations=((3, 600),), capacity=700, window=700, tokens_per_block=64)
    split = ["preprocess_kernel", "gqa_decode_attention_kernel", "combine_kernel"]
    assert launched(case, threads=64) == split
    register, reason = _step_choice(case)
    assert register and "split 19 ways" in reason, reason          # ceil(601 keys / (2 warps x 16))
    assert launched(case, threads=64, multi_block_mode=False) == split[:2]


def test_misaligned_cache_takes_rung_3_per_layer():
    """16-byte loads need the cache's rows aligned: a pool that starts 2 bytes off runs rung 3 for that layer."""
    args = build_trt(replace(DECODE, quant=0))
    pool = args["kv_cache_pool"]
    backing = np.empty(pool.size + 8, pool.dtype)
    shifted = backing[1:1 + pool.size].reshape(pool.shape)
    shifted[...] = pool
    with _launch.recorded_launches() as launches:
        cacheattn.gpt_attention(**{**args, "kv_cache_pool": shifted}, backend="numba", threads=64, rung=5)
    names = [kernel.py_func.__name__ for kernel, _ in launches]
    assert "vector_attention_kernel" in names and "gqa_decode_attention_kernel" not in names, names


@pytest.mark.skipif(KERNEL < 12, reason="a longer hunt: CACHEATTN_EXAMPLES=2 or more")
@settings(max_examples=KERNEL // 3)
@given(case=trt_cases(dtypes=("float16", "bfloat16"), streaming=(False, True), cross=(False, True)),
       head_size=st.sampled_from([32, 64]))
def test_drawn_calls_conform_with_rung_5(case, head_size):
    """The kit's drawn gpt_attention calls (in-flight batches, beams, windows and sinks, masks, RoPE, ALiBi, biases,
    cross attention, every cache; float16 and bfloat16) at a head size the decode kernel takes, rung 5 asked for
    (bfloat16: the plan's choice, rung 5's context kernel being float16's): the generation requests it serves run
    on it."""
    case = replace(case, head_size=head_size, rotary_dim=min(case.rotary_dim, head_size))
    launch = dict(rung=5) if case.dtype == "float16" else dict(multi_block_mode=False)
    kit.check_case("gpt_attention", kernels(32, **launch), case)


def test_rung_5_asked_for_bfloat16():
    """rung=5 with a bfloat16 qkv: a step of generation entries alone runs the decode kernel; a step with context
    entries raises naming rung before any launch (rung 5's context kernel multiplies float16 only); a float32 qkv
    is refused at once."""
    assert "gqa_decode_attention_kernel" in launched(replace(DECODE, dtype="bfloat16"), threads=32, rung=5)
    for case, why in ((replace(DECODE, dtype="bfloat16", contexts=((0, 5),)), "context phase"),
                      (replace(DECODE, dtype="float32"), "float16 or bfloat16 qkv")):
        with _launch.recorded_launches() as launches, pytest.raises(ValueError, match=f"^rung: 5 .*{why}"):
            cacheattn.gpt_attention(**build_trt(case), backend="numba", threads=32, rung=5)
        assert launches == []


def test_the_plan_says_rung_5_for_bfloat16_generation():
    """A bfloat16 step's generation: the plan prints rung 5's decode kernel after a layer on the kernels (launches
    recorded), and with an INT8 cache rung 3 and why."""
    for case, expected in ((replace(DECODE, dtype="bfloat16"), "rung 5, 1 split: rung 5's decode kernel: the GQA "
                                                               "group on tensor cores"),
                           (replace(DECODE, dtype="bfloat16", quant=64), "rung 3, 1 split: vector loads: rung 5's "
                                                                         "decode kernel does not serve it: a quantized "
                                                                         "cache (quant_bit 8) with a bfloat16 query")):
        args = build_trt(case)
        plan = cacheattn.plan_gpt_attention(**{k: v for k, v in args.items() if k not in trtllm.LAYER_INPUTS},
                                            multi_block_mode=False)
        with _launch.recorded_launches():
            plan.run(**{k: v for k, v in args.items() if k in trtllm.LAYER_INPUTS}, backend="numba")
        (generation,) = repr(plan).splitlines()[1:]
        assert generation.startswith("  generation (bfloat16 qkv") and expected in generation, generation
