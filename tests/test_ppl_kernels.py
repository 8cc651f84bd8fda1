"""numba.cuda kernels = the OpenPPL reference, across the attribute space, checked by the conformance kit.

The kit (`cacheattn.testing`) is what an outside implementation is held to; our kernels go through the same
code: caches and scales bit-identical to the reference's (untouched slots included), dequantized keys and
values bit-exact, attention outputs close to a float64 evaluation. Output buffers start poisoned with NaN
(conftest), so an element a kernel never writes fails. Under the simulator (CI) the kernels get NumPy
arrays through backend="numba"; with CACHEATTN_TEST_GPU=1 the same checks run them on CuPy arrays.
"""

import functools

import numpy as np
import pytest
from hypothesis import given, settings

import cacheattn
import cacheattn.testing as kit
from cacheattn.tour import ATTENTION_CASES

from helpers import assert_bits_equal, assert_close
from strategies import KERNEL, build_ppl, float64_ppl_attention, ppl_cases, reference_cache_state, with_

# Fewer threads than elements: every strided loop wraps. The budget is split between the two block sizes.
THREADS = (32, 64)
EXAMPLES = max(1, KERNEL // len(THREADS))


def kernels(device, function, threads, **launch):
    """`function` on the kernels, called as the document says with NumPy arrays (what the kit passes). On a
    GPU the arrays go over as CuPy and the in-place ones (cache, scale) come back into the caller's arrays."""
    fn = functools.partial(function, backend="numba", threads=threads, **launch)
    if not device.gpu:
        return fn

    @functools.wraps(fn)
    def on_gpu(*args, **attrs):
        moved = [device.put(a) for a in args]
        out = fn(*moved, **attrs)
        for host, there in zip(args, moved):
            if there is not host:
                host[...] = device.get(there)
        return tuple(device.get(o) for o in out) if isinstance(out, tuple) else device.get(out)
    return on_gpu


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("op", ["multi_head_cache_attention", "dynamic_multi_head_attention",
                                "dynamic_key_value_cache", "key_value_cache"])
def test_kernels_conform(device, op, threads):
    report = kit.check(op, kernels(device, getattr(cacheattn, op), threads), max_examples=EXAMPLES)
    assert report.examples >= 1


@pytest.mark.parametrize("op", ["multi_head_cache_attention", "dynamic_multi_head_attention"])
def test_rung_2_kernel_conforms(device, op):
    """The kernel ladder's second rung (a warp per key; docs/kernel-ladder.md) on the same checks. Its simulator
    path syncs the block at every warp reduction, so it gets a third of the budget and one block size."""
    report = kit.check(op, kernels(device, getattr(cacheattn, op), 64, rung=2), max_examples=max(1, KERNEL // 3))
    assert report.examples >= 1


@pytest.mark.parametrize("op", ["multi_head_cache_attention", "dynamic_multi_head_attention"])
def test_rung_3_kernel_conforms(device, op):
    """Rung 3 (16-byte chunks, lane groups per key): the kit's float16/float32 caches and int8 at head_dim 16 take
    the vector loads, int8 at 8 or 24 and every int4 the element-load fallback (rows not 16-byte multiples)."""
    report = kit.check(op, kernels(device, getattr(cacheattn, op), 64, rung=3), max_examples=max(1, KERNEL // 3))
    assert report.examples >= 1


@pytest.mark.parametrize("quant_bit", [8, 4])
@settings(max_examples=max(1, KERNEL // 6))
@given(case=ppl_cases(max_batch=2))
def test_rung_3_unpacks_int8_and_int4_vector_loads(device, quant_bit, case):
    """The kit's problems at head_dim 32, where int8 (32-byte) and int4 (16-byte) rows take the vector loads too:
    rung 3's shifts, sign extension and per-group scales against the reference's dequantized values."""
    impl = kernels(device, cacheattn.multi_head_cache_attention, 64, rung=3)
    kit.check_case("multi_head_cache_attention", impl, with_(case, head_dim=32, quant_bit=quant_bit))


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
