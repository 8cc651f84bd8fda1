"""The key walk of the vector kernel (rungs 3 and 4, kernels_numba/_attention_vector.py): which specialization the
host picks for a launch (32-bit offsets when the cache allows, one walk for K and V where they share a page table),
and that walks crossing pages at every place a tile or a step can cross one still give the reference's result."""

from dataclasses import replace

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import cacheattn
import cacheattn.testing as kit
from kernels_numba import _launch
from kernels_numba._attention_vector import PAGE_WALKER, KVWalker, each_source
from kernels_numba._cache import OFFSET_LIMIT, cache_source, offset_type
from kernels_numba._launch import OFFSET_PAGE
from kernels_numba.ft_cross_attention import CACHE_WALKER
from kernels_numba.onnx_attention import KV_WALKER
from kernels_numba.trtllm_generation import make_generation_walker

from strategies import PPLCase, TrtCase, build_ppl, build_trt

OFFSET_FIELDS = ("page", "base", "s_b", "s_t", "s_h", "sc_base", "sc_s_b", "sc_s_t", "sc_s_h")


def huge_view(dtype, shape):
    """A read-only view of `shape` over one element (every stride 0): past 2**31 elements without allocating them."""
    return as_strided(np.zeros(1, dtype), shape=shape, strides=(0,) * len(shape), writeable=False)


def test_offsets_are_int32_only_when_every_offset_fits():
    small = np.zeros((4, 2, 2, 3, 16), np.int8)                     # (T, L, KV, H, D)
    scales = np.zeros((4, 2, 2, 3, 2), np.float16)
    starts = np.zeros((1, 1), np.int64)
    src = cache_source(small, scales, starts, 64, "T L KV H D", layer_idx=1, kv=1)
    assert {type(getattr(src, name)) for name in OFFSET_FIELDS} == {np.int32}
    assert (int(src.base), int(src.s_t), int(src.sc_base)) == (3 * 16 + 6 * 16, 12 * 16, 3 * 2 + 6 * 2)
    # offset mode's page that never ends is clamped to one no token index reaches
    assert int(cache_source(small, scales, starts, OFFSET_PAGE, "T L KV H D").page) == OFFSET_LIMIT - 1

    # 2**31 elements: data or scales past int32 keep every offset 64-bit (and the offset mode's page)
    huge = huge_view(np.int8, (2 ** 21, 2, 2, 8, 32))
    assert huge.size == OFFSET_LIMIT
    assert offset_type(small, scales) is np.int32
    assert offset_type(huge.reshape(-1), scales) is np.int64
    assert offset_type(small, huge_view(np.float16, (OFFSET_LIMIT,))) is np.int64
    src = cache_source(huge, None, starts, OFFSET_PAGE, "T L KV H D")
    assert {type(getattr(src, name)) for name in OFFSET_FIELDS} == {np.int64}
    assert int(src.page) == OFFSET_PAGE and int(src.s_t) == 2 * 2 * 8 * 32
    # one element short of 2**31 still fits: the largest offset formed is 2**31 - 2
    assert offset_type(huge_view(np.int8, (OFFSET_LIMIT - 1,))) is np.int32


def test_which_walks_k_and_v_share():
    """OpenPPL's K and V come from one cache through one page table (cachestarts), so rung 3 takes PAGE_WALKER, one
    walk and one page-table read for both; TensorRT-LLM's share the walk (entry table, window, beams) but each
    takes its own address, as their blocks have offsets of their own; ONNX's and FasterTransformer's walkers place
    K and V apart (present's past and new parts, two caches), so they go through each_source, a walk each."""
    case = PPLCase(seqlens=(1, 1), past=(5, 9), decoding_batches=2, num_heads=4, num_kv_heads=2, head_dim=32,
                   dtype="float16", quant_bit=8, quant_group=8, scale_dtype="float16", cache_layout=0, cache_mode=1,
                   page_size=4, num_layer=2, layer_idx=1, is_causal=True, is_alibi=False, mask="none", mask_pad=0,
                   seed=5)
    with _launch.recorded_launches() as launches:
        cacheattn.multi_head_cache_attention(**build_ppl(case), **case.attrs(), backend="numba", threads=64, rung=3)
    (args,) = [args for kernel, args in launches if kernel.py_func.__name__ == "vector_attention_kernel"]
    k_src, v_src = args[4], args[5]
    assert k_src.starts is v_src.starts and int(k_src.page) == int(v_src.page) == 4
    assert type(k_src.s_t) is type(v_src.s_t) is np.int32
    assert isinstance(PAGE_WALKER, KVWalker)

    assert isinstance(make_generation_walker(2, 16, True)[1], KVWalker)
    for walker in (CACHE_WALKER, KV_WALKER):
        assert not isinstance(walker, KVWalker) and isinstance(each_source(walker), KVWalker)


# head_dim 128 with a GQA group of 4: lane groups take tiles of 2 keys and a block of 2 warps steps 8 keys (float16)
# or 16 (int8), so pages of 3 keys make tiles cross pages at odd offsets and every step cross several pages.
CROSSING = PPLCase(seqlens=(1, 1), past=(36, 21), decoding_batches=2, num_heads=4, num_kv_heads=1, head_dim=128,
                   dtype="float16", quant_bit=0, quant_group=8, scale_dtype="float16", cache_layout=0, cache_mode=1,
                   page_size=3, num_layer=1, layer_idx=0, is_causal=True, is_alibi=False, mask="none", mask_pad=0,
                   seed=11)


@pytest.mark.parametrize("quant_bit,rung,num_splits", [(0, 3, None), (8, 4, 3)])
def test_walks_that_cross_pages_inside_tiles_and_steps(quant_bit, rung, num_splits):
    """Rung 4's 3 splits start at keys 0, 13 and 26 (37 keys) and 0, 8 and 16 (22): odd first keys too."""
    impl = cacheattn.multi_head_cache_attention
    launch = dict(backend="numba", threads=64, rung=rung, num_splits=num_splits)
    kit.check_case("multi_head_cache_attention", lambda *a, **k: impl(*a, **k, **launch),
                   replace(CROSSING, quant_bit=quant_bit))


def test_trtllm_paged_k_and_v_on_their_own_blocks():
    """A paged TensorRT-LLM generation call whose K and V blocks differ, on rung 3: one walk, each its own block,
    the reference's result."""
    case = TrtCase(contexts=(), generations=((3, 6), (2, 9)), beam_width=1, num_heads=4, num_kv_heads=2,
                   head_size=16, dtype="float16", capacity=12, window=12, paged=True, tokens_per_block=4, seed=7)
    args = build_trt(case)
    offsets = args["kv_cache_block_offsets"]
    assert not np.array_equal(offsets[:, :, 0], offsets[:, :, 1])
    impl = cacheattn.gpt_attention
    with _launch.recorded_launches() as launches:
        impl(**args, backend="numba", threads=32, rung=3)
    assert "vector_attention_kernel" in [kernel.py_func.__name__ for kernel, _ in launches]
    kit.check_case("gpt_attention", lambda *a, **k: impl(*a, **k, backend="numba", threads=32, rung=3), case)
