"""The bfloat16 tensor-core primitives of `kernels_numba/_mma.py`: pack_bf162's rounding against ml_dtypes and
against the rounding written out in bits, bf162_floats' exact widening, mma_m16n8k16_bf16 on random fragments
(the f16 mma's fragment table), and all three compiled for sm_80 and sm_90 (HMMA.16816.F32.BF16, F2FP).

The mma test runs with CACHEATTN_TEST_GPU=1 too, on mma.sync itself.
"""

import ml_dtypes
import numpy as np
import pytest
from intrinsics_compile import compile_kernels, count
from numba import cuda

from kernels_numba import _mma
from kernels_numba._mma import MMA_K, MMA_M, MMA_N
from kernels_numba._warp import WARP_SIZE

RNG = np.random.default_rng(1128)
MMA_SCRATCH, _ = _mma.scratch_shapes(1)
simulator_only = pytest.mark.skipif(not _mma.SIMULATED, reason="calls the simulator twins directly")


def edge_floats():
    """float32 values that test a rounding to bfloat16: signed zeros, float32 subnormals (the smallest, the
    largest, ones that round up into the normals), infinities, NaNs with several payloads (one whose payload
    lies in the bits a truncation drops), exact ties between two bfloat16 (even and odd below), just above and
    below a tie, the largest float32 (rounds to inf), the largest bfloat16, and random bits."""
    bits = [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x007FFFFF, 0x007F8000, 0x007FFF80, 0x7F800000,
            0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFFFFFFFF, 0x3F808000, 0x3F818000,
            0xBF808000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F0000, 0x7F7F8000, 0x00008000, 0x00018000]
    ties = (RNG.integers(0, 2**16, 64, dtype=np.uint32) << 16) | 0x8000          # every tie sign and parity
    randoms = RNG.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.array(bits, np.uint32), ties, randoms]).view(np.float32)


