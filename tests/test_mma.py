"""The tensor-core primitives of `kernels_numba/_mma.py` against NumPy, on random fragments.

A one-warp kernel hands each lane the matrix elements the PTX ISA's fragment table (`a_position`, `b_position`,
`c_position`) assigns it, calls the primitive, and scatters the lanes' results back by the same table. Under
the simulator (CI) this runs the emulation, so a lane reading the wrong register, the wrong half of one, or
writing the wrong C element fails here without any attention around it; with CACHEATTN_TEST_GPU=1 the same
test runs `mma.sync` itself and so checks the table against the hardware.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from kernels_numba import _mma
from kernels_numba._mma import MMA_K, MMA_M, MMA_N
from kernels_numba._warp import WARP_SIZE


def position_table(position, count):
    """(32, count, 2) int64: (row, col) of each lane's fragment elements."""
    return np.array([[position(lane, i) for i in range(count)] for lane in range(WARP_SIZE)], np.int64)


A_AT, B_AT, C_AT = position_table(_mma.a_position, 8), position_table(_mma.b_position, 4), \
    position_table(_mma.c_position, 4)
MMA_SCRATCH, QUAD_SCRATCH = _mma.scratch_shapes(1)          # one warp

# The first thing a GPU session runs (`python -m cacheattn gpu-session`'s gpu-tests step): the layout table against
# the hardware's mma.sync.
pytestmark = pytest.mark.hardware


@cuda.jit
def mma_kernel(a, b, c, d, a_at, b_at, c_at, first_register):
    lane = cuda.threadIdx.x
    mma_scratch = cuda.shared.array(MMA_SCRATCH, np.uint32)
    regs = cuda.local.array(6, np.uint32)
    for k in range(4):                              # A: four registers of two elements, low half first
        regs[k] = _mma.pack_half2(a[a_at[lane, 2 * k, 0], a_at[lane, 2 * k, 1]],
                                  a[a_at[lane, 2 * k + 1, 0], a_at[lane, 2 * k + 1, 1]])
    first_register[lane] = regs[0]
    for k in range(2):
        regs[4 + k] = _mma.pack_half2(b[b_at[lane, 2 * k, 0], b_at[lane, 2 * k, 1]],
                                      b[b_at[lane, 2 * k + 1, 0], b_at[lane, 2 * k + 1, 1]])
    d0, d1, d2, d3 = _mma.mma_m16n8k16(regs[0], regs[1], regs[2], regs[3], regs[4], regs[5],
                                       c[c_at[lane, 0, 0], c_at[lane, 0, 1]], c[c_at[lane, 1, 0], c_at[lane, 1, 1]],
                                       c[c_at[lane, 2, 0], c_at[lane, 2, 1]], c[c_at[lane, 3, 0], c_at[lane, 3, 1]],
                                       mma_scratch, 0, lane)
    d[c_at[lane, 0, 0], c_at[lane, 0, 1]] = d0
    d[c_at[lane, 1, 0], c_at[lane, 1, 1]] = d1
    d[c_at[lane, 2, 0], c_at[lane, 2, 1]] = d2
    d[c_at[lane, 3, 0], c_at[lane, 3, 1]] = d3


@cuda.jit
def quad_kernel(x, y, out):
    lane = cuda.threadIdx.x
    quad_scratch = cuda.shared.array(QUAD_SCRATCH, np.float32)
    out[lane, 0], out[lane, 1] = _mma.quad_max2(x[lane], y[lane], quad_scratch, 0, lane)
    out[lane, 2], out[lane, 3] = _mma.quad_sum2(x[lane], y[lane], quad_scratch, 0, lane)


def test_every_fragment_element_is_held_by_exactly_one_lane():
    """The fragment table covers each matrix once: A 16x16, B 16x8, C 16x8 (so the scatter above is a bijection)."""
    for table, shape in ((A_AT, (MMA_M, MMA_K)), (B_AT, (MMA_K, MMA_N)), (C_AT, (MMA_M, MMA_N))):
        seen = np.zeros(shape, int)
        np.add.at(seen, (table[..., 0], table[..., 1]), 1)
        assert (seen == 1).all()


@settings(max_examples=6)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_mma_m16n8k16_is_a_b_plus_c(seed, scale):
    """D = A B + C with A, B rounded to float16 (nearest even) and float32 accumulation: within float32 rounding
    of the float64 product of the rounded inputs; a misplaced element would be off by O(1)."""
    rng = np.random.default_rng(seed)
    a = (scale * rng.standard_normal((MMA_M, MMA_K))).astype(np.float32)      # not float16-exact: pack rounds
    b = rng.standard_normal((MMA_K, MMA_N)).astype(np.float32)
    c = rng.standard_normal((MMA_M, MMA_N)).astype(np.float32)
    d = np.full((MMA_M, MMA_N), np.nan, np.float32)
    first_register = np.zeros(WARP_SIZE, np.uint32)
    mma_kernel[1, WARP_SIZE](a, b, c, d, A_AT, B_AT, C_AT, first_register)
    # pack_half2(lo, hi): lo in the low 16 bits, both rounded to nearest even (what NumPy's float16 view holds).
    pairs = a[A_AT[:, :2, 0], A_AT[:, :2, 1]].astype(np.float16)                  # (32 lanes, a0 and a1)
    assert (first_register == pairs.view(np.uint32)[:, 0]).all()
    a16, b16 = (x.astype(np.float16).astype(np.float64) for x in (a, b))
    want = a16 @ b16 + c
    bound = 4 * MMA_K * np.finfo(np.float32).eps * (np.abs(a16) @ np.abs(b16) + np.abs(c))
    assert (np.abs(d - want) <= bound).all(), np.argwhere(~(np.abs(d - want) <= bound))[:5]
    # The float16 rounding happened: unrounded inputs give a different product at this scale.
    assert not np.allclose(a16 @ b16, a.astype(np.float64) @ b, rtol=1e-9, atol=0)


@settings(max_examples=3)
@given(seed=st.integers(0, 2**32 - 1))
def test_quad_reductions_cover_the_four_lanes_of_a_row(seed):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((2, WARP_SIZE)).astype(np.float32)
    out = np.full((WARP_SIZE, 4), np.nan, np.float32)
    quad_kernel[1, WARP_SIZE](x, y, out)
    quads = np.arange(WARP_SIZE) // 4
    for col, (values, reduce) in enumerate(((x, np.max), (y, np.max), (x, np.sum), (y, np.sum))):
        want = np.array([reduce(values[quads == q]) for q in quads], np.float64)
        np.testing.assert_allclose(out[:, col], want, rtol=1e-6)
