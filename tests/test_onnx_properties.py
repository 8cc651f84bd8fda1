"""ONNX Attention: the reference held to the invariants the schema implies, the kernels to the reference."""

import functools

import numpy as np
import pytest
from hypothesis import given, settings

import cacheattn
import cacheattn.testing as kit
from cacheattn.examples import onnx_dtype

from helpers import assert_bits_equal, assert_close, assert_same_values
from strategies import KERNEL, REFERENCE, build_onnx, float64_onnx, onnx_cases, with_


def run(inputs, case, **overrides):
    return cacheattn.onnx_attention(**inputs, **{**case.attrs(), **overrides}, return_qk_matmul_output=True)


def to_4d(x, heads):
    batch, seq, hidden = x.shape
    return np.ascontiguousarray(x.reshape(batch, seq, heads, hidden // heads).transpose(0, 2, 1, 3))


@pytest.mark.spec("onnx/q-shape", "onnx/kv-shape", "onnx/y-shape", "onnx/num-heads-3d")
@settings(max_examples=REFERENCE)
@given(onnx_cases().filter(lambda c: c.three_d))
def test_3d_equals_4d(case):
    inputs = build_onnx(case)
    three = run(inputs, case)
    four_inputs = dict(inputs, Q=to_4d(inputs["Q"], case.q_heads), K=to_4d(inputs["K"], case.kv_heads),
                       V=to_4d(inputs["V"], case.kv_heads))
    four = run(four_inputs, with_(case, three_d=False))
    y4 = four.Y.transpose(0, 2, 1, 3).reshape(three.Y.shape)
    assert_same_values("Y", three.Y, y4)                       # another stride: another summation order
    assert_same_values("qk_matmul_output", three.qk_matmul_output, four.qk_matmul_output)
    for name in ("present_key", "present_value"):             # copies of the inputs: bit for bit
        assert_bits_equal(name, getattr(three, name), getattr(four, name))


@pytest.mark.spec("onnx/gqa")
@settings(max_examples=REFERENCE)
@given(onnx_cases(past=False).filter(lambda c: c.q_heads > c.kv_heads and not c.three_d))
def test_gqa_equals_repeated_heads(case):
    inputs = build_onnx(case)
    group = case.q_heads // case.kv_heads
    gqa = run(inputs, case)
    mha = run(dict(inputs, K=np.repeat(inputs["K"], group, axis=1), V=np.repeat(inputs["V"], group, axis=1)), case)
    assert_same_values("Y", gqa.Y, mha.Y)
    assert_same_values("qk_matmul_output", gqa.qk_matmul_output, mha.qk_matmul_output)


@pytest.mark.spec("onnx/mask-kinds", "onnx/bias-sources")
@settings(max_examples=REFERENCE)
@given(onnx_cases(masks=("bool",)))
def test_bool_mask_equals_float_zero_minus_inf_mask(case):
    inputs = build_onnx(case)
    dtype = onnx_dtype(case.dtype)
    as_float = np.where(inputs["attn_mask"], dtype.type(0), dtype.type(-np.inf)).astype(dtype)
    a, b = run(inputs, case), run(dict(inputs, attn_mask=as_float), case)
    assert_bits_equal("Y", a.Y, b.Y)
    assert_bits_equal("qk_matmul_output", a.qk_matmul_output, b.qk_matmul_output)


def explicit_mask(case, inputs, offsets):
    """Causal/window/padding rules written out as a bool (batch, 1, q_len, total) mask, ANDed with the user's."""
    i = np.arange(case.q_len)[:, None]
    j = np.arange(case.total)[None, :]
    keep = np.ones((case.batch, 1, case.q_len, case.total), bool)
    for b in range(case.batch):
        position = offsets[b] + i
        if case.is_causal:
            keep[b, 0] &= j <= position
        if case.left_window_size >= 0:
            keep[b, 0] &= j >= position - case.left_window_size
        if case.right_window_size >= 0:
            keep[b, 0] &= j <= position + case.right_window_size
        if case.nonpad is not None:
            keep[b, 0] &= j < case.nonpad[b]
    user = inputs["attn_mask"]
    if user is not None:
        pad = case.total - user.shape[-1]
        user = np.pad(user, [(0, 0)] * (user.ndim - 1) + [(0, pad)], constant_values=False) if pad else user
        keep = keep & user
    return keep


@pytest.mark.spec("onnx/cache-inside", "onnx/past-shape", "onnx/present-shape")
@settings(max_examples=REFERENCE)
@given(onnx_cases(masks=("none", "bool")).filter(lambda c: c.past_len > 0))
def test_past_and_present_equal_concatenated_kv_without_past(case):
    inputs = build_onnx(case)
    with_past = run(inputs, case)
    k4 = inputs["K"] if not case.three_d else to_4d(inputs["K"], case.kv_heads)
    v4 = inputs["V"] if not case.three_d else to_4d(inputs["V"], case.kv_heads)
    assert_bits_equal("present_key", with_past.present_key, np.concatenate([inputs["past_key"], k4], axis=2))
    assert_bits_equal("present_value", with_past.present_value, np.concatenate([inputs["past_value"], v4], axis=2))
    # Without past the causal/window alignment is top-left, so the past's offset moves into an explicit mask.
    offsets = np.full(case.batch, case.past_len)
    flat = with_(case, three_d=False, past_len=0, kv_len=case.total, is_causal=0, left_window_size=-1,
                 right_window_size=-1)
    q4 = inputs["Q"] if not case.three_d else to_4d(inputs["Q"], case.q_heads)
    without = run(dict(Q=q4, K=with_past.present_key, V=with_past.present_value,
                       attn_mask=explicit_mask(case, inputs, offsets)), flat, opset=25)
    y = with_past.Y if not case.three_d else to_4d(with_past.Y, case.q_heads)
    assert_same_values("Y", y, without.Y)


@pytest.mark.spec("onnx/nonpad", "onnx/cache-outside", "onnx/nonpad-mask-length")
@settings(max_examples=REFERENCE)
@given(onnx_cases(past=False, masks=("none", "bool")).filter(lambda c: c.nonpad is not None))
def test_nonpad_kv_seqlen_equals_its_padding_mask(case):
    inputs = build_onnx(case)
    a = run(inputs, case)
    offsets = np.asarray(case.nonpad) - case.q_len
    plain = with_(case, nonpad=None, is_causal=0, left_window_size=-1, right_window_size=-1)
    b = run(dict(inputs, nonpad_kv_seqlen=None, attn_mask=explicit_mask(case, inputs, offsets)), plain, opset=25)
    assert_bits_equal("Y", a.Y, b.Y)


@pytest.mark.spec("onnx/mask-short", "onnx/mask-shape")
@settings(max_examples=REFERENCE)
@given(onnx_cases(masks=("bool", "float")).filter(lambda c: c.mask_shape[-1] < c.total))
def test_short_mask_equals_explicitly_padded_mask(case):
    inputs = build_onnx(case)
    mask = inputs["attn_mask"]
    pad = case.total - mask.shape[-1]
    fill = False if mask.dtype == np.bool_ else -np.inf
    padded = np.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)], constant_values=fill)
    a, b = run(inputs, case), run(dict(inputs, attn_mask=padded), case)
    assert_bits_equal("Y", a.Y, b.Y)


