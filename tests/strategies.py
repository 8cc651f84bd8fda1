"""Hypothesis strategies for every test module: the attribute space is drawn, the tensors come from a seed
(`cacheattn.examples` builds them).

The PPL, ONNX, FasterTransformer and TensorRT-LLM strategies live in the conformance kit
(`cacheattn.testing.strategies`), so our kernels and anyone else's are drawn from one space; they are
re-exported here under the names the tests use.
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

# Example counts: reference tests are cheap; simulator kernel tests cost about a second per launch. The defaults
# are the quick tier (the README's test command, within 8 minutes on 2 cores); CI's deep tier runs
# CACHEATTN_EXAMPLES=4, which multiplies both and turns on the longer hunts (see .ci/run).
_SCALE = int(os.environ.get("CACHEATTN_EXAMPLES", "1"))
REFERENCE = 40 * _SCALE
KERNEL = 8 * _SCALE
# The deep tier's switch: a test too heavy for the quick tier's 8 minutes is decorated @deep_only (runs in .ci/run).
DEEP = _SCALE >= 2


def deep_only(test):
    import pytest
    return pytest.mark.skipif(not DEEP, reason="the deep tier: CACHEATTN_EXAMPLES=2 or more (.ci/run)")(test)


# ---- FasterTransformer

from cacheattn.examples import FTCase, build_ft, float64_ft  # noqa: E402, F401
from cacheattn.ft import HEAD_SIZES  # noqa: E402, F401
from cacheattn.testing.strategies import ft_cases  # noqa: E402, F401

# isort: split


# ---- TensorRT-LLM (the strategies live in the kit too: test_trtllm_kernels checks our kernels through it)
from cacheattn.examples import TrtCase, build_trt, float64_trt  # noqa: E402, F401
from cacheattn.testing.strategies import trt_cases, trt_streaming_cases  # noqa: E402, F401

# isort: split


# ---- cacheattn.convert: a format variant, heads, head_dim, tokens and a seed (the caches come from the seed)
from convert_formats import VARIANTS, torch_available  # noqa: E402

CONVERT_VARIANTS = [v for v in VARIANTS if v[0] != "hf" or torch_available()]
CONVERT = 100 * _SCALE


def convert_variants():
    """A format (each equally likely), then one of its variants."""
    formats = sorted({f for f, _ in CONVERT_VARIANTS})
    return st.sampled_from(formats).flatmap(lambda f: st.sampled_from([v for v in CONVERT_VARIANTS if v[0] == f]))


@st.composite
def convert_shapes(draw):
    return dict(heads=draw(st.integers(1, 3)), head_dim=draw(st.sampled_from([16, 32])),
                tokens=draw(st.integers(1, 16)), seed=draw(st.integers(0, 2**31 - 1)))
