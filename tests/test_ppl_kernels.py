"""numba.cuda kernels = the OpenPPL reference, across the attribute space.

Under the simulator (CI) these run NumPy arrays through backend="numba"; with CACHEATTN_TEST_GPU=1 the
same tests run CuPy arrays on the GPU. Output buffers start poisoned with NaN (conftest), caches and
scales must come out bit-identical to the reference's, outputs close to a float64 evaluation.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheattn
from cacheattn.tour import ATTENTION_CASES

from helpers import assert_bits_equal, assert_close
from strategies import (
    KERNEL,
    build_ppl,
    build_static,
    copy_inputs,
    float64_ppl_attention,
    ppl_cases,
    reference_cache_state,
    static_cases,
)

THREADS = st.sampled_from([32, 64])      # fewer threads than elements: every strided loop wraps


def on_device(device, inputs):
    return {k: device.put(v) for k, v in inputs.items()}


@settings(max_examples=KERNEL)
@given(ppl_cases(), THREADS)
def test_multi_head_cache_attention_kernel(device, case, threads):
    inputs = build_ppl(case)
    key, value, want_cache, want_scale = reference_cache_state(inputs, case)
    x = on_device(device, copy_inputs(inputs))
    out = cacheattn.multi_head_cache_attention(**x, **case.attrs(), backend="numba", threads=threads)
    assert_bits_equal("cache", device.get(x["cache"]), want_cache)
    if case.quant_bit:
        assert_bits_equal("scale", device.get(x["scale"]), want_scale)
    assert_close("attn_output", device.get(out), float64_ppl_attention(inputs, case, key, value), case.dtype)


@settings(max_examples=KERNEL)
@given(ppl_cases(quant_bits=(0,)), THREADS)
def test_dynamic_multi_head_attention_kernel(device, case, threads):
    inputs = build_ppl(case)
    key, value, _, _ = reference_cache_state(inputs, case)
    x = on_device(device, dict(query=inputs["query"], key=key, value=value, attn_mask=inputs["attn_mask"]))
    attrs = dict(num_heads=case.num_heads, head_dim=case.head_dim, is_causal=case.is_causal, is_alibi=case.is_alibi,
                 num_kv_heads=case.num_kv_heads)
    out = cacheattn.dynamic_multi_head_attention(
        x["query"], x["key"], x["value"], inputs["seqstarts"], inputs["kvstarts"], case.decoding_batches,
        inputs["max_seqlen"], inputs["max_kvlen"], x["attn_mask"], **attrs, backend="numba", threads=threads)
    assert_close("attn_output", device.get(out), float64_ppl_attention(inputs, case, key, value), case.dtype)


@settings(max_examples=KERNEL)
@given(ppl_cases(), st.integers(1, 3), THREADS)
def test_dynamic_key_value_cache_kernel(device, case, num_repeat, threads):
    inputs = build_ppl(case)
    names = ("current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen",
             "max_kvlen", "cache", "scale")
    attrs = dict(num_layer=case.num_layer, layer_idx=case.layer_idx, quant_bit=case.quant_bit,
                 quant_group=case.quant_group, num_repeat=num_repeat, cache_mode=case.cache_mode,
                 cache_layout=case.cache_layout, page_size=case.page_size)
    r = copy_inputs(inputs)
    want = cacheattn.dynamic_key_value_cache(*(r[n] for n in names), **attrs)
    x = on_device(device, copy_inputs(inputs))
    got = cacheattn.dynamic_key_value_cache(*(x[n] for n in names), **attrs, backend="numba", threads=threads)
    # Dequantization is specified to the bit (products in the scale dtype, then the output dtype).
    assert_bits_equal("key", device.get(got.key), want.key)
    assert_bits_equal("value", device.get(got.value), want.value)
    assert_bits_equal("cache", device.get(x["cache"]), r["cache"])


@settings(max_examples=KERNEL)
@given(static_cases(), THREADS)
def test_key_value_cache_kernel(device, case, threads):
    inputs = build_static(case)
    attrs = dict(num_layer=case.num_layer, layer_idx=case.layer_idx, quant_bit=case.quant_bit,
                 quant_group=case.quant_group, num_repeat=case.num_repeat, cache_layout=case.cache_layout)
    r = copy_inputs(inputs)
    want = cacheattn.key_value_cache(**r, **attrs)
    x = on_device(device, copy_inputs(inputs))
    got = cacheattn.key_value_cache(**x, **attrs, backend="numba", threads=threads)
    assert_bits_equal("key", device.get(got.key), want.key)
    assert_bits_equal("value", device.get(got.value), want.value)
    assert_bits_equal("cache", device.get(x["cache"]), r["cache"])
    if case.quant_bit:
        assert_bits_equal("scale", device.get(x["scale"]), r["scale"])


@pytest.mark.gpu
def test_cupy_arrays_dispatch_to_kernels_and_come_back_as_cupy():
    import cupy

    case = next(iter(ATTENTION_CASES.values()))
    inputs = build_ppl(case)
    x = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
    out = cacheattn.multi_head_cache_attention(**x, **case.attrs())
    assert isinstance(out, cupy.ndarray)
    key, value, want_cache, _ = reference_cache_state(inputs, case)
    assert_bits_equal("cache", x["cache"].get(), want_cache)
    assert_close("attn_output", out.get(), float64_ppl_attention(inputs, case, key, value), case.dtype)