@pytest.mark.spec("onnx/softcap")
@settings(max_examples=REFERENCE)
@given(onnx_cases(dtypes=("float64",)).filter(lambda c: c.softcap == 0))
def test_softcap_tends_to_identity(case):
    inputs = build_onnx(case)
    plain = run(inputs, case)
    huge = run(inputs, with_(case, softcap=1e7))
    assert_close("Y", huge.Y, plain.Y, np.float32)       # softcap*tanh(x/softcap) = x (1 - x^2/(3 softcap^2)...)


def test_fully_masked_rows_give_zeros():
    q = np.random.default_rng(1).standard_normal((1, 2, 3, 4)).astype(np.float32)
    mask = np.ones((3, 5), bool)
    mask[1] = False
    out = cacheattn.onnx_attention(q, q[:, :, :1].repeat(5, axis=2), q[:, :, :1].repeat(5, axis=2), mask,
                                   qk_matmul_output_mode=3, return_qk_matmul_output=True)
    assert np.array_equal(out.Y[:, :, 1], np.zeros_like(out.Y[:, :, 1]))
    assert np.array_equal(out.qk_matmul_output[:, :, 1], np.zeros_like(out.qk_matmul_output[:, :, 1]))
    assert np.isfinite(out.Y).all()


@pytest.mark.spec("onnx/pattern", "onnx/scale")
@settings(max_examples=REFERENCE)
@given(onnx_cases())
def test_reference_matches_float64_evaluation(case):
    inputs = build_onnx(case)
    got = run(inputs, case)
    want = float64_onnx(inputs, case)
    assert_close("Y", got.Y, want[0], case.dtype, scale=2.0 if case.dtype == "float16" else 1.0)


@pytest.mark.parametrize("threads", [32, 64])
def test_kernels_conform(device, threads):
    """The conformance kit on the kernels: Y and qk_matmul_output close to a float64 evaluation (hidden -inf
    entries exactly), presents bit-exact; outputs start as NaN (conftest). A few times the PPL kernel budget
    (small launches), split between the two block sizes."""
    impl = functools.partial(cacheattn.onnx_attention, backend="numba", threads=threads)
    if device.gpu:
        impl = on_device(device, impl)
    assert kit.check_onnx_attention(impl, max_examples=3 * KERNEL // 2).examples >= 1


def on_device(device, fn):
    """fn on CuPy copies of the NumPy inputs the kit passes; the outputs come back as NumPy."""
    @functools.wraps(fn)
    def on_gpu(*args, **attrs):
        return tuple(device.get(o) for o in fn(*(device.put(a) for a in args), **attrs))
    return on_gpu
