"""The registry: one `Operator` per cacheattn function, saying what an implementation may claim (features),
how a drawn case becomes the documented arguments, and what each output must be."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

import cacheattn
from cacheattn.examples import (
    FTCase,
    OnnxCase,
    PPLCase,
    StaticCase,
    TrtCase,
    build_ft,
    build_onnx,
    build_ppl,
    build_static,
    build_trt,
    copy_inputs,
    float64_ft,
    float64_onnx,
    float64_ppl_attention,
    float64_trt,
    reference_cache_state,
)
from cacheattn.ft import HEAD_SIZES
from reference.trtllm_gpt_attention import quantize_kv

from . import strategies
from ._core import Expect, Operator, call

PPL_DTYPES = ("float16", "float32")

CACHE_FEATURES = {
    "int8": "quant_bit 8: int8 cache with per-group scales",
    "int4": "quant_bit 4: two int4 codes per byte",
    **{f"cache_layout_{n}": f"cache_layout {n}" for n in range(4)},
    "cache_mode_0": "cache_mode 0: one contiguous region per batch at cachestarts[b]",
    "cache_mode_1": "cache_mode 1: paged, cachestarts a (B, MaxP) page table (shuffled pages, -1 unused)",
}
ATTENTION_FEATURES = {
    "causal": "is_causal: bottom-right aligned causal mask",
    "alibi": "is_alibi: ALiBi slopes, non-power-of-two head counts included",
    "gqa": "num_kv_heads < num_heads (groups of 2 and 3)",
    "mask_2d": "attn_mask (sum seqlens, >= sum kvlens), -inf entries included",
    "mask_3d": "attn_mask (num_heads, sum seqlens, >= sum kvlens)",
    "decoding": "decoding_batches > 0: the first batches have one query each",
}
CACHE_REQUIRES = (tuple(f"cache_layout_{n}" for n in range(4)), ("cache_mode_0", "cache_mode_1"))


def _quant_bits(f: frozenset) -> tuple:
    return (0,) + tuple(b for b, name in ((8, "int8"), (4, "int4")) if name in f)


def _repeats(f: frozenset) -> tuple:
    return (1, 2, 3) if "num_repeat" in f else (1,)


def _ppl_space(f: frozenset, dtypes: tuple) -> dict:
    """ppl_cases keywords for the declared features."""
    return dict(dtypes=dtypes, quant_bits=_quant_bits(f),
                layouts=tuple(n for n in range(4) if f"cache_layout_{n}" in f) or (0,),
                modes=tuple(n for n in range(2) if f"cache_mode_{n}" in f) or (0,),
                masks=("none",) + tuple(m for m in ("2d", "3d") if f"mask_{m}" in f),
                alibi=(False, True) if "alibi" in f else (False,), causal=(False, True) if "causal" in f else (False,),
                groups=(1, 2, 3) if "gqa" in f else (1,), decoding="decoding" in f)


def _cache_uses(case) -> set:
    used = {f"cache_layout_{case.cache_layout}", f"cache_mode_{case.cache_mode}"}
    return used | ({"int8"} if case.quant_bit == 8 else set()) | ({"int4"} if case.quant_bit == 4 else set())


def _attention_uses(case: PPLCase) -> set:
    flags = {"causal": case.is_causal, "alibi": case.is_alibi, "gqa": case.num_heads > case.num_kv_heads,
             "mask_2d": case.mask == "2d", "mask_3d": case.mask == "3d", "decoding": case.decoding_batches > 0}
    return {name for name, on in flags.items() if on}


def _cache_attrs(case) -> dict:
    return dict(num_layer=case.num_layer, layer_idx=case.layer_idx, quant_bit=case.quant_bit,
                quant_group=case.quant_group, cache_mode=case.cache_mode, cache_layout=case.cache_layout,
                page_size=case.page_size)


def _reference(op_name, inputs, attrs):
    """The reference's outputs on copies of the inputs (the copies' caches absorb its writes)."""
    op = OPERATORS[op_name]
    return call(op, op.function, copy_inputs(inputs), attrs, backend="reference")


# ---------------------------------------------------------------------------------------------- OpenPPL

def _mhca_expect(case: PPLCase, inputs, attrs):
    key, value, _, _ = reference_cache_state(inputs, case)
    return {"attn_output": Expect("close", float64_ppl_attention(inputs, case, key, value), case.dtype)}


MULTI_HEAD_CACHE_ATTENTION = Operator(
    name="multi_head_cache_attention", function=cacheattn.multi_head_cache_attention,
    features={**ATTENTION_FEATURES, **CACHE_FEATURES}, dtypes=PPL_DTYPES,
    strategy=lambda f, d: strategies.ppl_cases(**_ppl_space(f, d)),
    uses=lambda c: frozenset(_attention_uses(c) | _cache_uses(c)),
    problem=lambda c: (build_ppl(c), c.attrs()), expect=_mhca_expect,
    outputs=("attn_output",), in_place=("cache", "scale"), requires=CACHE_REQUIRES)


def _dmha_problem(case: PPLCase):
    inputs = build_ppl(case)
    key, value, _, _ = reference_cache_state(inputs, case)
    names = ("query", "seqstarts", "kvstarts", "decoding_batches", "max_seqlen", "max_kvlen", "attn_mask")
    attrs = dict(num_heads=case.num_heads, head_dim=case.head_dim, is_causal=case.is_causal, is_alibi=case.is_alibi,
                 num_kv_heads=case.num_kv_heads)
    return dict({n: inputs[n] for n in names}, key=key, value=value), attrs


def _dmha_expect(case: PPLCase, inputs, attrs):
    return {"attn_output": Expect("close", float64_ppl_attention(inputs, case, inputs["key"], inputs["value"]),
                                  case.dtype)}


DYNAMIC_MULTI_HEAD_ATTENTION = Operator(
    name="dynamic_multi_head_attention", function=cacheattn.dynamic_multi_head_attention,
    features=ATTENTION_FEATURES, dtypes=PPL_DTYPES,
    strategy=lambda f, d: strategies.ppl_cases(
        **{**_ppl_space(f, d), "quant_bits": (0,), "layouts": (0,), "modes": (0,)}),
    uses=lambda c: frozenset(_attention_uses(c)), problem=_dmha_problem, expect=_dmha_expect,
    outputs=("attn_output",))


@dataclass(frozen=True)
class DynamicCacheCase:
    """A dynamic_batching.KeyValueCache call: the cache part of a PPLCase plus num_repeat."""
    base: PPLCase
    num_repeat: int

    @property
    def dtype(self):
        return self.base.dtype


def _bits_of_reference(op_name):
    def expect(case, inputs, attrs):
        key, value = _reference(op_name, inputs, attrs)
        return {"key": Expect("bits", key), "value": Expect("bits", value)}
    return expect


DYNAMIC_KEY_VALUE_CACHE = Operator(
    name="dynamic_key_value_cache", function=cacheattn.dynamic_key_value_cache,
    features={**CACHE_FEATURES, "num_repeat": "num_repeat > 1"}, dtypes=PPL_DTYPES,
    strategy=lambda f, d: strategies.ppl_cases(**_ppl_space(f, d)).flatmap(
        lambda base: st.builds(DynamicCacheCase, st.just(base), st.sampled_from(_repeats(f)))),
    uses=lambda c: frozenset(_cache_uses(c.base) | ({"num_repeat"} if c.num_repeat > 1 else set())),
    problem=lambda c: (build_ppl(c.base), dict(_cache_attrs(c.base), num_repeat=c.num_repeat)),
    expect=_bits_of_reference("dynamic_key_value_cache"), outputs=("key", "value"), in_place=("cache", "scale"),
    requires=CACHE_REQUIRES, case_imports=("PPLCase",))

STATIC_FEATURES = {"int8": CACHE_FEATURES["int8"], "int4": CACHE_FEATURES["int4"],
                   "cache_layout_0": "cache_layout 0: (MaxB, L, 2, MaxS, H, Dh)",
                   "cache_layout_1": "cache_layout 1: (L, MaxB, 2, H, MaxS, Dh)", "num_repeat": "num_repeat > 1"}


def _static_attrs(case: StaticCase) -> dict:
    return dict(num_layer=case.num_layer, layer_idx=case.layer_idx, quant_bit=case.quant_bit,
                quant_group=case.quant_group, num_repeat=case.num_repeat, cache_layout=case.cache_layout)


KEY_VALUE_CACHE = Operator(
    name="key_value_cache", function=cacheattn.key_value_cache, features=STATIC_FEATURES,
    dtypes=PPL_DTYPES,
    strategy=lambda f, d: strategies.static_cases(
        dtypes=d, quant_bits=_quant_bits(f), layouts=tuple(n for n in range(2) if f"cache_layout_{n}" in f),
        repeats=_repeats(f)),
    uses=lambda c: frozenset({f"cache_layout_{c.cache_layout}"} | ({"int8"} if c.quant_bit == 8 else set())
                             | ({"int4"} if c.quant_bit == 4 else set())
                             | ({"num_repeat"} if c.num_repeat > 1 else set())),
    problem=lambda c: (build_static(c), _static_attrs(c)), expect=_bits_of_reference("key_value_cache"),
    outputs=("key", "value"), in_place=("cache", "scale"), requires=(("cache_layout_0", "cache_layout_1"),))


# ---------------------------------------------------------------------------------------------- ONNX

ONNX_FEATURES = {
    "past": "past_key / past_value (the causal offset is past_sequence_length)",
    "nonpad_kv_seqlen": "nonpad_kv_seqlen (opset 24 external cache)",
    "mask_bool": "bool attn_mask, broadcast, last dim possibly shorter than the keys",
    "mask_float": "float attn_mask (added), -inf entries included",
    "causal": "is_causal 1",
    "gqa": "kv_num_heads < q_num_heads (groups of 2 and 3)",
    "3d": "3-D Q/K/V (batch, seq, heads * size) with q_num_heads / kv_num_heads",
    "softcap": "softcap > 0",
    "scale": "an explicit scale attribute",
    "window": "opset 25 left_window_size / right_window_size",
    "qk_matmul_output": "the fourth output, qk_matmul_output_mode 0 to 3",
}


@dataclass(frozen=True)
class OnnxRequest:
    """An ONNX Attention call: the case plus whether the optional fourth output is asked for."""
    base: OnnxCase
    return_qk_matmul_output: bool

    @property
    def dtype(self):
        return self.base.dtype


def _onnx_uses(request: OnnxRequest) -> frozenset:
    case = request.base
    flags = {"past": case.past_len > 0, "nonpad_kv_seqlen": case.nonpad is not None,
             "mask_bool": case.mask == "bool", "mask_float": case.mask == "float", "causal": bool(case.is_causal),
             "gqa": case.q_heads > case.kv_heads, "3d": case.three_d, "softcap": case.softcap > 0,
             "scale": case.scale is not None, "window": case.opset == 25,
             "qk_matmul_output": request.return_qk_matmul_output}
    return frozenset(name for name, on in flags.items() if on)


def _onnx_strategy(f: frozenset, dtypes: tuple):
    qk = "qk_matmul_output" in f
    cases = strategies.onnx_cases(
        dtypes=dtypes, past="past" in f, windows="window" in f, nonpad="nonpad_kv_seqlen" in f,
        masks=("none",) + tuple(m for m in ("bool", "float") if f"mask_{m}" in f),
        modes=(0, 1, 2, 3) if qk else (0,), causal=(0, 1) if "causal" in f else (0,),
        groups=(1, 2, 3) if "gqa" in f else (1,), three_d=(False, True) if "3d" in f else (False,),
        softcaps=(0.0, 0.0, 1.5, 30.0) if "softcap" in f else (0.0,),
        scales=(None, None, 0.05, 0.7) if "scale" in f else (None,))
    return st.builds(OnnxRequest, cases, st.just(True) if qk else st.just(False))


def _onnx_problem(request: OnnxRequest):
    return build_onnx(request.base), dict(request.base.attrs(),
                                          return_qk_matmul_output=request.return_qk_matmul_output)


def _onnx_expect(request: OnnxRequest, inputs, attrs):
    case = request.base
    ref = _reference("onnx_attention", inputs, attrs)
    f64 = float64_onnx(inputs, case)
    qk = Expect("close", f64[3], case.dtype) if request.return_qk_matmul_output else None
    # "nonpad_kv_seqlen ... should not be used together with ... present_key and present_value outputs":
    # with it, an implementation may leave the presents out, so they are checked only without it.
    external_cache = case.nonpad is not None
    presents = {name: None if external_cache else Expect("bits", getattr(ref, name))
                for name in ("present_key", "present_value")}
    return {"Y": Expect("close", f64[0], case.dtype), **presents, "qk_matmul_output": qk}


ONNX_ATTENTION = Operator(
    name="onnx_attention", function=cacheattn.onnx_attention, features=ONNX_FEATURES,
    dtypes=("float16", "bfloat16", "float32", "float64"), strategy=_onnx_strategy, uses=_onnx_uses,
    problem=_onnx_problem,
    expect=_onnx_expect, outputs=("Y", "present_key", "present_value", "qk_matmul_output"),
    case_imports=("OnnxCase",))



# ---------------------------------------------------------------------------------------------- FasterTransformer

FT_FEATURES = {
    "batch_major_cache": "is_batch_major_cache: K [B, H, Dh/x, L, x], V [B, H, L, Dh]",
    "plain_cache": "is_batch_major_cache False: K and V [B, L, H, Dh]",
    "later_steps": "step 2 and 3: attention over the cache step 1 wrote (which stays unchanged)",
    "ia3": "ia3_tasks with weights.ia3_key_weight / ia3_value_weight (num_tasks 1 to 3)",
    "finished": "finished rows: their context row, probabilities and biased cache left alone",
    "cross_attentions": "the cross_attentions buffer (float32 probabilities at column step - 1)",
    "context_buf": "an old context_buf written in place",
    "all_head_sizes": "every size_per_head FasterTransformer instantiates (else 32 and 48 only)",
    "cache_bits": ("step-1 caches bit-identical to the reference's (the projection summed in NumPy's order); "
                   "leave it out for a GEMM that sums otherwise (cuBLAS): written cache elements are then held to "
                   "the dtype's tolerance against float64"),
}
FT_SIZES = dict(max_batch=2, max_mem_len=5, max_heads=2)       # what our simulator kernel test has always drawn


@dataclass(frozen=True)
class FTRequest:
    """A cross_attention call: the case plus whether its step-1 caches must equal the reference's bits."""
    base: FTCase
    cache_bits: bool

    @property
    def dtype(self):
        return self.base.dtype


