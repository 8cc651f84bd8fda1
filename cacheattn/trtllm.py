"""TensorRT-LLM `gpt_attention` (trtllm-gpt-attention.md): `cacheattn.gpt_attention` and TensorRT-LLM's enums.

Arguments keep `tensorrt_llm.functional.gpt_attention`'s names, order and defaults; the plugin-config settings
(remove_input_padding, paged_kv_cache, tokens_per_block, streamingllm, context_fmha_type, use_fp8_context_fmha,
multi_block_mode) are keyword arguments with the config's names. Where TensorRT-LLM passes raw pool pointers,
this takes the pool array `kv_cache_pool`. Every keyword of TensorRT-LLM's signature is accepted: those that ask for
what is not built (NOT_BUILT) are refused by name unless at their defaults, those without effect here (NO_EFFECT)
are accepted and dropped. Validation names TensorRT-LLM's argument at fault; then NumPy arrays go to
`reference.gpt_attention`. The batch/beam row convention is in reference/trtllm_gpt_attention.py.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag

import numpy as np

import reference
from reference import packed_mask
from reference import trtllm_gpt_attention as ref

from . import _arrays as arrays
from ._plans import asked_text, bind_step, phase_line, plan_signature
from ._validate import (
    bits_hint,
    check_bfloat16_arch,
    check_choice,
    check_int,
    check_launch,
    check_shape,
    dtype_mismatch,
    dtype_of,
)
from .kernel_choice import AttentionShape, choose_kernel

FLOATS = ("float16", "bfloat16", "float32", "float64")


class AttentionMaskType(IntEnum):
    """TensorRT-LLM's `AttentionMaskType` (gpt_attention's mask_type), with its values.

    Attributes
    ----------
    padding : int
        0: every key visible (encoders).
    causal : int
        1: key `j` visible to the query at position `p` when `j <= p` (bottom-right for chunks).
    sliding_window_causal : int
        2: causal; the window comes from host_max_attention_window_sizes.
    bidirectional : int
        3: every key visible.
    bidirectionalglm : int
        4: GLM's mask, not built (refused).
    blocksparse : int
        5: block-sparse attention, not built (refused).
    custom_mask : int
        6: attention_mask (and attention_packed_mask) say which keys each query sees.
    """
    padding = 0
    causal = 1
    sliding_window_causal = 2
    bidirectional = 3
    bidirectionalglm = 4
    blocksparse = 5
    custom_mask = 6


class PositionEmbeddingType(IntEnum):
    """TensorRT-LLM's `PositionEmbeddingType` (gpt_attention's position_embedding_type), with its values.

    Attributes
    ----------
    learned_absolute : int
        0: nothing inside the attention.
    rope_gptj : int
        1: RoPE on interleaved pairs `(x[2i], x[2i + 1])`.
    rope_gpt_neox : int
        2: RoPE on the halves `(x[i], x[i + d / 2])`.
    long_rope : int
        3: Phi-3 LongRoPE: GPT-NeoX pairs, short and long frequency tables, m-scales.
    alibi : int
        4: ALiBi bias `slope (j - p)` from alibi_slopes.
    alibi_with_scale : int
        5: the same here (the slopes carry the scale).
    relative : int
        6: relative_attention_bias (a table, or T5 buckets).
    chatglm : int
        7: not built (refused).
    yarn : int
        8: YaRN: GPT-NeoX pairs, the frequencies and table from the host.
    mrope : int
        9: multimodal RoPE, not built (refused).
    """
    learned_absolute = 0
    rope_gptj = 1
    rope_gpt_neox = 2
    long_rope = 3
    alibi = 4
    alibi_with_scale = 5
    relative = 6
    chatglm = 7
    yarn = 8
    mrope = 9


class RotaryScalingType(IntEnum):
    """TensorRT-LLM's `RotaryScalingType` (gpt_attention's rotary_embedding_scale_type), with its values.

    Attributes
    ----------
    none : int
        0: no scaling.
    linear : int
        1: positions divided by rotary_embedding_scale (unless rotary_inv_freq carries it).
    dynamic : int
        2: NTK: the base raised once a sequence passes rotary_embedding_max_positions.
    longrope : int
        3: the frequencies and tables come from the host (long_rope).
    llama3 : int
        4: llama3 frequencies from the host, as rotary_inv_freq.
    yarn : int
        5: the frequencies and table come from the host (yarn).
    """
    none = 0
    linear = 1
    dynamic = 2
    longrope = 3
    llama3 = 4
    yarn = 5


class RequestType(IntEnum):
    """TensorRT-LLM's `RequestType` (host_request_types): context requests come before generation ones.

    Attributes
    ----------
    context : int
        0: a prompt or a chunk of one.
    generation : int
        1: one new token per beam.
    """
    context = 0
    generation = 1


class QuantMode(IntFlag):
    """The KV-cache bits of TensorRT-LLM's `QuantMode` (its other bits quantize weights and activations).

    Attributes
    ----------
    INT8_KV_CACHE : int
        64: int8 codes at the per-tensor scale kv_quant_orig_scale.
    FP8_KV_CACHE : int
        128: float8 e4m3 codes at that scale.
    """
    INT8_KV_CACHE = 64
    FP8_KV_CACHE = 128


NO_KV_CACHE_QUANT = QuantMode(0)
MASK_TYPES = (0, 1, 2, 3, 6)
POSITION_TYPES = (0, 1, 2, 3, 4, 5, 6, 8)
ROPE_TYPES = (1, 2, 3, 8)
ALIBI_TYPES = (4, 5)
SCALING_TYPES = (0, 1, 2, 3, 4, 5)

# The float attributes and tables, each checked once by _check_floats: finite, and inside its range.
# (name, lowest value, whether the lowest itself is allowed)
FLOAT_SCALARS = (("q_scaling", 0.0, False), ("attn_logit_softcapping_scale", 0.0, True),     # 0: no softcap
                 ("rotary_embedding_base", 0.0, False), ("rotary_embedding_scale", 0.0, False),
                 ("rotary_embedding_short_m_scale", 0.0, False), ("rotary_embedding_long_m_scale", 0.0, False))
# (name, whether every entry must be > 0): logn_scaling multiplies Q by log_{seq_length}(position + 1) or 1.
# Float tables and what their entries may be: "finite", "positive" (finite and > 0), or "bias" (finite or -inf:
# an additive -inf hides a key, as a mask would).
FLOAT_TABLES = (("rotary_inv_freq", "finite"), ("rotary_cos_sin", "finite"), ("long_rope_rotary_inv_freq", "finite"),
                ("long_rope_rotary_cos_sin", "finite"), ("logn_scaling", "positive"), ("alibi_slopes", "finite"),
                ("relative_attention_bias", "bias"))
_ENTRY_RULE = {"finite": "finite entries", "positive": "finite entries > 0", "bias": "finite or -inf entries"}

# Keywords of TensorRT-LLM's gpt_attention that size buffers, pick kernels or describe the parallel layout and do
# not change the result here: accepted and not used.
NO_EFFECT = ("block_sparse_block_size", "block_sparse_homo_head_pattern", "block_sparse_num_local_blocks",
             "block_sparse_vertical_stride", "tp_size", "tp_rank", "host_runtime_perf_knobs", "host_context_progress",
             "num_kv_heads_origin", "spec_decoding_is_generation_length_variable",
             "spec_decoding_max_generation_length", "cp_group", "host_kv_cache_pool_mapping")
# Keywords that ask for what is not built here: accepted at their defaults, refused by name otherwise.
NOT_BUILT = {
    "attention_output_orig_quant_scale": (None, "FP8 attention output"),
    "attention_output_sf_scale": (None, "FP4 attention output (its scaling factors)"),
    "vision_start": (-1, "CogVLM's vision-token positions"),
    "vision_length": (-1, "CogVLM's vision-token positions"),
    "spec_decoding_generation_lengths": (None, "speculative decoding"),
    "spec_decoding_position_offsets": (None, "speculative decoding"),
    "spec_decoding_packed_mask": (None, "speculative decoding"),
    "spec_decoding_use": (None, "speculative decoding"),
    "mrope_rotary_cos_sin": (None, "multimodal RoPE (mrope)"),
    "mrope_position_deltas": (None, "multimodal RoPE (mrope)"),
    "is_mla_enabled_flag": (False, "multi-head latent attention (MLA)"),
    "q_lora_rank": (0, "multi-head latent attention (MLA)"),
    "kv_lora_rank": (0, "multi-head latent attention (MLA)"),
    "qk_nope_head_dim": (0, "multi-head latent attention (MLA)"),
    "qk_rope_head_dim": (0, "multi-head latent attention (MLA)"),
    "v_head_dim": (0, "multi-head latent attention (MLA)"),
    "q_b_proj": (None, "multi-head latent attention (MLA)"),
    "kv_b_proj": (None, "multi-head latent attention (MLA)"),
    "k_b_proj_trans": (None, "multi-head latent attention (MLA)"),
    "skip_attn": (None, "skipping the attention (skip_attn)"),
    "cp_size": (1, "context parallelism"),
    "cp_rank": (0, "context parallelism"),
}


def _enum(name, value, enum, supported):
    """A TensorRT-LLM enum member or plain int -> int, refused with the member's name when unsupported here."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected a {enum.__name__} or int, got {type(value).__name__} {value!r}")
    if int(value) in enum._value2member_map_ and int(value) not in supported:
        member = enum(int(value)).name
        raise ValueError(f"{name}: {enum.__name__}.{member} is not supported by this reference; expected one of "
                         f"{[enum(v).name for v in supported]}")
    check_choice(name, int(value), supported)
    return int(value)


def _float_tensor(name, x, like=None):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if dtype_of(x).name not in FLOATS:
        raise TypeError(f"{name}: expected dtype in {FLOATS}, got {dtype_of(x).name}{bits_hint(x, FLOATS)}")
    if like is not None and dtype_of(x) != dtype_of(like):
        raise dtype_mismatch(name, x, "qkv", like, allowed=FLOATS)


def _per_entry(name, x, entries):
    host = arrays.index_array(name, x)
    check_shape(name, host, (entries,) if entries is not None else (None,), "(batch_beam,)")
    return host


def _positive_scale(name, x):
    # spec: trtllm/quant-inverse-scale
    if x is None:
        raise ValueError(f"{name}: required with an INT8/FP8 KV cache (kv_cache_quant_mode), got None")
    host = np.asarray(arrays.to_host(x))
    if host.size != 1 or not np.issubdtype(host.dtype, np.floating):
        raise ValueError(f"{name}: expected a float32 tensor of shape (1,), got {host.dtype}{host.shape}")
    value = float(host.reshape(-1)[0])
    if not value > 0 or not np.isfinite(value):
        raise ValueError(f"{name}: expected a finite scale > 0, got {value}")
    return value


# The inputs TensorRT-LLM hands each layer's plugin (kernels_numba's LAYER_INPUTS): the rest of a call is the batch
# step's index tensors and the model's attributes, the same for every layer of one step.
LAYER_INPUTS = ("qkv", "past_key_value", "kv_cache_pool", "layer_idx", "qkv_bias", "kv_orig_quant_scale",
                "kv_quant_orig_scale", "cross_kv", "relative_attention_bias")
