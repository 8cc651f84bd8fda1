"""Bad gpt_attention input raises a ValueError/TypeError naming TensorRT-LLM's argument, before any backend runs,
and leaves the cache untouched."""

import inspect
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheattn
from cacheattn import trtllm
from cacheattn.examples import TrtCase, build_trt, copy_inputs
from kernels_numba import _launch

from strategies import REFERENCE, trt_cases

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
# BASE with each float table gpt_attention takes
TABLES = {"logn_scaling": replace(BASE, logn=True), "alibi_slopes": replace(BASE, position=4),
          "relative_attention_bias": replace(BASE, position=6, relative="regular"),
          "rotary_cos_sin": replace(BASE, position=2, rotary_dim=8, rope_table=True),
          "rotary_inv_freq": replace(BASE, position=2, rotary_dim=8, rope_table=True)}


def table_with(name, index, value):
    """The call of TABLES[name] with entry `index` of its table `name` set to value."""
    args = build_trt(TABLES[name])
    table = args[name].copy()
    table[index] = value
    return dict(args, **{name: table})

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
    # a window of no token is the window's fault, not the sinks' (0 sinks are never fewer than a window of 0)
    ("window 0", call(host_max_attention_window_sizes=np.zeros(2, np.int32)), ValueError,
     "host_max_attention_window_sizes"),
    ("negative window of this layer", call(host_max_attention_window_sizes=np.array([8, -4], np.int32)), ValueError,
     "host_max_attention_window_sizes"),
    ("window 0 of another layer", call(host_max_attention_window_sizes=np.array([0, 8], np.int32)), ValueError,
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
    ("q_scaling infinite", call(q_scaling=np.inf), ValueError, "q_scaling"),
    ("q_scaling a string", call(q_scaling="1"), TypeError, "q_scaling"),
    ("negative softcap", call(attn_logit_softcapping_scale=-1.0), ValueError, "attn_logit_softcapping_scale"),
    ("softcap NaN", call(attn_logit_softcapping_scale=np.nan), ValueError, "attn_logit_softcapping_scale"),
    ("softcap infinite", call(attn_logit_softcapping_scale=np.inf), ValueError, "attn_logit_softcapping_scale"),
    # float attributes and tables: finite, in range
    ("rotary base infinite", call(rotary_embedding_dim=4, rotary_embedding_base=np.inf, **ROPE), ValueError,
     "rotary_embedding_base"),
    ("rotary scale NaN", call(rotary_embedding_dim=4, rotary_embedding_scale=np.nan, **ROPE), ValueError,
     "rotary_embedding_scale"),
    ("rotary scale 0 without RoPE", call(rotary_embedding_scale=0.0), ValueError, "rotary_embedding_scale"),
    ("short m-scale NaN", call(rotary_embedding_short_m_scale=np.nan), ValueError, "rotary_embedding_short_m_scale"),
    ("long m-scale negative", call(rotary_embedding_long_m_scale=-1.0), ValueError, "rotary_embedding_long_m_scale"),
    ("logn_scaling NaN", table_with("logn_scaling", -1, np.nan), ValueError, "logn_scaling"),
    ("logn_scaling infinite", table_with("logn_scaling", 2, np.inf), ValueError, "logn_scaling"),
    ("logn_scaling 0", table_with("logn_scaling", 0, 0.0), ValueError, "logn_scaling"),
    ("logn_scaling negative", table_with("logn_scaling", 4, -1.0), ValueError, "logn_scaling"),
    ("alibi slope NaN", table_with("alibi_slopes", 3, np.nan), ValueError, "alibi_slopes"),
    # -inf hides a key (a mask written into the bias, which callers use); NaN and +inf have no meaning.
    ("relative bias +inf", table_with("relative_attention_bias", (1, 2, 0), np.inf), ValueError,
     "relative_attention_bias"),
    ("relative bias NaN", table_with("relative_attention_bias", (1, 2, 0), np.nan), ValueError,
     "relative_attention_bias"),
    ("cos/sin table NaN", table_with("rotary_cos_sin", (0, 9), np.nan), ValueError, "rotary_cos_sin"),
    ("inverse frequency infinite", table_with("rotary_inv_freq", 1, np.inf), ValueError, "rotary_inv_freq"),
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


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_table_calls_are_valid(name):
    """The float-table rows above start from valid calls: the table as built is accepted."""
    args = build_trt(TABLES[name])
    assert args[name] is not None
    output, _ = cacheattn.gpt_attention(**args)
    assert np.isfinite(output).all()


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_a_nan_logn_factor_is_refused_naming_it_and_its_entry(backend):
    """A NaN factor at the last position of logn_scaling would reach that token's query and every output it
    touches; it is refused naming logn_scaling and the entry, before any kernel, the cache untouched."""
    args = table_with("logn_scaling", -1, np.nan)
    cache = args["past_key_value"].copy()
    last = args["logn_scaling"].shape[0] - 1
    with _launch.recorded_launches() as launches, pytest.raises(
            ValueError, match=rf"^logn_scaling: expected finite entries > 0, got nan at flat index {last}$"):
        cacheattn.gpt_attention(**args, backend=backend)
    assert launches == [] and args["past_key_value"].tobytes() == cache.tobytes()


def test_a_device_table_is_checked_through_a_host_copy_without_cupy(monkeypatch):
    """A GPU table (here a stand-in with the CUDA array interface) is checked too; without CuPy to reduce it on
    the device, through a host copy."""
    monkeypatch.setitem(sys.modules, "cupy", None)                       # `import cupy` raises ImportError

    class Table(FakeDeviceArray):
        def copy_to_host(self):
            return self.host

    index, value = trtllm._first_bad_entry(Table(np.array([1.0, 2.0, np.nan, -1.0], np.float32)), "finite")
    assert index == 2 and np.isnan(value)
    assert trtllm._first_bad_entry(Table(np.array([1.0, 2.0, -1.0], np.float32)), "positive") == (2, -1.0)
    assert trtllm._first_bad_entry(Table(np.array([1.0, 2.0], np.float32)), "positive") is None


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


# ---- An argument the call would not read, given another argument's setting: refused, naming both ----------------

P = build_trt(PAGED)
WHOLE = replace(BASE, contexts=((0, 3), (0, 2)), generations=())          # use_cache=False takes whole contexts
RAMP = np.linspace(0.5, 0.01, 4).astype(np.float32)                      # frequencies for 8 rotary dims

UNREAD = [
    # (id, arguments, the argument refused, the argument whose setting leaves it unread)
    ("pool with a contiguous cache", call(kv_cache_pool=P["kv_cache_pool"]), "kv_cache_pool", "paged_kv_cache"),
    ("block table with a contiguous cache", call(kv_cache_block_offsets=P["kv_cache_block_offsets"]),
     "kv_cache_block_offsets", "paged_kv_cache"),
    ("host block table with a contiguous cache", call(host_kv_cache_block_offsets=P["kv_cache_block_offsets"]),
     "host_kv_cache_block_offsets", "paged_kv_cache"),
    ("pool mapping with a contiguous cache", call(host_kv_cache_pool_mapping=np.array([[0, 0], [0, 1]], np.int32)),
     "host_kv_cache_pool_mapping", "paged_kv_cache"),
    ("past_key_value with a paged cache", call(PAGED, past_key_value=A["past_key_value"]), "past_key_value",
     "paged_kv_cache"),
    ("past_key_value without a cache", call(WHOLE, use_cache=False), "past_key_value", "use_cache"),
    ("pool without a cache", call(replace(WHOLE, paged=True, tokens_per_block=2), use_cache=False), "kv_cache_pool",
     "use_cache"),
    ("quantization scale with a float cache", call(kv_orig_quant_scale=np.array([25.0], np.float32)),
     "kv_orig_quant_scale", "kv_cache_quant_mode"),
    ("dequantization scale with a float cache", call(kv_quant_orig_scale=np.array([0.04], np.float32)),
     "kv_quant_orig_scale", "kv_cache_quant_mode"),
    ("RoPE frequencies without RoPE", call(rotary_inv_freq=RAMP), "rotary_inv_freq", "position_embedding_type"),
    ("RoPE frequencies with ALiBi", call(rotary_inv_freq=RAMP, position_embedding_type=4,
                                         alibi_slopes=np.linspace(0.5, 0.1, 6).astype(np.float32)),
     "rotary_inv_freq", "position_embedding_type"),
]


def _caches(args):
    """Every cache array a call was given, copied: a refused call must leave each one as it was."""
    return {k: args[k].copy() for k in ("past_key_value", "kv_cache_pool") if args.get(k) is not None}


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("name,args,param,setting", UNREAD, ids=[u[0] for u in UNREAD])
def test_an_argument_the_call_would_not_read_is_refused_naming_both(name, args, param, setting, backend):
    before = _caches(args)
    with _launch.recorded_launches() as launches, pytest.raises(ValueError, match=rf"^{param}: .*\b{setting}\b"):
        cacheattn.gpt_attention(**args, backend=backend)
    assert launches == []
    for k, x in before.items():
        assert x.tobytes() == args[k].tobytes(), f"{name}: the refused call changed {k}"


def _unread_breaks(case, args, rng):
    """(argument, value, the setting named with it) that this valid call would not read."""
    Hkv, Dh = case.num_kv_heads, case.head_size
    like = args["kv_cache_pool"] if case.paged else args["past_key_value"]
    breaks = []
    if case.paged:
        row_cache = rng.standard_normal((case.entries, 2, Hkv, case.capacity, Dh)).astype(like.dtype)
        breaks.append(("past_key_value", row_cache, "paged_kv_cache"))
    else:
        pool = rng.standard_normal((3, case.num_layers, 2, Hkv, case.tokens_per_block, Dh)).astype(like.dtype)
        offsets = rng.permutation(6)[None, None, :].reshape(1, 1, 2, 3).repeat(case.entries, axis=1)
        breaks += [("kv_cache_pool", pool, "paged_kv_cache"),
                   ("kv_cache_block_offsets", offsets.astype(np.int32), "paged_kv_cache")]
    if not case.quant:
        breaks += [("kv_orig_quant_scale", np.array([rng.uniform(10, 50)], np.float32), "kv_cache_quant_mode"),
                   ("kv_quant_orig_scale", np.array([rng.uniform(0.02, 0.1)], np.float32), "kv_cache_quant_mode")]
    if case.position not in (1, 2, 3, 8):
        freq = rng.uniform(0.01, 1.0, max(case.rotary_dim, 8) // 2).astype(np.float32)
        breaks.append(("rotary_inv_freq", freq, "position_embedding_type"))
    return breaks


@settings(max_examples=max(REFERENCE // 3, 10))
@given(case=trt_cases(), backend=st.sampled_from(["reference", "numba"]), data=st.data())
def test_a_drawn_call_given_an_argument_it_would_not_read_is_refused(case, backend, data):
    """A drawn valid call (it runs on the reference) given one argument its settings leave unread is refused,
    naming the argument and the setting, before any kernel; every cache stays bit-identical."""
    args = build_trt(case)
    output, _ = cacheattn.gpt_attention(**copy_inputs(args), backend="reference")
    assert np.isfinite(output).all()
    breaks = _unread_breaks(case, args, np.random.default_rng(case.seed))
    name, value, setting = data.draw(st.sampled_from(breaks), label="unread argument")
    broken = dict(args, **{name: value})
    before = _caches(broken)
    with _launch.recorded_launches() as launches, pytest.raises(ValueError, match=rf"^{name}: .*\b{setting}\b"):
        cacheattn.gpt_attention(**broken, backend=backend)
    assert launches == []
    for k, x in before.items():
        assert x.tobytes() == broken[k].tobytes(), f"the refused call changed {k}"


def test_what_tensorrt_llm_passes_to_every_layer_is_accepted():
    """TensorRT-LLM's layers pass some tensors whatever the settings: encoder_input_lengths and cross_kv_length to
    a decoder's self attention, cache_indirection with one beam. Given with a self-attention call they change
    nothing."""
    args = build_trt(replace(BASE, beam_width=1))
    plain, _ = cacheattn.gpt_attention(**copy_inputs(args))
    given, _ = cacheattn.gpt_attention(**copy_inputs(args), encoder_input_lengths=np.full(3, 5, np.int32),
                                       cross_kv_length=5)
    assert np.array_equal(given, plain)
    assert args["cache_indirection"].shape[1] == 1 and not args["cache_indirection"].any()


# ---- The attention window: checked first, resolved once for both backends ---------------------------------------

@pytest.mark.parametrize("sinks,streamingllm", [(0, False), (1, True)])
def test_a_window_of_no_token_names_the_window_not_the_sinks(sinks, streamingllm):
    args = call(WHOLE, host_max_attention_window_sizes=np.array([8, 0], np.int32), streamingllm=streamingllm,
                host_sink_token_length=np.array([sinks], np.int32))
    with pytest.raises(ValueError, match=r"^host_max_attention_window_sizes: expected windows >= 1 token, got 0 at "
                                         r"entry 1 \(layer 1's window\)$"):
        cacheattn.gpt_attention(**args)


def _all_arguments(args):
    """gpt_attention's keyword arguments with its defaults filled in, as validate() receives them."""
    defaults = {k: p.default for k, p in inspect.signature(cacheattn.gpt_attention).parameters.items()
                if p.default is not inspect.Parameter.empty and k not in ("backend", "threads")}
    return {**defaults, **args}


@pytest.mark.parametrize("windows,layer_idx,want", [([5], 1, 5), ([8, 5], 1, 5), ([8, 5, 6], 4, 5), ([6, 8], 0, 6)])
def test_validation_hands_both_backends_the_layers_window_once(windows, layer_idx, want):
    """The list repeats over the layers when shorter: layer l reads entry l % len. Validation resolves it once and
    hands the reference and the kernels that single window."""
    args = call(host_max_attention_window_sizes=np.array(windows, np.int32), layer_idx=layer_idx)
    checked = trtllm.validate(_all_arguments(args))
    assert checked["host_max_attention_window_sizes"].tolist() == [want]
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


# ---- Errors that point at the mistake: the plan's arguments, a cache of another dtype than qkv -------------------

def _split(args):
    """(the step's arguments, the layer's) of a gpt_attention call."""
    return ({k: v for k, v in args.items() if k not in trtllm.LAYER_INPUTS},
            {k: v for k, v in args.items() if k in trtllm.LAYER_INPUTS})


@pytest.mark.parametrize("name", ["past_key_value", "qkv", "layer_idx", "backend"])
def test_a_per_layer_argument_given_to_the_plan_names_the_plan_and_sends_it_to_run(name):
    step, layer = _split(build_trt(BASE))
    value = dict(layer, backend="reference")[name]
    before = {k: v.copy() for k, v in {**step, **layer}.items() if isinstance(v, np.ndarray)}
    with pytest.raises(TypeError, match=rf"^{name}: expected in plan\.run\(\.\.\.\), got in plan_gpt_attention: it "
                                        rf"is per layer.*pass it to plan\.run\({name}=\.\.\.\) for each layer$"):
        cacheattn.plan_gpt_attention(**step, **{name: value})
    assert all(x.tobytes() == {**step, **layer}[k].tobytes() for k, x in before.items())


@pytest.mark.parametrize("name,close", [("num_kv_head", "num_kv_heads"), ("past_key_values", "past_key_value "
                                                                           r"\(per layer: plan\.run\)"),
                                        ("banana", None)])
def test_an_unknown_argument_of_the_plan_names_the_plan_and_the_close_names(name, close):
    step, _ = _split(build_trt(BASE))
    hint = rf"; did you mean {close}( or [^?]*)?\?$" if close else "$"
    with pytest.raises(TypeError, match=rf"^{name}: expected an argument of plan_gpt_attention, got an unknown "
                                        rf"name{hint}"):
        cacheattn.plan_gpt_attention(**step, **{name: 1})


def test_a_missing_argument_of_the_plan_names_the_plan_and_what_to_pass():
    step, _ = _split(build_trt(BASE))
    del step["num_kv_heads"], step["q_scaling"]
    with pytest.raises(TypeError, match=r"^num_kv_heads: expected a value, got none: plan_gpt_attention requires it "
                                        r"\(also missing: q_scaling\); pass num_kv_heads=\.\.\.$"):
        cacheattn.plan_gpt_attention(**step)


DTYPE_DISAGREEMENTS = [
    # (id, case, the layer's changes, the argument named, the rest of the message)
    ("float64 qkv, float32 pool", PAGED, lambda a: dict(qkv=a["qkv"].astype(np.float64)), "kv_cache_pool",
     r"expected qkv's dtype float64 \(with kv_cache_quant_mode 0 the cache holds qkv's dtype\), got float32: the "
     r"call follows qkv; pass both as float32 or both as float64$"),
    ("float16 contiguous cache", BASE, lambda a: dict(past_key_value=a["past_key_value"].astype(np.float16)),
     "past_key_value", r"expected qkv's dtype float32 .*, got float16: the call follows qkv; pass both as float16 "
                       r"or both as float32$"),
    ("int8 cache without quantization", BASE, lambda a: dict(past_key_value=a["past_key_value"].astype(np.int8)),
     "past_key_value", r"expected qkv's dtype float32 with kv_cache_quant_mode 0 .*, got int8: int8 holds quantized "
                       r"codes; pass kv_cache_quant_mode=INT8_KV_CACHE \(64\) with its KV scales, or a float32 cache$"),
    ("float cache with INT8_KV_CACHE", INT8, lambda a: dict(past_key_value=a["past_key_value"].astype(np.float32)),
     "past_key_value", r"expected int8 codes for kv_cache_quant_mode INT8_KV_CACHE \(64\), got float32: pass the "
                       r"cache as int8, or kv_cache_quant_mode=0 for a cache of qkv's dtype \(float32\)$"),
    ("float16 qkv_bias", BASE, lambda a: dict(qkv_bias=np.ones(a["qkv"].shape[-1], np.float16)), "qkv_bias",
     r"expected qkv's dtype float32, got float16: the call follows qkv; pass both as float16 or both as float32$"),
]


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("how", ["one call", "plan"])
@pytest.mark.parametrize("name,case,change,param,rest", DTYPE_DISAGREEMENTS, ids=[d[0] for d in DTYPE_DISAGREEMENTS])
def test_a_dtype_disagreement_names_both_arrays_and_how_to_agree(name, case, change, param, rest, how, backend):
    """The cache (or a table) whose dtype is not qkv's is named with qkv and both ways out, not only "convert the
    cache"; on either backend, through the plan as through the one call, before any kernel, every array
    bit-identical afterwards."""
    args = build_trt(case)
    args.update(change(args))
    before = {k: v.copy() for k, v in args.items() if isinstance(v, np.ndarray)}
    step, layer = _split(args)
    with _launch.recorded_launches() as launches, pytest.raises(TypeError, match=rf"^{param}: {rest}"):
        if how == "plan":
            cacheattn.plan_gpt_attention(**step).run(**layer, backend=backend)
        else:
            cacheattn.gpt_attention(**args, backend=backend)
    assert launches == []
    for k, x in before.items():
        assert x.dtype == args[k].dtype and x.tobytes() == args[k].tobytes(), f"the refused call changed {k}"


def test_the_plan_prints_each_phases_choice():
    """Before a kernel runs the plan says the choice is to come, and why; after a layer on the kernels, one line per
    phase with the rung, the split count and the reason, as the launches ran (rung 5's context kernel on float16,
    rung 1's tiles otherwise; the generation's vector kernel, rung 4 as asked)."""
    f16 = replace(BASE, dtype="float16")
    step, layer = _split(build_trt(f16))
    plan = cacheattn.plan_gpt_attention(**step)
    text = repr(plan)
    assert text.splitlines()[0] == ("GptAttentionPlan(4 entries: 2 context, 2 generation; 6 heads over 2 kv heads, "
                                    "head size 8; kernel keywords rung=None, num_splits=None, threads=128)")
    assert [line.split(":")[0] for line in text.splitlines()[1:]] == ["  context", "  generation"]
    assert all("not chosen yet" in line for line in text.splitlines()[1:])
    with _launch.recorded_launches() as launches:
        plan.run(**layer, backend="numba")
    context, generation = repr(plan).splitlines()[1:]
    assert context.startswith("  context (float16 qkv (7, 80), window 8): rung 5, 1 split: tensor cores")
    assert generation.startswith("  generation (float16 qkv (7, 80), window 8): rung 3, 1 split: vector loads: ")
    assert "head_dim 8 is not one of" in generation             # rung 5's decode kernel takes head sizes 32 to 128
    names = [kernel.py_func.__name__ for kernel, _ in launches]
    assert any("mma" in n for n in names) and not any("combine" in n for n in names)

    step, layer = _split(build_trt(BASE))
    plan = cacheattn.plan_gpt_attention(**step, rung=4, num_splits=2)
    plan.run(**layer, backend="numba")
    context, generation = repr(plan).splitlines()[1:]
    assert context.startswith("  context (float32 qkv (7, 80), window 8): rung 1, 1 split: fallback to shared-memory "
                              "tiles: rung 5 takes a float16 query, got float32")
    assert generation == "  generation (float32 qkv (7, 80), window 8): rung 4, 2 splits: vector loads: rung=4 asked " \
                         "for; its keys split 2 ways (multi-block)"


# ---- bfloat16: mixed with float16, and below sm_80 -------------------------------------------------------------------

BF16 = replace(BASE, dtype="bfloat16", qkv_bias=True)


def test_mixed_float16_and_bfloat16_names_both():
    """A float16 qkv_bias beside a bfloat16 qkv: a TypeError naming qkv_bias and qkv."""
    args = build_trt(BF16)
    args["qkv_bias"] = args["qkv_bias"].astype(np.float16)
    for backend in ("reference", "numba"):
        with pytest.raises(TypeError, match=r"^qkv_bias: expected qkv's dtype bfloat16, got float16"):
            cacheattn.gpt_attention(**args, backend=backend)


def test_bfloat16_below_sm_80_is_refused(monkeypatch):
    """On a GPU older than sm_80 (faked) a bfloat16 call names qkv and the architecture before any launch."""
    import cacheattn._arrays as arrays
    monkeypatch.setattr(arrays, "compute_capability", lambda: (7, 0))
    with _launch.recorded_launches() as launches:
        with pytest.raises(TypeError, match=r"^qkv: bfloat16 on the kernels needs a GPU of compute capability 8.0 "
                                            r"\(sm_80\) or newer, this one is 7.0 \(sm_70\)"):
            cacheattn.gpt_attention(**build_trt(BF16), backend="numba")
        assert not launches
        monkeypatch.setattr(arrays, "compute_capability", lambda: (9, 0))
        cacheattn.gpt_attention(**build_trt(BF16), backend="numba")
    assert launches