def _ft_strategy(f: frozenset, dtypes: tuple):
    cases = strategies.ft_cases(
        dtypes=dtypes, layouts=tuple(major for major, name in ((True, "batch_major_cache"), (False, "plain_cache"))
                                     if name in f),
        steps=(1, 2, 3) if "later_steps" in f else (1,),
        head_sizes=HEAD_SIZES if "all_head_sizes" in f else HEAD_SIZES[:2], finished="finished" in f,
        ia3="ia3" in f, cross="cross_attentions" in f, context_bufs="context_buf" in f, **FT_SIZES)
    return st.builds(FTRequest, cases, st.just("cache_bits" in f))


def _ft_uses(request: FTRequest) -> frozenset:
    case = request.base
    flags = {"batch_major_cache": case.is_batch_major_cache, "plain_cache": not case.is_batch_major_cache,
             "later_steps": case.step > 1, "ia3": case.ia3_tasks is not None,
             "finished": case.finished is not None and any(case.finished),
             "cross_attentions": case.max_decoder_seq_len > 0, "context_buf": case.context_buf,
             "all_head_sizes": case.size_per_head not in HEAD_SIZES[:2],
             "cache_bits": request.cache_bits and case.step == 1}
    return frozenset(name for name, on in flags.items() if on)


def _ft_problem(request: FTRequest):
    inputs = build_ft(request.base)
    # FasterTransformer passes the weights as one AttentionWeight (DenseWeight members): an attribute here.
    return inputs, dict(request.base.attrs(), weights=inputs.pop("weights"))