# The step's arrays the kernels read as they are (data, not index tensors): on the layers' side (NumPy or GPU).
STEP_DATA = ("attention_mask", "attention_packed_mask", "alibi_slopes", "rotary_cos_sin", "long_rope_rotary_cos_sin",
             "logn_scaling")
LAYER_DATA = ("qkv", "past_key_value", "kv_cache_pool", "cross_kv", "qkv_bias", "relative_attention_bias")


def validate(a: dict) -> dict:
    """Check every argument of gpt_attention (a: the call's keyword arguments): the step's (validate_step) then the
    layer's (validate_layer). Returns the normalised arguments the reference takes: host int arrays for index
    tensors, ints for enums, floats for scales, the layer's window alone."""
    step = validate_step({k: v for k, v in a.items() if k not in LAYER_INPUTS})
    return validate_layer(step, {k: a[k] for k in LAYER_INPUTS})


def validate_step(a: dict) -> dict:
    """Check everything of a call but its per-layer inputs (LAYER_INPUTS), every index tensor read from the device
    once. A step serves every layer, so the slots, blocks and races are checked under each distinct window of
    host_max_attention_window_sizes. Returns {"checked": the normalised step arguments, "facts": what
    validate_layer checks a layer's inputs against}."""
    out = dict(a)
    _check_cache_settings(a)
    mapping_layers = _check_unbuilt_and_pool(a)
    for name in (*NO_EFFECT, *NOT_BUILT, "host_kv_cache_pool_pointers"):
        out.pop(name)
    H = check_int("num_heads", a["num_heads"], low=1)
    Hkv = check_int("num_kv_heads", a["num_kv_heads"], low=1)
    Dh = check_int("hidden_size_per_head", a["hidden_size_per_head"], low=1)
    # spec: trtllm/mha-mqa-gqa
    if H % Hkv:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads ({H}), got {Hkv}")
    packed = bool(a["remove_input_padding"])
    per_entry = _check_requests(a)
    E = per_entry["host_request_types"].shape[0]
    is_context = per_entry["host_request_types"] == 0
    past, lengths = per_entry["host_past_key_value_lengths"], per_entry["sequence_length"]
    new = np.where(is_context, per_entry["context_lengths"], 1)

    # Enums and scalar attributes.
    mask_type = _enum("mask_type", a["mask_type"], AttentionMaskType, MASK_TYPES)
    pos_type = _enum("position_embedding_type", a["position_embedding_type"], PositionEmbeddingType, POSITION_TYPES)
    scale_type = _enum("rotary_embedding_scale_type", a["rotary_embedding_scale_type"], RotaryScalingType,
                       SCALING_TYPES)
    out.update(mask_type=mask_type, position_embedding_type=pos_type, rotary_embedding_scale_type=scale_type)
    tpb, quant = _check_scalars_and_quantization(a, out)
    _check_rope(a, out, pos_type, scale_type, Dh)
    _check_rope_tables(a, out, pos_type, scale_type, per_entry, is_context)
    _check_logn(a, lengths)
    _check_alibi(a, pos_type, H)
    check_int("max_distance", a["max_distance"], low=0)
    _check_mask(a, mask_type, packed, E, new, lengths)
    _check_packed_mask(a, mask_type, lengths - past, lengths)
    _check_floats(a, [t for t in FLOAT_TABLES if t[0] not in LAYER_INPUTS])
    facts = dict(H=H, Hkv=Hkv, Dh=Dh, hidden=(H + 2 * Hkv) * Dh, packed=packed, E=E, new=new, lengths=lengths,
                 quant=quant, pos_type=pos_type, mapping_layers=mapping_layers, is_context=is_context, windows={})

    # Windows, sinks, cache capacity: every layer's.
    # spec: trtllm/window-per-layer, trtllm/window-repeat
    windows = arrays.index_array("host_max_attention_window_sizes", a["host_max_attention_window_sizes"])
    if windows.ndim != 1 or windows.shape[0] < 1:
        raise ValueError(f"host_max_attention_window_sizes: expected a 1-D tensor of windows (repeated over the "
                         f"layers when shorter), got shape {windows.shape}")
    # A window of no token is the caller's mistake, named here before the sinks are compared with it.
    if (windows < 1).any():
        i = int(np.flatnonzero(windows < 1)[0])
        raise ValueError(f"host_max_attention_window_sizes: expected windows >= 1 token, got {int(windows[i])} at "
                         f"entry {i} (layer {i}'s window)")
    facts["window_list"] = windows
    sinks_host = arrays.index_array("host_sink_token_length", a["host_sink_token_length"])
    check_shape("host_sink_token_length", sinks_host, (1,), "(1,)")
    sinks = int(sinks_host[0])
    out.update(host_sink_token_length=sinks_host)
    if sinks < 0:
        raise ValueError(f"host_sink_token_length: expected a number of sink tokens >= 0, got {sinks}")
    if sinks and not a["streamingllm"]:
        raise ValueError(f"host_sink_token_length: sink tokens need streamingllm=True, got {sinks}")
    if a["streamingllm"] and (is_context & (past > 0)).any():
        raise ValueError("host_past_key_value_lengths: chunked context is not defined with streamingllm "
                         f"(dense context phase), got {past.tolist()}")

    use_cache = bool(a["use_cache"])
    cross = bool(a["do_cross_attention"])
    facts["use_cache"] = use_cache
    if not use_cache:
        if not is_context.all() or past.any():
            raise ValueError("use_cache: without a cache every request is a whole context (no past, no "
                             "generation)")
        # Refused with the layer's cache, which a layer names first (validate_layer).
        facts["unread"] = [name for name in ("kv_cache_block_offsets", "host_kv_cache_block_offsets")
                           if a[name] is not None]
        out.update(per_entry)
        facts.update(sinks=sinks, capacity=None)
        return dict(checked=out, facts=_cross_step(a, out, facts, is_context, E, pos_type, None))

    ci = arrays.index_array("cache_indirection", a["cache_indirection"])
    if ci.ndim != 3:
        raise ValueError(f"cache_indirection: expected shape (batch_size, beam_width, max_seqlen), got {ci.shape}")
    beam, capacity = int(ci.shape[1]), int(ci.shape[2])
    num_gen = int((~is_context).sum())
    if beam < 1 or num_gen % beam or ci.shape[0] < num_gen // beam:
        raise ValueError(f"cache_indirection: expected (>= {num_gen // max(beam, 1)} generation sequences, "
                         f"beam_width dividing the {num_gen} generation entries, max_seqlen), got {ci.shape}")
    # spec: trtllm/cache-indirection
    if ((ci < 0) | (ci >= beam)).any():
        raise ValueError(f"cache_indirection: expected values in [0, beam_width = {beam}), got "
                         f"[{int(ci.min())}, {int(ci.max())}]")
    enc = None if not cross else _encoder_lengths(a, E)
    paged = bool(a["paged_kv_cache"])
    offsets = _block_offsets(a, E) if paged else None
    facts.update(sinks=sinks, capacity=capacity, beam=beam, encoder=enc, paged=paged, offsets=offsets, tpb=tpb,
                 per_entry=per_entry)
    out.update(per_entry)
    if paged:
        out["kv_cache_block_offsets"] = offsets
    out["cache_indirection"] = ci
    return dict(checked=out, facts=_cross_step(a, out, facts, is_context, E, pos_type, enc))


