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