def rne_bits(x):
    """float32 -> bfloat16 bits by round to nearest, ties to even, written in integers: add 0x7fff plus the
    lowest kept bit and truncate (a carry out of the mantissa moves to the exponent, up to inf). Not for NaN."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@simulator_only
def test_pack_bf162_rounds_as_ml_dtypes_and_as_the_bits_say():
    values = edge_floats()
    assert np.isnan(values).sum() >= 4 and (values.view(np.uint32) & 0xFFFF == 0x8000).sum() >= 64
    pairs = values.reshape(-1, 2)
    got = np.array([int(_mma.pack_bf162(lo, hi)) for lo, hi in pairs], np.uint32)
    got_halves = got.view(np.uint16).reshape(-1)                           # low half first: lo, hi, lo, hi ...
    with np.errstate(invalid="ignore"):
        want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(got_halves, want), np.flatnonzero(got_halves != want)[:5]
    finite = ~np.isnan(values)
    assert np.array_equal(got_halves[finite], rne_bits(values[finite]))
    assert np.isnan(got_halves[~finite].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    # the ties went to even, both ways; the largest float32 to inf; a float32 subnormal to a bfloat16 one
    assert got_halves[values.view(np.uint32) == 0x3F808000][0] == 0x3F80
    assert got_halves[values.view(np.uint32) == 0x3F818000][0] == 0x3F82
    assert got_halves[values.view(np.uint32) == 0x7F7FFFFF][0] == 0x7F80
    assert got_halves[values.view(np.uint32) == 0x007F8000][0] == 0x0080          # rounds up into the normals
    assert got_halves[values.view(np.uint32) == 0x00018000][0] == 0x0002


@simulator_only
def test_a_python_float_is_rounded_to_float32_first():
    """As on the GPU (the arguments become float32 before the cvt): 1 + 2^-8 + 2^-30 as a double would round up
    to bfloat16 directly, but its float32 is the tie 1 + 2^-8, which rounds to even: 1."""
    assert int(_mma.pack_bf162(1 + 2**-8 + 2**-30, 0.0)) & 0xFFFF == 0x3F80


@simulator_only
def test_bf162_floats_widens_exactly():
    bits = RNG.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32)
    got = np.array([_mma.bf162_floats(int(w)) for w in bits], np.float32)
    want = bits.view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32).reshape(-1, 2)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))           # NaN payloads too: a shift


def position_table(position, count):
    return np.array([[position(lane, i) for i in range(count)] for lane in range(WARP_SIZE)], np.int64)


A_AT, B_AT, C_AT = (position_table(_mma.a_position, 8), position_table(_mma.b_position, 4),
                    position_table(_mma.c_position, 4))


@cuda.jit
def mma_bf16_kernel(a, b, c, d, a_at, b_at, c_at, registers, unpacked):
    lane = cuda.threadIdx.x
    scratch = cuda.shared.array(MMA_SCRATCH, np.uint32)
    regs = cuda.local.array(6, np.uint32)
    for k in range(4):
        regs[k] = _mma.pack_bf162(a[a_at[lane, 2 * k, 0], a_at[lane, 2 * k, 1]],
                                  a[a_at[lane, 2 * k + 1, 0], a_at[lane, 2 * k + 1, 1]])
    for k in range(2):
        regs[4 + k] = _mma.pack_bf162(b[b_at[lane, 2 * k, 0], b_at[lane, 2 * k, 1]],
                                      b[b_at[lane, 2 * k + 1, 0], b_at[lane, 2 * k + 1, 1]])
    for k in range(6):
        registers[lane, k] = regs[k]
    d0, d1, d2, d3 = _mma.mma_m16n8k16_bf16(regs[0], regs[1], regs[2], regs[3], regs[4], regs[5],
                                            c[c_at[lane, 0, 0], c_at[lane, 0, 1]],
                                            c[c_at[lane, 1, 0], c_at[lane, 1, 1]],
                                            c[c_at[lane, 2, 0], c_at[lane, 2, 1]],
                                            c[c_at[lane, 3, 0], c_at[lane, 3, 1]], scratch, 0, lane)
    lo, hi = _mma.bf162_floats(regs[0])
    d[c_at[lane, 0, 0], c_at[lane, 0, 1]] = d0
    d[c_at[lane, 1, 0], c_at[lane, 1, 1]] = d1
    d[c_at[lane, 2, 0], c_at[lane, 2, 1]] = d2
    d[c_at[lane, 3, 0], c_at[lane, 3, 1]] = d3
    unpacked[lane, 0], unpacked[lane, 1] = lo, hi


@pytest.mark.hardware
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e5])
def test_mma_m16n8k16_bf16_is_a_b_plus_c(scale):
    """D = A B + C with A, B rounded to bfloat16 (nearest even) and float32 accumulation, within float32 rounding
    of the float64 product of the rounded inputs. At scale 1e5 the products (1e10) are far past float16's range:
    only bfloat16's float32 exponent holds them."""
    a = (scale * RNG.standard_normal((MMA_M, MMA_K))).astype(np.float32)
    b = (scale * RNG.standard_normal((MMA_K, MMA_N))).astype(np.float32)
    c = (scale * scale * RNG.standard_normal((MMA_M, MMA_N))).astype(np.float32)
    d = np.full((MMA_M, MMA_N), np.nan, np.float32)
    registers = np.zeros((WARP_SIZE, 6), np.uint32)
    unpacked = np.full((WARP_SIZE, 2), np.nan, np.float32)
    mma_bf16_kernel[1, WARP_SIZE](a, b, c, d, A_AT, B_AT, C_AT, registers, unpacked)
    a16, b16 = (x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in (a, b))
    # register 0 of each lane: a0 (low), a1 (high) of its A fragment, rounded by ml_dtypes' rule; unpacked exactly
    pairs = a[A_AT[:, :2, 0], A_AT[:, :2, 1]].astype(ml_dtypes.bfloat16)
    assert np.array_equal(registers[:, 0], pairs.view(np.uint32)[:, 0])
    assert np.array_equal(unpacked, pairs.astype(np.float32))
    want = a16 @ b16 + c
    bound = 4 * MMA_K * np.finfo(np.float32).eps * (np.abs(a16) @ np.abs(b16) + np.abs(c))
    assert np.isfinite(d).all()
    assert (np.abs(d - want) <= bound).all(), np.argwhere(~(np.abs(d - want) <= bound))[:5]
    # bfloat16's 8-bit significand, not float16's 11: the unrounded inputs give a product off by more than that
    assert not (np.abs(a.astype(np.float64) @ b + c - want) <= bound).all()


COMPILE = """
import numpy as np
from kernels_numba import _mma


def kernel(x, out):
    lane = cuda.threadIdx.x
    p = _mma.pack_bf162(x[lane], x[lane + 32])
    d0, d1, d2, d3 = _mma.mma_m16n8k16_bf16(p, p, p, p, p, p, x[0], x[1], x[2], x[3], out, 0, lane)
    lo, hi = _mma.bf162_floats(p)
    x[lane] = d0 + d1 + d2 + d3 + lo * hi


def build(cc):
    return kernel, (types.float32[::1], types.uint32[:, :, ::1])
"""


def test_bf16_mma_and_pack_compile_to_hmma_bf16_and_f2fp():
    """For sm_80 and sm_90: one HMMA.16816.F32.BF16 and one F2FP.BF16 pack (PACK_AB); the unpack is a shift and a
    mask (no conversion instruction)."""
    for cc, result in compile_kernels(COMPILE).items():
        ptx, ops = result["ptx"], result["opcodes"]
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and "cvt.rn.bf16x2.f32" in ptx, cc
        assert count(ops, "HMMA.16816.F32.BF16") == 1, (cc, ops)
        packs = {op: n for op, n in ops.items() if op.startswith("F2FP")}
        assert sum(packs.values()) == 1 and all(".BF16." in op and op.endswith("PACK_AB") for op in packs), (cc, ops)