def _ft_expect(request: FTRequest, inputs, attrs):
    case = request.base
    hidden, context, key_cache, value_cache, cross = float64_ft(dict(copy_inputs(inputs), weights=attrs["weights"]),
                                                                case)
    # Widened as tests/test_ft_properties.py holds the reference itself: the context sums Dh * L products, the
    # output projection another H * Dh; the probabilities are float32 but of a dtype-rounded score.
    expect = {"hidden_features": Expect("close", hidden, case.dtype, scale=4.0),
              "context": Expect("close", context, case.dtype, scale=2.0),
              "context_buf": Expect("close", context, case.dtype, scale=2.0),
              "cross_attentions": Expect("close", cross, "float32", scale=2.0, tolerance=case.dtype)}
    if not request.cache_bits:                  # another summation order: the written rows near float64's
        expect.update(key_cache=Expect("close", key_cache, case.dtype), value_cache=Expect("close", value_cache,
                                                                                             case.dtype))
    return expect


CROSS_ATTENTION = Operator(
    name="cross_attention", function=cacheattn.cross_attention, features=FT_FEATURES, dtypes=("float16", "float32"),
    strategy=_ft_strategy, uses=_ft_uses, problem=_ft_problem, expect=_ft_expect,
    outputs=("hidden_features", "context"), in_place=("key_cache", "value_cache", "context_buf", "cross_attentions"),
    requires=(("batch_major_cache", "plain_cache"),), case_imports=("FTCase",))