def _window_facts(f: dict, window: int, layer_idx: int) -> dict:
    """What the step needs of a cache under one layer window: checked at the first layer with that window (from
    the step's host copies: no device read), kept in the step's facts for the layers after it. A step's windows
    beyond its model's layers are never checked, as a single call checks only its layer's."""
    if window in f["windows"]:
        return f["windows"][window]
    sinks, lengths = f["sinks"], f["lengths"]
    if sinks >= window:
        raise ValueError(f"host_sink_token_length: expected fewer sink tokens than the attention window of layer "
                         f"{layer_idx} (host_max_attention_window_sizes: {window}), got {sinks}")
    if f["capacity"] is None:                           # use_cache=False: no cache to check
        f["windows"][window] = {}
        return f["windows"][window]
    longest, capacity, beam, enc, tpb, E = int(lengths.max()), f["capacity"], f["beam"], f["encoder"], f["tpb"], f["E"]
    if window > capacity and longest > capacity:
        raise ValueError(f"sequence_length: {longest} exceeds the cache capacity {capacity} (cache_indirection."
                         f"shape[2]) and the window ({window}) does not make the cache cyclic")
    if beam > 1 and longest > window:
        raise ValueError(f"host_max_attention_window_sizes: the cyclic cache does not work with beam search "
                         f"(beam_width {beam}), but a sequence of {longest} tokens passes the window {window}")
    # Slots this call reads or writes: the cyclic formula (plus the paged bubble after the sinks) over the
    # positions up to the window; later positions reuse those slots. Cross attention: the encoder tokens.
    bubble = ref.paged_bubble(sinks, tpb) if f["paged"] else 0
    if enc is not None:
        slots = int(enc.max())
    else:
        slots = int(ref.cyclic_slot(np.arange(min(longest, window)), window, sinks, bubble).max()) + 1
    facts = dict(slots=slots)
    if f["paged"]:
        offsets = f["offsets"]
        blocks = -(-slots // tpb)
        if offsets.shape[3] < blocks:
            raise ValueError(f"kv_cache_block_offsets: expected >= {E} rows and >= {blocks} blocks per sequence, "
                             f"got {offsets.shape}")
        used = offsets[0, :E, :, :blocks]
        # A layer uses these blocks plus 2 layer_idx: their range is checked per layer, against its pool.
        facts.update(lowest=int(used.min()), highest=int(used.max()))
        _check_pages_not_raced(offsets, f["per_entry"], f["is_context"], layer=layer_idx, tpb=tpb, window=window,
                               sinks=sinks, bubble=bubble, encoder=enc, slots=slots)
    f["windows"][window] = facts
    return facts


def validate_layer(step: dict, a: dict) -> dict:
    """Check one layer's inputs (a: LAYER_INPUTS) against a validated step (validate_step); nothing here reads the
    device unless the KV scales or relative_attention_bias are device tensors. Returns the normalised arguments
    of the call (the step's and the layer's) for the reference and the kernels."""
    f, s = step["facts"], step["checked"]
    out = dict(s)
    layer_idx = check_int("layer_idx", a["layer_idx"], low=0)
    if f["mapping_layers"] is not None and f["mapping_layers"] <= layer_idx:
        raise ValueError(f"host_kv_cache_pool_mapping: one pool is supported (kv_cache_pool), every layer l "
                         f"mapped to (pool 0, layer l) for layers 0..>= layer_idx ({layer_idx}), got "
                         f"{f['mapping_layers']} layers")
    paged = bool(s["paged_kv_cache"])
    if not paged and a["kv_cache_pool"] is not None:
        raise ValueError("kv_cache_pool: read only with paged_kv_cache=True, but paged_kv_cache is False (the "
                         "cache is then past_key_value); set paged_kv_cache=True, or pass kv_cache_pool=None")
    if paged and a["past_key_value"] is not None:
        raise ValueError("past_key_value: not read with paged_kv_cache=True (the cache is kv_cache_pool); pass "
                         "past_key_value=None, or paged_kv_cache=False to run on it")
    qkv = a["qkv"]
    _float_tensor("qkv", qkv)
    E, new, hidden = f["E"], f["new"], f["hidden"]
    if f["packed"]:
        # spec: trtllm/packed-qkv-shape, trtllm/qkv-packing
        check_shape("qkv", qkv, (None, hidden), "(num_tokens, (num_heads + 2 num_kv_heads) hidden_size_per_head)")
        if qkv.shape[0] != new.sum():
            raise ValueError(f"qkv: expected {int(new.sum())} packed tokens (context_lengths of the context "
                             f"requests + one per generation beam), got {qkv.shape[0]}")
    else:
        # spec: trtllm/padded-qkv-shape
        check_shape("qkv", qkv, (None, None, hidden),
                    "(batch_beam, max_seqlen, (num_heads + 2 num_kv_heads) hidden_size_per_head)")
        if qkv.shape[0] != E or qkv.shape[1] < new.max():
            raise ValueError(f"qkv: expected padded shape ({E}, >= {int(new.max())}, {hidden}), got "
                             f"{tuple(qkv.shape)}")
        mask = s["attention_mask"]
        if mask is not None and mask.shape[1] != qkv.shape[1]:
            raise ValueError(f"attention_mask: expected shape ({E}, {qkv.shape[1]}, max_kv_len), one row per "
                             f"query token of qkv, got {tuple(mask.shape)}")
    _check_layer_scales(a, out, qkv, f["quant"], hidden)
    _check_relative_bias(a, f["pos_type"], f["H"], qkv, f["lengths"], s["max_distance"])
    windows = f["window_list"]
    window = int(windows[layer_idx % windows.shape[0]])
    window_facts = _window_facts(f, window, layer_idx)
    # This layer's window, resolved once: the reference and the kernels both read this single entry.
    out.update(qkv=qkv, layer_idx=layer_idx, host_max_attention_window_sizes=np.array([window], np.int64),
               past_key_value=a["past_key_value"], kv_cache_pool=a["kv_cache_pool"], qkv_bias=a["qkv_bias"],
               cross_kv=a["cross_kv"], relative_attention_bias=a["relative_attention_bias"])
    if not f["use_cache"]:
        for name in ("past_key_value", "kv_cache_pool", *f["unread"]):
            if name in f["unread"] or a[name] is not None:
                raise ValueError(f"{name}: given with use_cache=False, which reads and writes no cache; pass "
                                 f"{name}=None, or use_cache=True to write the new tokens")
    else:
        _check_cache(s, f, a, layer_idx, window_facts)
    _cross_layer(s, f, a, qkv)
    return out


def _check_requests(a):
    """Per-entry tensors and the request order (qkv's tokens are checked against them per layer). Returns the host
    int64 copies {name: (E,)} of sequence_length, host_past_key_value_lengths, context_lengths and
    host_request_types: each is read from the device once."""
    types = _per_entry("host_request_types", a["host_request_types"], None)
    E = types.shape[0]
    if E < 1:
        raise ValueError("host_request_types: expected at least one request, got none")
    if not ((types == 0) | (types == 1)).all():            # (np.isin: some 25 µs more per call)
        raise ValueError(f"host_request_types: expected RequestType values 0 (context) or 1 (generation), "
                         f"got {types.tolist()}")
    # spec: trtllm/inflight-order
    if (np.diff(types) < 0).any():
        raise ValueError(f"host_request_types: context requests must come before generation requests, "
                         f"got {types.tolist()}")
    past = _per_entry("host_past_key_value_lengths", a["host_past_key_value_lengths"], E)
    lengths = _per_entry("sequence_length", a["sequence_length"], E)
    ctx_len = _per_entry("context_lengths", a["context_lengths"], E)
    if a.get("host_context_lengths") is not None:
        host_ctx = _per_entry("host_context_lengths", a["host_context_lengths"], E)
        if (host_ctx != ctx_len).any():
            raise ValueError(f"host_context_lengths: expected the values of context_lengths {ctx_len.tolist()}, "
                             f"got {host_ctx.tolist()}")
    if (past < 0).any():
        raise ValueError(f"host_past_key_value_lengths: expected values >= 0, got {past.tolist()}")
    is_context = types == 0
    if (ctx_len < 1).any():
        raise ValueError(f"context_lengths: expected values >= 1, got {ctx_len.tolist()}")
    # spec: trtllm/beam-context, trtllm/generation-beam-tokens
    new = np.where(is_context, ctx_len, 1)
    if (lengths != past + new).any():
        raise ValueError(f"sequence_length: expected host_past_key_value_lengths + new tokens (context_lengths for "
                         f"a context request, 1 per beam in generation) = {(past + new).tolist()}, "
                         f"got {lengths.tolist()}")
    if (~is_context & (ctx_len > past)).any():
        raise ValueError(f"context_lengths: a generation request's prompt must be in the cache already "
                         f"(<= host_past_key_value_lengths {past.tolist()}), got {ctx_len.tolist()}")
    if a.get("max_context_length") is not None:
        check_int("max_context_length", a["max_context_length"], low=int(new[is_context].max(initial=1)))
    return {"sequence_length": lengths, "host_past_key_value_lengths": past, "context_lengths": ctx_len,
            "host_request_types": types}


def _check_scalars_and_quantization(a, out):
    """Scalar attributes, the plugin settings, the KV cache quantization (its scales and qkv_bias are the layer's:
    _check_layer_scales). Returns (tokens_per_block, quant mode)."""
    # spec: trtllm/context-unfused, trtllm/context-fmha-fp32-acc
    check_choice("context_fmha_type", a["context_fmha_type"], (0, 1, 2))
    tpb = check_int("tokens_per_block", a["tokens_per_block"], low=1)
    if tpb & (tpb - 1):
        raise ValueError(f"tokens_per_block: expected a power of two, got {tpb}")
    quant = a["kv_cache_quant_mode"]
    if isinstance(quant, bool) or not isinstance(quant, (int, np.integer)) or int(quant) & ~(64 | 128) \
            or int(quant) == 64 | 128:
        raise ValueError(f"kv_cache_quant_mode: expected QuantMode(0), INT8_KV_CACHE (64) or FP8_KV_CACHE (128), "
                         f"got {quant!r}")
    quant = out["kv_cache_quant_mode"] = int(quant)
    if a["use_fp8_context_fmha"] and not quant & 128:
        raise ValueError("use_fp8_context_fmha: needs an FP8 KV cache (kv_cache_quant_mode = FP8_KV_CACHE), "
                         f"got kv_cache_quant_mode {quant}")
    return tpb, quant


def _check_layer_scales(a, out, qkv, quant, hidden):
    """A layer's KV cache scales (floats in `out`) and its qkv_bias."""
    if quant:
        out["kv_orig_quant_scale"] = _positive_scale("kv_orig_quant_scale", a["kv_orig_quant_scale"])
        out["kv_quant_orig_scale"] = _positive_scale("kv_quant_orig_scale", a["kv_quant_orig_scale"])
    else:
        for name in ("kv_orig_quant_scale", "kv_quant_orig_scale"):
            if a[name] is not None:
                raise ValueError(f"{name}: the scale of an INT8/FP8 KV cache, but kv_cache_quant_mode is QuantMode(0) "
                                 f"(the cache holds qkv's dtype and the scale would not be read); pass {name}=None, "
                                 f"or kv_cache_quant_mode INT8_KV_CACHE / FP8_KV_CACHE")
            out[name] = None
    if a["qkv_bias"] is not None:
        _float_tensor("qkv_bias", a["qkv_bias"], qkv)
        check_shape("qkv_bias", a["qkv_bias"], (hidden,), "((num_heads + 2 num_kv_heads) hidden_size_per_head,)")


def _check_rope(a, out, pos_type, scale_type, Dh):
    """rotary_embedding_dim and the RoPE attributes; a RoPE dim only with a RoPE position type."""
    rot = check_int("rotary_embedding_dim", a["rotary_embedding_dim"], low=0)
    if pos_type in ROPE_TYPES:
        if rot == 0 or rot % 2 or rot > Dh:
            raise ValueError(f"rotary_embedding_dim: expected an even value in [2, hidden_size_per_head = {Dh}] "
                             f"for {PositionEmbeddingType(pos_type).name}, got {rot}")
        if a["rotary_inv_freq"] is not None:
            freq = np.asarray(arrays.to_host(a["rotary_inv_freq"]))
            check_shape("rotary_inv_freq", freq, (rot // 2,), "(rotary_embedding_dim / 2,)")
            out["rotary_inv_freq"] = freq.astype(np.float32)
        elif scale_type == RotaryScalingType.llama3:
            raise ValueError("rotary_inv_freq: llama3 scaling needs the host-computed frequencies "
                             "(reference.rope.llama3_inv_freq), got None")
        check_int("rotary_embedding_max_positions", a["rotary_embedding_max_positions"], low=1)
        if scale_type == RotaryScalingType.dynamic and rot <= 2 and a["rotary_inv_freq"] is None:
            raise ValueError(f"rotary_embedding_dim: dynamic NTK scaling raises the base to d / (d - 2), so it needs "
                             f"a rotary_embedding_dim > 2, got {rot}")
    elif rot:
        raise ValueError(f"rotary_embedding_dim: expected 0 without a RoPE position_embedding_type, got {rot}")
    elif a["rotary_inv_freq"] is not None:
        raise ValueError(f"rotary_inv_freq: only with a RoPE position_embedding_type, got "
                         f"{PositionEmbeddingType(pos_type).name}")


PAGED_ONLY = ("kv_cache_pool", "kv_cache_block_offsets", "host_kv_cache_block_offsets", "host_kv_cache_pool_mapping")


def _check_cache_settings(a):
    """The cache arguments a call reads depend on paged_kv_cache; one it would not read is refused naming both
    (a pool given with paged_kv_cache left False would run on past_key_value and leave the pool as it was). The
    step's block tables here; the layer's cache (kv_cache_pool, past_key_value) in validate_layer."""
    if not a["paged_kv_cache"]:
        for name in PAGED_ONLY:
            if a.get(name) is not None:
                raise ValueError(f"{name}: read only with paged_kv_cache=True, but paged_kv_cache is False (the "
                                 f"cache is then past_key_value); set paged_kv_cache=True, or pass {name}=None")


def _check_unbuilt_and_pool(a):
    """The keywords of TensorRT-LLM's signature that ask for what is not built are refused by name; the pool is
    the array kv_cache_pool, one pool whose layer l is layer l (host_kv_cache_pool_mapping may say so). Returns
    the mapping's number of layers (None without one): a layer past it is refused per layer."""
    for name, (default, feature) in NOT_BUILT.items():
        value = a[name]
        unchanged = value is None if default is None else (
            not hasattr(value, "shape") and value == default)
        if not unchanged:
            raise ValueError(f"{name}: {feature} is not built here; expected the default {default!r}, "
                             f"got {value if not hasattr(value, 'shape') else 'a tensor'!r}")
    if not isinstance(a["tp_size"], (int, np.integer)) or not 0 <= a["tp_rank"] < a["tp_size"]:
        raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size (the heads given are this rank's), got "
                         f"tp_rank {a['tp_rank']!r}, tp_size {a['tp_size']!r}")
    if a["host_kv_cache_pool_pointers"] is not None:
        raise ValueError("host_kv_cache_pool_pointers: raw pool addresses are not taken here; pass the pool itself "
                         "as kv_cache_pool (num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, "
                         "hidden_size_per_head)")
    mapping = a["host_kv_cache_pool_mapping"]
    if mapping is not None:
        host = arrays.index_array("host_kv_cache_pool_mapping", mapping)
        layers = host.shape[0] if host.ndim == 2 else 0
        check_shape("host_kv_cache_pool_mapping", host, (None, 2), "(num_layers, 2): (pool, layer in the pool)")
        one_pool = np.stack([np.zeros(layers, np.int64), np.arange(layers)], axis=1)
        if (host != one_pool).any():
            raise ValueError(f"host_kv_cache_pool_mapping: one pool is supported (kv_cache_pool), every layer l "
                             f"mapped to (pool 0, layer l), got {host.tolist()}")
        return layers
    return None


def _float32_tensor(name, x, ndim_meaning):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected a float32 tensor, got {type(x).__name__}")
    if dtype_of(x) != np.float32:
        raise TypeError(f"{name}: expected a float32 tensor {ndim_meaning}, got {dtype_of(x).name}")


def _check_rope_tables(a, out, pos_type, scale_type, per_entry, is_context):
    """rotary_cos_sin and long_rope's second table: float32 (1, num_pos * rotary_embedding_dim), long enough for
    every position read from them; long_rope and yarn get their frequencies and tables from the host."""
    rot = a["rotary_embedding_dim"]
    tables = ("rotary_cos_sin", "long_rope_rotary_cos_sin", "long_rope_rotary_inv_freq")
    if pos_type not in ROPE_TYPES:
        for name in tables:
            if a[name] is not None:
                raise ValueError(f"{name}: only with a RoPE position_embedding_type, got "
                                 f"{PositionEmbeddingType(pos_type).name}")
        return
    if pos_type != PositionEmbeddingType.long_rope:
        for name in tables[1:]:
            if a[name] is not None:
                raise ValueError(f"{name}: only with position_embedding_type long_rope, got "
                                 f"{PositionEmbeddingType(pos_type).name}")
    needs = {PositionEmbeddingType.long_rope: ("rotary_inv_freq", "rotary_cos_sin") + tables[1:],
             PositionEmbeddingType.yarn: ("rotary_inv_freq", "rotary_cos_sin")}.get(pos_type, ())
    if scale_type in (RotaryScalingType.longrope, RotaryScalingType.yarn):
        needs = needs or ("rotary_inv_freq", "rotary_cos_sin")
    for name in needs:
        if a[name] is None:
            raise ValueError(f"{name}: required with position_embedding_type {PositionEmbeddingType(pos_type).name} "
                             f"and rotary_embedding_scale_type {RotaryScalingType(scale_type).name} (build it with "
                             f"reference.rope.long_rope_tables / yarn_tables), got None")
    if a["long_rope_rotary_inv_freq"] is not None:
        freq = np.asarray(arrays.to_host(a["long_rope_rotary_inv_freq"]))
        check_shape("long_rope_rotary_inv_freq", freq.reshape(-1), (rot // 2,), "(rotary_embedding_dim / 2,)")
        out["long_rope_rotary_inv_freq"] = freq.reshape(-1).astype(np.float32)
    check_int("rotary_embedding_original_max_positions", a["rotary_embedding_original_max_positions"], low=1)
    lengths = per_entry["sequence_length"]
    plans = ref.rope_plan(
        position_embedding_type=pos_type, rotary_inv_freq=a["rotary_inv_freq"], rotary_cos_sin=a["rotary_cos_sin"],
        long_rope_rotary_inv_freq=a["long_rope_rotary_inv_freq"],
        long_rope_rotary_cos_sin=a["long_rope_rotary_cos_sin"],
        rotary_embedding_original_max_positions=a["rotary_embedding_original_max_positions"],
        rotary_embedding_max_positions=a["rotary_embedding_max_positions"],
        rotary_embedding_scale_type=scale_type, streamingllm=a["streamingllm"], lengths=lengths, is_context=is_context)
    for name in tables[:2]:
        table = a[name]
        if table is None:
            continue
        _float32_tensor(name, table, "(1, num_pos * rotary_embedding_dim)")
        size = int(np.prod(table.shape))
        if size % rot or size == 0:
            raise ValueError(f"{name}: expected shape (1, num_pos * rotary_embedding_dim) with rotary_embedding_dim "
                             f"{rot}, got {tuple(table.shape)}")
        read = [int(n) for n, (_, t, from_table) in zip(lengths, plans) if from_table and t is table]
        if read and max(read) > size // rot:
            raise ValueError(f"{name}: a sequence of {max(read)} tokens reads its cos/sin at positions up to "
                             f"{max(read) - 1}, but the table holds {size // rot} positions")


def _check_logn(a, lengths):
    """logn_scaling: float32 (positions,), one factor per absolute position up to the longest sequence."""
    logn = a["logn_scaling"]
    if logn is None:
        return
    _float32_tensor("logn_scaling", logn, "(max_position_embeddings,)")
    if a["do_cross_attention"]:
        raise ValueError("logn_scaling: only with self attention (do_cross_attention=False)")
    if len(logn.shape) != 1 or logn.shape[0] < lengths.max():
        raise ValueError(f"logn_scaling: expected shape (>= {int(lengths.max())},), one factor per position up to "
                         f"the longest sequence_length, got {tuple(logn.shape)}")


def _check_floats(a, tables=FLOAT_TABLES):
    """Every float attribute finite and in its range, every float table given finite (logn_scaling's factors
    also > 0): a NaN or an infinity there would reach each output it touches without an error. The tables' dtypes
    and shapes are checked before this."""
    for name, low, inclusive in FLOAT_SCALARS:
        value = a[name]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
        if not (np.isfinite(value) and (value >= low if inclusive else value > low)):
            raise ValueError(f"{name}: expected a finite float {'>=' if inclusive else '>'} {low:g}, got {value!r}")
    for name, rule in tables:
        if a[name] is not None:
            bad = _first_bad_entry(a[name], rule)
            if bad is not None:
                index, value = bad
                raise ValueError(f"{name}: expected {_ENTRY_RULE[rule]}, got {value!r} at flat index {index}")


def _first_bad_entry(x, rule):
    """(flat index, value) of x's first entry that breaks `rule` (a key of _ENTRY_RULE), else None. A GPU
    table is reduced where it lives when CuPy is there: a cos/sin table can hold millions of entries, and this
    runs on every call."""
    xp, entries = np, None
    if arrays.is_device_array(x):
        try:
            import cupy
        except ImportError:
            pass
        else:
            xp, entries = cupy, cupy.asarray(arrays.as_kernel_array(x)).reshape(-1)
    if entries is None:
        entries = np.asarray(arrays.to_host(x)).reshape(-1).astype(np.float64)   # bfloat16 too, exactly
    bad = ~xp.isfinite(entries)
    if rule == "positive":
        bad |= entries <= 0
    elif rule == "bias":
        bad &= entries != -xp.inf
    if not bool(bad.any()):
        return None
    index = int(xp.argmax(bad))
    return index, float(entries[index])


def _check_packed_mask(a, mask_type, new, lengths):
    """attention_packed_mask: TensorRT-LLM's packed form of the custom mask, which the context requests read."""
    packed = a["attention_packed_mask"]
    if packed is None:
        return
    if mask_type != AttentionMaskType.custom_mask:
        raise ValueError("attention_packed_mask: given only when mask_type is custom_mask")
    if dtype_of(packed) != np.int32:
        raise TypeError(f"attention_packed_mask: expected an int32 tensor (reference.packed_mask."
                        f"pack_attention_mask), got {dtype_of(packed).name}")
    check_shape("attention_packed_mask", packed, packed_mask.packed_shape(new, lengths),
                "(sum roundUp(new tokens, 128), roundUp(max sequence_length, 256) / 32)")


def _ranges(starts, counts):
    """(owner index, value) of the concatenated integer ranges [starts[i], starts[i] + counts[i])."""
    counts = np.maximum(counts, 0)
    owner = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, np.repeat(starts, counts) + offset


def _check_pages_not_raced(offsets, per_entry, is_context, *, layer, tpb, window, sinks, bubble, encoder, slots):
    """Two entries must not both touch a cache slot that one of them writes in this call: on a GPU their blocks run
    at once, so that is a data race (two writers, or a writer and a reader). Sharing a block read-only, e.g. a
    common prompt prefix no entry writes into this call, is legal. Whole blocks first, vectorized (a few numpy
    calls per decode step); slot by slot only for an entry whose table holds a block another entry writes."""
    past, lengths, E = per_entry["host_past_key_value_lengths"], per_entry["sequence_length"], len(is_context)
    kept = window - sinks

    def positions(write, entries=None):
        """(entry, position) of what the entries write (the new tokens that stay cached, the encoder tokens of
        cross attention's context requests) or read (the cached tokens in view)."""
        pick = np.arange(E) if entries is None else np.asarray(entries)
        P, N = past[pick], lengths[pick]
        if encoder is not None:
            owner, pos = _ranges(np.zeros(len(pick), np.int64), np.where(is_context[pick] == write, encoder[pick], 0))
            return pick[owner], pos
        if write:
            stays = np.maximum(P, N - kept)                                      # older new tokens wrap away
            parts = [_ranges(stays, N - stays), _ranges(P, np.minimum(N, sinks) - P)]
        else:
            window_start = np.maximum(np.minimum(P, sinks), P - kept)
            parts = [_ranges(np.zeros_like(P), np.minimum(P, sinks)), _ranges(window_start, P - window_start)]
        return pick[np.concatenate([o for o, _ in parts])], np.concatenate([v for _, v in parts])

    w_entry, w_pos = positions(True)
    if not w_entry.size:
        return
    w_slot = ref.cyclic_slot(w_pos, window, sinks, bubble)
    used = -(-slots // tpb)
    for kv in (0, 1):
        table = offsets[0, :E, kv, :used] + 2 * layer                           # (E, used blocks), validated ids
        w_block, w_row = table[w_entry, w_slot // tpb], w_slot % tpb
        # Each written block's lowest and highest writer; entry f looks closer only at blocks another one writes.
        base = int(table.min())                                                 # the step's offsets, any layer
        low, high = np.full(int(table.max()) - base + 1, E), np.full(int(table.max()) - base + 1, -1)
        np.minimum.at(low, w_block - base, w_entry)
        np.maximum.at(high, w_block - base, w_entry)
        rows = np.arange(E)[:, None]
        foreign = (high[table - base] >= 0) & ((low[table - base] != rows) | (high[table - base] != rows))
        for f in np.flatnonzero(foreign.any(axis=1)):
            for write in (True, False):
                _, pos = positions(write, [f])
                f_slot = ref.cyclic_slot(pos, window, sinks, bubble)
                for block, row in zip(table[f, f_slot // tpb], f_slot % tpb):
                    writers = w_entry[(w_block == block) & (w_row == row) & (w_entry != f)]
                    if writers.size:
                        e = int(writers[0])
                        raise ValueError(
                            f"kv_cache_block_offsets: entries {min(e, f)} and {max(e, f)} share block {block} "
                            f"({'K' if kv == 0 else 'V'}), and entry {e} writes row {row} of it that entry {f} "
                            f"{'writes' if write else 'reads'} in the same call: a data race on a GPU. Give each "
                            "sequence its own block for the tokens it writes; sharing a block read-only (a common "
                            "prefix nobody writes into this call) is legal")


def _check_alibi(a, pos_type, H):
    """ALiBi slopes, given exactly with their position types."""
    slopes = a["alibi_slopes"]
    if (slopes is not None) != (pos_type in ALIBI_TYPES):
        raise ValueError(f"alibi_slopes: given exactly when position_embedding_type is alibi or alibi_with_scale; "
                         f"got {'slopes' if slopes is not None else 'None'} with "
                         f"{PositionEmbeddingType(pos_type).name}")
    if slopes is not None:
        _float_tensor("alibi_slopes", slopes)
        check_shape("alibi_slopes", slopes, (H,), "(num_heads,)")


def _check_relative_bias(a, pos_type, H, qkv, lengths, max_distance):
    """A layer's relative attention bias, given exactly with position type relative: a regular (H, L, L) table or
    T5's buckets, entries finite or -inf."""
    rab = a["relative_attention_bias"]
    if (rab is not None) != (pos_type == PositionEmbeddingType.relative):
        raise ValueError("relative_attention_bias: given exactly when position_embedding_type is relative")
    if rab is None:
        return
    _float_tensor("relative_attention_bias", rab, qkv)
    if max_distance > 0:
        check_shape("relative_attention_bias", rab, (H, None), "(num_heads, num_buckets) with max_distance > 0")
        buckets = rab.shape[1]
        if buckets < 2 or max_distance <= buckets // 2:
            raise ValueError(f"relative_attention_bias: expected num_buckets >= 2 and max_distance "
                             f"> num_buckets / 2 ({max_distance}), got num_buckets {buckets}")
    else:
        longest = int(lengths.max())
        check_shape("relative_attention_bias", rab, (H, None, None), "(num_heads, L, L)")
        if rab.shape[1] < longest or rab.shape[2] < longest:
            raise ValueError(f"relative_attention_bias: expected (num_heads, L, L) with L >= {longest} "
                             f"(the longest sequence_length), got {tuple(rab.shape)}")
    bad = _first_bad_entry(rab, "bias")
    if bad is not None:
        raise ValueError(f"relative_attention_bias: expected {_ENTRY_RULE['bias']}, got {bad[1]!r} at flat index "
                         f"{bad[0]}")


def _check_mask(a, mask_type, packed, E, new, lengths):
    """attention_mask: bool, one row per query token, given exactly with custom_mask (a padded qkv's max_seqlen
    is checked against its rows per layer)."""
    mask = a["attention_mask"]
    if (mask is not None) != (mask_type == AttentionMaskType.custom_mask):
        raise ValueError("attention_mask: given exactly when mask_type is custom_mask")
    if mask is not None:
        if dtype_of(mask) != np.bool_:
            raise TypeError(f"attention_mask: expected a bool tensor (True = attend), got {dtype_of(mask).name}")
        rows = (int(new.sum()),) if packed else (E, None)
        check_shape("attention_mask", mask, rows + (None,), "(num_tokens or (batch_beam, max_seqlen), max_kv_len)")
        if not packed and mask.shape[1] < new.max():
            raise ValueError(f"attention_mask: expected ({E}, >= {int(new.max())}, max_kv_len), one row per query "
                             f"token, got {tuple(mask.shape)}")
        if mask.shape[-1] < lengths.max():
            raise ValueError(f"attention_mask: expected a last dim >= the longest sequence_length "
                             f"({int(lengths.max())}), got {mask.shape[-1]}")


def _cache_dtype_ok(name, x, qkv, quant):
    """The cache's dtype: qkv's without quantization (the call follows qkv: the message says so, and that either
    array may change), the codes' with it (the message names the mode the cache's dtype would ask for)."""
    codes = {64: np.dtype(np.int8), 128: ref.fp8_e4m3()}
    got = dtype_of(x)
    if quant == 0:
        if got == dtype_of(qkv):
            return
        mode = next((f"kv_cache_quant_mode={QuantMode(m).name} ({m})" for m, d in codes.items() if d == got), None)
        if mode is not None:
            raise TypeError(f"{name}: expected qkv's dtype {dtype_of(qkv).name} with kv_cache_quant_mode 0 (an "
                            f"unquantized cache holds qkv's dtype), got {got.name}: {got.name} holds "
                            f"quantized codes; pass {mode} with its KV scales, or a {dtype_of(qkv).name} cache")
        raise dtype_mismatch(name, x, "qkv", qkv, allowed=FLOATS,
                             why="with kv_cache_quant_mode 0 the cache holds qkv's dtype")
    if got != codes[quant]:
        raise TypeError(f"{name}: expected {codes[quant].name} codes for kv_cache_quant_mode {QuantMode(quant).name} "
                        f"({quant}), got {got.name}: pass the cache as {codes[quant].name}, or kv_cache_quant_mode=0 "
                        f"for a cache of qkv's dtype ({dtype_of(qkv).name})")


def _block_offsets(a, E):
    """The paged block table's host copy, its shape and its host twin; the blocks per window are checked by
    validate_step, their range against the pool per layer."""
    offsets = arrays.index_array("kv_cache_block_offsets", a["kv_cache_block_offsets"])
    check_shape("kv_cache_block_offsets", offsets, (1, None, 2, None), "(num_pools = 1, batch_beam, 2, max_blocks)")
    if offsets.shape[1] < E:
        raise ValueError(f"kv_cache_block_offsets: expected >= {E} rows, got {offsets.shape}")
    if a.get("host_kv_cache_block_offsets") is not None:
        host_offsets = arrays.index_array("host_kv_cache_block_offsets", a["host_kv_cache_block_offsets"])
        if host_offsets.shape != offsets.shape or (host_offsets != offsets).any():
            raise ValueError("host_kv_cache_block_offsets: expected the values of kv_cache_block_offsets")
    return offsets


def _check_cache(s, f, a, layer_idx, window):
    """A layer's cache against the step: its dtype and shape, the slots its window uses (window: validate_step's
    facts of it), and with a pool the blocks the step's table names for this layer."""
    qkv, Hkv, Dh, quant, E = a["qkv"], f["Hkv"], f["Dh"], f["quant"], f["E"]
    slots = window["slots"]
    if not s["paged_kv_cache"]:
        pkv = a["past_key_value"]
        if pkv is None:
            raise ValueError("past_key_value: required for the contiguous cache (paged_kv_cache=False), got None")
        _cache_dtype_ok("past_key_value", pkv, qkv, quant)
        # spec: trtllm/contiguous-shape
        check_shape("past_key_value", pkv, (None, 2, Hkv, None, Dh),
                    "(batch_beam, 2, num_kv_heads, max_seqlen, hidden_size_per_head)")
        if pkv.shape[0] < E or pkv.shape[3] < slots:
            raise ValueError(f"past_key_value: expected >= {E} rows (one per entry) and max_seqlen >= {slots} "
                             f"(the slots this call uses), got {tuple(pkv.shape)}")
        return
    pool = a["kv_cache_pool"]
    if pool is None:
        raise ValueError("kv_cache_pool: required with paged_kv_cache=True, got None")
    _cache_dtype_ok("kv_cache_pool", pool, qkv, quant)
    tpb = int(s["tokens_per_block"])
    # spec: trtllm/paged-blocks, trtllm/cache-per-layer
    check_shape("kv_cache_pool", pool, (None, None, 2, Hkv, tpb, Dh),
                "(num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, hidden_size_per_head)")
    if layer_idx >= pool.shape[1]:
        raise ValueError(f"layer_idx: expected < num_layers = {pool.shape[1]} (kv_cache_pool), got {layer_idx}")
    total = pool.shape[0] * pool.shape[1] * 2
    for bound in (window["lowest"], window["highest"]):
        if not 0 <= bound + 2 * layer_idx < total:
            raise ValueError(f"kv_cache_block_offsets: block {bound + 2 * layer_idx} (offset + 2 * layer_idx) is "
                             f"outside the pool's {total} blocks")


def _encoder_lengths(a, E):
    if a["encoder_input_lengths"] is None:
        raise ValueError("encoder_input_lengths: required with do_cross_attention=True, got None")
    enc = _per_entry("encoder_input_lengths", a["encoder_input_lengths"], E)
    if (enc < 1).any():
        raise ValueError(f"encoder_input_lengths: expected values >= 1, got {enc.tolist()}")
    return enc


def _cross_step(a, out, facts, is_context, E, pos_type, enc):
    """Cross attention's step: the encoder lengths (cross_kv, a layer's, in _cross_layer). Returns facts."""
    if not a["do_cross_attention"]:
        return facts
    enc = _encoder_lengths(a, E) if enc is None else enc
    if pos_type != PositionEmbeddingType.learned_absolute:
        raise ValueError(f"position_embedding_type: cross attention takes no position embedding here, got "
                         f"{PositionEmbeddingType(pos_type).name}")
    if a["cross_kv_length"] is not None and int(a["cross_kv_length"]) < enc.max():
        raise ValueError(f"cross_kv_length: expected >= max(encoder_input_lengths) = {int(enc.max())}, "
                         f"got {a['cross_kv_length']}")
    out["encoder_input_lengths"] = enc
    return facts


def _cross_layer(s, f, a, qkv):
    """A layer's cross_kv: the context requests' encoder K/V, qkv's dtype."""
    if not s["do_cross_attention"]:
        if a["cross_kv"] is not None:
            raise ValueError("cross_kv: only with do_cross_attention=True")
        return
    enc, is_context, Hkv, Dh, E = s["encoder_input_lengths"], f["is_context"], f["Hkv"], f["Dh"], f["E"]
    encoder_tokens = int(enc[is_context].sum())
    if is_context.any():
        if a["cross_kv"] is None:
            raise ValueError("cross_kv: required when a context request does cross attention, got None")
        cross_kv = a["cross_kv"]
        _float_tensor("cross_kv", cross_kv, qkv)
        if s["remove_input_padding"]:
            if cross_kv.ndim == 3 and cross_kv.shape[0] == 1:
                cross_kv = cross_kv.reshape(cross_kv.shape[1:])               # TensorRT-LLM's [1, num_tokens, .]
            check_shape("cross_kv", cross_kv, (encoder_tokens, 2 * Hkv * Dh),
                        "([1,] encoder tokens of the context requests, 2 num_kv_heads hidden_size_per_head)")
        else:
            check_shape("cross_kv", cross_kv, (E, None, 2 * Hkv * Dh),
                        "(batch_beam, max encoder length, 2 num_kv_heads hidden_size_per_head)")
            if cross_kv.shape[1] < enc.max():
                raise ValueError(f"cross_kv: expected a padded length >= max(encoder_input_lengths) = "
                                 f"{int(enc.max())}, got {cross_kv.shape[1]}")


@arrays.accepts_torch
def gpt_attention(
        *, qkv, past_key_value, attention_mask=None, attention_packed_mask=None, sequence_length,
        host_past_key_value_lengths, host_max_attention_window_sizes, host_sink_token_length, context_lengths,
        cache_indirection, host_request_types, layer_idx: int, num_heads: int, num_kv_heads: int,
        hidden_size_per_head: int, q_scaling: float, attn_logit_softcapping_scale: float = 0.0,
        rotary_embedding_dim: int = 0, rotary_embedding_base: float = 10000.0,
        rotary_embedding_scale_type: int = RotaryScalingType.none, rotary_embedding_short_m_scale: float = 1.0,
        rotary_embedding_long_m_scale: float = 1.0, rotary_embedding_scale: float = 1.0,
        rotary_embedding_max_positions: int = 1024, rotary_embedding_original_max_positions: int = 1024,
        position_embedding_type: int = PositionEmbeddingType.learned_absolute, rotary_inv_freq=None,
        rotary_cos_sin=None, kv_orig_quant_scale=None, kv_quant_orig_scale=None,
        attention_output_orig_quant_scale=None, attention_output_sf_scale=None,
        kv_cache_quant_mode: int = NO_KV_CACHE_QUANT, max_context_length: int | None = None,
        mask_type: int = AttentionMaskType.causal, block_sparse_block_size: int = 64,
        block_sparse_homo_head_pattern: bool = False, block_sparse_num_local_blocks: int = 16,
        block_sparse_vertical_stride: int = 8, alibi_slopes=None, tp_size: int = 1, tp_rank: int = 0,
        vision_start: int = -1, vision_length: int = -1, kv_cache_block_offsets=None,
        host_kv_cache_block_offsets=None, host_kv_cache_pool_pointers=None, host_kv_cache_pool_mapping=None,
        do_cross_attention: bool = False, cross_kv=None, cross_kv_length: int | None = None,
        encoder_input_lengths=None, relative_attention_bias=None, logn_scaling=None, max_distance: int = 0,
        host_context_lengths=None, qkv_bias=None, use_cache: bool = True,
        spec_decoding_is_generation_length_variable: bool = False, spec_decoding_max_generation_length: int = 0,
        spec_decoding_generation_lengths=None, spec_decoding_position_offsets=None, spec_decoding_packed_mask=None,
        spec_decoding_use=None, long_rope_rotary_inv_freq=None, long_rope_rotary_cos_sin=None,
        mrope_rotary_cos_sin=None, mrope_position_deltas=None, host_runtime_perf_knobs=None,
        host_context_progress=None, is_mla_enabled_flag: bool = False, q_lora_rank: int = 0, kv_lora_rank: int = 0,
        qk_nope_head_dim: int = 0, qk_rope_head_dim: int = 0, v_head_dim: int = 0, q_b_proj=None, kv_b_proj=None,
        k_b_proj_trans=None, skip_attn=None, cp_group=(0,), cp_size: int = 1, cp_rank: int = 0,
        num_kv_heads_origin: int = -1, remove_input_padding: bool = True, paged_kv_cache: bool = False,
        tokens_per_block: int = 64, streamingllm: bool = False, context_fmha_type: int = 1,
        use_fp8_context_fmha: bool = False, multi_block_mode: bool = True, kv_cache_pool=None,
        backend: str = "auto", threads: int = 128, rung: int | None = None,
        num_splits: int | None = None) -> tuple:
    r"""TensorRT-LLM's `gpt_attention`: in-flight batched attention over a contiguous or paged KV cache.

    Arguments keep `tensorrt_llm.functional.gpt_attention`'s names, order and defaults (all keyword-only); the
    plugin-config settings follow as keywords with the config's names, then the pool array `kv_cache_pool`
    (where TensorRT-LLM passes raw pool pointers). NumPy arrays run the reference, GPU arrays the kernels.

    Notation: `E` = batch_beam entries (one per context request, `beam_width` per generation sequence; context
    requests first), `H` = num_heads, `Hkv` = num_kv_heads, `Dh` = hidden_size_per_head, `T` = packed tokens
    (context_lengths of the context requests plus one per generation entry), `L_e` = sequence_length[e],
    `P_e` = host_past_key_value_lengths[e].

    For query token `i` of entry `e` at position `p = P_e + i`, head `h` (kv head `g = h // (H / Hkv)`):

    `out[i, h] = sum_j softmax_j(bias(h, p, j) + cap(norm * q[i, h] . k[j, g])) v[j, g]`

    over the keys `j` visible to it: `j <= p` (causal, bottom-right), `p - W < j` or `j < S` (window `W`, `S` sink
    tokens), and the custom mask. `norm = 1 / (q_scaling sqrt(Dh))`, `cap(x) = c tanh(x / c)` when
    attn_logit_softcapping_scale `c > 0`, `bias` is ALiBi's `slope_h (j - p)` or the relative attention bias.
    Q and K are RoPE-rotated first (then Q times `logn_scaling[p]`); cached keys and values come from the cache
    (dequantized), the new ones are written to it.

    Parameters
    ----------
    qkv : array (T, (H + 2 Hkv) Dh) packed, or (E, max_seqlen, (H + 2 Hkv) Dh) padded
        `[Q | K | V]` along the last axis; float16, bfloat16, float32 or float64 (bfloat16 on a GPU: a torch tensor, or
        `cacheattn.bfloat16(bits)` around a uint16 CuPy array; the kernels need sm_80 for it). Required.
    past_key_value : array (>= E, 2, Hkv, max_seqlen, Dh) or None
        The contiguous cache (paged_kv_cache False): qkv's dtype, int8 or float8_e4m3fn; written in place and
        returned as present_key_value. None with a paged cache or use_cache False (refused otherwise: the call
        would not read it). Required.
    attention_mask : bool array (T or (E, max_seqlen), >= max L_e), optional
        Custom mask, True = attend; row = query token, column = key position. Only with mask_type custom_mask.
        Default None.
    attention_packed_mask : int32 array (sum_e roundUp(new_e, 128), roundUp(max L_e, 256) / 32), optional
        The same custom mask in TensorRT-LLM's packed layout (`reference.packed_mask.pack_attention_mask`); the
        context requests read it, generation reads attention_mask. Default None.
    sequence_length : int array (E,)
        Length after this step, `P_e + new tokens`. Required.
    host_past_key_value_lengths : int array (E,)
        Tokens already in the cache. Required.
    host_max_attention_window_sizes : int32 array (num_layers,) or shorter
        Attention window `W` per layer (each >= 1), repeated over the layers when shorter. The cache is cyclic when
        `W` is at most its capacity. Required.
    host_sink_token_length : int32 array (1,)
        StreamingLLM sink tokens `S`, `0 <= S < W` (0 without streamingllm). Required.
    context_lengths : int array (E,)
        New tokens of a context request (its prompt or chunk); the prompt length of a generation request.
        Required.
    cache_indirection : int32 array (>= generation sequences, beam_width, capacity)
        Beam of each cached token; its last extent is the cache's token capacity. Required.
    host_request_types : int32 array (E,)
        RequestType per entry: context 0 before generation 1. Required.
    layer_idx : int
        This layer: selects its window and its layer in the paged pool. Required.
    num_heads : int
        `H`. Required.
    num_kv_heads : int
        `Hkv`, dividing `H` (MHA, GQA or MQA). Required.
    hidden_size_per_head : int
        `Dh`. Required.
    q_scaling : float
        `QK^T` is scaled by `1 / (q_scaling sqrt(Dh))`. Required.
    attn_logit_softcapping_scale : float
        `c > 0` caps the scaled scores to `c tanh(x / c)`; 0 disables. Default 0.0.
    rotary_embedding_dim : int
        RoPE over the first rotary_embedding_dim elements of each head (even, at most `Dh`); 0 without RoPE.
        Default 0.
    rotary_embedding_base : float
        RoPE base (theta): frequencies `base^(-2i / rotary_embedding_dim)`. Default 10000.0.
    rotary_embedding_scale_type : RotaryScalingType or int
        none, linear (the position divided by rotary_embedding_scale), dynamic (NTK: the base raised past
        rotary_embedding_max_positions), llama3, longrope or yarn (frequencies and tables from the host).
        Default none.
    rotary_embedding_short_m_scale : float
        m-scale on cos/sin recomputed from the frequencies while the newest position is at most
        rotary_embedding_original_max_positions (long_rope, yarn). Default 1.0.
    rotary_embedding_long_m_scale : float
        The m-scale past rotary_embedding_original_max_positions. Default 1.0.
    rotary_embedding_scale : float
        Linear or dynamic scaling factor. Default 1.0.
    rotary_embedding_max_positions : int
        Dynamic scaling starts past it; a longer sequence has its cos/sin recomputed, not read from
        rotary_cos_sin. Default 1024.
    rotary_embedding_original_max_positions : int
        long_rope switches a phase to its long frequencies and table once the phase's longest sequence passes
        it; the m-scale switches at it. Default 1024.
    position_embedding_type : PositionEmbeddingType or int
        learned_absolute (nothing here), rope_gptj, rope_gpt_neox, long_rope, yarn, alibi, alibi_with_scale or
        relative. Default learned_absolute.
    rotary_inv_freq : float32 array (rotary_embedding_dim / 2,), optional
        Frequencies used as they are (linear scaling already in them; llama3: `reference.rope.llama3_inv_freq`).
        Required with long_rope, yarn and llama3; only with a RoPE position_embedding_type. Default None.
    rotary_cos_sin : float32 array (1, num_pos rotary_embedding_dim), optional
        cos/sin table, `(cos, sin)` of position `p`, pair `i` at `2 (p rotary_embedding_dim / 2 + i)`; read at the
        token's position, except with dynamic scaling, past rotary_embedding_max_positions and with
        streamingllm, where cos/sin are recomputed. `reference.rope.plugin_tables`, `long_rope_tables`,
        `yarn_tables` build it. Required with long_rope and yarn. Default None.
    kv_orig_quant_scale : float32 array (1,), optional
        `1 / s`, the INT8/FP8 cache's quantization scale (store `x / s`); only with such a cache
        (kv_cache_quant_mode). Default None.
    kv_quant_orig_scale : float32 array (1,), optional
        `s` (load `code s`); only with an INT8/FP8 cache. Default None.
    attention_output_orig_quant_scale : float32 array (1,), optional
        FP8 output: not built, refused unless None. Default None.
    attention_output_sf_scale : float32 array (1,), optional
        FP4 output scaling factors: not built, refused unless None. Default None.
    kv_cache_quant_mode : QuantMode or int
        QuantMode(0), INT8_KV_CACHE or FP8_KV_CACHE. Default QuantMode(0).
    max_context_length : int, optional
        Bound on the context requests' new tokens, checked. Default None.
    mask_type : AttentionMaskType or int
        padding, causal, sliding_window_causal (causal; the window comes from host_max_attention_window_sizes),
        bidirectional or custom_mask. Default causal.
    block_sparse_block_size : int
        Block-sparse attention (mask_type blocksparse, not built): accepted, not used. Default 64.
    block_sparse_homo_head_pattern : bool
        Likewise. Default False.
    block_sparse_num_local_blocks : int
        Likewise. Default 16.
    block_sparse_vertical_stride : int
        Likewise. Default 8.
    alibi_slopes : float32 array (H,), optional
        ALiBi slopes, with alibi and alibi_with_scale. Default None.
    tp_size : int
        Tensor-parallel ranks; the heads given are this rank's. Default 1.
    tp_rank : int
        This rank, `0 <= tp_rank < tp_size`. Default 0.
    vision_start : int
        CogVLM vision positions: not built, refused unless -1. Default -1.
    vision_length : int
        Likewise. Default -1.
    kv_cache_block_offsets : int array (1, >= E, 2, max_blocks), optional
        Paged block table: the offset `o` of entry `e`, K (0) or V (1), block index `t // tokens_per_block`
        addresses block `o + 2 layer_idx` of the pool seen as blocks (a manager writes
        `o = block num_layers 2 + kv`). Entries may share blocks read-only (a common prefix); a slot one entry
        writes must not be written or read by another in the same call (a data race on a GPU, refused). Only
        with paged_kv_cache True. Default None.
    host_kv_cache_block_offsets : int array, optional
        Host copy of kv_cache_block_offsets, checked equal; only with paged_kv_cache True. Default None.
    host_kv_cache_pool_pointers : int64 array (num_pools, 2), optional
        Raw pool addresses: refused; pass the pool as kv_cache_pool. Default None.
    host_kv_cache_pool_mapping : int32 array (num_layers, 2), optional
        (pool, layer in pool) per layer: one pool only, layer l as (0, l); only with paged_kv_cache True.
        Default None.
    do_cross_attention : bool
        Attend to encoder states (cross_kv, cached by the context phase). Default False.
    cross_kv : array ([1,] encoder tokens, 2 Hkv Dh) packed or (E, max encoder length, 2 Hkv Dh), optional
        `[K | V]` of the context requests' encoder tokens, qkv's dtype. Default None.
    cross_kv_length : int, optional
        Longest encoder length, checked with cross attention (not read without it: TensorRT-LLM passes it to a
        decoder's self attention too). Default None.
    encoder_input_lengths : int array (E,), optional
        Encoder tokens per entry, with cross attention (not read without it, as cross_kv_length). Default None.
    relative_attention_bias : array (H, L, L) or (H, num_buckets), optional
        Relative attention bias (position_embedding_type relative): a regular table, or T5 buckets with
        max_distance > 0. qkv's dtype. Default None.
    logn_scaling : float32 array (>= max L_e,), optional
        Qwen's logn attention: Q times `logn_scaling[p]` after RoPE, `p` the absolute position
        (`reference.rope.logn_scaling`). Default None.
    max_distance : int
        T5 bucket distance; 0 means a regular relative bias table. Default 0.
    host_context_lengths : int array (E,), optional
        Host copy of context_lengths, checked equal. Default None.
    qkv_bias : array ((H + 2 Hkv) Dh,), optional
        Added to qkv before RoPE, qkv's dtype. Default None.
    use_cache : bool
        False runs whole contexts without reading or writing a cache (past_key_value, kv_cache_pool and the block
        tables stay None). Default True.
    spec_decoding_is_generation_length_variable : bool
        Speculative decoding setting: accepted, not used. Default False.
    spec_decoding_max_generation_length : int
        Likewise. Default 0.
    spec_decoding_generation_lengths : int array, optional
        Speculative decoding: not built, refused unless None. Default None.
    spec_decoding_position_offsets : int array, optional
        Likewise. Default None.
    spec_decoding_packed_mask : int array, optional
        Likewise. Default None.
    spec_decoding_use : array, optional
        Likewise. Default None.
    long_rope_rotary_inv_freq : float32 array (rotary_embedding_dim / 2,), optional
        long_rope's long frequencies. Required with long_rope. Default None.
    long_rope_rotary_cos_sin : float32 array (1, num_pos rotary_embedding_dim), optional
        long_rope's long table, laid out as rotary_cos_sin. Required with long_rope. Default None.
    mrope_rotary_cos_sin : array, optional
        Multimodal RoPE: not built, refused unless None. Default None.
    mrope_position_deltas : array, optional
        Likewise. Default None.
    host_runtime_perf_knobs : int64 array, optional
        Kernel choices: accepted, not used. Default None.
    host_context_progress : array, optional
        Layer-wise progress tracking: accepted, not used. Default None.
    is_mla_enabled_flag : bool
        Multi-head latent attention: not built, refused unless False. Default False.
    q_lora_rank : int
        MLA: refused unless 0. Default 0.
    kv_lora_rank : int
        MLA: refused unless 0. Default 0.
    qk_nope_head_dim : int
        MLA: refused unless 0. Default 0.
    qk_rope_head_dim : int
        MLA: refused unless 0. Default 0.
    v_head_dim : int
        MLA: refused unless 0. Default 0.
    q_b_proj : array, optional
        MLA: refused unless None. Default None.
    kv_b_proj : array, optional
        MLA: refused unless None. Default None.
    k_b_proj_trans : array, optional
        MLA: refused unless None. Default None.
    skip_attn : bool array (1,), optional
        Skipping the attention: not built, refused unless None. Default None.
    cp_group : list of int
        Context-parallel group: accepted, not used. Default [0].
    cp_size : int
        Context parallelism: refused unless 1. Default 1.
    cp_rank : int
        Context parallelism: refused unless 0. Default 0.
    num_kv_heads_origin : int
        KV heads before tensor parallelism: accepted, not used. Default -1.
    remove_input_padding : bool
        Plugin config: packed (True) or padded qkv. Default True.
    paged_kv_cache : bool
        Plugin config: the paged cache kv_cache_pool (True) or past_key_value. Default False.
    tokens_per_block : int
        Plugin config: tokens per paged block, a power of two. Default 64.
    streamingllm : bool
        Plugin config: StreamingLLM (keys cached before RoPE, rotated at their cache index; a dense context
        phase). Default False.
    context_fmha_type : int
        Plugin config: 0 disabled (the unfused path), 1 enabled, 2 enabled_with_fp32_acc. Default 1.
    use_fp8_context_fmha : bool
        Plugin config: FP8 context FMHA (Q, K, V and the probabilities in e4m3), with an FP8 cache.
        Default False.
    multi_block_mode : bool
        Plugin config: split long generation keys over several blocks (kernels). Default True.
    kv_cache_pool : array (num_blocks, num_layers, 2, Hkv, tokens_per_block, Dh), optional
        The paged pool, qkv's dtype, int8 or float8_e4m3fn, written in place. Only with paged_kv_cache True
        (with False the call runs on past_key_value, so a pool given then is refused). Default None.
    backend : str
        "auto" (NumPy: reference, GPU arrays: kernels), "reference" or "numba". Default "auto".
    threads : int
        The kernels' block size, a multiple of 32 up to 1024; the reference ignores it. Default 128.
    rung : int, optional
        The kernel of the ladder (docs/kernel-ladder.md) the generation requests run on: 1 shared-memory tiles, 3
        vector loads, 4 split-K (vector loads, the keys split over several blocks with few blocks for the SMs), 5
        rung 5's decode kernel (each GQA group's query heads on tensor cores, K/V loaded straight into the mma's
        registers, its keys split across blocks as rung 4's) where it serves the step, else 3 or 4 as with None;
        None: rung 5's decode kernel where it serves (split where multi_block_mode splits), else 3, or 4 when
        multi_block_mode splits. The decode kernel takes a float16 qkv with a float16, INT8 or FP8 cache, or a
        bfloat16 qkv with a bfloat16 cache (its mma multiplies bfloat16; a quantized cache keeps a bfloat16 qkv on
        rung 3 or 4), head size 32, 64 or 128, beams, sink tokens, cross attention and sequences past the cyclic
        attention window, not StreamingLLM with RoPE (its cached keys are rotated as they load); a layer whose
        cache is not aligned for 16-byte loads runs
        rung 3. Rungs 3 to 5 accumulate in float32: a float64 qkv runs on rung 1, and asking for 3 or 4 with one
        raises. Context requests (the fused context FMHA) run on the tensor cores: rung 6 (FlashAttention-2
        tiles, a float16 or bfloat16 qkv, head size 16 to 128, every key a new token: no chunked context or cross
        attention) or rung 5 (a float16 qkv whose head size fits its tiles), by their bounds where both serve,
        else on rung 1 (rung 1 forces it; 5 and 6 ask for theirs and raise where it cannot run, the generation
        requests then as with None; 3 and 4 leave it to the default). The unfused path (context_fmha_type 0, FP8
        context FMHA) is its own. The reference ignores it. Default None.
    num_splits : int, optional
        Split-K's count of key ranges for the generation requests, 1 to 64 (rung 4, rung 5's decode kernel, rung
        1's multi-block mode, or None's choice); None: chosen from the SMs the grid leaves idle (with
        multi_block_mode). Not with rung 3.
        Default None.

    Returns
    -------
    output : array (T, H Dh) packed or (E, max_seqlen, H Dh) padded
        qkv's dtype; padding rows are zero.
    present_key_value : array or None
        past_key_value itself (written in place), None with a paged cache or use_cache False.

    Raises
    ------
    ValueError
        A value, shape or combination TensorRT-LLM's document does not allow, or a feature not built here; the
        message starts with the argument's name. An argument the call would not read under another one's setting
        is refused, naming both: kv_cache_pool or a block table with paged_kv_cache False, past_key_value with it
        True, a cache with use_cache False, KV scales with kv_cache_quant_mode QuantMode(0), rotary_inv_freq
        without RoPE. Raised before any kernel runs; the cache is untouched.
    TypeError
        A dtype or argument kind that does not fit (an index tensor of floats, a non-bool mask).

    Examples
    --------
    One context request of 3 tokens, then its first generation step, on a contiguous cache:

    >>> import numpy as np, cacheattn
    >>> H, Dh = 2, 4
    >>> cache = np.zeros((1, 2, H, 8, Dh), np.float32)
    >>> step = dict(past_key_value=cache, host_max_attention_window_sizes=np.array([8], np.int32),
    ...             host_sink_token_length=np.array([0], np.int32), cache_indirection=np.zeros((1, 1, 8), np.int32),
    ...             layer_idx=0, num_heads=H, num_kv_heads=H, hidden_size_per_head=Dh, q_scaling=1.0)
    >>> qkv = np.random.default_rng(0).standard_normal((3, 3 * H * Dh)).astype(np.float32)
    >>> out, present = cacheattn.gpt_attention(qkv=qkv, sequence_length=np.array([3]),
    ...     host_past_key_value_lengths=np.array([0]), context_lengths=np.array([3]),
    ...     host_request_types=np.array([0]), **step)
    >>> out.shape, present is cache
    ((3, 8), True)
    >>> out, _ = cacheattn.gpt_attention(qkv=qkv[:1], sequence_length=np.array([4]),
    ...     host_past_key_value_lengths=np.array([3]), context_lengths=np.array([3]),
    ...     host_request_types=np.array([1]), **step)
    >>> out.shape
    (1, 8)
    """
    # Exactly a plan of this step, run for this layer: both paths share every line.
    step = {k: v for k, v in locals().items() if k not in LAYER_INPUTS and k != "backend"}
    return GptAttentionPlan(step).run(qkv=qkv, past_key_value=past_key_value, kv_cache_pool=kv_cache_pool,
                                      layer_idx=layer_idx, qkv_bias=qkv_bias, kv_orig_quant_scale=kv_orig_quant_scale,
                                      kv_quant_orig_scale=kv_quant_orig_scale, cross_kv=cross_kv,
                                      relative_attention_bias=relative_attention_bias, backend=backend)


RUNGS = (1, 3, 4, 5, 6)  # gpt_attention's `rung`: 3 and 4 the generation's kernel, 5 and 6 the context phase's


class GptAttentionPlan:
    """One batch step of `gpt_attention`, checked once, run once per layer (`plan_gpt_attention` builds it).

    The step is what TensorRT-LLM's plugin holds as attributes and the step's index tensors (sequence_length,
    host_past_key_value_lengths, context_lengths, host_request_types, cache_indirection, kv_cache_block_offsets,
    windows, sinks, heads, head size, tokens_per_block, quant mode, position embedding, masks, ...); a layer brings
    its own qkv, cache, layer_idx, KV scales, qkv_bias, cross_kv and relative_attention_bias. Building the plan
    validates the step and reads its device index tensors back once; `run` checks only the layer's inputs, and on
    the kernels reuses the step's uploaded tables, scratch and launch geometry (prepared at the first layer of each
    qkv shape, dtype, array kind and window), reading nothing back from the device. The layers of one plan run one
    after another on the caller's stream: they share its scratch."""

    def __init__(self, step: dict):
        launch = {name: step.pop(name) for name in ("threads", "rung", "num_splits")}
        self._data = {name: step[name] for name in STEP_DATA}
        self._step = validate_step(step)
        threads = check_int("threads", launch["threads"], low=32, high=1024)
        if threads % 32:
            raise ValueError(f"threads: expected a multiple of 32 (whole warps), got {threads}")
        check_launch(launch["rung"], None, launch["num_splits"], rungs=RUNGS, split_rungs=(1, 4, 5))
        self._launch = dict(launch, threads=threads)
        self._prepared = {}                 # (array kind, dtype, qkv shape, window) -> the kernels' StepLaunch

    def __repr__(self) -> str:
        """The step, then one line per phase (context, generation) and per qkv dtype, shape and window the kernels
        ran: the rung, the split count and why. The kernels choose at the first layer of each (the choice depends
        on qkv's dtype and the layer's window); until then each phase says so."""
        f = self._step["facts"]
        E, contexts = f["E"], int(f["is_context"].sum())
        phases = [p for p, n in (("context", contexts), ("generation", E - contexts)) if n]
        lines = [f"GptAttentionPlan({E} entries: {contexts} context, {E - contexts} generation; {f['H']} heads over "
                 f"{f['Hkv']} kv heads, head size {f['Dh']}; {asked_text(self._launch)})"]
        for (_, dtype, shape, window), step in self._prepared.items():
            where = f"{dtype.name} qkv {tuple(shape)}, window {window}"
            lines += [phase_line(f"{phase} ({where})", *_phase_choice(step, phase)) for phase in phases]
        if not self._prepared:
            lines += [f"  {phase}: not chosen yet: the kernels choose at the first layer run on them, by qkv's dtype "
                      f"and the layer's window (the reference runs no kernel)" for phase in phases]
        return "\n".join(lines)

    @arrays.accepts_torch
    def run(self, *, qkv, layer_idx: int, past_key_value=None, kv_cache_pool=None, qkv_bias=None,
            kv_orig_quant_scale=None, kv_quant_orig_scale=None, cross_kv=None, relative_attention_bias=None,
            backend: str = "auto") -> tuple:
        """One layer of the planned step: `gpt_attention(**step, **layer)`, the same output bit for bit.

        Parameters are gpt_attention's per-layer ones (see its docstring): qkv, layer_idx, the layer's cache
        (past_key_value, or kv_cache_pool with paged_kv_cache), kv_orig_quant_scale / kv_quant_orig_scale (INT8 /
        FP8 cache), qkv_bias, cross_kv (do_cross_attention) and relative_attention_bias (position type relative),
        and backend. Returns (output, present_key_value) as gpt_attention. Raises ValueError / TypeError naming the
        layer's argument at fault (a qkv whose tokens do not match the step's, a cache too small for this layer's
        window, a layer outside the pool), before any kernel runs."""
        layer = dict(qkv=qkv, past_key_value=past_key_value, kv_cache_pool=kv_cache_pool, layer_idx=layer_idx,
                     qkv_bias=qkv_bias, kv_orig_quant_scale=kv_orig_quant_scale,
                     kv_quant_orig_scale=kv_quant_orig_scale, cross_kv=cross_kv,
                     relative_attention_bias=relative_attention_bias)
        data = {**self._data, **{name: layer[name] for name in LAYER_DATA}}
        engine = arrays.resolve_backend(backend, data)
        checked = validate_layer(self._step, layer)
        if dtype_of(qkv) == np.float64:
            check_launch(self._launch["rung"], None, self._launch["num_splits"], rungs=RUNGS, split_rungs=(1, 4, 5),
                         float64="qkv")
        if self._launch["rung"] == 5 and dtype_of(qkv).name not in ("float16", "bfloat16"):
            raise ValueError(f"rung: 5 (tensor cores, mma.sync on float16, or bfloat16 in generation) needs a "
                             f"float16 or bfloat16 qkv, got {dtype_of(qkv).name}")
        if self._launch["rung"] == 6 and dtype_of(qkv).name not in ("float16", "bfloat16"):
            raise ValueError(f"rung: 6 (FlashAttention-2 tiles, mma.sync on float16 or bfloat16) needs a float16 or "
                             f"bfloat16 qkv, got {dtype_of(qkv).name}")
        if engine != "reference":
            check_bfloat16_arch("qkv", qkv, arrays.compute_capability)
            return self._run_kernels({**checked, **{k: arrays.as_kernel_array(x) for k, x in data.items()}})

        def call(host):
            return reference.gpt_attention(**{**checked, **host})
        return arrays.run_reference(data, ("past_key_value", "kv_cache_pool"), call)

    def _run_kernels(self, call: dict) -> tuple:
        launches = arrays.kernels().trtllm_gpt_attention
        given = call
        if dtype_of(call["qkv"]).name == "bfloat16":      # the kernels take bfloat16 as its bits
            call = launches.bfloat16_call(call)
        qkv = call["qkv"]
        window = int(call["host_max_attention_window_sizes"][0])
        key = (type(qkv), dtype_of(given["qkv"]), tuple(qkv.shape), window)     # bfloat16, not its bits' uint16
        step = self._prepared.get(key)
        if step is None:
            step = self._prepared[key] = launches.prepare_step(
                like=qkv, window=window, num_sms=None, rounds_as=call.get("rounds_as"),
                choose_context=context_on_rung_6, **self._launch,
                **{k: v for k, v in call.items() if k not in LAYER_INPUTS and k != "rounds_as"})
        result = launches.run_layer(step, **{name: call[name] for name in LAYER_INPUTS})
        return launches.bfloat16_results(given, *result) if call is not given else result


def context_on_rung_6(*, threads, sms, **shape) -> tuple:
    """(rung 6 wins, why) for a step's context entries where rungs 5 and 6 both serve them: the bound model's
    choice (`cacheattn.choose_kernel`) for their shape, causal, among rungs 1, 5 and 6."""
    plan = choose_kernel(AttentionShape(**shape, causal=True), threads=threads, sms=sms, rungs=(1, 5, 6),
                         register_decode=False)
    return plan.rung == 6, plan.reason


def _phase_choice(s, phase: str) -> tuple:
    """(rung, split count, why) of one phase of a prepared step (the kernels' StepLaunch), as its launches run."""
    if phase == "context":
        if s.unfused:
            return 1, 1, ("the unfused path (scores in global memory, softmax, P V): context_fmha_type 0 or FP8 "
                          "context FMHA")
        if s.fused_rung in (5, 6):
            return s.fused_rung, 1, s.fused_reason
        return 1, s.num_splits, s.fused_reason + (" (multi-block)" if s.num_splits > 1 else "")
    if not s.vector_generation:
        why = ("rung=1 asked for" if s.rung == 1 else "rungs 3 to 5 accumulate in float32, qkv is float64"
               if s.acc_t != np.float32 else "no cache to read the generation tokens from")
        return 1, s.num_splits, f"shared-memory tiles, with the context entries: {why}"
    if s.register_generation:
        return 5, s.register_splits, s.generation_reason + " (rung 3 for a layer whose cache is not aligned for " \
                                                           "16-byte loads)"
    from kernels_numba.trtllm_generation import step_splits

    rung = None if s.rung in (5, 6) else s.rung
    itemsize = 1 if s.quant else 2 if s.rounds_as == "bfloat16" else np.dtype(s.rounds_as).itemsize
    splits = step_splits(rung, s.generation_splits, s.multi_block_mode, s.num_sms, s.generation_new, s.kvlens,
                         s.window, s.H, s.Hkv, s.Dh, itemsize, s.threads)
    chosen = 4 if splits > 1 or rung == 4 else 3
    why = (f"rung={s.rung} asked for" if s.rung in (3, 4) else
           f"rung 5's decode kernel does not serve it: {s.generation_reason.removeprefix('rung 3/4: ')}")
    mode = f"; its keys split {splits} ways (multi-block)" if splits > 1 else ""
    return chosen, splits, f"vector loads: {why}{mode}"


@arrays.accepts_torch
def plan_gpt_attention(**step) -> GptAttentionPlan:
    """Plan one batch step of `gpt_attention` (as FlashInfer's `plan`): validate the step once, then
    `plan.run(qkv=..., layer_idx=..., kv_cache_pool=...)` per layer.

    Takes gpt_attention's keyword arguments, with its names and defaults, except the per-layer ones (qkv,
    past_key_value, kv_cache_pool, layer_idx, qkv_bias, kv_orig_quant_scale, kv_quant_orig_scale, cross_kv,
    relative_attention_bias) and backend, which `GptAttentionPlan.run` takes: the step's index tensors
    (sequence_length, host_past_key_value_lengths, context_lengths, host_request_types, cache_indirection,
    kv_cache_block_offsets, ...), the model's attributes and plugin settings, threads, rung and num_splits.

    Every error gpt_attention raises about these is raised here, naming the same argument, except what depends on
    a layer's window or pool (the slots a cache must hold, the blocks and shared pages of the block table): `run`
    checks that at the first layer with each window, from the host copies kept here (no device read).
    `gpt_attention(**step, **layer)` is `plan_gpt_attention(**step).run(**layer)`.

    Examples
    --------
    >>> import numpy as np, cacheattn
    >>> H, Dh, layers = 2, 4, 2
    >>> caches = [np.zeros((1, 2, H, 8, Dh), np.float32) for _ in range(layers)]
    >>> plan = cacheattn.plan_gpt_attention(sequence_length=np.array([3]), host_past_key_value_lengths=np.array([0]),
    ...     context_lengths=np.array([3]), host_request_types=np.array([0]),
    ...     host_max_attention_window_sizes=np.array([8], np.int32), host_sink_token_length=np.array([0], np.int32),
    ...     cache_indirection=np.zeros((1, 1, 8), np.int32), num_heads=H, num_kv_heads=H, hidden_size_per_head=Dh,
    ...     q_scaling=1.0)
    >>> rng = np.random.default_rng(0)
    >>> outs = [plan.run(qkv=rng.standard_normal((3, 3 * H * Dh)).astype(np.float32), layer_idx=l,
    ...                  past_key_value=caches[l])[0] for l in range(layers)]
    >>> [o.shape for o in outs]
    [(3, 8), (3, 8)]
    """
    return GptAttentionPlan(bind_step(_PLAN_PARAMETERS, (), step, function="plan_gpt_attention",
                                       layer_inputs=LAYER_INPUTS))


_PLAN_PARAMETERS = plan_signature(gpt_attention, LAYER_INPUTS, "GptAttentionPlan")
plan_gpt_attention.__signature__ = _PLAN_PARAMETERS

