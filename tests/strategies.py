"""Hypothesis strategies for every test module: the attribute space is drawn, the tensors come from a seed
(`cacheattn.examples` builds them).

Sizes are awkward on purpose: sequences of length 1, pasts of 0, head_dim 24, page sizes that do not
divide the lengths, GQA groups of 3, unused page-table entries holding -1.
"""

from __future__ import annotations

import os

from hypothesis import strategies as st

from cacheattn.examples import (  # noqa: F401
    OnnxCase,
    PPLCase,
    StaticCase,
    build_onnx,
    build_ppl,
    build_static,
    copy_inputs,
    float64_onnx,
    float64_ppl_attention,
    reference_cache_state,
    with_,
)

# Example counts: reference tests are cheap; simulator kernel tests cost about a second per launch.
# CACHEATTN_EXAMPLES=10 multiplies both, for a long hunt before a release.
_SCALE = int(os.environ.get("CACHEATTN_EXAMPLES", "1"))
REFERENCE = 60 * _SCALE
KERNEL = 12 * _SCALE


@st.composite
def ppl_cases(draw, *, max_batch=3, max_seqlen=5, max_past=9, quant_bits=(0, 8, 4), dtypes=("float16", "float32"),
              layouts=(0, 1, 2, 3), modes=(0, 1), masks=("none", "2d", "3d"), alibi=(False, True)):
    batch = draw(st.integers(1, max_batch))
    decoding_batches = draw(st.integers(0, batch))
    seqlens = tuple(1 if b < decoding_batches else draw(st.integers(1, max_seqlen)) for b in range(batch))
    past = tuple(draw(st.integers(0, max_past)) for _ in range(batch))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([8, 16, 24]))
    quant_bit = draw(st.sampled_from(quant_bits))
    groups = [g for g in (2, 4, 8) if head_dim % g == 0] if quant_bit else [8]
    num_layer = draw(st.integers(1, 2))
    return PPLCase(
        seqlens=seqlens, past=past, decoding_batches=decoding_batches,
        num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 3])), num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=draw(st.sampled_from(dtypes)), quant_bit=quant_bit, quant_group=draw(st.sampled_from(groups)),
        scale_dtype=draw(st.sampled_from(["float16", "float32"])), cache_layout=draw(st.sampled_from(layouts)),
        cache_mode=draw(st.sampled_from(modes)), page_size=draw(st.sampled_from([1, 3, 4, 8])),
        num_layer=num_layer, layer_idx=draw(st.integers(0, num_layer - 1)), is_causal=draw(st.booleans()),
        is_alibi=draw(st.sampled_from(alibi)), mask=draw(st.sampled_from(masks)), mask_pad=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def static_cases(draw, quant_bits=(0, 8, 4)):
    batch = draw(st.integers(1, 3))
    seqlen = draw(st.integers(1, 4))
    start_pos = draw(st.integers(0, 5))
    head_dim = draw(st.sampled_from([8, 16, 24]))
    quant_bit = draw(st.sampled_from(quant_bits))
    num_layer = draw(st.integers(1, 2))
    return StaticCase(batch=batch, max_batch=batch + draw(st.integers(0, 1)), seqlen=seqlen, start_pos=start_pos,
                      max_seqlen=start_pos + seqlen + draw(st.integers(0, 2)), num_heads=draw(st.integers(1, 3)),
                      head_dim=head_dim, dtype=draw(st.sampled_from(["float16", "float32"])), quant_bit=quant_bit,
                      quant_group=draw(st.sampled_from([g for g in (2, 4, 8) if head_dim % g == 0])),
                      num_layer=num_layer, layer_idx=draw(st.integers(0, num_layer - 1)),
                      num_repeat=draw(st.integers(1, 3)), cache_layout=draw(st.sampled_from([0, 1])),
                      seed=draw(st.integers(0, 2**32 - 1)))




@st.composite
def onnx_cases(draw, *, dtypes=("float16", "float32", "float64"), past=True, windows=True, masks=("none", "bool",
               "float"), modes=(0, 1, 2, 3)):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    q_len, kv_len = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    past_len = draw(st.integers(1, 4)) if past and draw(st.booleans()) else 0
    total = past_len + kv_len
    q_heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    nonpad = None
    if not past_len and draw(st.booleans()):
        nonpad = tuple(draw(st.integers(0, kv_len)) for _ in range(batch))
    mask = draw(st.sampled_from(masks))
    shape = ()
    if mask != "none":
        # Right-aligned against (batch, q_heads, q_len, total): each leading axis full or 1, rank 1 to 4,
        # the last dim possibly shorter (padded) but covering the nonpad lengths.
        rank = draw(st.integers(1, 4))
        full = (batch, q_heads, q_len)
        lead = tuple(draw(st.sampled_from([1, n])) for n in full[3 - (rank - 1):]) if rank > 1 else ()
        shortest = max(1, max(nonpad) if nonpad else 1)
        shape = lead + (draw(st.integers(shortest, total)),)
    windowed = windows and draw(st.booleans())
    return OnnxCase(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, past_len=past_len,
        head_size=draw(st.sampled_from([4, 8, 12])), v_head_size=draw(st.sampled_from([4, 6, 8])),
        three_d=draw(st.booleans()), dtype=draw(st.sampled_from(dtypes)), mask=mask, mask_shape=shape,
        is_causal=int(draw(st.booleans())), nonpad=nonpad, softcap=draw(st.sampled_from([0.0, 0.0, 1.5, 30.0])),
        scale=draw(st.sampled_from([None, None, 0.05, 0.7])),
        left_window_size=draw(st.integers(-1, 3)) if windowed else -1,
        right_window_size=draw(st.integers(-1, 2)) if windowed else -1,
        qk_matmul_output_mode=draw(st.sampled_from(modes)), seed=draw(st.integers(0, 2**32 - 1)))