# ---------------------------------------------------------------------------------------------- TensorRT-LLM

TRT_FEATURES = {
    "contiguous": "paged_kv_cache False: past_key_value (batch_beam, 2, num_kv_heads, max_seqlen, "
                  "hidden_size_per_head), returned as present_key_value",
    "paged": "paged_kv_cache True: kv_cache_pool through a shuffled kv_cache_block_offsets table, "
             "tokens_per_block 1, 2 or 4",
    "generation": "generation requests (one token per beam, over the cache) after the context requests, in flight",
    "chunked_context": "context requests with host_past_key_value_lengths > 0: a chunk after cached tokens",
    "beam_search": "beam_width 2: generation reads the cached tokens of the beam cache_indirection names",
    "gqa": "num_kv_heads < num_heads (groups of 2 and 3)",
    "padded": "remove_input_padding False: qkv (batch_beam, max_seqlen, hidden); all requests in one phase "
              "(in-flight batching needs packed input); padding rows of the output are not compared",
    "qkv_bias": "qkv_bias, added before RoPE",
    "int8_kv": "kv_cache_quant_mode INT8_KV_CACHE with the per-tensor kv_orig_quant_scale / kv_quant_orig_scale",
    "fp8_kv": "kv_cache_quant_mode FP8_KV_CACHE (e4m3 codes)",
    "fp8_context_fmha": "use_fp8_context_fmha on FP8-cache calls: context Q, K, V and probabilities in e4m3",
    "rope_gptj": "position_embedding_type rope_gptj (interleaved pairs), rotary_embedding_dim 2, 6, 8 or the head",
    "rope_gpt_neox": "position_embedding_type rope_gpt_neox (pairs across halves)",
    "rope_scaling": "rotary_embedding_scale_type linear and dynamic (NTK), with a RoPE feature",
    "rope_table": "rotary_cos_sin (and rotary_inv_freq) built on the host, read where TensorRT-LLM reads it",
    "long_rope": "position_embedding_type long_rope: short and long tables switched past "
                 "rotary_embedding_original_max_positions (4), the m-scales",
    "yarn": "position_embedding_type yarn: YaRN frequencies and its magnitude-scaled table",
    "logn_scaling": "logn_scaling (Qwen's logn attention): Q scaled at its absolute position",
    "alibi": "position_embedding_type alibi and alibi_with_scale, alibi_slopes for any head count",
    "relative_bias": "position_embedding_type relative: relative_attention_bias (H, L, L), or T5 buckets with "
                     "max_distance",
    "bidirectional": "mask_type padding and bidirectional (no causal mask)",
    "custom_mask": "mask_type custom_mask with a bool attention_mask",
    "packed_mask": "attention_packed_mask, the same custom mask packed as TensorRT-LLM's context FMHA reads it",
    "sliding_window": "host_max_attention_window_sizes below the sequence lengths: a cyclic cache (mask_type "
                      "sliding_window_causal too)",
    "streamingllm": "streamingllm with host_sink_token_length 0 to 2: whole contexts, keys cached before RoPE",
    "cross_attention": "do_cross_attention: context requests cache the encoder K/V of cross_kv, generation reads it",
    "softcap": "attn_logit_softcapping_scale > 0",
    "context_fmha_type": "context_fmha_type 0 (unfused) and 2 (FP32 accumulation), not only 1",
}
TRT_CACHES = ("past_key_value", "kv_cache_pool")

