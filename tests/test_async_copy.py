"""cp.async and ldmatrix (`kernels_numba/_async_copy.py`): the ldmatrix twin against a NumPy model of the PTX ISA's
fragment table and against the mma's A and B fragments (`_mma.a_position`, `b_position`); the cp.async twin's
copies and its checks of the contract (alignment, bounds, no touching a copy's bytes before a wait covers it, by
the hardware's group accounting); and both compiled for sm_80 and sm_90, with the machine code's LDGSTS,
LDGDEPBAR, DEPBAR and LDSM.

The fragment tests run with CACHEATTN_TEST_GPU=1 too (the real instructions against the same tables); the checks
of the contract exist in the simulator only.
"""

import numpy as np
import pytest
from intrinsics_compile import compile_kernels, count
from numba import cuda

from kernels_numba import _async_copy as ac
from kernels_numba import _mma
from kernels_numba._warp import WARP_SIZE

RNG = np.random.default_rng(20261128)
SCRATCH = ac.scratch_shape(1)                          # one warp
MMA_SCRATCH, _ = _mma.scratch_shapes(1)
ALIGN = ac.SHARED_ALIGNMENT
simulator_only = pytest.mark.skipif(not ac.SIMULATED, reason="the contract checks exist in the simulator only")


# ----------------------------------------------------------------------------- the ISA's table, written independently

def isa_ldmatrix_x4(buffer, rows, transpose):
    """(32 lanes, 4 registers) of ldmatrix.m8n8.x4.b16 on the uint16 `buffer`, lane l having given the element
    index rows[l]. The ISA's picture: the rows of matrix j come from the addresses of threads 8j .. 8j + 7; row i of
    the matrix (after .trans: column i) is spread over threads 4i .. 4i + 3, two consecutive elements each, the
    first in the low half."""
    out = np.zeros((WARP_SIZE, 4), np.uint32)
    for j in range(4):
        matrix = np.stack([buffer[rows[8 * j + r]:rows[8 * j + r] + 8] for r in range(8)]).astype(np.uint32)
        if transpose:
            matrix = matrix.T
        for i in range(8):
            for q in range(4):
                out[4 * i + q, j] = matrix[i, 2 * q] | matrix[i, 2 * q + 1] << 16
    return out


@cuda.jit
def ldmatrix_kernel(values, rows, out, transpose):
    lane = cuda.threadIdx.x
    tile = cuda.shared.array(512, np.uint16, alignment=ALIGN)
    scratch = cuda.shared.array(SCRATCH, np.int32)
    for i in range(lane, 512, WARP_SIZE):
        tile[i] = values[i]
    cuda.syncthreads()
    if transpose:
        out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = ac.ldmatrix_x4_trans(tile, rows[lane], scratch, 0,
                                                                                      lane)
    else:
        out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = ac.ldmatrix_x4(tile, rows[lane], scratch, 0, lane)


@pytest.mark.hardware
@pytest.mark.parametrize("transpose", [False, True])
def test_ldmatrix_gives_the_isas_fragments(transpose):
    """32 distinct 16-byte rows anywhere in a 1 KiB buffer of random bits, in random order."""
    values = RNG.integers(0, 2**16, 512).astype(np.uint16)
    rows = (8 * RNG.permutation(64)[:WARP_SIZE]).astype(np.int64)
    out = np.zeros((WARP_SIZE, 4), np.uint32)
    ldmatrix_kernel[1, WARP_SIZE](values, rows, out, transpose)
    want = isa_ldmatrix_x4(values, rows, transpose)
    assert np.array_equal(out, want), np.argwhere(out != want)[:5]
    assert not np.array_equal(want, isa_ldmatrix_x4(values, rows, not transpose))     # .trans matters here


STRIDE = 24          # elements between tile rows: padded (a multiple of 8 keeps every row 16-byte aligned)


