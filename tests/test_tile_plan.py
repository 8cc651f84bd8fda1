"""The attention core's tile plan: within the shared-memory budget, and a whole GQA group per block when it fits
(each K/V element is then loaded once per group)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels_numba._attention_core import SHARED_BYTES, plan_tiles, shared_bytes
from kernels_numba._attention_vector import keys_per_step, keys_per_tile, lanes_per_key, plan_vector_rows
from kernels_numba._cache import cache_source, chunk_elements, vector_loads_ok


@given(kv_heads=st.integers(1, 8), group=st.sampled_from([1, 2, 3, 4, 8, 16, 32]), max_seqlen=st.integers(1, 4096),
       head_dim=st.sampled_from([8, 24, 64, 80, 96, 128, 256]), elem_bytes=st.sampled_from([4, 8]))
def test_plan_fits_shared_memory(kv_heads, group, max_seqlen, head_dim, elem_bytes):
    try:
        heads_per_block, q_tile, key_tile = plan_tiles(kv_heads * group, kv_heads, max_seqlen, head_dim, head_dim,
                                                       elem_bytes)
    except ValueError as exc:                  # only float64 at head_dim 256 may not fit at all
        assert elem_bytes == 8 and head_dim == 256, exc
        return
    assert shared_bytes(heads_per_block * q_tile, key_tile, head_dim, head_dim, elem_bytes) <= SHARED_BYTES
    assert group % heads_per_block == 0 and q_tile >= 1 and key_tile >= 8
    if max_seqlen == 1:
        assert q_tile == 1                      # decode: no idle query rows


@pytest.mark.parametrize("group,head_dim", [(1, 128), (4, 128), (8, 64), (16, 128)])
def test_decode_reads_kv_once_per_group(group, head_dim):
    heads_per_block, q_tile, _ = plan_tiles(8 * group, 8, 1, head_dim, head_dim)
    assert (heads_per_block, q_tile) == (group, 1)


@pytest.mark.parametrize("quant_bit,dtype,head_dim,lanes,rows,tile", [
    (0, np.float16, 128, 16, 8, 2), (8, np.int8, 128, 8, 4, 2), (4, np.int8, 128, 8, 4, 2),
    (0, np.float32, 128, 32, 8, 4)])
def test_rung_3_lane_groups_and_register_rows(quant_bit, dtype, head_dim, lanes, rows, tile):
    """A chunk per lane (16 bytes; 8 for int4): Dh * bytes / chunk lanes per key, and fewer rows per block the wider
    a lane's slice (32/8 heads: the whole group of 4 on every cache format at head_dim 128), and a tile of keys per
    lane group whose K and V slices fit 64 floats a lane."""
    chunk = chunk_elements(quant_bit, dtype, 3)
    assert lanes_per_key(-(-head_dim // chunk)) == lanes
    assert keys_per_tile(head_dim, chunk) == tile
    assert keys_per_step(head_dim, chunk, warps=4) == 4 * 32 // lanes * tile
    heads_per_block, q_tile = plan_vector_rows(8 * 4, 8, 1, head_dim, chunk, warps=4)
    assert heads_per_block * q_tile == min(rows, 4)


def aligned_zeros(shape, dtype, skew=0):
    """Zeros whose data starts `skew` elements after a 16-byte boundary."""
    size, itemsize = int(np.prod(shape)), np.dtype(dtype).itemsize
    storage = np.zeros(size + 16 + skew, dtype)
    offset = (-storage.ctypes.data % 16) // itemsize + skew
    return storage[offset:offset + size].reshape(shape)


def test_vector_loads_only_on_aligned_rows():
    """Rung 3 reads 16-byte vectors only when every row of the source starts on a 16-byte boundary and is a whole
    number of chunks; anything else takes the element loads."""
    starts = np.zeros((1, 1), np.int64)

    def ok(cache, quant_bit, head_dim, **source):
        return vector_loads_ok(cache_source(cache, None, starts, 64, "T H D", **source), quant_bit, head_dim)

    assert ok(aligned_zeros((4, 2, 32), np.float16), 0, 32)
    assert not ok(aligned_zeros((4, 2, 32), np.float16, skew=1), 0, 32)        # the data starts 2 bytes off
    assert not ok(aligned_zeros((4, 2, 28), np.float16), 0, 28)                # 56-byte rows
    shifted = cache_source(aligned_zeros((4, 2, 32), np.float16), None, starts, 64, "T H D")._replace(base=np.int64(4))
    assert not vector_loads_ok(shifted, 0, 32)                                 # rows start 8 bytes into a chunk
    assert ok(aligned_zeros((4, 2, 16), np.int8), 4, 32)                       # int4: 16-byte rows
    assert not ok(aligned_zeros((4, 2, 12), np.int8), 4, 24)                   # int4: 12-byte rows
    assert not ok(aligned_zeros((4, 2, 24), np.int8), 8, 24)
    assert ok(aligned_zeros((4, 2, 8), np.float32), 0, 8)
    assert not ok(aligned_zeros((4, 2, 8), np.float64), 0, 8)                  # no float64 unpacking