# RoPE'd keys. The document fixes the rotation, not the bits of cos(p theta) and sin(p theta): one implementation
# takes theta = base^(-2i/d) in float64, another powf in float32; cos/sin come from libm, NumPy's SIMD code or
# a GPU's sincosf, each good to an ulp or two of float32 at angles p theta up to ~16 rad here. A rotated key
# x cos - y sin then moves by up to ~2^-18 of the pair's magnitude m = |(x, y)| (a rotation keeps it), however
# small the key itself (cancellation). So a written rotated key is held to the reference's value within
# ulp(key) + 2^-17 m in its dtype, and a quantized one to the codes of the values in that interval; every
# other cached element (values, dims past rotary_embedding_dim, StreamingLLM's unrotated keys, encoder K/V)
# bit for bit. Our kernels need it in float32: over 60 drawn calls 150 of 2,678 rotated keys differed from the
# reference's, by up to 256 ulps of the key (a cancelling pair) yet at most 2.5 x 2^-24 m; in float16 none did.
ROPE_SLACK = 2.0 ** -17
ROPE_WHY = "a RoPE'd key may be off by ulp + 2^-17 |its rotated pair| (quantized: the codes of that interval)"


def _trt_strategy(f: frozenset, dtypes: tuple):
    masks = (1, 1) + ((2,) if "sliding_window" in f else ()) + ((0, 3) if "bidirectional" in f else ()) \
        + ((6,) if "custom_mask" in f else ())
    positions = (0,) + tuple(p for p, name in ((1, "rope_gptj"), (2, "rope_gpt_neox"), (3, "long_rope"), (4, "alibi"),
                                               (5, "alibi"), (6, "relative_bias"), (8, "yarn")) if name in f)
    return strategies.trt_cases(
        dtypes=dtypes, paged=tuple(p for p, name in ((False, "contiguous"), (True, "paged")) if name in f),
        quant=(0,) + ((64,) if "int8_kv" in f else ()) + ((128,) if "fp8_kv" in f else ()), positions=positions,
        masks=masks, beams=(1, 1, 2) if "beam_search" in f else (1,), windowed="sliding_window" in f,
        chunked="chunked_context" in f, generation="generation" in f,
        packed=(True, False) if "padded" in f else (True,), softcap="softcap" in f,
        groups=(1, 2, 3) if "gqa" in f else (1,), qkv_bias=(False, True) if "qkv_bias" in f else (False,),
        rope_scaling="rope_scaling" in f, fmha_types=(1, 1, 0, 2) if "context_fmha_type" in f else (1,),
        streaming=(False, True) if "streamingllm" in f else (False,),
        cross=(False, True) if "cross_attention" in f else (False,), fp8_fmha="fp8_context_fmha" in f,
        padded_inflight=False, rope_tables="rope_table" in f, logn="logn_scaling" in f, packed_mask="packed_mask" in f)


