"""Bad gpt_attention input raises a ValueError/TypeError naming TensorRT-LLM's argument, before any backend runs,
and leaves the cache untouched."""

from dataclasses import replace

import numpy as np
import pytest

import cacheattn
from cacheattn.examples import TrtCase, build_trt
from kernels_numba import _launch

# Two context requests (one chunked), one generation sequence of two beams; 6 query heads over 2 KV heads.
BASE = TrtCase(contexts=((0, 3), (2, 2)), generations=((2, 4),), beam_width=2, num_heads=6, num_kv_heads=2,
               head_size=8, dtype="float32", capacity=8, window=8, num_layers=2, layer_idx=1, seed=3)
PAGED = replace(BASE, paged=True, tokens_per_block=2)
INT8 = replace(BASE, quant=64)


def call(case=BASE, **changes):
    args = build_trt(case)
    args.update(changes)
    return args


def offsets_with(value):
    table = build_trt(PAGED)["kv_cache_block_offsets"].copy()
    table[0, 1, 0, 0] = value
    return table


def indirection_with(value):
    ci = build_trt(BASE)["cache_indirection"].copy()
    ci[0, 1, 3] = value
    return ci


A = build_trt(BASE)
ROPE = dict(position_embedding_type=cacheattn.PositionEmbeddingType.rope_gpt_neox)

