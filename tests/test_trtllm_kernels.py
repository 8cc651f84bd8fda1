"""TensorRT-LLM gpt_attention kernels (kernels_numba/trtllm_gpt_attention.py) under the simulator, checked by the
conformance kit (`cacheattn.testing`, what an outside implementation is held to): outputs against the float64
evaluation, caches bit-identical to the reference's (RoPE'd keys by the kit's rule), every slot a call must not
write unchanged; here every slot a call must not read also holds NaN. Then what the kit does not see: FP8 e4m3
bits against ml_dtypes, the features not run yet refused by name, multi-block split counts, unfused = fused."""

import functools
from dataclasses import replace

import numpy as np
import pytest
from numba import cuda

import cacheattn
import cacheattn.testing as kit
from kernels_numba import _launch
from kernels_numba.trtllm_gpt_attention import e4m3_decode, e4m3_encode
from reference import trtllm_gpt_attention as ref

from helpers import assert_bits_equal, assert_close
from strategies import KERNEL, TrtCase, build_trt

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


def kernels(**args):
    return cacheattn.gpt_attention(**args, backend="numba")


POISONED = poisoned(kernels)
DTYPES = ("float16", "float32")                          # bfloat16 runs on the reference only


def run(args, backend):
    args = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    output, _ = cacheattn.gpt_attention(**args, backend=backend)
    return output, args


def test_kernels_conform():
    """The kit on drawn calls (every feature; a simulator call costs 2-4 s)."""
    report = kit.check_gpt_attention(POISONED, max_examples=max(2 * KERNEL // 3, 4), dtypes=DTYPES)
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
    "unfused-inflight-custom-mask-t5": replace(BASE, mask_type=6, position=6, relative="t5", softcap=3.0,
                                               contexts=((0, 3), (2, 2)), beam_width=1, context_fmha_type=0),
    "unfused-paged-int8-wrapping-chunk-alibi": replace(BASE, generations=(), beam_width=1, contexts=((3, 6),),
                                                       window=4, capacity=4, paged=True, tokens_per_block=2, quant=64,
                                                       position=4, dtype="float16", context_fmha_type=0),
    "fp8-context-fmha-rope": replace(BASE, quant=128, fp8_context_fmha=True, dtype="float16", position=2,
                                     rotary_dim=8),                          # always the unfused path
}


@pytest.mark.spec("trtllm/cross-attention", "trtllm/context-unfused", "trtllm/fp8-context-fmha")
@pytest.mark.parametrize("name", list(CHOSEN))
def test_kernels_on_chosen_calls(name):
    kit.check_case("gpt_attention", POISONED, CHOSEN[name])


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


# ---- not run by the kernels yet: refused by name, after validation, before any launch ------------------------------

@pytest.mark.parametrize("change,feature", [(dict(dtype="bfloat16"), "qkv")])
def test_features_not_run_yet_are_refused_by_name(change, feature):
    case = replace(BASE, **change)
    args = build_trt(case)
    before = args[cache_name(args)].copy()
    with _launch.recorded_launches() as launches, pytest.raises(NotImplementedError, match=rf"^{feature}\b"):
        cacheattn.gpt_attention(**args, backend="numba")
    assert launches == []
    assert_bits_equal("cache", args[cache_name(args)], before)


# ---- multi-block: split keys, (m, l, o) partials, combine ----------------------------------------------------------

@pytest.mark.spec("trtllm/multi-block")
def test_multi_block_equals_single_block(monkeypatch):
    """Several split counts, one with splits that see no key (the window leaves the early ones empty): the combined
    output matches one block per row and the reference, and the cache is written the same."""
    from kernels_numba import trtllm_gpt_attention as kernels
    case = replace(BASE, contexts=(), generations=((2, 7),), beam_width=1, capacity=8, window=5, quant=64,
                   position=4, softcap=3.0, num_heads=2, num_kv_heads=1)
    args = build_trt(case)
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
        assert_bits_equal(f"cache, {splits} splits", caches[splits][cache_name(args)], caches[1][cache_name(args)])
    assert launch_counts[2] == launch_counts[5] == launch_counts[1] + 1          # + the combine kernel
    ref_output, _ = run(args, "reference")
    for splits in (2, 5):
        assert_close(f"{splits} splits vs 1", outputs[splits], outputs[1].astype(np.float64), case.dtype)
        assert_close(f"{splits} splits vs reference", outputs[splits], ref_output.astype(np.float64), case.dtype)


def test_choose_splits_fills_idle_sms_only():
    from kernels_numba.trtllm_gpt_attention import choose_splits
    assert choose_splits(blocks=132, max_kv_len=4096, key_tile=32, num_sms=132) == 1       # the grid fills the GPU
    assert choose_splits(blocks=8, max_kv_len=4096, key_tile=32, num_sms=132) == 16        # 132 // 8
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