def _trt_uses(c: TrtCase) -> frozenset:
    flags = {"contiguous": not c.paged, "paged": c.paged, "generation": bool(c.generations),
             "chunked_context": any(p for p, _ in c.contexts), "beam_search": c.beam_width > 1 and bool(c.generations),
             "gqa": c.num_heads > c.num_kv_heads, "padded": not c.packed, "qkv_bias": c.qkv_bias,
             "int8_kv": c.quant == 64, "fp8_kv": c.quant == 128,
             "fp8_context_fmha": c.fp8_context_fmha and bool(c.contexts), "rope_gptj": c.position == 1,
             "rope_gpt_neox": c.position == 2, "rope_scaling": c.position in (1, 2) and c.rotary_scale_type != 0,
             "alibi": c.position in (4, 5), "relative_bias": c.position == 6, "bidirectional": c.mask_type in (0, 3),
             "custom_mask": c.mask_type == 6, "sliding_window": c.window < max(c.lengths),
             "streamingllm": c.streamingllm, "cross_attention": bool(c.encoder_lengths), "softcap": c.softcap > 0,
             "context_fmha_type": c.context_fmha_type != 1 and bool(c.contexts),
             "rope_table": c.position in (3, 8) or (c.position in (1, 2) and c.rope_table),
             "long_rope": c.position == 3, "yarn": c.position == 8, "logn_scaling": c.logn,
             "packed_mask": c.mask_type == 6 and c.packed_mask}
    return frozenset(name for name, on in flags.items() if on)


def _trt_problem(case: TrtCase):
    """Tensors (and the cache that is not used, None) as inputs, everything else as attributes: all by keyword."""
    args = build_trt(case)
    inputs = {n: v for n, v in args.items() if isinstance(v, np.ndarray) or n in TRT_CACHES}
    return inputs, {n: v for n, v in args.items() if n not in inputs}