BAD = [
    # request order and per-entry tensors
    ("generation before context", call(host_request_types=np.array([0, 1, 0, 1], np.int32)), ValueError,
     "host_request_types"),
    ("request type 2", call(host_request_types=np.array([0, 0, 1, 2], np.int32)), ValueError, "host_request_types"),
    ("sequence_length not past + new", call(sequence_length=A["sequence_length"] + 1), ValueError, "sequence_length"),
    ("sequence_length shape", call(sequence_length=A["sequence_length"][:3]), ValueError, "sequence_length"),
    ("sequence_length float", call(sequence_length=A["sequence_length"].astype(np.float32)), TypeError,
     "sequence_length"),
    ("negative past", call(host_past_key_value_lengths=np.array([-1, 2, 4, 4], np.int32),
                           sequence_length=np.array([2, 4, 5, 5], np.int32)), ValueError,
     "host_past_key_value_lengths"),
    ("generation prompt not cached", call(context_lengths=np.array([3, 2, 5, 5], np.int32)), ValueError,
     "context_lengths"),
    ("host_context_lengths differ", call(host_context_lengths=np.array([3, 2, 1, 2], np.int32)), ValueError,
     "host_context_lengths"),
    ("max_context_length too small", call(max_context_length=2), ValueError, "max_context_length"),
    # qkv and heads
    ("qkv tokens", call(qkv=A["qkv"][:-1]), ValueError, "qkv"),
    ("qkv hidden", call(qkv=A["qkv"][:, :-8]), ValueError, "qkv"),
    ("qkv integer", call(qkv=A["qkv"].astype(np.int32)), TypeError, "qkv"),
    ("qkv padded rank", call(remove_input_padding=False), ValueError, "qkv"),
    ("heads not dividing", call(num_kv_heads=4), ValueError, "num_kv_heads"),
    ("head size 0", call(hidden_size_per_head=0), ValueError, "hidden_size_per_head"),
    ("qkv_bias shape", call(qkv_bias=np.zeros(7, np.float32)), ValueError, "qkv_bias"),
    ("qkv_bias dtype", call(qkv_bias=np.zeros(80, np.float16)), TypeError, "qkv_bias"),
    # caches
    ("cache dtype", call(past_key_value=A["past_key_value"].astype(np.float16)), TypeError, "past_key_value"),
    ("cache heads", call(past_key_value=A["past_key_value"][:, :, :1]), ValueError, "past_key_value"),
    ("cache too short", call(past_key_value=A["past_key_value"][:, :, :, :4]), ValueError, "past_key_value"),
    ("cache rows", call(past_key_value=A["past_key_value"][:3]), ValueError, "past_key_value"),
    ("no contiguous cache", call(past_key_value=None), ValueError, "past_key_value"),
    ("tokens_per_block 3", call(PAGED, tokens_per_block=3), ValueError, "tokens_per_block"),
    ("block offset outside the pool", call(PAGED, kv_cache_block_offsets=offsets_with(10_000)), ValueError,
     "kv_cache_block_offsets"),
    ("negative block offset", call(PAGED, kv_cache_block_offsets=offsets_with(-3)), ValueError,
     "kv_cache_block_offsets"),
    ("too few blocks", call(PAGED, kv_cache_block_offsets=build_trt(PAGED)["kv_cache_block_offsets"][..., :2]),
     ValueError, "kv_cache_block_offsets"),
    ("no pool", call(PAGED, kv_cache_pool=None), ValueError, "kv_cache_pool"),
    ("pool block size", call(PAGED, tokens_per_block=4), ValueError, "kv_cache_pool"),
    ("layer outside the pool", call(PAGED, layer_idx=2, host_max_attention_window_sizes=np.full(3, 8, np.int32)),
     ValueError, "layer_idx"),
    # window and capacity
    ("longer than a non-cyclic cache", call(host_max_attention_window_sizes=np.full(2, 9, np.int32),
                                            cache_indirection=A["cache_indirection"][..., :4]), ValueError,
     "sequence_length"),
    ("beam search past the window", call(host_max_attention_window_sizes=np.full(2, 4, np.int32)), ValueError,
     "host_max_attention_window_sizes"),
    ("no window", call(host_max_attention_window_sizes=np.zeros(0, np.int32)), ValueError,
     "host_max_attention_window_sizes"),
    ("padded cross_kv short", call(remove_input_padding=False, qkv=np.zeros((4, 3, 80), np.float32),
                                   do_cross_attention=True, encoder_input_lengths=np.full(4, 3, np.int32),
                                   cross_kv=np.zeros((4, 2, 32), np.float32)), ValueError, "cross_kv"),
    ("sinks without streamingllm", call(host_sink_token_length=np.array([1], np.int32)), ValueError,
     "host_sink_token_length"),
    ("streamingllm chunked context", call(streamingllm=True), ValueError, "host_past_key_value_lengths"),
    # beams
    ("indirection value = beam width", call(cache_indirection=indirection_with(2)), ValueError, "cache_indirection"),
    ("indirection negative", call(cache_indirection=indirection_with(-1)), ValueError, "cache_indirection"),
    ("indirection rank", call(cache_indirection=A["cache_indirection"][0]), ValueError, "cache_indirection"),
    ("beam width not dividing", call(cache_indirection=np.zeros((1, 3, 8), np.int32)), ValueError,
     "cache_indirection"),
    # quantized caches
    ("int8 without scale", call(INT8, kv_orig_quant_scale=None), ValueError, "kv_orig_quant_scale"),
    ("int8 zero scale", call(INT8, kv_quant_orig_scale=np.array([0.0], np.float32)), ValueError,
     "kv_quant_orig_scale"),
    ("int8 negative scale", call(INT8, kv_orig_quant_scale=np.array([-2.0], np.float32)), ValueError,
     "kv_orig_quant_scale"),
    ("int8 cache holding floats", call(INT8, past_key_value=A["past_key_value"]), TypeError, "past_key_value"),
    ("quant mode int8 + fp8", call(kv_cache_quant_mode=64 | 128), ValueError, "kv_cache_quant_mode"),
    ("fp8 fmha without fp8 cache", call(use_fp8_context_fmha=True), ValueError, "use_fp8_context_fmha"),
    # RoPE
    ("odd rotary dim", call(rotary_embedding_dim=5, **ROPE), ValueError, "rotary_embedding_dim"),
    ("rotary dim > head size", call(rotary_embedding_dim=10, **ROPE), ValueError, "rotary_embedding_dim"),
    ("rope without a dim", call(**ROPE), ValueError, "rotary_embedding_dim"),
    ("rotary dim without rope", call(rotary_embedding_dim=4), ValueError, "rotary_embedding_dim"),
    ("rotary_inv_freq shape", call(rotary_embedding_dim=4, rotary_inv_freq=np.ones(3, np.float32), **ROPE),
     ValueError, "rotary_inv_freq"),
    ("llama3 without frequencies", call(rotary_embedding_dim=4, rotary_embedding_scale_type=4, **ROPE), ValueError,
     "rotary_inv_freq"),
    ("dynamic scaling of 2 dims", call(rotary_embedding_dim=2, rotary_embedding_scale_type=2, **ROPE), ValueError,
     "rotary_embedding_dim"),
    ("yarn scaling without its tables", call(rotary_embedding_dim=4, rotary_embedding_scale_type=5, **ROPE),
     ValueError, "rotary_inv_freq"),
    ("mrope", call(position_embedding_type=9), ValueError, "position_embedding_type"),
    # ALiBi, relative bias
    ("alibi without slopes", call(position_embedding_type=4), ValueError, "alibi_slopes"),
    ("slopes without alibi", call(alibi_slopes=np.ones(6, np.float32)), ValueError, "alibi_slopes"),
    ("slopes shape", call(position_embedding_type=5, alibi_slopes=np.ones(4, np.float32)), ValueError,
     "alibi_slopes"),
    ("relative without bias", call(position_embedding_type=6), ValueError, "relative_attention_bias"),
    ("relative table too small", call(position_embedding_type=6, relative_attention_bias=np.zeros((6, 4, 4),
                                                                                                np.float32)),
     ValueError, "relative_attention_bias"),
    ("t5 buckets vs max_distance", call(position_embedding_type=6, max_distance=3,
                                        relative_attention_bias=np.zeros((6, 8), np.float32)), ValueError,
     "relative_attention_bias"),
    # masks
    ("blocksparse", call(mask_type=cacheattn.AttentionMaskType.blocksparse), ValueError, "mask_type"),
    ("bidirectionalglm", call(mask_type=4), ValueError, "mask_type"),
    ("mask type 7", call(mask_type=7), ValueError, "mask_type"),
    ("custom without mask", call(mask_type=6), ValueError, "attention_mask"),
    ("mask without custom", call(attention_mask=np.ones((7, 6), bool)), ValueError, "attention_mask"),
    ("custom mask float", call(mask_type=6, attention_mask=np.ones((7, 6), np.float32)), TypeError, "attention_mask"),
    ("custom mask short", call(mask_type=6, attention_mask=np.ones((7, 4), bool)), ValueError, "attention_mask"),
    # scalars and plugin settings
    ("q_scaling 0", call(q_scaling=0.0), ValueError, "q_scaling"),
    ("negative softcap", call(attn_logit_softcapping_scale=-1.0), ValueError, "attn_logit_softcapping_scale"),
    ("context_fmha_type 3", call(context_fmha_type=3), ValueError, "context_fmha_type"),
    ("layer_idx float", call(layer_idx=1.0), TypeError, "layer_idx"),
    # cross attention
    ("cross without encoder lengths", call(do_cross_attention=True), ValueError, "encoder_input_lengths"),
    ("cross without cross_kv", call(do_cross_attention=True, encoder_input_lengths=np.full(4, 3, np.int32)),
     ValueError, "cross_kv"),
    ("cross_kv shape", call(do_cross_attention=True, encoder_input_lengths=np.full(4, 3, np.int32),
                            cross_kv=np.zeros((5, 32), np.float32)), ValueError, "cross_kv"),
    ("cross with rope", call(do_cross_attention=True, encoder_input_lengths=np.full(4, 3, np.int32),
                             cross_kv=np.zeros((6, 32), np.float32), rotary_embedding_dim=4, **ROPE), ValueError,
     "position_embedding_type"),
    ("cross_kv_length short", call(do_cross_attention=True, encoder_input_lengths=np.full(4, 3, np.int32),
                                   cross_kv=np.zeros((6, 32), np.float32), cross_kv_length=2), ValueError,
     "cross_kv_length"),
    ("use_cache off with generation", call(use_cache=False), ValueError, "use_cache"),
    ("encoder length 0", call(do_cross_attention=True, encoder_input_lengths=np.array([3, 0, 3, 3], np.int32),
                              cross_kv=np.zeros((3, 32), np.float32)), ValueError, "encoder_input_lengths"),
    ("sinks shape", call(host_sink_token_length=np.zeros(2, np.int32)), ValueError, "host_sink_token_length"),
    ("window not above the sinks", call(streamingllm=True, host_sink_token_length=np.array([8], np.int32),
                                        host_past_key_value_lengths=np.array([0, 0, 4, 4], np.int32),
                                        sequence_length=np.array([3, 2, 5, 5], np.int32)), ValueError,
     "host_sink_token_length"),
    ("negative sinks", call(host_sink_token_length=np.array([-1], np.int32)), ValueError, "host_sink_token_length"),
    ("quant mode as a string", call(kv_cache_quant_mode="int8"), ValueError, "kv_cache_quant_mode"),
    ("rotary base 0", call(rotary_embedding_dim=4, rotary_embedding_base=0.0, **ROPE), ValueError,
     "rotary_embedding_base"),
    ("host block table differs", call(PAGED, host_kv_cache_block_offsets=offsets_with(0)), ValueError,
     "host_kv_cache_block_offsets"),
    # the kernels' block size (plugin config), checked whichever backend runs
    ("threads not whole warps", call(threads=48), ValueError, "threads"),
    ("threads past 1024", call(threads=2048), ValueError, "threads"),
    ("threads 0", call(threads=0), ValueError, "threads"),
    ("threads float", call(threads=64.0), TypeError, "threads"),
]


