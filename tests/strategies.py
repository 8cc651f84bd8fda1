"""Hypothesis strategies for every test module: the attribute space is drawn, the tensors come from a seed
(`cacheattn.examples` builds them).

The PPL and ONNX strategies live in the conformance kit (`cacheattn.testing.strategies`), so our kernels
and anyone else's are drawn from one space; they are re-exported here under the names the tests use.
Other slices append their own sections at the END of this file.
"""

from __future__ import annotations

import os

from hypothesis import strategies as st  # noqa: F401

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
from cacheattn.testing.strategies import onnx_cases, ppl_cases, static_cases  # noqa: F401

# Example counts: reference tests are cheap; simulator kernel tests cost about a second per launch.
# CACHEATTN_EXAMPLES=10 multiplies both, for a long hunt before a release.
_SCALE = int(os.environ.get("CACHEATTN_EXAMPLES", "1"))
REFERENCE = 60 * _SCALE
KERNEL = 12 * _SCALE


# ---- FasterTransformer

from cacheattn.examples import FTCase, build_ft, float64_ft  # noqa: E402, F401
from cacheattn.ft import HEAD_SIZES  # noqa: E402, F401
from cacheattn.testing.strategies import ft_cases  # noqa: E402, F401

# isort: split


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
