"""TensorRT-LLM gpt_attention kernels (kernels_numba/trtllm_gpt_attention.py) under the simulator, checked by the
conformance kit (`cacheattn.testing`, what an outside implementation is held to): outputs against the float64
evaluation, caches bit-identical to the reference's (RoPE'd keys by the kit's rule), every slot a call must not
write unchanged; here every slot a call must not read also holds NaN. Then what the kit does not see: FP8 e4m3
and bfloat16 roundings against ml_dtypes, bfloat16 outputs step for step, multi-block split counts and tile
boundaries, unfused = fused."""

import functools
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import cacheattn
import cacheattn.testing as kit
from cacheattn import trtllm
from kernels_numba import _launch, trtllm_gpt_attention
from kernels_numba._numerics import round_to_bfloat16
from kernels_numba.trtllm_common import e4m3_decode, e4m3_encode
from reference import trtllm_gpt_attention as ref

from helpers import assert_bits_equal, assert_close
from strategies import DEEP, KERNEL, REFERENCE, TrtCase, build_trt, copy_inputs, float64_trt

BASE = TrtCase(contexts=((0, 5), (2, 3)), generations=((3, 4),), beam_width=2, num_heads=4, num_kv_heads=2,
               head_size=8, dtype="float32", capacity=8, window=8, seed=3)


def cache_name(args) -> str:
    return "kv_cache_pool" if args["paged_kv_cache"] else "past_key_value"


