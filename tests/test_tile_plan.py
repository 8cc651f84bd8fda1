"""The attention core's tile plan: within the shared-memory budget, and a whole GQA group per block when it fits
(each K/V element is then loaded once per group)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels_numba._attention_core import SHARED_BYTES, plan_tiles, shared_bytes


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
