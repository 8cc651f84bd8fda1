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
from kernels_numba import _launch

from helpers import assert_bits_equal, assert_close
from strategies import KERNEL, PPLCase, build_ppl, float64_ppl_attention, ppl_cases, reference_cache_state, with_

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
    """The attention operators take the plan's rung at one warp (`choose_kernel`: rungs 3 to 5 on these problems)
    and rung 1, the plan's fallback, at two; the rungs below each get their own check too."""
    launch = {"rung": 1} if op.endswith("attention") and threads == THREADS[-1] else {}
    report = kit.check(op, kernels(device, getattr(cacheattn, op), threads, **launch), max_examples=EXAMPLES)
    assert report.examples >= 1


@pytest.mark.parametrize("op", ["multi_head_cache_attention", "dynamic_multi_head_attention"])
def test_rung_2_kernel_conforms(device, op):
    """The kernel ladder's second rung (a warp per key; docs/rung-2.md) on the same checks. Its simulator
    path syncs the block at every warp reduction, so it gets a third of the budget and one block size."""
    report = kit.check(op, kernels(device, getattr(cacheattn, op), 64, rung=2), max_examples=max(1, KERNEL // 3))
    assert report.examples >= 1


@pytest.mark.parametrize("op", ["multi_head_cache_attention", "dynamic_multi_head_attention"])
def test_rung_3_kernel_conforms(device, op):
    """Rung 3 (16-byte chunks, lane groups per key): the kit's float16/float32 caches and int8 at head_dim 16 take
    the vector loads, int8 at 8 or 24 and every int4 the element-load fallback (rows not 16-byte multiples)."""
    report = kit.check(op, kernels(device, getattr(cacheattn, op), 64, rung=3), max_examples=max(1, KERNEL // 6))
    assert report.examples >= 1


@pytest.mark.parametrize("quant_bit", [0, 8, 4])
@settings(max_examples=max(1, KERNEL // 6))
@given(case=ppl_cases(max_batch=2))
def test_rung_3_vector_loads_unpack_every_format(device, quant_bit, case):
    """The kit's problems at head_dim 32, where every cache row is a whole number of 16-byte chunks (float16 and
    float32 bit casts; int8 and int4 shifts, sign extension and per-group scales), against the reference."""
    impl = kernels(device, cacheattn.multi_head_cache_attention, 64, rung=3)
    kit.check_case("multi_head_cache_attention", impl, with_(case, head_dim=32, quant_bit=quant_bit))


@pytest.mark.parametrize("head_dim", [12, 32])
@settings(max_examples=max(1, KERNEL // 6))
@given(case=ppl_cases(max_batch=2, quant_bits=(0,)))
def test_the_store_copies_whole_rows(device, head_dim, case):
    """An unquantized cache's store copies every row whole: in 16-byte chunks (one vector load and store a thread)
    where both sides' rows are 16-byte aligned, else 8 elements a thread with the last span partial (float16 at
    head_dim 12, no multiple of 8). The cache, untouched slots included, must be the reference's."""
    from unittest import mock

    from kernels_numba import ppl_dynamic_key_value_cache as store

    built = []
    original = store._store_kernel

    def spy(*key):
        built.append(key[-1])                    # its last argument: whether it copies 16-byte chunks
        return original(*key)
    with mock.patch.object(store, "_store_kernel", spy):
        kit.check_case("multi_head_cache_attention", kernels(device, cacheattn.multi_head_cache_attention, 32),
                       with_(case, head_dim=head_dim))
    row_bytes = head_dim * np.dtype(case.dtype).itemsize
    assert built and all(vector == (row_bytes % 16 == 0) for vector in built), (built, row_bytes)


@pytest.mark.parametrize("num_splits,past_from", [(3, 4), (8, 0)])
@settings(max_examples=max(1, KERNEL // 6))
@given(case=ppl_cases(max_batch=2, max_seqlen=3, max_past=3))
def test_rung_4_split_k_conforms(device, num_splits, past_from, case):
    """Rung 4 (rung 3 + split-K and the combine kernel) at forced split counts. Pasts from 4 give every sequence
    5 to 10 keys, so 3 splits all hold keys; 8 splits of at most 6 keys leave some empty, which must add nothing.
    One warp a block: the simulator's cost is blocks x threads."""
    impl = kernels(device, cacheattn.multi_head_cache_attention, 32, rung=4, num_splits=num_splits)
    kit.check_case("multi_head_cache_attention", impl, with_(case, past=tuple(p + past_from for p in case.past)))


@pytest.mark.parametrize("batch,context,splits", [(1, 4096, 33), (1, 150, 3), (32, 4096, 1)])
def test_rung_4_splits_only_when_sms_idle(batch, context, splits):
    """The heuristic on recorded launches (nothing runs): batch x kv heads blocks against the 132 SMs the
    simulator reports, at most one split per step of keys (64 keys a step at head_dim 8 with 64 threads)."""
    case = PPLCase(seqlens=(1,) * batch, past=(context,) * batch, decoding_batches=batch, num_heads=16,
                   num_kv_heads=8, head_dim=8, dtype="float16", quant_bit=0, quant_group=8, scale_dtype="float16",
                   cache_layout=0, cache_mode=0, page_size=1, num_layer=1, layer_idx=0, is_causal=True,
                   is_alibi=False, mask="none", mask_pad=0, seed=0)
    with _launch.recorded_launches() as launches:
        cacheattn.multi_head_cache_attention(**build_ppl(case), **case.attrs(), backend="numba", threads=64, rung=4)
    names = [kernel.py_func.__name__ for kernel, _ in launches]
    if splits == 1:
        assert names == ["store_kernel", "vector_attention_kernel"]
    else:
        assert names == ["store_kernel", "vector_attention_kernel", "combine_kernel"]
        # out_geom's num_splits: two blocks an SM (2 x 132 / 8), or 151 keys
        assert launches[1][1][1][5] == splits


@pytest.mark.parametrize("op", ["multi_head_cache_attention", "dynamic_multi_head_attention"])
def test_rung_5_kernel_conforms(device, op):
    """The fifth rung (tensor cores through mma.sync; docs/rung-5.md) on the same checks, float16 only: it
    rounds Q, K, V (exact: the document's dequantized K/V are float16 here) and P to float16 and accumulates in
    float32, which the float16 tolerance holds. The simulator emulates each mma between two block barriers, so it
    gets a third of the budget; 64 threads make two warps, so the key split and the warps' merge run too."""
    report = kit.check(op, kernels(device, getattr(cacheattn, op), 64, rung=5), max_examples=max(1, KERNEL // 3),
                       dtypes=("float16",))
    assert report.examples >= 1


# Rung 5 beyond the kit's contexts (which fit one 16-key tile, so a second warp never holds a key), four warps:
# decode over more than three tiles splits the keys four ways and merges the warps' states pairwise in two
# rounds; prefill of more than 16 / group positions gives each of two warp pairs its own 16-row tile.
RUNG_5_SPLITS = {
    "keys split four ways": ppl_cases(max_seqlen=3, max_past=60, dtypes=("float16",)).filter(
        lambda c: max(p + s for p, s in zip(c.past, c.seqlens)) > 3 * 16),
    "two row tiles": ppl_cases(max_seqlen=12, max_past=24, groups=(2, 3), dtypes=("float16",)).filter(
        lambda c: max(c.seqlens) * (c.num_heads // c.num_kv_heads) > 16),
}


@pytest.mark.parametrize("split", RUNG_5_SPLITS)
def test_rung_5_splits_keys_and_rows_across_warps(device, split):
    @settings(max_examples=max(1, KERNEL // 12))
    @given(case=RUNG_5_SPLITS[split])
    def conforms(case):
        kit.check_case("multi_head_cache_attention",
                       kernels(device, cacheattn.multi_head_cache_attention, 128, rung=5), case)
    conforms()


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


@pytest.mark.parametrize("quant_bit,seed", [(0, 1), (8, 2), (4, 3)])
def test_rung_3_tiles_of_keys_at_head_dim_128(device, quant_bit, seed):
    """The kit's head_dims are too small for a lane group to take more than one key a step; at head_dim 128 with a
    GQA group of 4, every cache format's groups take tiles of 2 keys (`keys_per_tile`; int4 in 8-byte chunks),
    summed by the transposed butterfly and stepped through one softmax update a tile. 45 and 70 keys end mid-step
    and mid-page."""
    case = PPLCase(seqlens=(1, 1), past=(44, 69), decoding_batches=2, num_heads=4, num_kv_heads=1, head_dim=128,
                   dtype="float16", quant_bit=quant_bit, quant_group=8, scale_dtype="float16", cache_layout=0,
                   cache_mode=1, page_size=16, num_layer=1, layer_idx=0, is_causal=True, is_alibi=False,
                   mask="none", mask_pad=0, seed=seed)
    from kernels_numba._attention_vector import keys_per_tile
    from kernels_numba._cache import chunk_elements
    assert keys_per_tile(128, chunk_elements(quant_bit, np.int8 if quant_bit else np.float16, 3)) == 2
    kit.check_case("multi_head_cache_attention", kernels(device, cacheattn.multi_head_cache_attention, 64, rung=3),
                   case)