def holding(args, positions_of) -> np.ndarray:
    """bool mask over the cache of a call's keyword arguments: the elements of row e that hold the token
    positions positions_of(e)."""
    cache = args[cache_name(args)]
    mask = np.zeros(cache.shape, bool)
    blocks = mask.reshape(-1, *mask.shape[3:])                                  # paged: (blocks, Hkv, tpb, Dh)
    layer, tpb = args["layer_idx"], args["tokens_per_block"]
    windows, sinks = args["host_max_attention_window_sizes"], int(args["host_sink_token_length"][0])
    window = int(windows[layer % len(windows)])
    bubble = ref.paged_bubble(sinks, tpb) if args["paged_kv_cache"] else 0
    for e in range(len(args["sequence_length"])):
        slots = ref.cyclic_slot(np.asarray(positions_of(e), np.int64), window, sinks, bubble)
        for kv in (0, 1):
            if args["paged_kv_cache"]:
                table = args["kv_cache_block_offsets"][0, e, kv]
                blocks[table[slots // tpb] + 2 * layer, :, slots % tpb] = True
            else:
                mask[e, kv, :, slots] = True
    return mask


def readable(args) -> np.ndarray:
    """The cache elements a call may read: the tokens cached before it (self attention), or a generation
    request's encoder tokens (cross attention; a context request reads cross_kv, not the cache)."""
    if args.get("do_cross_attention"):
        encoder, generation = args["encoder_input_lengths"], args["host_request_types"] == 1
        return holding(args, lambda e: np.arange(encoder[e] if generation[e] else 0))
    return holding(args, lambda e: np.arange(args["host_past_key_value_lengths"][e]))


def poisoned(kernels):
    """kernels run with NaN (e4m3: 0x7F) in every cache element the call must not read, so reading one shows in
    the output (INT8 has no NaN: those calls run as they are). Elements still poisoned afterwards get their old
    bytes back, so the kit's untouched-bytes check still sees any the kernels wrote."""
    @functools.wraps(kernels)
    def run(**args):
        cache = args[cache_name(args)]
        if cache.dtype == np.int8:
            return kernels(**args)
        bytes_of = cache.view(np.uint8).reshape(*cache.shape, -1)
        unread = ~readable(args)
        old = bytes_of.copy()
        poison = np.frombuffer(np.array(np.nan, cache.dtype).tobytes() if cache.dtype.kind == "f"
                               else b"\x7f", np.uint8)
        bytes_of[unread] = poison
        result = kernels(**args)
        still = unread & (bytes_of == poison).all(axis=-1)
        bytes_of[still] = old[still]                     # present_key_value is this array: restored too
        return result
    return run


def kernels(threads: int, **launch):
    """The kernels with `threads` a block (and `launch`: rung, num_splits), as the kit calls an implementation, NaN
    in every slot they must not read (32 and 64 threads leave most loops several strides per thread)."""
    def on_kernels(**args):
        return cacheattn.gpt_attention(**args, backend="numba", threads=threads, **launch)
    return poisoned(on_kernels)


DTYPES = ("float16", "bfloat16", "float32")


def run(args, backend, **launch):
    args = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    output, _ = cacheattn.gpt_attention(**args, backend=backend, **launch)
    return output, args


def test_kernels_conform():
    """The kit on drawn calls (every feature; a simulator call costs 2-4 s)."""
    report = kit.check_gpt_attention(kernels(64), max_examples=max(2 * KERNEL // 3, 4), dtypes=DTYPES)
    assert report.examples >= 1


CHOSEN = {
    "inflight-beams-custom-mask-t5": replace(BASE, mask_type=6, position=6, relative="t5"),   # chunk + beams, GQA 2
    "paged-fp8-layer1": replace(BASE, paged=True, tokens_per_block=4, quant=128, dtype="float16", layer_idx=1,
                                num_layers=2),
    "wrapping-chunk-int8-relative": replace(BASE, contexts=((3, 6),), generations=((2, 5),), beam_width=1, window=4,
                                            capacity=4, paged=True, tokens_per_block=2, quant=64, position=6),
    "neox-dynamic-bias-padded": replace(BASE, position=2, rotary_dim=6, rotary_scale_type=2, rotary_scale=2.0,
                                        qkv_bias=True, packed=False),
    "streamingllm": replace(BASE, contexts=((0, 7),), generations=((2, 6),), beam_width=1, window=5, capacity=5,
                            sinks=2, streamingllm=True, paged=True, tokens_per_block=4, position=1, rotary_dim=8,
                            quant=128, dtype="float16"),                     # sinks + bubble, keys rotated on load
    "cross-paged-fp8-bias": replace(BASE, mask_type=0, capacity=6, window=6, paged=True, tokens_per_block=4,
                                    quant=128, dtype="float16", qkv_bias=True, contexts=((0, 1),),
                                    encoder_lengths=(4, 6, 6)),              # generation reads 6 encoder tokens
    # Padded cross_kv (E, L_max, 2 Hkv Dh) with encoder lengths that differ: entry 1's tokens start at row L_max.
    "cross-context-padded-fp16": replace(BASE, capacity=3, window=3, dtype="float16", num_heads=1, num_kv_heads=1,
                                         contexts=((0, 1), (0, 1)), generations=(), beam_width=1,
                                         encoder_lengths=(1, 3), packed=False),
    "unfused-inflight-custom-mask-t5": replace(BASE, mask_type=6, position=6, relative="t5", softcap=3.0,
                                               contexts=((0, 3), (2, 2)), beam_width=1, context_fmha_type=0),
    "unfused-paged-int8-wrapping-chunk-alibi": replace(BASE, generations=(), beam_width=1, contexts=((3, 6),),
                                                       window=4, capacity=4, paged=True, tokens_per_block=2, quant=64,
                                                       position=4, dtype="float16", context_fmha_type=0),
    "fp8-context-fmha-rope": replace(BASE, quant=128, fp8_context_fmha=True, dtype="float16", position=2,
                                     rotary_dim=8),                          # always the unfused path
}


# The default rung runs generation on rung 3; these also on rung 1 (beams, custom mask and T5; keys rotated on load).
RUNG_1 = ("inflight-beams-custom-mask-t5", "streamingllm")


@pytest.mark.spec("trtllm/cross-attention", "trtllm/context-unfused", "trtllm/fp8-context-fmha")
@pytest.mark.parametrize("name,rung", [(name, None) for name in CHOSEN] + [(name, 1) for name in RUNG_1])
def test_kernels_on_chosen_calls(name, rung):
    threads = (32, 64, 128)[list(CHOSEN).index(name) % 3]
    kit.check_case("gpt_attention", kernels(threads, rung=rung), CHOSEN[name])


# ---- the generation phase on the kernel ladder's rungs 3 and 4 (kernels_numba/trtllm_generation.py) ----------------

GEN = replace(BASE, contexts=(), generations=((3, 6), (2, 9)), beam_width=2, head_size=16, capacity=12, window=12,
              paged=True, tokens_per_block=4)
# Generation calls whose rows are whole 16-byte chunks (head_size 16 or 32), so the vector loads and their unpacking
# run, on every feature of the generation phase; in-flight calls add a context request (rung 1) beside them.
GENERATION = {
    "paged-fp16-beams-alibi-softcap": replace(GEN, dtype="float16", position=4, softcap=3.0),
    "contiguous-int8-t5-logn": replace(GEN, paged=False, quant=64, position=6, relative="t5", logn=True,
                                       beam_width=1),
    "paged-fp8-cyclic-window-regular-bias": replace(GEN, quant=128, dtype="float16", head_size=32, window=7,
                                                    capacity=7, position=6, relative="regular", beam_width=1),
    "streamingllm-fp8-neox-sinks": replace(GEN, quant=128, dtype="float16", streamingllm=True, sinks=2, window=6,
                                           capacity=6, position=2, head_size=32, rotary_dim=32, beam_width=1),
    "streamingllm-fp16-gptj-contiguous": replace(GEN, dtype="float16", streamingllm=True, sinks=1, window=5,
                                                 capacity=5, position=1, rotary_dim=8, paged=False, beam_width=1),
    "inflight-wrapping-chunk-fp16-custom-mask": replace(GEN, contexts=((3, 6),), dtype="float16", window=5,
                                                        capacity=5, mask_type=6, generations=((2, 4),), beam_width=1),
    "bfloat16-paged-neox-int8": replace(GEN, dtype="bfloat16", quant=64, position=2, rotary_dim=16, qkv_bias=True,
                                        beam_width=1),
    # head_size 128: lane groups take tiles of 2 keys, 4 keys a step, so a tile and a step cross from the sink into
    # the window past the keys it hides (walked over, not loaded); no RoPE: the new token read from its cache slot.
    "streamingllm-fp16-sink-tiles-dh128": replace(GEN, dtype="float16", head_size=128, streamingllm=True, sinks=1,
                                                  window=6, capacity=6, generations=((3, 12), (2, 20)),
                                                  beam_width=1, paged=False),
}
# Rung 4 where splitting meets something new: beams, a window (split, not [0, kvlen)), keys rotated on load; one
# sequence.
SPLIT = ("paged-fp16-beams-alibi-softcap", "paged-fp8-cyclic-window-regular-bias", "streamingllm-fp8-neox-sinks")


def launched(args, **launch) -> list:
    """Names of the kernels a numba call launches (recorded, not run)."""
    with _launch.recorded_launches() as launches:
        cacheattn.gpt_attention(**args, backend="numba", **launch)
    return [kernel.py_func.__name__ for kernel, _ in launches]


@pytest.mark.spec("trtllm/generation-mmha", "trtllm/multi-block")
@pytest.mark.parametrize("name,rung", [(name, 3) for name in GENERATION] + [(name, 4) for name in SPLIT])
def test_generation_on_rungs_3_and_4(name, rung):
    """The kit's checks (float64 evaluation, caches bit for bit, unread slots NaN) on the vector kernel; rung 4 with
    3 forced splits of the 10 keys. One warp a block: the simulator's cost is blocks x threads."""
    case = GENERATION[name]
    if rung == 4:
        case = replace(case, generations=case.generations[1:])
    launch = dict(rung=4, num_splits=3) if rung == 4 else dict(rung=3)
    names = launched(build_trt(case), **launch)
    assert "vector_attention_kernel" in names and ("combine_kernel" in names) == (rung == 4), names
    kit.check_case("gpt_attention", kernels(32, **launch), case)


# StreamingLLM around its 2 sinks and window 3: past 1 (a sink still to come), 2 (every sink cached, the window not
# yet full: no keys hidden, the walk starts at 0), 3 (the window full: one key hidden), 4 (wrapped). The cached sink 1
# is rotated at its slot 1 as it loads, GPT-J in registers, GPT-NeoX (rotary_dim 2: a pair in one element each)
# element by element; rung 4 with 2 splits.
SINKS = TrtCase(contexts=(), generations=((1, 2),), beam_width=1, num_heads=2, num_kv_heads=1, head_size=8,
                dtype="float16", capacity=3, window=3, sinks=2, streamingllm=True, paged=False, tokens_per_block=1,
                packed=True, quant=0, fp8_context_fmha=False, position=1, rotary_dim=2, rotary_scale_type=0,
                rotary_scale=1.0, mask_type=1, softcap=0.0, q_scaling=1.0, relative="regular", qkv_bias=False,
                num_layers=1, layer_idx=0, seed=0, encoder_lengths=(), context_fmha_type=1)


def test_streamingllm_sink_rotated_at_its_slot_before_the_window_fills():
    """The kit's smallest failing call (past 2 = sinks < W: key 1 was rotated at slot 0 on rung 3), as it found it:
    the default plan (rung 3), 64 threads."""
    assert "vector_attention_kernel" in launched(build_trt(SINKS), threads=64)
    kit.check_case("gpt_attention", kernels(64), SINKS)


@pytest.mark.parametrize("launch", [dict(rung=3), dict(rung=4, num_splits=2), dict(rung=1)], ids=["3", "4", "1"])
@pytest.mark.parametrize("position", [1, 2], ids=["gptj", "neox"])
def test_streamingllm_around_sinks_and_window(position, launch):
    """Pasts 1, 2, 3 and 4 as four sequences of one call (a block each)."""
    case = replace(SINKS, generations=((1, 1), (1, 2), (2, 3), (2, 4)), position=position, seed=position)
    kit.check_case("gpt_attention", kernels(32, **launch), case)


@pytest.mark.spec("trtllm/multi-block")
@pytest.mark.parametrize("sequences,past,splits", [(4, 4000, 33), (1, 4000, 64), (1, 40, 3), (66, 40, 1)])
def test_generation_splits_only_when_sms_idle(sequences, past, splits):
    """rung None on recorded launches (nothing runs): the vector kernel, split (rung 4, with the combine) only when
    its blocks (2 a sequence: a GQA group of 2 heads a block) leave some of the simulator's 132 SMs idle: two blocks
    an SM (2 x 132 / 8 blocks = 33 splits), at most 64, at most one split per step of keys (16 at head_size 16 in
    float16, one warp)."""
    case = replace(GEN, generations=((3, past),) * sequences, beam_width=1, capacity=past + 1, window=past + 1,
                   tokens_per_block=64, dtype="float16")
    with _launch.recorded_launches() as launches:
        cacheattn.gpt_attention(**build_trt(case), backend="numba", threads=32)
    names = [kernel.py_func.__name__ for kernel, _ in launches]
    if splits == 1:
        assert names == ["preprocess_kernel", "vector_attention_kernel"]
    else:
        assert names == ["preprocess_kernel", "vector_attention_kernel", "combine_kernel"]
        assert launches[1][1][1][5] == splits           # out_geom's num_splits
    with _launch.recorded_launches() as launches:      # rung 1's multi-block mode is still there
        cacheattn.gpt_attention(**build_trt(case), backend="numba", threads=32, rung=1, num_splits=2)
    assert [kernel.py_func.__name__ for kernel, _ in launches] == ["preprocess_kernel", "attention_kernel",
                                                                   "combine_kernel"]


def test_float64_generation_runs_on_rung_1():
    """The vector kernels accumulate in float32; a float64 call takes rung 1 by default (and refuses rung 3 or 4)."""
    names = launched(build_trt(replace(GEN, dtype="float64")), threads=32)
    assert names == ["preprocess_kernel", "attention_kernel"]


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


# ---- bfloat16: its bits in the kernels, rounded to bfloat16 where the reference rounds -----------------------------

SMALL = replace(BASE, contexts=((0, 3),), generations=((2, 3),), beam_width=1, num_heads=2, num_kv_heads=1,
                dtype="bfloat16", qkv_bias=True)


@pytest.mark.parametrize("case,changes", [
    (replace(SMALL, position=2, rotary_dim=8), {}),                                  # RoPE'd K in the cache
    (replace(SMALL, paged=True, tokens_per_block=2, contexts=((1, 2),), position=4), {}),   # chunk, ALiBi
    (replace(SMALL, quant=64, softcap=3.0),                                          # INT8 codes of bfloat16 values;
     dict(kv_orig_quant_scale=np.float32([100]), kv_quant_orig_scale=np.float32([0.01]))),  # fine codes: q + bias
], ids=["contiguous-neox", "paged-chunk-alibi", "int8-softcap"])                    # unrounded would round apart
def test_bfloat16_kernels_match_the_reference(case, changes):
    """The cache bit for bit as the reference writes it, and the output within one bfloat16 step of the reference's
    at no more than one element: both round the same float32 values once (they differ by summation order, ~1e-7),
    so a rounding to bfloat16 missed inside the kernels (Q, RoPE'd K, qkv + bias) shows as many differing elements.
    (The scales of the INT8 case are the caller's, which the kit's drawn problems do not take.)"""
    args = dict(build_trt(case), **changes)
    output, after = run(args, "numba")
    ref_output, ref_after = run(args, "reference")
    assert_bits_equal("cache", after[cache_name(args)], ref_after[cache_name(args)])
    steps = np.abs(output.view(np.int16).astype(np.int32) - ref_output.view(np.int16).astype(np.int32))
    assert steps.max() <= 1 and np.count_nonzero(steps) <= 1, f"output: {np.count_nonzero(steps)} bfloat16 " \
        f"elements differ from the reference's, by up to {steps.max()} steps"


# ---- multi-block: split keys, (m, l, o) partials, combine ----------------------------------------------------------

@pytest.mark.spec("trtllm/multi-block")
def test_multi_block_equals_single_block(monkeypatch):
    """Rung 1's multi-block mode: several split counts over key tiles of 2, one with splits that see no key (the
    window hides the first tile, the last split has none): the combined output matches one block per row and the
    reference, and the cache is written the same."""
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
        outputs[splits], caches[splits] = run(args, "numba", rung=1)
        launch_counts[splits] = len(launched)
        assert_bits_equal(f"cache, {splits} splits", caches[splits][cache_name(args)], caches[1][cache_name(args)])
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


def test_choose_splits_puts_two_blocks_on_every_idle_sm():
    from kernels_numba.trtllm_gpt_attention import choose_splits
    assert choose_splits(blocks=132, max_kv_len=4096, key_tile=32, num_sms=132) == 1       # the grid fills the GPU
    # Two blocks on every SM: ceil(2 x 132 / 8) = 33 splits, 264 blocks (the lab's split-K target: >= 2 x 132).
    assert choose_splits(blocks=8, max_kv_len=4096, key_tile=32, num_sms=132) == 33
    assert choose_splits(blocks=100, max_kv_len=4096, key_tile=32, num_sms=132) == 3       # 300 blocks
    assert choose_splits(blocks=8, max_kv_len=40, key_tile=32, num_sms=132) == 2           # two key tiles only
    assert choose_splits(blocks=1, max_kv_len=1 << 20, key_tile=32, num_sms=132) == 64     # capped


# ---- context_fmha_type 0: the unfused context path next to the fused one -------------------------------------------

@pytest.mark.spec("trtllm/context-unfused")
@pytest.mark.parametrize("name", ["unfused-inflight-custom-mask-t5", "unfused-paged-int8-wrapping-chunk-alibi"])
def test_unfused_context_matches_fused(name):
    """The unfused context path (held to the document by the kit above) and the fused kernel agree: outputs within
    the dtype's tolerance of each other, caches bit-identical."""
    case = CHOSEN[name]
    args = build_trt(case)
    unfused, after = run(args, "numba")
    fused, fused_after = run(dict(args, context_fmha_type=1), "numba")
    assert_close("unfused vs fused", unfused, fused.astype(np.float64), case.dtype)
    assert_bits_equal("cache, fused", fused_after[cache_name(args)], after[cache_name(args)])


def test_bfloat16_launches_take_bits_only():
    """A bfloat16 call hands the kernels bits: qkv, its bias, the cache and the scratch as uint16, never a float32
    copy of one (launches recorded, nothing runs); the recorded output is defined (zeros, what the PTX check
    leaves), not leftover memory."""
    args = build_trt(replace(SMALL, dtype="bfloat16"))
    with _launch.poisoned_outputs(None), _launch.recorded_launches() as launches:   # the suite poisons
        output, _ = cacheattn.gpt_attention(**args, backend="numba")
    arrays = [a for _, launched in launches for a in _leaves(launched) if isinstance(a, np.ndarray)]
    sizes = {x.size for x in args.values() if isinstance(x, np.ndarray) and x.dtype.name == "bfloat16"}
    assert not [a for a in arrays if a.dtype == np.float32 and a.size in sizes], "a float32 copy was launched on"
    assert {a.size for a in arrays if a.dtype == np.uint16} >= sizes
    assert output.dtype.name == "bfloat16" and not output.astype(np.float32).any()


def _leaves(args):
    for a in args:
        if isinstance(a, tuple):                        # namedtuples of sources and arguments too
            yield from _leaves(a)
        else:
            yield a


# ---- host_max_attention_window_sizes shorter than the layers: repeated ------------------------------------------

@pytest.mark.parametrize("windows,layer_idx,paged", [([4], 1, False), ([9, 4], 3, True)],
                         ids=["one-entry-layer1-contiguous", "two-entries-layer3-paged"])
def test_a_shorter_window_list_repeats_on_the_kernels(windows, layer_idx, paged, monkeypatch):
    """Layer l reads entry l % len of the window list, on the kernels as on the reference: a window of 4 that
    makes the cache cyclic (a 6-token context, then a generation step past it), given as a list shorter than the
    layers, with ALiBi (no RoPE: the cache is exact) and an INT8 pool when paged. The output is within the dtype's
    tolerance of the reference's and of the float64 evaluation, the cache bit for bit the reference's; the
    reference on the full per-layer list computes the same, and so does the launcher handed the short list itself
    (validation hands it the resolved window)."""
    case = replace(BASE, contexts=((0, 6),), generations=((2, 5),), beam_width=1, window=4, capacity=4,
                   paged=paged, tokens_per_block=2, num_layers=layer_idx + 1, layer_idx=layer_idx, position=4,
                   quant=64 if paged else 0)
    args = dict(build_trt(case), host_max_attention_window_sizes=np.asarray(windows, np.int32))
    output, after = run(args, "numba")
    ref_output, ref_after = run(args, "reference")
    full_output, _ = run(dict(args, host_max_attention_window_sizes=np.full(case.num_layers, 4, np.int32)),
                         "reference")
    want, _ = float64_trt(copy_inputs(args))
    assert_close("kernels vs reference", output, ref_output.astype(np.float64), case.dtype)
    assert_close("kernels vs float64", output, want, case.dtype, scale=4.0)
    assert_bits_equal("cache", after[cache_name(args)], ref_after[cache_name(args)])
    assert_bits_equal("full list vs shorter", full_output, ref_output)

    validate = trtllm.validate

    def unresolved(a):
        return dict(validate(a), host_max_attention_window_sizes=a["host_max_attention_window_sizes"])
    monkeypatch.setattr(trtllm, "validate", unresolved)
    direct, direct_after = run(args, "numba")
    assert_bits_equal("launcher on the short list", direct, output)
    assert_bits_equal("cache, launcher on the short list", direct_after[cache_name(args)], after[cache_name(args)])


def test_long_rope_with_one_entry_runs_on_the_kernels():
    """A batch of one generation entry past long_rope's original positions with its frequencies given: the kernels'
    per-entry frequency rows must be writable (a found failure: they were a read-only broadcast view)."""
    case = TrtCase(contexts=(), generations=((1, 4),), beam_width=1, num_heads=1, num_kv_heads=1, head_size=8,
                   dtype="float16", capacity=5, window=5, sinks=0, streamingllm=False, paged=False,
                   tokens_per_block=1, packed=True, quant=0, fp8_context_fmha=False, position=3, rotary_dim=2,
                   rotary_scale_type=0, rotary_scale=1.0, mask_type=1, softcap=0.0, q_scaling=1.0, relative="regular",
                   qkv_bias=False, num_layers=1, layer_idx=0, seed=0, encoder_lengths=(), context_fmha_type=1)
    args = build_trt(case)
    assert args["long_rope_rotary_inv_freq"] is not None and args["rotary_inv_freq"] is not None
    got, _ = run(args, "numba", threads=32)
    want, _ = float64_trt(args)
    assert_close("output", got, want, case.dtype, scale=2)


# ---- the preprocess a thread per 16-byte chunk: bit for bit the element kernel's --------------------------------

CHUNKED = replace(BASE, contexts=((0, 3),), generations=((2, 3),), beam_width=1, num_heads=2, num_kv_heads=1,
                  head_size=16, dtype="float16", capacity=6, window=6)
# Each runs the chunked preprocess (float16 / bfloat16, rows of whole chunks): GPT-NeoX halves of one chunk each
# with a chunk past rotary_dim, GPT-J with a chunk rotated only in part, a quantized cache stored element by element,
# StreamingLLM's K cached before RoPE over sinks, cos/sin from the host's table, Qwen's logn on Q, the bias.
PREPROCESS = {
    "float16-neox-bias-logn-generation": replace(CHUNKED, contexts=(), generations=((2, 4),), position=2,
                                                 rotary_dim=16, qkv_bias=True, logn=True),
    "bfloat16-neox-partial-bias-logn": replace(CHUNKED, dtype="bfloat16", head_size=32, rotary_dim=16, position=2,
                                               qkv_bias=True, logn=True),
    "float16-gptj-partial-paged": replace(CHUNKED, position=1, rotary_dim=12, paged=True, tokens_per_block=2),
    "float16-neox-int8-bias": replace(CHUNKED, position=2, rotary_dim=16, quant=64, qkv_bias=True),
    "float16-streamingllm-gptj-sinks": replace(CHUNKED, contexts=(), generations=((2, 4),), streamingllm=True, sinks=1,
                                               window=4, capacity=4, position=1, rotary_dim=16),
    "float16-neox-table-fp8-wrapping": replace(CHUNKED, contexts=((3, 6),), generations=(), window=4, capacity=4,
                                               position=2, rotary_dim=32, head_size=32, rope_table=True, quant=128),
}


DEEP_TIER = pytest.mark.skipif(not DEEP, reason="the deep tier: CACHEATTN_EXAMPLES=2 or more (.ci/run)")


@pytest.mark.spec("trtllm/generation-mmha", "trtllm/rope")
@pytest.mark.parametrize("name", [pytest.param(name, marks=() if k == 0 else DEEP_TIER)
                                  for k, name in enumerate(PREPROCESS)])
def test_chunked_preprocess_matches_the_element_kernel(name, monkeypatch):
    """The chunked preprocess (a thread per 16-byte chunk, each pair's cos/sin once) writes the scratch and the cache
    bit for bit as the element kernel does: the outputs, which attend over the scratch, and the caches are equal
    bits; the cache is the reference's too. The chunked kernel must have run."""
    args = build_trt(PREPROCESS[name])
    chunked = []
    original = trtllm_gpt_attention._preprocess_chunk_kernel

    def noted(*key):
        chunked.append(key)
        return original(*key)
    monkeypatch.setattr(trtllm_gpt_attention, "_preprocess_chunk_kernel", noted)
    output, after = run(args, "numba", threads=32)
    assert chunked, "the chunked preprocess did not run"
    monkeypatch.setattr(trtllm_gpt_attention, "chunked_preprocess_ok", lambda *facts: False)
    chunked.clear()
    element_output, element_after = run(args, "numba", threads=32)
    assert not chunked
    _, ref_after = run(args, "reference")
    assert_bits_equal("output, chunked vs element", output, element_output)
    assert_bits_equal("cache, chunked vs element", after[cache_name(args)], element_after[cache_name(args)])
    assert_bits_equal("cache, chunked vs reference", after[cache_name(args)], ref_after[cache_name(args)])
