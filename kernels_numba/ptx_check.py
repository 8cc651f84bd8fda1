"""Compile the kernel variants the launchers produce to PTX, without a GPU.

    python -m kernels_numba.ptx_check [--cc 80 90] [--family ppl onnx] [--full]

The CUDA simulator accepts code that the real compiler rejects, so this runs in a
process *without* NUMBA_ENABLE_CUDASIM. It drives each launcher on small NumPy
inputs with launches recorded instead of run, then compiles each recorded kernel
for the argument types it was given. Needs numba-cuda's cu12/cu13 extra (NVVM).

Kernels come in families (one per operator module). By default each family compiles one
representative per code path: every kernel body, every quantization and rounding path,
every compile-time branch (decode/prefill, ALiBi, each qk_matmul_output stage) at least
once. `--full` compiles the whole cross product (quantization x dtype x shape), which a
release or a session with a GPU can afford; `--full --stride N` every Nth variant of each
kernel. The quick test tier compiles the representatives for sm_90; CI's deep tier the
representatives for sm_80 too, the smaller families whole and FasterTransformer's and
TensorRT-LLM's cross products at a stride.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections import namedtuple

import numpy as np


def _allow_device_functions_without_gpu():
    """numba-cuda asks the current device for its compute capability when a kernel calls a
    device function; with no GPU there is none, so answer for the target being compiled."""
    from numba.cuda import dispatcher
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=_target_cc[0])


_target_cc = [(9, 0)]


# One (quant_bit, dtype, seqlen, alibi) per code path: each quantization's load and store, each rounding
# (float16 / float32), decode and prefill tiles, with and without ALiBi.
PPL_REPRESENTATIVES = ((0, np.float32, 1, False), (8, np.float16, 3, True), (4, np.float32, 3, False),
                       (4, np.float16, 1, True))


def _ppl_launches(full: bool, rung: int = 1, representatives=PPL_REPRESENTATIVES, head_dim: int = 32,
                  dtypes=(np.float16, np.float32), **launch):
    """(label, kernel, args) for the OpenPPL kernels: quant 0/8/4 x dtypes x decode/prefill when full, else
    `representatives`; launch: rung 4's num_splits."""
    from . import _launch
    from .ppl_key_value_cache import key_value_cache
    from .ppl_multi_head_cache_attention import multi_head_cache_attention

    rng = np.random.default_rng(0)
    heads, kv_heads, group = 4, 2, 8
    variants = [(quant_bit, dtype, seqlen, alibi) for quant_bit in (0, 8, 4) for dtype in dtypes
                for seqlen, alibi in ((1, False), (3, True))] if full else representatives
    out = []
    for quant_bit, dtype, seqlen, alibi in variants:
        stored = head_dim // 2 if quant_bit == 4 else head_dim
        cache_dtype = np.int8 if quant_bit else dtype
        scale = np.ones((64, 1, 2, kv_heads, head_dim // group), np.float16) if quant_bit else None
        seqstarts = np.array([0, seqlen, 2 * seqlen])
        kvstarts = np.array([0, seqlen + 2, 2 * seqlen + 4])
        cache = np.zeros((64, 1, 2, kv_heads, stored), cache_dtype)
        q = rng.standard_normal((2 * seqlen, heads, head_dim)).astype(dtype)
        k = rng.standard_normal((2 * seqlen, kv_heads, head_dim)).astype(dtype)
        mask = np.zeros((2 * seqlen, kvstarts[-1]), dtype)
        with _launch.recorded_launches() as launches:
            multi_head_cache_attention(
                q, k, k, seqstarts, kvstarts, np.array([0, 32]), np.array([2, 2]), 1, seqlen, seqlen + 2,
                cache, scale, mask, num_heads=heads, head_dim=head_dim, is_causal=True,
                alibi_slopes=np.ones(heads, np.float32) if alibi else None, num_kv_heads=kv_heads,
                quant_bit=quant_bit, quant_group=group, cache_axes="T L KV H D", rung=rung, **launch)
            static_cache = np.zeros((2, 1, 2, 8, kv_heads, stored), cache_dtype)
            static_scale = np.ones((2, 1, 2, 8, kv_heads, head_dim // group), np.float32) if quant_bit else None
            key_value_cache(k.reshape(2, seqlen, kv_heads, head_dim), k.reshape(2, seqlen, kv_heads, head_dim),
                            2, static_cache, static_scale, quant_bit=quant_bit, quant_group=group,
                            cache_axes="B L KV T H D")
        label = f"quant_bit={quant_bit} {np.dtype(dtype).name} seqlen={seqlen} Dh {head_dim}"
        out += [(label, kernel, args) for kernel, args in launches]
    return out


# One qk_matmul_output mode per dtype: mode 3 compiles every stage (softcap, bias, softmax rows), mode 0 the
# plain product; each dtype's loads and accumulator type once.
ONNX_REPRESENTATIVES = ((np.float16, 3), (np.float32, 2), (np.float64, 0), ("bfloat16", 3))


def _onnx_launches(full: bool):
    """(label, kernel, args) for the ONNX kernels: 3-D with past and mask and 4-D with nonpad and windows, with
    the qk_matmul_output kernels; float16/32/64 x every mode when full, else ONNX_REPRESENTATIVES (bfloat16 among
    them: every kernel on its bits, BFLOAT16_BITS)."""
    import ml_dtypes  # noqa: F401  (registers the "bfloat16" dtype name of a representative)

    from . import _launch
    from .onnx_attention import onnx_attention

    rng = np.random.default_rng(0)
    out = []
    variants = [(dtype, mode) for dtype in (np.float16, np.float32, np.float64) for mode in (0, 1, 2, 3)]
    for dtype, mode in variants if full else ONNX_REPRESENTATIVES:
        q = rng.standard_normal((2, 3, 4 * 8)).astype(dtype)
        k = rng.standard_normal((2, 3, 2 * 8)).astype(dtype)
        past = rng.standard_normal((2, 2, 5, 8)).astype(dtype)
        with _launch.recorded_launches() as launches:
            onnx_attention(q, k, k, np.ones((3, 8), bool), past, past, None, is_causal=1, q_num_heads=4,
                           kv_num_heads=2, qk_matmul_output_mode=mode, softcap=1.0,
                           return_qk_matmul_output=True)
            q4, k4 = q.reshape(2, 3, 4, 8).transpose(0, 2, 1, 3).copy(), past
            onnx_attention(q4, k4, k4, np.zeros((2, 1, 3, 4), dtype), nonpad_kv_seqlen=np.array([3, 5]),
                           left_window_size=2, right_window_size=0)
        label = f"onnx {np.dtype(dtype).name} qk mode {mode}" + _bits_marker(dtype)
        out += [(label, kernel, args) for kernel, args in launches]
    # Rungs 3 and 4 (float16 / float32; float64 stays on rung 1): decode with past 3-D in 16-byte loads, 4-D at head
    # size 12 in element loads, a 3-D prefill with a window; rung 4's split decode and its combine. Every variant
    # in both dtypes when full; else the 16-byte decode on rung 3 (each vector kernel is a long compile; the element
    # loads and the prefill rows are rung 3's code paths that the ladder families compile too, and rung 4's partials
    # the rung4 family's). Rung 5 (tensor cores, float16 only): the prefill, through the same key walk and loads.
    calls = [("decode 3-D", 3, np.float16), ("prefill", 5, np.float16)]
    if full:
        calls = [(what, rung, dtype) for what, rung in (("decode 3-D", 3), ("decode 4-D head 12", 3), ("prefill", 3),
                                                        ("decode 3-D", 4)) for dtype in (np.float16, np.float32)]
        calls += [("prefill", 5, np.float16), ("decode 3-D", 3, "bfloat16"), ("decode 3-D", 4, "bfloat16")]
    for what, rung, dtype in calls:
        past = rng.standard_normal((2, 2, 5, 12 if "4-D" in what else 8)).astype(dtype)
        q_len, splits = (3 if what == "prefill" else 1), (2 if rung == 4 else None)
        with _launch.recorded_launches() as launches:
            if "4-D" in what:
                q = rng.standard_normal((2, 4, 1, 12)).astype(dtype)
                k = rng.standard_normal((2, 2, 1, 12)).astype(dtype)
                onnx_attention(q, k, k, np.zeros((2, 1, 1, 6), dtype), past, past, rung=rung, num_splits=splits)
            else:
                q = rng.standard_normal((2, q_len, 4 * 8)).astype(dtype)
                k = rng.standard_normal((2, q_len, 2 * 8)).astype(dtype)
                onnx_attention(q, k, k, np.ones((1, 5 + q_len), bool), past, past, None, is_causal=1, q_num_heads=4,
                               kv_num_heads=2, softcap=1.0, left_window_size=2 if q_len > 1 else -1, rung=rung,
                               num_splits=splits)
        marker = f" {VECTOR_LOAD}" if "4-D" not in what else ""
        fast = ("vector_attention_kernel", "mma_attention_kernel")

        # Rung 4's attention writes float32 partials (and copies present's bits): its combine rounds to bfloat16.
        rounding = {name: _bits_marker(dtype) if rung != 4 or name == "combine_kernel" else ""
                    for name in fast + ("combine_kernel",)}
        out += [(f"onnx rung {rung} {what} {np.dtype(dtype).name}" + (marker if kernel.py_func.__name__ in fast
                 else "") + rounding[kernel.py_func.__name__], kernel, args) for kernel, args in launches
                if kernel.py_func.__name__ in fast + ("combine_kernel",)]
    # Rung 6 (the FlashAttention-2 prefill over present): a 4-D causal GQA prefill at head size 16 with a float
    # mask and softcap, float16 and bfloat16 (the mask and the mma on its bits). A rung-6 compile takes half a
    # minute: --full only (CI's deep tier), as the rung6 family.
    for dtype in (np.float16, "bfloat16") if full else ():
        q = rng.standard_normal((2, 4, 3, 16)).astype(dtype)
        k = rng.standard_normal((2, 2, 3, 16)).astype(dtype)
        past = rng.standard_normal((2, 2, 5, 16)).astype(dtype)
        with _launch.recorded_launches() as launches:
            onnx_attention(q, k, k, np.zeros((2, 1, 3, 8), dtype), past, past, None, is_causal=1, softcap=1.0,
                           rung=6)
        out += [(f"onnx rung 6 prefill {np.dtype(dtype).name}" + _bits_marker(dtype), kernel, args)
                for kernel, args in launches if kernel.py_func.__name__ == "flash_attention_kernel"]
    return out


# (is_batch_major_cache, dtype, step, ia3, head size) per code path: each layout's addressing, float16 and
# float32 rounding, step 1 (layout kernel, with and without IA3) and a later step, the smallest and largest
# head size (the largest tests the shared-memory plan); every launch also runs the probabilities kernel.
FT_REPRESENTATIVES = ((True, np.float16, 1, True, 32), (False, np.float32, 1, False, 256),
                      (True, np.float32, 2, False, 256), (False, np.float16, 3, False, 32))


# FasterTransformer's head-size dispatch list, as cacheattn.ft.HEAD_SIZES has it (the kernels never import the public
# face; tests/test_ptx.py holds the two equal), and the two weight records the launcher reads by attribute.
FT_HEAD_SIZES = (32, 48, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256)
DenseWeight = namedtuple("DenseWeight", "kernel bias", defaults=(None,))
AttentionWeight = namedtuple("AttentionWeight", "query_weight key_weight value_weight attention_output_weight "
                                                "ia3_key_weight ia3_value_weight", defaults=(None, None))


def _ft_launches(full: bool):
    """(label, kernel, args) for the FasterTransformer cross-attention kernels: both layouts x float16/float32 x
    step 1 with/without IA3 and a later step x every head size when full, else FT_REPRESENTATIVES; the attention
    on rungs 1, 3 and 4."""
    from . import _launch
    from .ft_cross_attention import cross_attention

    rng = np.random.default_rng(0)
    variants = [(major, dtype, step, ia3, size) for major in (True, False) for dtype in (np.float16, np.float32)
                for step, ia3 in ((1, False), (1, True), (2, False)) for size in FT_HEAD_SIZES] if full \
        else FT_REPRESENTATIVES
    out = []
    batch, heads, length, d_model = 2, 2, 5, 16
    for major, dtype, step, ia3, size in variants:
        hidden = heads * size
        x = 16 // np.dtype(dtype).itemsize

        def dense(rows, cols, dtype=dtype):
            return DenseWeight(rng.standard_normal((rows, cols)).astype(dtype), np.zeros(cols, dtype))

        ia3_weights = (DenseWeight(np.ones((3, hidden), dtype)),) * 2 if ia3 else (None, None)
        weights = AttentionWeight(dense(d_model, hidden), dense(d_model, hidden), dense(d_model, hidden),
                                  dense(hidden, d_model), *ia3_weights)
        k_shape = (batch, heads, size // x, length, x) if major else (batch, length, heads, size)
        v_shape = (batch, heads, length, size) if major else k_shape
        label = f"ft {'batch-major' if major else 'plain'} {np.dtype(dtype).name} step {step}{' ia3' * ia3} Dh {size}"
        # Rung 1 with every kernel of the step; rungs 3 and 4 (the vector kernel, its partials and the combine) add
        # their attention kernels only.
        for rung, splits in ((1, 1), (3, 1), (4, 2)):
            with _launch.recorded_launches() as launches:
                cross_attention(rng.standard_normal((batch, d_model)).astype(dtype),
                                rng.standard_normal((batch, length, d_model)).astype(dtype), np.array([3, 5]), step,
                                np.zeros(k_shape, dtype), np.zeros(v_shape, dtype), np.array([False, True]),
                                np.array([0, 2]) if ia3 else None, None,
                                np.zeros((batch, heads, 4, length), np.float32), weights=weights, head_num=heads,
                                size_per_head=size, is_batch_major_cache=major, rung=rung, num_splits=splits)
            for kernel, args in launches:
                name = kernel.py_func.__name__
                if rung == 1:
                    out.append((label, kernel, args))
                elif name in ("vector_attention_kernel", "combine_kernel"):    # the vector kernel's 16-byte loads
                    marker = f" {VECTOR_LOAD}" if name == "vector_attention_kernel" else ""
                    out.append((f"{label} rung {rung}{marker}", kernel, args))
    return out


# One (dtype, kv cache quant mode, position embedding, paged, qkv bias, extras) per code path, five calls in all:
# each dtype's rounding and accumulator, the INT8 / e4m3 stores and loads, GPT-J / GPT-NeoX RoPE, ALiBi, T5 bias
# and custom mask, both cache layouts, the unfused context path plain and FP8 (context_fmha_type 0 /
# use_fp8_context_fmha), StreamingLLM (keys rotated on load), cross attention (its copy kernel), multi-block
# (partials and combine). Each call has a context chunk that wraps the cyclic cache (the write-after launch)
# next to two beams, except "decode" (the two beams alone, so the vector kernel reads the new token from its cache
# slot). The beams' generation runs on the vector kernel (rung 3, rung 4 with multi-block): float16 read from the cache
# slot, INT8 split (partials), FP8 rotated in registers; on rung 1 in float64 and where "rung1" says so (those vector
# kernels would repeat the others' code paths, each a long compile; --full compiles FP8 folded without rotation too).
# Generation on the vector kernel: "streaming" (FP8, paged) compiles it with TensorRT-LLM's walker; its float16-cache
# path is the one the ONNX, FasterTransformer and rung3 families compile, its split-K partials the rung4 family's.
# A plain float16 decode and "multi-block" (INT8, contiguous, 3 splits) would compile more copies at 10-15 s
# each: --full adds them (TRTLLM_FULL_ONLY). The context phase
# runs on rung 5 (tensor cores) wherever rung 1 is not forced on a float16 call: "streaming" compiles it once, on
# every load it has (the scratch's 16-byte loads, FP8 codes in 16-byte loads rotated in registers, paged).
TRTLLM_REPRESENTATIVES = ((np.float16, 0, 2, True, True, {"unfused", "rung1"}),
                          (np.float16, 128, 6, True, False, {"t5-mask", "fp8-fmha", "rung1"}),
                          (np.float16, 128, 1, True, False, {"streaming"}),
                          (np.float64, 0, 0, False, True, {"cross"}),
                          ("bfloat16", 64, 2, False, True, {"rung1"}))   # round_to_bfloat16 in bias, RoPE, INT8 store
# Rung 6's context compiles (half a minute each) are --full only, as the rung6 family.
TRTLLM_FULL_ONLY = ((np.float16, 0, 2, True, False, {"decode"}),
                    (np.float32, 64, 4, False, False, {"multi-block"}),
                    ("bfloat16", 0, 4, False, False, {"flash"}),                  # the context on rung 6, ALiBi
                    (np.float16, 64, 6, True, False, {"flash", "t5-mask"}))


def _trtllm_launches(full: bool):
    """(label, kernel, args) for the TensorRT-LLM gpt_attention kernels: float16/32/64 x no/INT8/FP8 cache x
    position embedding x layout when full, else TRTLLM_REPRESENTATIVES."""
    import ml_dtypes  # noqa: F401  (registers the "bfloat16" dtype name of a representative)

    from . import _launch
    from .trtllm_gpt_attention import gpt_attention

    rng = np.random.default_rng(0)
    H, Hkv, Dh, window, tpb = 4, 2, 16, 4, 2
    variants = [(dtype, quant, position, paged, bias, set()) for dtype in (np.float16, np.float32, np.float64)
                for quant in (0, 64, 128) for position in (0, 1, 2, 4) for paged in (False, True)
                for bias in (False, True)] if full else []
    out = []
    representatives = TRTLLM_REPRESENTATIVES + (TRTLLM_FULL_ONLY if full else ())
    for dtype, quant, position, paged, bias, extras in variants + list(representatives):
        cache_dtype = {0: dtype, 64: np.int8, 128: np.uint8}[quant]
        slots = -(-window // tpb) * tpb
        decode = "decode" in extras
        # a chunk, then one sequence's two beams (decode: the beams alone)
        past, new = (np.array([3, 3]), np.array([1, 1])) if decode else (np.array([2, 3, 3]), np.array([5, 1, 1]))
        call = dict(qkv=rng.standard_normal((int(new.sum()), (H + 2 * Hkv) * Dh)).astype(dtype),
                    past_key_value=None if paged else np.zeros((3, 2, Hkv, slots, Dh), cache_dtype),
                    kv_cache_pool=np.zeros((3 * slots // tpb, 1, 2, Hkv, tpb, Dh), cache_dtype) if paged else None,
                    kv_cache_block_offsets=(np.arange(3 * 2 * (slots // tpb)).reshape(1, 3, 2, -1) if paged else None),
                    attention_mask=None, sequence_length=past + new, host_past_key_value_lengths=past,
                    host_max_attention_window_sizes=np.array([window]), host_sink_token_length=np.array([0]),
                    context_lengths=np.array([2, 2] if decode else [5, 2, 2]),
                    cache_indirection=np.zeros((1, 2, window), np.int32),
                    host_request_types=np.array([1, 1] if decode else [0, 1, 1]), layer_idx=0, num_heads=H,
                    num_kv_heads=Hkv,
                    hidden_size_per_head=Dh, q_scaling=1.0, attn_logit_softcapping_scale=2.0,
                    rotary_embedding_dim=Dh if position in (1, 2) else 0, position_embedding_type=position,
                    kv_orig_quant_scale=10.0, kv_quant_orig_scale=0.1, kv_cache_quant_mode=quant,
                    alibi_slopes=np.ones(H, np.float32) if position == 4 else None,
                    qkv_bias=np.ones((H + 2 * Hkv) * Dh, dtype) if bias else None, paged_kv_cache=paged,
                    tokens_per_block=tpb)
        if "unfused" in extras:
            call.update(context_fmha_type=0)
        if "flash" in extras:           # rung 6 takes a context whose keys are all new tokens: no past
            call.update(host_past_key_value_lengths=np.array([0, 3, 3]), sequence_length=np.array([5, 4, 4]))
        if "streaming" in extras:
            call.update(streamingllm=True, host_sink_token_length=np.array([1]),
                        host_past_key_value_lengths=np.array([0, 3, 3]), sequence_length=np.array([5, 4, 4]))
        if "t5-mask" in extras:
            call.update(mask_type=6, attention_mask=np.ones((int(new.sum()), 8), bool), max_distance=12,
                        relative_attention_bias=rng.standard_normal((H, 8)).astype(dtype))
        if "fp8-fmha" in extras:
            call.update(use_fp8_context_fmha=True)
        if "cross" in extras:
            call.update(do_cross_attention=True, encoder_input_lengths=np.array([3, 2, 2]),
                        cross_kv=rng.standard_normal((3, 2 * Hkv * Dh)).astype(dtype))
        with _launch.recorded_launches() as launches:
            gpt_attention(**call, num_splits=3 if "multi-block" in extras else None,
                          rung=1 if "rung1" in extras else 6 if "flash" in extras else None)
        label = (f"trtllm {'+'.join(sorted(extras)) or 'self'} {np.dtype(dtype).name} quant {quant} pos {position}"
                 f"{' paged' if paged else ''}{_bits_marker(dtype)}")
        # The generation entries' vector kernel (rungs 3 and 4): rows of 16-byte multiples at Dh 16 in every format.
        # The context phase's mma kernel (rung 5) reads the scratch in 16-byte loads too.
        vector = ("vector_attention_kernel", "mma_attention_kernel")
        out += [(label + (f" {VECTOR_LOAD}" if kernel.py_func.__name__ in vector else ""), kernel,
                 args) for kernel, args in launches]
    return out + _trtllm_decode_launches(full)


# The generation entries on rung 5's decode kernel (head size 32), split two ways: FP8 (e4m3 codes, the folded
# per-tensor scale, K and V pages apart, the new token from the scratch, the split partials) and bfloat16 (its mma,
# P packed by cvt.rn.bf16x2.f32, the combine's bfloat16 store); --full adds the slot maps of two beams (the cyclic
# formula, cache_indirection's rows) and of 4 sinks (a paged bubble), and float16 and INT8, each with both slot maps.
TRTLLM_DECODE_VARIANTS = ((np.float16, 128), ("bfloat16", 0))
TRTLLM_DECODE_FULL_ONLY = ((np.float16, 0), (np.float16, 64))
TRTLLM_DECODE_SLOTS = ()
TRTLLM_DECODE_SLOTS_FULL_ONLY = ("beams", "sinks")


def _trtllm_decode_launches(full: bool):
    import ml_dtypes

    from . import _launch
    from .trtllm_gpt_attention import gpt_attention

    rng = np.random.default_rng(1)
    H, Hkv, Dh, tpb, past = 4, 2, 32, 16, np.array([20, 20])
    out = []
    for dtype, quant in TRTLLM_DECODE_VARIANTS + (TRTLLM_DECODE_FULL_ONLY if full else ()):
        dtype = ml_dtypes.bfloat16 if isinstance(dtype, str) else dtype        # the kernels take its bits
        name = np.dtype(dtype).name
        maps = TRTLLM_DECODE_SLOTS + (TRTLLM_DECODE_SLOTS_FULL_ONLY if full else ()) if name == "float16" else ()
        for slots in ("",) + maps:
            cache_dtype = {0: dtype, 64: np.int8, 128: np.uint8}[quant]
            sinks, beams = (4, 1) if slots == "sinks" else (0, 2) if slots == "beams" else (0, 1)
            blocks = 2 * -(-int(past[0] + 1 + 12) // tpb)       # room for the sinks' bubble of 12
            call = dict(qkv=rng.standard_normal((2, (H + 2 * Hkv) * Dh)).astype(dtype), past_key_value=None,
                        kv_cache_pool=np.zeros((2 * blocks, 1, 2, Hkv, tpb, Dh), cache_dtype),
                        kv_cache_block_offsets=np.arange(2 * blocks).reshape(1, 2, 2, -1), attention_mask=None,
                        sequence_length=past + 1, host_past_key_value_lengths=past,
                        host_max_attention_window_sizes=np.array([36 if sinks else 64]),
                        host_sink_token_length=np.array([sinks]), streamingllm=bool(sinks),
                        context_lengths=np.array([2, 2]),
                        cache_indirection=np.zeros((2 // beams, beams, 64), np.int32),
                        host_request_types=np.array([1, 1]), layer_idx=0, num_heads=H, num_kv_heads=Hkv,
                        hidden_size_per_head=Dh, q_scaling=1.0, kv_orig_quant_scale=10.0, kv_quant_orig_scale=0.1,
                        kv_cache_quant_mode=quant, paged_kv_cache=True, tokens_per_block=tpb)
            with _launch.recorded_launches() as launches:
                gpt_attention(**call, rung=5, num_splits=2)
            label = f"trtllm rung5 decode {name} quant {quant} paged split{' ' + slots if slots else ''}"
            out += [(label + _bits_marker(name), kernel, args) for kernel, args in launches
                    if kernel.py_func.__name__ == "gqa_decode_attention_kernel"]
    return out


def _ladder_launches(full: bool):
    """The kernel ladder's later rungs (rung 2: a warp per key, warp shuffles) on the OpenPPL launches; the
    cache-store kernels they share with rung 1 are the "ppl" family's."""
    return [(f"rung 2 {label}", kernel, args) for label, kernel, args in _ppl_launches(full, rung=2)
            if kernel.py_func.__name__ == "warp_attention_kernel"]


# Rung 3 on the cache formats' vector unpacking (float16, int8, int4 rows of 16-byte multiples at head_dim 32;
# float32's bit cast with --full; one prefill with ALiBi, the rest decode: prefill rows multiply the unrolled code
# and the compile time), then the element-load fallback (int8 rows of 24 bytes).
RUNG3_REPRESENTATIVES = ((0, np.float16, 1, False), (8, np.float16, 3, True), (4, np.float32, 1, False))
RUNG3_FALLBACK = ((8, np.float32, 1, False),)
# A label with one of these markers must compile to its vector load (PTX_MARKERS): rungs 3 and 4 read int4 in 8-byte
# chunks, every other format in 16-byte ones (`_cache.chunk_elements`).
VECTOR_LOAD, VECTOR_LOAD_INT4 = "[16-byte loads]", "[8-byte loads]"


def _rung_launches(full: bool, rung: int, representatives, fallback=(), **launch):
    """Rung 3 or 4's vector attention kernel (and rung 4's combine kernel) on the OpenPPL launches:
    `representatives` with 16-byte loads at head_dim 32, `fallback` with element loads at head_dim 24."""
    out = []
    for variants, head_dim, vector in ((representatives, 32, True), (fallback, 24, False)):
        for label, kernel, args in _ppl_launches(full, rung, variants, head_dim, **launch):
            name = kernel.py_func.__name__
            marker = ""
            if vector and name == "vector_attention_kernel":
                marker = f" {VECTOR_LOAD_INT4 if label.startswith('quant_bit=4 ') else VECTOR_LOAD}"
            if name in ("vector_attention_kernel", "combine_kernel"):
                out.append((f"rung {rung} {label}{marker}", kernel, args))
    return out


def _rung3_launches(full: bool):
    return _rung_launches(full, 3, RUNG3_REPRESENTATIVES, RUNG3_FALLBACK)


def _rung4_launches(full: bool):
    """Rung 4 with a forced split count: the partials kernel, vector and fallback, and the combine kernel."""
    return _rung_launches(full, 4, RUNG3_REPRESENTATIVES[:1], RUNG3_FALLBACK, num_splits=3)




# OpenPPL's rung 5 takes a float16 query only (the decode kernel's bfloat16 compile is the trtllm family's): decode
# on a float16 and on an int4 cache, prefill (row tiles, ALiBi) on an int8 one; --full adds the other pairs. Each
# compile takes several seconds (a large unrolled body), so three.
RUNG5_REPRESENTATIVES = ((0, np.float16, 1, False), (8, np.float16, 3, True), (4, np.float16, 1, True))


def _rung5_launches(full: bool):
    """Rung 5 (tensor cores: inline-PTX mma.sync) on the OpenPPL launches: the staged kernel (prefill) and the
    register-fed decode kernel (the decode representatives); every compile must contain the mma (REQUIRED_PTX), so
    a build that silently lost it fails."""
    return [(f"rung 5 {label}", kernel, args) for label, kernel, args in
            _ppl_launches(full, rung=5, representatives=RUNG5_REPRESENTATIVES, dtypes=(np.float16,))
            if kernel.py_func.__name__ in REQUIRED_PTX]


def _rung6_launches(full: bool):
    """Rung 6 (the FlashAttention-2 prefill: cp.async, ldmatrix, mma.sync): OpenPPL's launches with a mask, ALiBi
    or both at head_dim 32 (its `score` compiled with the bias), then the kernel alone without bias: bfloat16 at
    head_dim 128 (the lab's shape, whose float16 twin the SASS variant compiles); full: float16 too, and head_dims
    16 and 64."""
    from ._attention_flash import make_flash_attention_kernel
    from ._cache import cache_source
    from ._numerics import rounder
    from .ppl_dynamic_multi_head_attention import PPLScoreArgs, make_ppl_score

    out = [(f"rung 6 {label}", kernel, args) for label, kernel, args in
           _ppl_launches(full, rung=6, representatives=((0, np.float16, 3, True), (0, np.float16, 3, False)),
                         dtypes=(np.float16,)) if kernel.py_func.__name__ == "flash_attention_kernel"]
    starts = np.zeros(3, np.int64)
    for dtype in ("float16", "bfloat16") if full else ("bfloat16",):
        for head_dim in (16, 64, 128) if full else (128,):
            score, key_range = make_ppl_score(rounder(dtype), biased=False)
            kernel = make_flash_attention_kernel(score, key_range, head_dim=head_dim, group=4, warps=4, dtype=dtype)
            src = cache_source(np.zeros((64, 2, head_dim), np.uint16), None, np.zeros((2, 4), np.int64), 16, "T H D")
            score_args = PPLScoreArgs(np.int64(1), np.int64(0), np.int64(0), np.zeros(1, np.float32),
                                      np.zeros(1, np.uint16), np.int64(0), np.int64(0), starts, starts, np.int64(0))
            rows = (np.zeros(8, np.uint16), starts, np.int64(0), np.int64(0), np.int64(0))
            out.append((f"rung 6 {dtype} head_dim={head_dim} unbiased", kernel,
                        (rows, rows, starts, starts, src, src, score_args, np.float32(1))))
    return out


# Kernels with inline PTX: the instruction their PTX must contain, by kernel name (rung 5's mma, in every compile)
# or by a marker in the launch's label (rung 3's vector loads, on the aligned launches only). NVVM copies inline asm
# into the PTX without reading it, so these are also assembled with ptxas when it is installed (the CUDA toolkit
# wheels of numba-cuda's cu12 extra bring it): a bad operand or constraint fails here, not when a GPU loads the module.
MMA_PTX = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
BF16_MMA_PTX = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
# The decode kernel also pairs two keys' V values with one prmt a register before unpacking them; its mma is f16,
# or bf16 for a bfloat16 call (`_required_ptx`).
# Rung 6 copies K/V tiles by cp.async and reads its fragments by ldmatrix (.trans for V); its mma is f16 or bf16.
REQUIRED_PTX = {"mma_attention_kernel": (MMA_PTX,), "gqa_decode_attention_kernel": ("prmt.b32",),
                "flash_attention_kernel": ("mma.sync.aligned.m16n8k16.row.col.f32", "cp.async.cg.shared.global",
                                           "cp.async.wait_group", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                                           "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16")}
# Every kernel of a bfloat16 call stores bfloat16 bits rounded by cvt.rn.bf16x2.f32 (`_numerics.narrow_bfloat16`).
BFLOAT16_BITS = "[bfloat16 bits]"
PTX_MARKERS = {VECTOR_LOAD: "ld.global.nc.v4.u32", VECTOR_LOAD_INT4: "ld.global.nc.v2.u32",
               BFLOAT16_BITS: "cvt.rn.bf16x2.f32"}


def _bits_marker(dtype) -> str:
    return f" {BFLOAT16_BITS}" if isinstance(dtype, str) and dtype == "bfloat16" else ""


# A quantized cache's vector loads turn codes into float16 pairs by magic numbers and scale them with one f16x2
# multiply (`_dequant`): a build that fell back to per-value conversions would still be right, and slower.
QUANT_VECTOR_PTX = "mul.rn.f16x2"


def _required_ptx(label: str, kernel) -> list:
    texts = [text for marker, text in PTX_MARKERS.items() if marker in label]
    if texts and ("quant_bit=8 " in label or "quant_bit=4 " in label):
        texts.append(QUANT_VECTOR_PTX)
    texts += REQUIRED_PTX.get(kernel.py_func.__name__, ())
    if kernel.py_func.__name__ == "gqa_decode_attention_kernel":
        texts.append(BF16_MMA_PTX if BFLOAT16_BITS in label else MMA_PTX)
    return texts


def _ptxas() -> str | None:
    try:
        import nvidia.cuda_nvcc
        bundled = os.path.join(nvidia.cuda_nvcc.__path__[0], "bin", "ptxas")
        if os.path.exists(bundled):
            return bundled
    except ImportError:
        pass
    return shutil.which("ptxas")


def _assemble(ptx: str, cc) -> str:
    """ptxas on the PTX for sm_<cc>: raises with ptxas's first error line; says so when there is no ptxas."""
    ptxas = _ptxas()
    if ptxas is None:
        return ", not assembled (no ptxas)"
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", source, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True)
    if run.returncode:
        raise AssertionError(f"ptxas: {(run.stderr or run.stdout).strip().splitlines()[0]}")
    return ", assembled"


def _convert_launches(full: bool):
    """(label, kernel, args) for cacheattn.convert's gather and scatter kernels: every storage kind (float16 and
    float32 floats, bfloat16 bits, per-tensor int8 / e4m3 / e5m2, int8 and int4 groups with float16 or float32
    scales) gathered and encoded; per-tensor codes by multiplication (TensorRT-LLM) for int8 and e4m3, by
    division (vLLM, FlashInfer) for the fp8s; codes copied for a float, an fp8 and a group kind. full: every
    kind both ways and copied."""
    from . import _launch
    from . import convert as kc

    heads, tokens, head_dim = 2, 3, 16
    offsets = np.arange(tokens, dtype=np.int64) * heads * head_dim
    kinds = [(kc.FLOAT, np.float32, np.float32), (kc.FLOAT, np.float16, np.float32), (kc.BF16, np.uint16, np.float32),
             (kc.INT8, np.int8, np.float32), (kc.E4M3, np.uint8, np.float32), (kc.E5M2, np.uint8, np.float32),
             (kc.GROUP8, np.int8, np.float16), (kc.GROUP4, np.int8, np.float32)]
    out = []
    for kind, storage, scale_dtype in kinds:
        grouped = kind in (kc.GROUP8, kc.GROUP4)
        stored = head_dim // 2 if kind == kc.GROUP4 else head_dim
        data = np.zeros(tokens * heads * stored, storage)
        src = kc.where(data, offsets // head_dim * stored, stored, stored, 0, 1)
        scales = kc.where(np.ones(tokens * heads * 4, scale_dtype), offsets // head_dim * 4, 4, 4, 0, 1) \
            if grouped else None
        values = np.ones((heads, tokens, head_dim), np.float32)
        with _launch.recorded_launches() as launches:
            kc.gather(src, scales, kind=kind, heads=heads, tokens=tokens, head_dim=head_dim, stored_dim=stored,
                      quant_group=4, scale_dtype=scale_dtype)
            divides = {kc.INT8: (False,), kc.E4M3: (False, True), kc.E5M2: (True,)}.get(kind, (False,))
            for divide in (True, False) if full and kind in (kc.INT8, kc.E4M3, kc.E5M2) else divides:
                kc.scatter(src, scales, values, kind=kind, heads=heads, tokens=tokens, head_dim=head_dim,
                           quant_group=4, divide=divide, scale_dtype=scale_dtype)
            if full or kind in (kc.FLOAT, kc.E4M3, kc.GROUP4):
                kc.scatter(src, scales, None, np.zeros((heads, tokens, stored), storage),
                           np.ones((heads, tokens, 4), scale_dtype) if grouped else None, kind=kind, heads=heads,
                           tokens=tokens, head_dim=head_dim, quant_group=4, scale_dtype=scale_dtype)
        label = f"convert kind {kind} {np.dtype(storage).name}"
        out += [(label, kernel, args) for kernel, args in launches]
    return out


# Kernel families: name -> launches(full). A new operator module adds its family here; tests/test_ptx.py runs
# one test per family and compute capability.
FAMILIES = {"ppl": _ppl_launches, "onnx": _onnx_launches, "ft": _ft_launches, "trtllm": _trtllm_launches,
            "ladder": _ladder_launches, "rung3": _rung3_launches, "rung4": _rung4_launches, "rung5": _rung5_launches,
            "rung6": _rung6_launches, "convert": _convert_launches}


def spread(launches, stride: int) -> list:
    """Every `stride`-th launch of each kernel, its first always: a sample of a family's cross product that keeps
    every kernel body and spreads over the variants (stride 1: every launch)."""
    taken, seen = [], {}
    for launch in launches:
        kernel = launch[1].py_func.__qualname__        # a factory makes a function per variant: group by name
        if seen.setdefault(kernel, 0) % stride == 0:
            taken.append(launch)
        seen[kernel] += 1
    return taken


def compile_all(ccs, families=tuple(FAMILIES), full=False, report=print, stride: int = 1) -> int:
    """Compile the recorded kernels of `families` for each compute capability (with `full`, every `stride`-th
    variant of each kernel); returns the number of failures."""
    import numba
    from numba import cuda

    _allow_device_functions_without_gpu()
    seen, failures = set(), 0
    launches = [launch for family in families for launch in spread(FAMILIES[family](full), stride)]
    for label, kernel, args in launches:
        signature = tuple(numba.typeof(a) for a in args)
        key = (kernel.py_func, signature)
        if key in seen:
            continue
        seen.add(key)
        for cc in ccs:
            _target_cc[0] = cc
            start = time.perf_counter()
            try:
                ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=cc)
                required = _required_ptx(label, kernel)
                missing = [text for text in required if text not in ptx]
                if missing:
                    raise AssertionError(f"the PTX lacks {', '.join(missing)}")
                assembled = _assemble(ptx, cc) if required else ""
                status = f"ok  {len(ptx):7d} chars{assembled}"
            except Exception as exc:  # report every failure, then fail the run
                failures += 1
                status = f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            report(f"sm_{cc[0]}{cc[1]}  {kernel.py_func.__name__:<20} {label:<32} {status} "
                   f"({time.perf_counter() - start:.1f}s)")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", nargs="+", type=int, default=[80, 90], help="compute capabilities, e.g. 80 90")
    parser.add_argument("--family", nargs="+", choices=tuple(FAMILIES), default=tuple(FAMILIES),
                        help="kernel families to compile (default: all)")
    parser.add_argument("--full", action="store_true", help="every variant, not one representative per code path")
    parser.add_argument("--stride", type=int, default=1, metavar="N",
                        help="with --full: every Nth variant of each kernel, its first always (a spread of the cross "
                             "product in less time; default 1, all)")
    args = parser.parse_args(argv)
    if args.stride < 1:
        parser.error(f"--stride: expected a whole number of at least 1, got {args.stride}")
    ccs = [(c // 10, c % 10) for c in args.cc]
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("ptx_check: unset NUMBA_ENABLE_CUDASIM; the simulator cannot compile PTX", file=sys.stderr)
        return 2
    failures = compile_all(ccs, args.family, args.full, stride=args.stride)
    print(f"{'all kernels compiled' if not failures else f'{failures} compile failures'} for "
          f"{', '.join(f'sm_{a}{b}' for a, b in ccs)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