@cuda.jit
def fragment_kernel(a, b, c, a_regs, b_regs, d):
    """ldmatrix_x4 of the 16x16 tile a, ldmatrix_x4_trans of the 16x16 tile b (both row-major, rows STRIDE apart in
    shared memory), then the two mmas of A B (two n-tiles of 8 columns)."""
    lane = cuda.threadIdx.x
    a_tile = cuda.shared.array(16 * STRIDE, np.float16, alignment=ALIGN)
    b_tile = cuda.shared.array(16 * STRIDE, np.float16, alignment=ALIGN)
    scratch = cuda.shared.array(SCRATCH, np.int32)
    mma_scratch = cuda.shared.array(MMA_SCRATCH, np.uint32)
    for i in range(lane, 256, WARP_SIZE):
        a_tile[(i // 16) * STRIDE + i % 16] = a[i // 16, i % 16]
        b_tile[(i // 16) * STRIDE + i % 16] = b[i // 16, i % 16]
    cuda.syncthreads()
    row = (lane % 16) * STRIDE + 8 * (lane // 16)          # a_rows(lane, STRIDE), b_rows(lane, STRIDE)
    a0, a1, a2, a3 = ac.ldmatrix_x4(a_tile, row, scratch, 0, lane)
    b0, b1, b2, b3 = ac.ldmatrix_x4_trans(b_tile, row, scratch, 0, lane)
    a_regs[lane, 0], a_regs[lane, 1], a_regs[lane, 2], a_regs[lane, 3] = a0, a1, a2, a3
    b_regs[lane, 0], b_regs[lane, 1], b_regs[lane, 2], b_regs[lane, 3] = b0, b1, b2, b3
    for n in range(2):
        r, s = (b0, b1) if n == 0 else (b2, b3)
        g, t = lane >> 2, lane % 4
        d0, d1, d2, d3 = _mma.mma_m16n8k16(a0, a1, a2, a3, r, s, c[g, 8 * n + 2 * t], c[g, 8 * n + 2 * t + 1],
                                           c[g + 8, 8 * n + 2 * t], c[g + 8, 8 * n + 2 * t + 1], mma_scratch, 0, lane)
        d[g, 8 * n + 2 * t], d[g, 8 * n + 2 * t + 1], d[g + 8, 8 * n + 2 * t], d[g + 8, 8 * n + 2 * t + 1] = \
            d0, d1, d2, d3


@pytest.mark.hardware
def test_ldmatrix_loads_the_mma_fragments():
    """ldmatrix_x4 of a row-major 16x16 float16 tile is the A fragment mma_m16n8k16 expects, register k holding
    a_(2k) and a_(2k+1) of `a_position`; ldmatrix_x4_trans of a row-major 16 (k) x 16 (n) tile is the B fragment
    of its columns 0..7 (registers 0, 1) and 8..15 (registers 2, 3) by `b_position`; and the mma on them is A B."""
    a = RNG.standard_normal((16, 16)).astype(np.float16)
    b = RNG.standard_normal((16, 16)).astype(np.float16)
    c = RNG.standard_normal((16, 16)).astype(np.float32)
    a_regs, b_regs = np.zeros((WARP_SIZE, 4), np.uint32), np.zeros((WARP_SIZE, 4), np.uint32)
    d = np.full((16, 16), np.nan, np.float32)
    fragment_kernel[1, WARP_SIZE](a, b, c, a_regs, b_regs, d)
    a_bits, b_bits = a.view(np.uint16).astype(np.uint32), b.view(np.uint16).astype(np.uint32)
    for lane in range(WARP_SIZE):
        for k in range(4):
            low, high = _mma.a_position(lane, 2 * k), _mma.a_position(lane, 2 * k + 1)
            assert a_regs[lane, k] == a_bits[low] | a_bits[high] << 16, (lane, k)
            n, i = 8 * (k // 2), 2 * (k % 2)
            (r0, c0), (r1, c1) = _mma.b_position(lane, i), _mma.b_position(lane, i + 1)
            assert b_regs[lane, k] == b_bits[r0, n + c0] | b_bits[r1, n + c1] << 16, (lane, k)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    bound = 4 * 16 * np.finfo(np.float32).eps * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
                                                 + np.abs(c))
    assert (np.abs(d - want) <= bound).all(), np.argwhere(~(np.abs(d - want) <= bound))[:5]


def test_row_helpers_point_each_lane_at_its_row():
    assert [ac.a_rows(lane, 40) for lane in (0, 1, 15, 16, 31)] == [0, 40, 600, 8, 608]
    assert all(ac.b_rows(lane, 24) == ac.a_rows(lane, 24) for lane in range(WARP_SIZE))


# ------------------------------------------------------------------------------------------------------- cp.async

THREADS, CHUNK = 8, 8          # 8 threads, each copying 16 bytes = 8 float16 a stage


@cuda.jit
def pipeline_kernel(src, out, stages):
    """Double buffering: stage s + 1's copies are issued before stage s is read; each thread reads the chunk of
    another thread (so after its wait, a barrier)."""
    t = cuda.threadIdx.x
    tile = ac.async_target(cuda.shared.array(2 * THREADS * CHUNK, np.float16, alignment=ALIGN))
    ac.cp_async16(tile, t * CHUNK, src, t * CHUNK)
    ac.cp_async_commit()
    for s in range(stages):
        if s + 1 < stages:
            ac.cp_async16(tile, ((s + 1) % 2) * THREADS * CHUNK + t * CHUNK, src, (s + 1) * THREADS * CHUNK
                          + t * CHUNK)
        ac.cp_async_commit()                      # an empty group on the last stage keeps the count uniform
        ac.cp_async_wait(1)                       # all but the newest group: stage s has landed
        cuda.syncthreads()
        other = (t + 3) % THREADS
        for k in range(CHUNK):
            out[s * THREADS * CHUNK + other * CHUNK + k] = tile[(s % 2) * THREADS * CHUNK + other * CHUNK + k]
        cuda.syncthreads()                        # everyone has read stage s before its buffer is refilled


@pytest.mark.hardware
def test_double_buffered_copies_deliver_every_stage():
    stages = 3
    src = RNG.standard_normal(stages * THREADS * CHUNK).astype(np.float16)
    out = np.full_like(src, np.nan)
    pipeline_kernel[1, THREADS](src, out, stages)
    assert np.array_equal(out.view(np.uint16), src.view(np.uint16))


@cuda.jit
def contract_kernel(src, out, case):
    t = cuda.threadIdx.x
    tile = ac.async_target(cuda.shared.array(64, np.float16, alignment=ALIGN))
    plain = cuda.shared.array(64, np.float16)
    scratch = cuda.shared.array(SCRATCH, np.int32)
    if case == 0:                                  # read by the copying thread before any wait
        ac.cp_async16(tile, 8 * t, src, 8 * t)
        ac.cp_async_commit()
        out[t] = tile[8 * t + 3]
    elif case == 1:                                # wait_group 1 of two groups: the first landed, the second not
        ac.cp_async16(tile, 16 * t, src, 16 * t)
        ac.cp_async_commit()
        ac.cp_async16(tile, 16 * t + 8, src, 16 * t + 8)
        ac.cp_async_commit()
        ac.cp_async_wait(1)
        out[t] = tile[16 * t + 7]                  # fine
        out[t] = tile[16 * t + 8]
    elif case == 2:                                # another thread's copy, not yet waited, across a barrier
        if t == 0:
            ac.cp_async16(tile, 0, src, 0)
            ac.cp_async_commit()
        cuda.syncthreads()
        if t == 1:
            out[t] = tile[5]
    elif case == 3:                                # never committed: wait_group 0 does not cover it
        ac.cp_async16(tile, 8 * t, src, 8 * t)
        ac.cp_async_wait(0)
        out[t] = tile[8 * t]
    elif case == 4:                                # wait_all commits and waits: fine
        ac.cp_async16(tile, 8 * t, src, 8 * t)
        ac.cp_async_wait_all()
        out[t] = tile[8 * t + 1]
    elif case == 5:                                # a write into a pending copy's bytes (a 4-byte view)
        ac.cp_async16(tile, 8 * t, src, 8 * t)
        ac.cp_async_commit()
        words = tile.view(np.uint32)
        words[4 * t + 2] = 0
    elif case == 6:                                # misaligned destination
        ac.cp_async16(tile, 8 * t + 4, src, 8 * t)
    elif case == 7:                                # source past its end
        ac.cp_async16(tile, 8 * t, src, src.shape[0] - 4)
    elif case == 8:                                # a destination not through async_target
        ac.cp_async16(plain, 8 * t, src, 8 * t)
    elif case == 9:                                # ldmatrix of rows whose copy is pending
        if t < 8:
            ac.cp_async16(tile, 8 * t, src, 8 * t)
            ac.cp_async_commit()
        cuda.syncthreads()
        r0, r1, r2, r3 = ac.ldmatrix_x4(tile, 8 * (t % 8), scratch, 0, t)
        out[t] = r0
    elif case == 10:                               # two copies into the same bytes, both pending
        ac.cp_async16(tile, 0, src, 8 * t)
    elif case == 11:                               # a wait count that cannot be an instruction's
        ac.cp_async_wait(t - 5)


CONTRACT = {0: (ac.PendingCopyError if ac.SIMULATED else None, r"shared array 'tile' .*element \d+ of a float16 "
                r"view is read while a cp.async copy .* is still pending \(copied by thread \(\d, 0, 0\).*"
                r"commit group 0"),
            1: (ac.PendingCopyError if ac.SIMULATED else None, r"'tile'.*element \d+ .*read.*commit group 1"),
            2: (ac.PendingCopyError if ac.SIMULATED else None, r"'tile'.*element 5 .*copied by thread \(0, 0, 0\)"),
            3: (ac.PendingCopyError if ac.SIMULATED else None, "not yet committed"),
            5: (ac.PendingCopyError if ac.SIMULATED else None, r"'tile'.*of a uint32 view is written"),
            6: (ValueError, r"cp_async16: dst\[dst_index=\d+\] is not 16-byte aligned"),
            7: (ValueError, r"cp_async16: src_index 28 \.\. 35 \(16 bytes\) is outside src, which has 32 elements"),
            8: (TypeError, "dst must be a shared array passed through async_target"),
            9: (ac.PendingCopyError if ac.SIMULATED else None, r"'tile'.*ldmatrix_x4 reads row \d+ .* still pending"),
            10: (ac.PendingCopyError if ac.SIMULATED else None, r"'tile'.*cp_async16 into bytes 0\.\.15 while an "
                 r"earlier copy"),
            11: (ValueError, r"cp_async_wait: n must be a non-negative integer constant, got -\d")}


@simulator_only
@pytest.mark.parametrize("case", sorted(CONTRACT))
def test_the_twin_refuses_what_the_gpu_would_get_wrong(case):
    error, message = CONTRACT[case]
    src = RNG.standard_normal(32 if case == 7 else 64).astype(np.float16)
    with pytest.raises(error, match=message):
        contract_kernel[1, 32 if case == 9 else 2](src, np.zeros(32, np.float16), case)


@simulator_only
def test_what_the_twin_allows_it_copies_at_once():
    """wait_all covers uncommitted copies; the twin's copy has landed by then, bit for bit."""
    src = RNG.standard_normal(64).astype(np.float16)
    out = np.full(32, np.nan, np.float16)
    contract_kernel[1, 2](src, out, 4)
    assert np.array_equal(out[:2].view(np.uint16), src[[1, 9]].view(np.uint16))


# --------------------------------------------------------------------------------------------- the real compiler

COMPILE = """
import numpy as np
from kernels_numba import _async_copy as ac

ALIGN, SCRATCH, WAIT = ac.SHARED_ALIGNMENT, ac.scratch_shape(1), 1


def kernel(src, out):
    lane = cuda.threadIdx.x
    tile = ac.async_target(cuda.shared.array(512, np.float16, alignment=ALIGN))
    scratch = cuda.shared.array(SCRATCH, np.int32)
    ac.cp_async16(tile, 8 * lane, src, 8 * lane)
    ac.cp_async_commit()
    ac.cp_async16(tile, 256 + 8 * lane, src, 256 + 8 * lane)
    ac.cp_async_commit()
    ac.cp_async_wait(WAIT)
    ac.cp_async_wait_all()
    cuda.syncthreads()
    row = (lane % 16) * 16 + 8 * (lane // 16)
    r0, r1, r2, r3 = ac.ldmatrix_x4(tile, row, scratch, 0, lane)
    s0, s1, s2, s3 = ac.ldmatrix_x4_trans(tile, 256 + row, scratch, 0, lane)
    out[lane] = r0 ^ r1 ^ r2 ^ r3 ^ s0 ^ s1 ^ s2 ^ s3


def build(cc):
    return kernel, (types.float16[::1], types.uint32[::1])


def runtime_wait(counts):
    ac.cp_async_wait(counts[0])


try:                                  # wait_group encodes its count: a run-time one is refused by name
    cuda.compile_ptx(runtime_wait, (types.int32[::1],), cc=(8, 0))
except Exception as refused:
    assert "cp_async_wait(n): n must be a non-negative compile-time integer constant" in str(refused), refused
else:
    raise AssertionError("cp_async_wait compiled with a run-time count")
"""


def test_cp_async_and_ldmatrix_compile_to_ldgsts_depbar_and_ldsm():
    """For sm_80 and sm_90: two 16-byte cp.async (LDGSTS ... .128), two commits and wait_all's own (LDGDEPBAR),
    wait_group 1 and 0 (DEPBAR.LE SB0, 1 and 0), one ldmatrix and one ldmatrix.trans (LDSM.16.M88.4,
    LDSM.16.MT88.4); the shared tile 16-byte aligned. A run-time wait count does not compile."""
    for cc, result in compile_kernels(COMPILE).items():
        ptx, ops = result["ptx"], result["opcodes"]
        assert ptx.count("cp.async.cg.shared.global") == 2 and ptx.count("cp.async.wait_group 1;") == 1, cc
        assert ".shared .align 16 .b8" in ptx, cc
        ldgsts = {op: n for op, n in ops.items() if op.startswith("LDGSTS")}
        assert sum(ldgsts.values()) == 2 and all(op.endswith(".128") for op in ldgsts), (cc, ldgsts)
        assert count(ops, "LDGDEPBAR") == 3, (cc, ops)
        assert count(ops, "DEPBAR") == 2, (cc, ops)
        assert count(ops, "LDSM.16.M88") == 1 and count(ops, "LDSM.16.MT88") == 1, (cc, ops)


@cuda.jit
def copy_at_kernel(src, out, case):
    t = cuda.threadIdx.x
    tile = ac.async_target(cuda.shared.array(64, np.float16, alignment=ALIGN))
    base = ac.shared_base(tile)
    for k in range(8):
        tile[8 * t + k] = np.float16(-1.0)      # poison: the zero-filled chunk must overwrite it
    cuda.syncthreads()
    # thread t: chunk t from src (full), chunk t + 2 zero-filled from an index past src's end (never read)
    ac.cp_async16_at(tile, base, 8 * t, src, 8 * t, True)
    ac.cp_async16_at(tile, base, 16 + 8 * t, src, src.shape[0] + 8, False)
    if case == 0:                                  # the zero fill is a pending copy like any other
        ac.cp_async_commit()
        out[t] = tile[16 + 8 * t]
    ac.cp_async_wait_all()
    cuda.syncthreads()
    for k in range(32):
        out[k] = tile[k]


@simulator_only
def test_cp_async16_at_copies_or_zero_fills_and_is_waited_for():
    """cp_async16_at(..., full) copies 16 bytes, or with full false writes 16 zero bytes without reading its source
    (an index past the end is never checked, as the GPU reads nothing); both are pending until waited for."""
    src = RNG.standard_normal(16).astype(np.float16)
    out = np.full(32, np.nan, np.float16)
    copy_at_kernel[1, 2](src, out, 1)
    assert np.array_equal(out[:16].view(np.uint16), src.view(np.uint16))
    assert np.array_equal(out[16:], np.zeros(16, np.float16))
    # whichever of the two threads reads first: thread 0 its element 16, thread 1 its element 24
    with pytest.raises(ac.PendingCopyError, match=r"'tile'.*element (16|24) .*read.*still pending"):
        copy_at_kernel[1, 2](src, np.zeros(32, np.float16), 0)


COMPILE_AT = """
import numpy as np
from kernels_numba import _async_copy as ac

ALIGN = ac.SHARED_ALIGNMENT


def kernel(src, out, n):
    lane = cuda.threadIdx.x
    tile = ac.async_target(cuda.shared.array(1024, np.float16, alignment=ALIGN))
    base = ac.shared_base(tile)
    for k in range(4):                  # constant distances from one 32-bit base: immediates of one register
        ac.cp_async16_at(tile, base, 256 * k + 8 * lane, src, np.uint32(n * lane + 8 * k), 8 * k < n)
    ac.cp_async_wait_all()
    cuda.syncthreads()
    out[lane] = tile[8 * lane]


def build(cc):
    return kernel, (types.float16[::1], types.float16[::1], types.int32)
"""


def test_cp_async16_at_compiles_to_ldgsts_from_one_shared_base():
    """For sm_80 and sm_90: four cp.async with a src-size operand (the zero fill), one shared address converted
    once (cvta.to.shared), four LDGSTS .128."""
    for cc, result in compile_kernels(COMPILE_AT).items():
        ptx, ops = result["ptx"], result["opcodes"]
        assert ptx.count("cp.async.cg.shared.global") == 4 and ptx.count("], 16, %r") == 4, cc
        assert ptx.count("cvta.to.shared") == 1, cc
        ldgsts = {op: n for op, n in ops.items() if op.startswith("LDGSTS")}
        assert sum(ldgsts.values()) == 4 and all(op.endswith(".128") for op in ldgsts), (cc, ldgsts)
