"""TensorRT-LLM gpt_attention kernels (kernels_numba/trtllm_gpt_attention.py) under the simulator: outputs against
the float64 evaluation, caches bit-identical to the reference's, every slot a call must not read poisoned, every
slot it must not write unchanged; FP8 e4m3 bits against ml_dtypes; bfloat16 through float32 copies."""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import cacheattn
from kernels_numba import _launch
from kernels_numba._numerics import round_to_bfloat16
from kernels_numba.trtllm_gpt_attention import e4m3_decode, e4m3_encode
from reference import trtllm_gpt_attention as ref

from helpers import assert_bits_equal, assert_close
from strategies import KERNEL, REFERENCE, TrtCase, build_trt, float64_trt, trt_kernel_cases, trt_streaming_cases

BASE = TrtCase(contexts=((0, 5), (2, 3)), generations=((3, 4),), beam_width=2, num_heads=4, num_kv_heads=2,
               head_size=8, dtype="float32", capacity=8, window=8, seed=3)


def cache_name(case: TrtCase) -> str:
    return "kv_cache_pool" if case.paged else "past_key_value"


def holding(case: TrtCase, args, positions_of) -> np.ndarray:
    """bool mask over the cache: the elements of row e that hold the token positions positions_of(e)."""
    cache = args[cache_name(case)]
    mask = np.zeros(cache.shape, bool)
    blocks = mask.reshape(-1, *mask.shape[3:])                                  # paged: (blocks, Hkv, tpb, Dh)
    bubble = ref.paged_bubble(case.sinks, case.tokens_per_block) if case.paged else 0
    for e in range(case.entries):
        slots = ref.cyclic_slot(np.asarray(positions_of(e), np.int64), case.window, case.sinks, bubble)
        for kv in (0, 1):
            if case.paged:
                table = args["kv_cache_block_offsets"][0, e, kv]
                blocks[table[slots // case.tokens_per_block] + 2 * case.layer_idx, :,
                       slots % case.tokens_per_block] = True
            else:
                mask[e, kv, :, slots] = True
    return mask


def poison_unread(case: TrtCase, args) -> None:
    """NaN (e4m3: 0x7F) in every cache element that holds no token cached before this call (INT8 has no NaN)."""
    if case.quant == 64:
        return
    cache = args[cache_name(case)]
    readable = holding(case, args, lambda e: np.arange(case.past[e]))
    if case.quant == 128:
        cache.view(np.uint8)[~readable] = 0x7F
    else:
        cache[~readable] = np.nan


def run(args, backend):
    args = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    output, _ = cacheattn.gpt_attention(**args, backend=backend)
    return output, args


def assert_same_cache(case: TrtCase, got, want, written) -> None:
    """Bit for bit; with RoPE, the written keys may differ by one step of the stored type: the kernel's cos/sin are
    the GPU's (float64 rounded to float32 in the simulator), NumPy's float32 ones can differ in the last bit."""
    if case.position not in (1, 2):
        assert_bits_equal("cache", got, want)
        return
    if not written.all():
        assert_bits_equal("cache (not written)", got[~written], want[~written])
    if case.quant == 0:
        assert_close("cache", got[written], want[written], case.dtype)
    elif written.any():
        code_type = np.int8 if case.quant == 64 else np.uint8           # e4m3 codes are monotonic per sign
        step = np.abs(got.view(code_type)[written].astype(np.int32) - want.view(code_type)[written].astype(np.int32))
        assert step.max() <= 1, f"cache: a code {step.max()} steps from the reference's"


def check_kernels(case: TrtCase, **changes):
    """Kernel output = float64 evaluation; kernel cache = reference cache, bit for bit; unwritten bytes unchanged.
    changes: arguments replacing the case's. Returns the kernel's and the reference's outputs."""
    args = dict(build_trt(case), **changes)
    poison_unread(case, args)
    before = args[cache_name(case)].copy()
    output, after = run(args, "numba")
    ref_output, ref_after = run(args, "reference")
    want, _ = float64_trt(args)
    # Against the reference at the dtype's tolerance: both round Q/K to the input dtype after bias and RoPE, so a
    # sharp softmax (q_scaling 0.5) of float16 inputs can put both 1.5 tolerances from the float64 evaluation.
    assert_close("output vs reference", output, ref_output.astype(np.float64), case.dtype)
    assert_close("output vs float64", output, want, case.dtype, scale=4.0)
    written = holding(case, args, lambda e: np.arange(case.past[e], case.lengths[e]))
    assert_same_cache(case, after[cache_name(case)], ref_after[cache_name(case)], written)
    if not written.all():
        assert_bits_equal("untouched cache", after[cache_name(case)][~written], before[~written])
    return output, ref_output


@settings(max_examples=max(2 * KERNEL // 3, 4))       # a simulator call costs 2-4 s; the chosen calls below add more
@given(trt_kernel_cases())
def test_kernels_match_the_reference(case):
    check_kernels(case)


@settings(max_examples=max(KERNEL // 3, 3))
@given(trt_streaming_cases())
def test_streamingllm_kernels_match_the_reference(case):
    check_kernels(case)


@pytest.mark.parametrize("case,threads", [
    (replace(BASE, mask_type=6, position=6, relative="t5"), 32),            # in-flight: chunk + beams, GQA 2
    (replace(BASE, paged=True, tokens_per_block=4, quant=128, dtype="float16", layer_idx=1, num_layers=2), 64),
    (replace(BASE, contexts=((3, 6),), generations=((2, 5),), beam_width=1, window=4, capacity=4,
             paged=True, tokens_per_block=2, quant=64, position=6), 128),  # a chunk wrapping the cyclic cache
    (replace(BASE, position=2, rotary_dim=6, rotary_scale_type=2, rotary_scale=2.0, qkv_bias=True, packed=False),
     32),
    (replace(BASE, contexts=((0, 7),), generations=((2, 6),), beam_width=1, window=5, capacity=5, sinks=2,
             streamingllm=True, paged=True, tokens_per_block=4, position=1, rotary_dim=8, quant=128,
             dtype="float16"), 64),                                          # sinks + bubble, keys rotated on load
], ids=["inflight-beams-custom-mask-t5", "paged-fp8-layer1", "wrapping-chunk-int8-relative",
        "neox-dynamic-bias-padded", "streamingllm"])
def test_kernels_on_chosen_calls(case, threads):
    """threads: the kernels' block size (32 and 64 leave most loops several strides per thread)."""
    check_kernels(case, threads=threads)


# ---- FP8 e4m3 from the bits ------------------------------------------------------------------------------------

@cuda.jit
def codec(x, codes, decoded):
    """codes[i] = e4m3 code of x[i]; decoded[c] = the value of code c."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        codes[i] = e4m3_encode(x[i])
    if i < 256:
        decoded[i] = e4m3_decode(i)


def test_e4m3_codec_matches_ml_dtypes():
    fp8 = ref.fp8_e4m3()
    every = np.arange(256, dtype=np.uint8).view(fp8).astype(np.float32)
    finite = every[np.isfinite(every)]
    rng = np.random.default_rng(0)
    halfway = (finite[:-1] + finite[1:]) / 2                                   # ties between neighbours
    x = np.concatenate([finite, halfway[np.isfinite(halfway)], rng.standard_normal(200).astype(np.float32) * 50,
                        np.float32([500, -1e6, 448, 464, 2.0 ** -10, -(2.0 ** -10), 2.0 ** -12])]).astype(np.float32)
    codes, decoded = np.zeros(x.shape, np.uint8), np.zeros(256, np.float32)
    codec[(x.size + 255) // 256, 256](x, codes, decoded)
    want = np.clip(x, -448, 448).astype(fp8).view(np.uint8)
    assert_bits_equal("e4m3 codes", codes, want)
    assert_bits_equal("e4m3 values", decoded, every)


@cuda.jit
def bf16_rounding(x, out):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = round_to_bfloat16(x[i])


def test_round_to_bfloat16_matches_ml_dtypes():
    """Nearest, ties to even, subnormals, signed zeros, overflow to inf, NaN: against ml_dtypes' cast. (Every
    float32 that is a bfloat16 or halfway between two was checked once, 133,564 values, in 70 s; a sample here.)"""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    every = np.unique(np.arange(1 << 16, dtype=np.uint16).view(bf16).astype(np.float32))
    finite = every[np.isfinite(every)]
    halfway = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)   # exact in float32
    rng = np.random.default_rng(0)
    x = np.concatenate([finite[::251], halfway[::251], halfway[(finite[:-1] == 0) | (np.abs(finite[:-1]) < 1e-38)],
                        rng.integers(0, 1 << 32, 200, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        np.float32([3.4e38, -3.39e38, np.inf, -np.inf, np.nan, -1e-45, -0.0, 0.0])])
    got = np.zeros_like(x)
    bf16_rounding[(x.size + 127) // 128, 128](x, got)
    want = x.astype(bf16).astype(np.float32)
    assert_bits_equal("bfloat16 rounding", got.view(np.uint32)[~np.isnan(x)], want.view(np.uint32)[~np.isnan(x)])
    assert np.isnan(got[np.isnan(x)]).all()


# ---- bfloat16: float32 copies, rounded to bfloat16 where the reference rounds ---------------------------------------

SMALL = replace(BASE, contexts=((0, 3),), generations=((2, 3),), beam_width=1, num_heads=2, num_kv_heads=1,
                dtype="bfloat16", qkv_bias=True)


@pytest.mark.parametrize("case,changes", [
    (replace(SMALL, position=2, rotary_dim=8), {}),                                  # RoPE'd K in the cache
    (replace(SMALL, paged=True, tokens_per_block=2, contexts=((1, 2),), position=4), {}),   # chunk, ALiBi
    (replace(SMALL, quant=64, softcap=3.0),                                          # INT8 codes of bfloat16 values;
     dict(kv_orig_quant_scale=np.float32([100]), kv_quant_orig_scale=np.float32([0.01]))),  # fine codes: q + bias
], ids=["contiguous-neox", "paged-chunk-alibi", "int8-softcap"])                    # unrounded would round apart
def test_bfloat16_kernels_match_the_reference(case, changes):
    """The standard check, and the output within one bfloat16 step of the reference's at no more than one element:
    both round the same float32 values once (they differ by summation order, ~1e-7), so a rounding to bfloat16
    missed inside the kernels (Q, RoPE'd K, qkv + bias) shows as many differing elements."""
    output, ref_output = check_kernels(case, **changes)
    steps = np.abs(output.view(np.int16).astype(np.int32) - ref_output.view(np.int16).astype(np.int32))
    assert steps.max() <= 1 and np.count_nonzero(steps) <= 1, f"output: {np.count_nonzero(steps)} bfloat16 " \
        f"elements differ from the reference's, by up to {steps.max()} steps"


# ---- cross attention: context entries cache the encoder K/V, generation entries read them back ------------------

@pytest.mark.spec("trtllm/cross-attention")
@pytest.mark.parametrize("case", [
    replace(BASE, mask_type=0, capacity=6, window=6),
    replace(BASE, mask_type=0, capacity=6, window=6, paged=True, tokens_per_block=4, quant=128, dtype="float16",
            qkv_bias=True, contexts=((0, 1),)),
    replace(BASE, mask_type=3, capacity=6, window=6, quant=64, num_heads=2, num_kv_heads=1, softcap=3.0),
], ids=["contiguous", "paged-fp8-bias", "int8-mqa-softcap"])
def test_cross_attention_kernels_match_the_reference(case):
    args = build_trt(case)
    rng = np.random.default_rng(case.seed)
    encoder = rng.integers(1, case.capacity + 1, case.entries).astype(np.int32)
    contexts = len(case.contexts)
    cross_kv = rng.standard_normal((int(encoder[:contexts].sum()), 2 * case.num_kv_heads * case.head_size))
    args.update(do_cross_attention=True, cross_kv=cross_kv.astype(case.dtype), encoder_input_lengths=encoder)
    # Poison what cross attention must not read: generation rows past their encoder length (int8 has no NaN).
    if case.quant != 64:
        unread = ~holding(case, args, lambda e: np.arange(encoder[e] if e >= contexts else 0))
        cache = args[cache_name(case)]
        if case.quant == 128:
            cache.view(np.uint8)[unread] = 0x7F
        else:
            cache[unread] = np.nan
    output, after = run(args, "numba")
    ref_output, ref_after = run(args, "reference")
    want, _ = float64_trt(args)
    assert_close("output vs reference", output, ref_output.astype(np.float64), case.dtype)
    assert_close("output vs float64", output, want, case.dtype, scale=4.0)
    assert_bits_equal("cache", after[cache_name(case)], ref_after[cache_name(case)])


# ---- multi-block: split keys, (m, l, o) partials, combine ----------------------------------------------------------

@pytest.mark.spec("trtllm/multi-block")
def test_multi_block_equals_single_block(monkeypatch):
    """Several split counts over key tiles of 2, one with splits that see no key (the window hides the first tile,
    the last split has none): the combined output matches one block per row and the reference, and the cache is
    written the same."""
    from kernels_numba import trtllm_gpt_attention as kernels
    case = replace(BASE, contexts=(), generations=((2, 7),), beam_width=1, capacity=8, window=5, quant=64,
                   position=4, softcap=3.0, num_heads=2, num_kv_heads=1)
    args = build_trt(case)
    plan = kernels.plan_tiles
    monkeypatch.setattr(kernels, "plan_tiles", lambda *a, **k: (*plan(*a, **k)[:2], 2))   # 7 keys: 4 tiles
    outputs, caches, launch_counts = {}, {}, {}
    for splits in (1, 2, 5):
        launched = []

        def counted(kernel, *rest, log=launched):
            log.append(kernel)
            _launch.launch(kernel, *rest)

        monkeypatch.setattr(kernels, "choose_splits", lambda *_, count=splits, **__: count)
        monkeypatch.setattr(kernels, "launch", counted)
        outputs[splits], caches[splits] = run(args, "numba")
        launch_counts[splits] = len(launched)
        assert_bits_equal(f"cache, {splits} splits", caches[splits][cache_name(case)], caches[1][cache_name(case)])
    assert launch_counts[2] == launch_counts[5] == launch_counts[1] + 1          # + the combine kernel
    ref_output, _ = run(args, "reference")
    for splits in (2, 5):
        assert_close(f"{splits} splits vs 1", outputs[splits], outputs[1].astype(np.float64), case.dtype)
        assert_close(f"{splits} splits vs reference", outputs[splits], ref_output.astype(np.float64), case.dtype)


@settings(max_examples=REFERENCE)
@given(kvlen=st.integers(0, 300), num_splits=st.integers(1, 64), key_tile=st.integers(1, 64))
def test_splits_cover_the_keys_once_on_tile_boundaries(kvlen, num_splits, key_tile):
    """split_keys (the kernel's rule, and the docs drawing's): the splits, in order, cover [0, kvlen) exactly once,
    each starts on a key tile and ends on one (or at kvlen), and only trailing splits are empty."""
    from kernels_numba._attention_core import split_keys
    ranges = [split_keys(s, num_splits, kvlen, key_tile) for s in range(num_splits)]
    covered = np.concatenate([np.arange(lo, hi) for lo, hi in ranges])
    assert covered.tolist() == list(range(kvlen)), ranges
    for lo, hi in ranges:
        assert lo % key_tile == 0 or lo == kvlen, ranges
        assert hi % key_tile == 0 or hi == kvlen, ranges
    sizes = [hi - lo for lo, hi in ranges]
    assert sizes == sorted(sizes, key=lambda n: n == 0), ranges                        # the empty ones last
    filled = [n for n in sizes if n]
    assert len(set(filled[:-1])) <= 1 and filled[-1:] <= filled[:1], ranges           # equal, the last maybe less


def test_choose_splits_fills_idle_sms_only():
    from kernels_numba.trtllm_gpt_attention import choose_splits
    assert choose_splits(blocks=132, max_kv_len=4096, key_tile=32, num_sms=132) == 1       # the grid fills the GPU
    assert choose_splits(blocks=8, max_kv_len=4096, key_tile=32, num_sms=132) == 16        # 132 // 8
    assert choose_splits(blocks=8, max_kv_len=40, key_tile=32, num_sms=132) == 2           # two key tiles only
    assert choose_splits(blocks=1, max_kv_len=1 << 20, key_tile=32, num_sms=132) == 64     # capped


# ---- context_fmha_type 0: the unfused context path next to the fused one -------------------------------------------

@pytest.mark.spec("trtllm/context-unfused", "trtllm/fp8-context-fmha")
@pytest.mark.parametrize("case", [
    replace(BASE, mask_type=6, position=6, relative="t5", softcap=3.0, contexts=((0, 3), (2, 2)), beam_width=1),
    replace(BASE, generations=(), beam_width=1, contexts=((3, 6),), window=4, capacity=4, paged=True,
            tokens_per_block=2, quant=64, position=4, dtype="float16"),
    replace(BASE, quant=128, fp8_context_fmha=True, dtype="float16", position=2, rotary_dim=8),
], ids=["inflight-custom-mask-t5", "paged-int8-wrapping-chunk-alibi", "fp8-context-fmha-rope"])
def test_unfused_context_matches_fused_and_reference(case):
    """Unfused = fused = reference; FP8 context FMHA (always unfused) = its reference emulation."""
    args = dict(build_trt(case), context_fmha_type=0)
    poison_unread(case, args)
    written = holding(case, args, lambda e: np.arange(case.past[e], case.lengths[e]))
    unfused, after = run(args, "numba")
    ref_output, ref_after = run(args, "reference")
    assert_close("unfused vs reference", unfused, ref_output.astype(np.float64), case.dtype)
    assert_same_cache(case, after[cache_name(case)], ref_after[cache_name(case)], written)
    if not case.fp8_context_fmha:
        fused, fused_after = run(dict(args, context_fmha_type=1), "numba")
        assert_close("unfused vs fused", unfused, fused.astype(np.float64), case.dtype)
        assert_bits_equal("cache, fused", fused_after[cache_name(case)], after[cache_name(case)])
