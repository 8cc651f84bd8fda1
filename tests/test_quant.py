"""KeyValueCache Quantization: the worked example, the error bound, int4 packing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from reference.quant import QMAX, dequantize, pack_int4, quantize, unpack_int4

from strategies import REFERENCE

EXAMPLE = [0.5, -1, 0.25, 2.54, -2.54, 0.01, 1.27, -0.635]


@pytest.mark.spec("ppl-kvc/quant-bit", "ppl-mhca/quant-bit", "ppl-kvc/quant-group", "ppl-mhca/quant-group")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_worked_example_int8(dtype):
    # docs/semantics.md's worked example: scale 0.02, q = [25,-50,12,127,-127,0,64,-32];
    # 12.5 -> 12 and 63.5 -> 64 show half-to-even.
    scale, q = quantize(np.array(EXAMPLE, dtype), 8, 8, np.float32)
    assert scale.tolist() == [np.float32(0.02)]
    assert q.tolist() == [25, -50, 12, 127, -127, 0, 64, -32]


def test_float16_inputs_quantize_in_float16():
    # The scale 2.54/127 rounds to 0.01999 in float16, so 0.25/scale = 12.51 rounds up: upstream's float16 result.
    scale, q = quantize(np.array(EXAMPLE, np.float16), 8, 8, np.float16)
    assert scale.dtype == np.float16 and scale[0] == np.float16(np.float16(2.54) / np.float16(127))
    assert q.tolist() == [25, -50, 13, 127, -127, 1, 64, -32]


@pytest.mark.spec("ppl-mhca/types")
def test_int4_packing_is_low_nibble_first():
    values = np.array([1, -1, -8, 7], np.int8)
    packed = pack_int4(values)
    assert packed.view(np.uint8).tolist() == [0xF1, 0x78]
    every = np.array(np.meshgrid(np.arange(-8, 8), np.arange(-8, 8))).reshape(2, -1).T.reshape(-1).astype(np.int8)
    assert np.array_equal(unpack_int4(pack_int4(every)), every)


UNIT_ROUNDOFF = {np.float16: 2.0**-11, np.float32: 2.0**-24, np.float64: 2.0**-53}


@settings(max_examples=REFERENCE)
@given(dtype=st.sampled_from([np.float16, np.float32, np.float64]), quant_bit=st.sampled_from([8, 4]),
       group=st.sampled_from([2, 4, 8, 16]), groups=st.integers(1, 4), magnitude=st.sampled_from([1e-6, 1e-2, 1, 300]),
       seed=st.integers(0, 2**32 - 1))
@pytest.mark.spec("ppl-kvc/dequant", "ppl-kvc/quant-group", "ppl-mhca/quant-group")
def test_round_trip_error_is_half_a_step(dtype, quant_bit, group, groups, magnitude, seed):
    x = (np.random.default_rng(seed).standard_normal((3, groups * group)) * magnitude).astype(dtype)
    scale, q = quantize(x, quant_bit, group, np.float32)
    codes = unpack_int4(q) if quant_bit == 4 else q
    assert np.abs(codes).max() <= QMAX[quant_bit]
    back = dequantize(q, scale, quant_bit, group, np.float64)
    step = np.repeat(scale.astype(np.float64), group, axis=-1)
    u = max(UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[np.float32])
    # Half a step, plus the roundings of x / scale (in x's dtype) and of q * scale (float32).
    bound = step * (0.5 + 2 * u * QMAX[quant_bit]) + 2 * u * np.abs(x.astype(np.float64))
    err = np.abs(back - x.astype(np.float64))
    assert (err <= bound).all(), f"max error {err.max()} at {np.unravel_index(np.argmax(err - bound), err.shape)}"
    assert (scale >= np.float32(1e-5)).all()


@given(hnp.arrays(np.float32, (2, 8), elements=st.floats(-1e3, 1e3, width=32)))
def test_quantize_is_deterministic_and_bounded(x):
    s1, q1 = quantize(x, 8, 8, np.float16)
    s2, q2 = quantize(x.copy(), 8, 8, np.float16)
    assert np.array_equal(q1, q2) and np.array_equal(s1, s2)
    assert q1.dtype == np.int8 and s1.dtype == np.float16 and np.abs(q1).max(initial=0) <= 127
