"""Real-GPU checks (CACHEATTN_TEST_GPU=1 with CuPy): CuPy in -> kernels -> CuPy out, on the caller's stream.

The kernel tests elsewhere already rerun with CuPy arrays in that mode; these check what only a device shows.
"""

import numpy as np
import pytest

import cacheattn
from cacheattn.examples import build_onnx, build_ppl, float64_onnx, float64_ppl_attention, reference_cache_state
from cacheattn.tour import ATTENTION_CASES, ONNX_CASES

from helpers import assert_bits_equal, assert_close

pytestmark = pytest.mark.gpu


def test_onnx_attention_cupy_in_cupy_out():
    import cupy

    case = next(iter(ONNX_CASES.values()))
    inputs = build_onnx(case)
    x = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    out = cacheattn.onnx_attention(**x, **case.attrs(), return_qk_matmul_output=True)
    assert all(isinstance(o, cupy.ndarray) for o in out)
    assert_close("Y", out.Y.get(), float64_onnx(inputs, case)[0], case.dtype)


def test_kernels_run_on_the_callers_stream():
    import cupy

    case = next(iter(ATTENTION_CASES.values()))
    inputs = build_ppl(case)
    key, value, want_cache, _ = reference_cache_state(inputs, case)
    want = float64_ppl_attention(inputs, case, key, value)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
        out = cacheattn.multi_head_cache_attention(**x, **case.attrs())
        stream.synchronize()
    assert_close("attn_output", out.get(), want, case.dtype)
    assert_bits_equal("cache", x["cache"].get(), want_cache)


def test_gpt_attention_cupy_in_cupy_out_on_the_callers_stream():
    """In-flight TensorRT-LLM batch (a chunk, two beams) on an INT8 paged pool, on a non-default stream."""
    import cupy

    from cacheattn.examples import TrtCase, build_trt

    case = TrtCase(contexts=((0, 5), (2, 3)), generations=((3, 4),), beam_width=2, num_heads=4, num_kv_heads=2,
                   head_size=8, dtype="float16", capacity=8, window=8, paged=True, tokens_per_block=4, quant=64,
                   position=4, seed=5)
    inputs = build_trt(case)
    want_inputs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    want, _ = cacheattn.gpt_attention(**want_inputs, backend="reference")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        device = ("qkv", "kv_cache_pool", "alibi_slopes")
        x = {k: cupy.asarray(v) if k in device and v is not None else v for k, v in inputs.items()}
        out, present = cacheattn.gpt_attention(**x)
        stream.synchronize()
    assert isinstance(out, cupy.ndarray) and present is None
    assert_close("output", out.get(), want.astype(np.float64), case.dtype)
    assert_bits_equal("pool", x["kv_cache_pool"].get(), want_inputs["kv_cache_pool"])