# ---- TensorRT-LLM
from cacheattn.examples import TrtCase, build_trt, float64_trt  # noqa: E402, F401


@st.composite
def trt_cases(draw, *, dtypes=("float16", "float32"), paged=(False, True), quant=(0, 64, 128),
              positions=(0, 1, 2, 4, 5, 6), masks=(1, 1, 2, 0, 3, 6), beams=(1, 1, 2), windowed=True, chunked=True,
              generation=True, packed=(True, False), softcap=True):
    """A gpt_attention call: a few context requests (some chunked), a few generation sequences (maybe beams),
    awkward sizes (length 1, past 0, tokens_per_block not dividing the lengths, GQA group 3, head size 24)."""
    beam_width = draw(st.sampled_from(beams))
    contexts = tuple((draw(st.integers(0, 4)) if chunked else 0, draw(st.integers(1, 5)))
                     for _ in range(draw(st.integers(0 if generation else 1, 2))))
    generations = ()
    if generation:
        generations = tuple((prompt, prompt + draw(st.integers(0, 3))) for prompt in
                            (draw(st.integers(1, 4)) for _ in range(draw(st.integers(0 if contexts else 1, 2)))))
    lengths = [p + n for p, n in contexts] + [p + 1 for _, p in generations]
    longest = max(lengths)
    capacity = longest + draw(st.integers(0, 2))
    window = capacity + draw(st.integers(0, 2))                   # no window in view
    if windowed and beam_width == 1 and draw(st.booleans()):
        window = draw(st.integers(2, longest + 1))                # a window, the cache cyclic past it
        capacity = max(window, draw(st.integers(window, longest + 1)))
    position = draw(st.sampled_from(positions))
    head_size = draw(st.sampled_from([8, 24]))
    num_kv_heads = draw(st.integers(1, 2))
    rope = position in (1, 2)
    rotary_dim = draw(st.sampled_from([d for d in (2, 6, 8, head_size) if d <= head_size])) if rope else 0
    num_layers = draw(st.integers(1, 2))
    return TrtCase(
        contexts=contexts, generations=generations, beam_width=beam_width,
        num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 3])), num_kv_heads=num_kv_heads, head_size=head_size,
        dtype=draw(st.sampled_from(dtypes)), capacity=capacity, window=window,
        paged=draw(st.sampled_from(paged)), tokens_per_block=draw(st.sampled_from([1, 2, 4])),
        packed=draw(st.sampled_from(packed)), quant=draw(st.sampled_from(quant)), position=position,
        rotary_dim=rotary_dim, rotary_scale_type=draw(st.sampled_from([0, 1, 2] if rotary_dim > 2 else [0, 1])),
        rotary_scale=draw(st.sampled_from([1.0, 2.0])), mask_type=draw(st.sampled_from(masks)),
        softcap=draw(st.sampled_from([0.0, 0.0, 3.0])) if softcap else 0.0, q_scaling=draw(st.sampled_from([1.0, 0.5])),
        relative=draw(st.sampled_from(["regular", "t5"])), qkv_bias=draw(st.booleans()),
        num_layers=num_layers, layer_idx=draw(st.integers(0, num_layers - 1)), seed=draw(st.integers(0, 2**32 - 1)))


# ---- TensorRT-LLM kernels
from dataclasses import replace  # noqa: E402


def trt_kernel_cases(**kw):
    """gpt_attention calls in what the numba kernels run today: trt_cases (which draws neither cross attention,
    StreamingLLM nor FP8 context FMHA)."""
    return trt_cases(**kw)


@st.composite
def trt_streaming_cases(draw):
    """StreamingLLM calls: whole contexts (no chunks), sink tokens below the window, RoPE most of the time."""
    case = draw(trt_kernel_cases(chunked=False, beams=(1,), positions=(1, 2, 2, 0)))
    return replace(case, streamingllm=True, sinks=draw(st.integers(0, min(2, case.window - 1))))