def _cache_of(args):
    return args["kv_cache_pool"] if args.get("kv_cache_pool") is not None else args["past_key_value"]


@pytest.mark.spec("trtllm/inflight-order", "trtllm/mha-mqa-gqa", "trtllm/packed-qkv-shape", "trtllm/padded-qkv-shape",
                  "trtllm/contiguous-shape", "trtllm/paged-blocks", "trtllm/cache-indirection",
                  "trtllm/quant-inverse-scale", "trtllm/generation-beam-tokens", "trtllm/window-repeat")
@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("name,args,error,param", BAD, ids=[b[0] for b in BAD])
def test_bad_gpt_attention_input(name, args, error, param, backend):
    cache = _cache_of(args)
    before = None if cache is None else cache.copy()
    with _launch.recorded_launches() as launches, pytest.raises(error, match=rf"^{param}\b"):
        cacheattn.gpt_attention(**args, backend=backend)
    assert launches == []
    if cache is not None:
        assert before.tobytes() == cache.tobytes(), f"{name}: the refused call changed the cache"


@pytest.mark.parametrize("case", [BASE, PAGED, INT8], ids=["contiguous", "paged", "int8"])
def test_the_base_calls_are_valid(case):
    args = build_trt(case)
    cache = _cache_of(args).copy()
    output, present = cacheattn.gpt_attention(**args)
    assert output.shape == (sum(case.new), 6 * 8) and np.isfinite(output).all()
    assert (present is None) == case.paged
    assert cache.tobytes() != _cache_of(args).tobytes()          # the call wrote its new tokens