def _rope_slack(case: TrtCase, inputs, attrs, cache_name):
    """(low, high) for the RoPE'd key elements of the cache (NaN elsewhere): see ROPE_SLACK."""
    cache = inputs[cache_name]
    # The rotated keys in the input dtype, before any quantization: the reference on a float cache of that dtype.
    plain = dict(copy_inputs(inputs), **{cache_name: np.zeros(cache.shape, case.dtype)})
    plain.pop("kv_orig_quant_scale", None), plain.pop("kv_quant_orig_scale", None)
    cacheattn.gpt_attention(**plain, **dict(attrs, kv_cache_quant_mode=0, use_fp8_context_fmha=False),
                            backend="reference")
    rotary = case.rotary_dim
    key_axis = 1 if cache_name == "past_key_value" else 2                    # the K/V axis of either layout
    keys = np.moveaxis(plain[cache_name], key_axis, 0)[0][..., :rotary]     # (..., rotary_embedding_dim)
    k = keys.astype(np.float64)
    partner = np.arange(rotary) ^ 1 if case.position == 1 else (np.arange(rotary) + rotary // 2) % rotary
    delta = np.spacing(np.abs(keys)).astype(np.float64) + ROPE_SLACK * np.hypot(k, k[..., partner])
    low, high = k - delta, k + delta
    if case.quant:
        inv_s = float(inputs["kv_orig_quant_scale"][0])
        low, high = (quantize_kv(x, inv_s, case.quant).astype(np.float64) for x in (low, high))
    bounds = []
    for bound in (low, high):
        full = np.full(cache.shape, np.nan)
        np.moveaxis(full, key_axis, 0)[0][..., :rotary] = bound
        bounds.append(full)
    return tuple(bounds)


def _trt_expect(case: TrtCase, inputs, attrs):
    want, _ = float64_trt({**inputs, **attrs})
    after = copy_inputs(inputs)                 # the reference's run in the input dtype; its cache after
    ref_output, _ = cacheattn.gpt_attention(**after, **attrs, backend="reference")
    where = None
    if not case.packed:                         # padded qkv: rows past an entry's new tokens are padding
        where = np.zeros(want.shape, bool)
        for e, n in enumerate(case.new):
            where[e, :n] = True
    # 4x: the reference and an implementation both round Q and K to the input dtype after bias and RoPE, so a sharp
    # softmax (q_scaling 0.5) of float16 inputs can put both 1.5 tolerances from the float64 evaluation.
    output = Expect("close", want, case.dtype, scale=4.0, where=where)
    if case.fp8_context_fmha:
        # FP8 context FMHA rounds Q, K, V (as the input dtype holds them after bias and RoPE) and the probabilities
        # to e4m3, 3 fraction bits: a Q element near an e4m3 boundary rounds one way from the dtype's value and the
        # other from float64's, and a sharp softmax turns that into output errors past 0.2 (the reference itself
        # reached 3.6x e4m3's 1/16 in bfloat16 over 2,600 draws). So these calls are held to the reference's own
        # run in the input dtype, the same roundings in the same order, at the dtype's tolerance.
        output = Expect("close", ref_output.astype(np.float64), case.dtype, scale=4.0, where=where,
                        against="the reference's run in the input dtype (FP8 context FMHA)")
    expect = {"output": output,
              "present_key_value": None}         # the cache it returns: checked against past_key_value (aliases)
    cache_name = "kv_cache_pool" if case.paged else "past_key_value"
    if case.position in (1, 2, 3, 8) and not case.streamingllm:
        expect[cache_name] = Expect("bits", after[cache_name], slack=_rope_slack(case, inputs, attrs, cache_name),
                                    why=ROPE_WHY)
    return expect


GPT_ATTENTION = Operator(
    name="gpt_attention", function=cacheattn.gpt_attention, features=TRT_FEATURES,
    dtypes=("float16", "bfloat16", "float32"), strategy=_trt_strategy, uses=_trt_uses, problem=_trt_problem,
    expect=_trt_expect, outputs=("output", "present_key_value"), in_place=TRT_CACHES,
    aliases={"present_key_value": "past_key_value"}, requires=(("contiguous", "paged"),),
    needs={"fp8_context_fmha": ("fp8_kv",), "rope_scaling": ("rope_gptj", "rope_gpt_neox"),
           "rope_table": ("rope_gptj", "rope_gpt_neox", "long_rope", "yarn"), "packed_mask": ("custom_mask",)},
    case_imports=("TrtCase",))


OPERATORS = {op.name: op for op in (MULTI_HEAD_CACHE_ATTENTION, DYNAMIC_MULTI_HEAD_ATTENTION, DYNAMIC_KEY_VALUE_CACHE,
                                    KEY_VALUE_CACHE, ONNX_ATTENTION, CROSS_ATTENTION, GPT_ATTENTION)}