def test_enums_keep_tensorrt_llm_values():
    assert [m.value for m in cacheattn.AttentionMaskType] == list(range(7))
    assert cacheattn.PositionEmbeddingType.rope_gpt_neox == 2 and cacheattn.PositionEmbeddingType.alibi == 4
    assert cacheattn.RotaryScalingType.llama3 == 4 and cacheattn.RequestType.generation == 1
    assert cacheattn.QuantMode.INT8_KV_CACHE == 64 and cacheattn.QuantMode.FP8_KV_CACHE == 128


class FakeDeviceArray:
    """Looks like a GPU array to the dispatcher (CUDA array interface), holds a NumPy array for the checks."""

    def __init__(self, host):
        self.host, self.shape, self.dtype, self.ndim = host, host.shape, host.dtype, host.ndim
        self.__cuda_array_interface__ = {"shape": host.shape, "typestr": host.dtype.str, "data": (0, False),
                                         "version": 3}


def test_gpu_arrays_are_validated_before_any_kernel():
    args = call(qkv=FakeDeviceArray(A["qkv"]), past_key_value=FakeDeviceArray(A["past_key_value"]))
    with _launch.recorded_launches() as launches, pytest.raises(ValueError, match="^num_kv_heads"):
        cacheattn.gpt_attention(**dict(args, num_kv_heads=4))
    assert launches == []


def test_without_a_cache_whole_contexts_run_and_nothing_is_returned():
    case = replace(BASE, contexts=((0, 3), (0, 2)), generations=())
    args = build_trt(case)
    with_cache, _ = cacheattn.gpt_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v)
                                               for k, v in args.items()})
    output, present = cacheattn.gpt_attention(**dict(args, use_cache=False, past_key_value=None))
    assert present is None
    assert np.array_equal(output, with_cache)


FLOAT64 = replace(BASE, dtype="float64")
BAD_LAUNCH = [
    ("rung 2", BASE, dict(rung=2), ValueError, "rung"),
    ("rung 5", BASE, dict(rung=5), ValueError, "rung"),
    ("rung float", BASE, dict(rung=3.0), ValueError, "rung"),
    ("rung 3 on float64", FLOAT64, dict(rung=3), ValueError, "rung"),
    ("rung 4 on float64", FLOAT64, dict(rung=4, num_splits=2), ValueError, "rung"),
    ("num_splits with rung 3", BASE, dict(rung=3, num_splits=2), ValueError, "num_splits"),
    ("num_splits 0", BASE, dict(num_splits=0), ValueError, "num_splits"),
    ("num_splits 65", BASE, dict(rung=4, num_splits=65), ValueError, "num_splits"),
    ("num_splits float", BASE, dict(rung=1, num_splits=2.0), TypeError, "num_splits"),
]


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("name,case,launch,error,param", BAD_LAUNCH, ids=[b[0] for b in BAD_LAUNCH])
def test_bad_kernel_choice(name, case, launch, error, param, backend):
    """rung and num_splits (the kernels' choice, as OpenPPL's) are checked on either backend, before any kernel."""
    args = build_trt(case)
    before = _cache_of(args).copy()
    with _launch.recorded_launches() as launches, pytest.raises(error, match=rf"^{param}\b"):
        cacheattn.gpt_attention(**args, backend=backend, **launch)
    assert launches == [] and before.tobytes() == _cache_of(args).tobytes()
