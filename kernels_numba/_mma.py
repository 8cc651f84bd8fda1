"""Tensor-core primitives for the kernel ladder's fifth rung: one warp-wide `mma.sync` and its helpers.

numba-cuda has no tensor-core API, so on a GPU these are `@intrinsic`s that emit inline PTX through
llvmlite's `ir.InlineAsm`:

    pack_half2(lo, hi)   cvt.rn.f16x2.f32: two float32 -> one .f16x2 register, lo in the low 16 bits
    mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch, warp, lane) -> (d0, d1, d2, d3)
                         mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: D = A B + C for a 16x16 float16 A,
                         a 16x8 float16 B and a 16x8 float32 C spread over the 32 lanes of a warp
    quad_max2 / quad_sum2(x, y, scratch, warp, lane)
                         max / sum of x and of y over the 4 lanes of a quad (the lanes sharing a C row)
    pack_bf162(lo, hi)   cvt.rn.bf16x2.f32 (sm_80+): two float32 -> one .bf16x2 register, lo in the low 16 bits,
                         each rounded to the nearest bfloat16, ties to even
    bf162_floats(pair) -> (lo, hi)
                         the two bfloat16 of a register as float32, exactly: a bfloat16 is the high half of a
                         float32, so a shift and a mask (no conversion instruction)
    mma_m16n8k16_bf16(...)
                         mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (sm_80+): mma_m16n8k16 with bfloat16
                         A and B registers (from pack_bf162), the same arguments and fragment layout
                         (PTX ISA, section "Matrix Fragments for mma.m16n8k16 with floating point type" covers
                         .f16 and .bf16 alike)

Which lane holds which element is fixed by the PTX ISA, section 9.7.14.5.8 "Matrix Fragments for
mma.m16n8k16 with floating point type"; with groupID = lane >> 2 and threadID_in_group = lane % 4:

    A (16x16, row-major), 4 .f16x2 registers, elements a0..a7 (low half first):
        row = groupID          for a0, a1, a4, a5;   groupID + 8 for a2, a3, a6, a7
        col = 2 * threadID_in_group + (i & 1)        (+ 8 for a4..a7)
    B (16x8, column-major), 2 .f16x2 registers, elements b0..b3:
        row = 2 * threadID_in_group + (i & 1)        (+ 8 for b2, b3);   col = groupID
    C and D (16x8), 4 float32, c0..c3:
        row = groupID for c0, c1;  groupID + 8 for c2, c3;   col = 2 * threadID_in_group + (i & 1)

so register k of A holds row groupID + 8 * (k % 2), columns 2 * threadID_in_group + 8 * (k // 2) + {0, 1}.
`a_position`, `b_position` and `c_position` below are that table as code.

numba's CUDA simulator cannot run PTX, so there each primitive is emulated with the same warp-collective
semantics: every lane writes its registers to a per-warp row of shared memory, the block meets at a barrier,
each lane computes its own outputs from the whole warp's registers (the mma: its four C elements as float32
sums of products of the float16 inputs, which float32 holds exactly), and the block meets again before the
scratch is reused (the bfloat16 mma alike: a bfloat16 widens to float32 exactly and the product of two holds
in float32 too). pack_bf162's twin rounds with ml_dtypes' bfloat16, which rounds to nearest even as the
instruction does; a NaN stays a NaN (its bits are ml_dtypes' there, the GPU's may differ). As with
`_warp.warp_sum`, callers therefore call them the same number of times in every
thread of the block. The summation order inside the mma is the hardware's own on a GPU and numpy's in the
simulator; both are float32 accumulations of exact products.
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda

from ._vector import float_from_bits
from ._warp import FULL_MASK, WARP_SIZE

SIMULATED = bool(config.ENABLE_CUDASIM)
MMA_M, MMA_N, MMA_K = 16, 8, 16


def a_position(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of element a_i (0..7) of lane's A fragment; register i // 2, low half when i is even."""
    group, thread = lane >> 2, lane % 4
    return group + 8 * ((i // 2) % 2), 2 * thread + (i & 1) + 8 * (i // 4)


def b_position(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of element b_i (0..3) of lane's B fragment; register i // 2, low half when i is even."""
    return 2 * (lane % 4) + (i & 1) + 8 * (i // 2), lane >> 2


def c_position(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of element c_i (0..3) of lane's C/D fragment."""
    return (lane >> 2) + 8 * (i // 2), 2 * (lane % 4) + (i & 1)


def scratch_shapes(warps: int):
    """Shapes of the shared scratch (uint32 registers for the mma, float32 pairs for the quad reductions) that
    the simulator paths need; a GPU needs none, so it gets one element each."""
    if SIMULATED:
        return (warps, WARP_SIZE, 6), (warps, WARP_SIZE, 2)
    return (1, 1, 1), (1, 1, 1)


if SIMULATED:
    # Flat indices into a warp's (32 lanes x 8 halves) A registers and (32 x 4) B registers, per matrix element.
    _A_INDEX = np.zeros((MMA_M, MMA_K), np.int64)
    _B_INDEX = np.zeros((MMA_K, MMA_N), np.int64)
    for _lane in range(WARP_SIZE):
        for _i in range(8):
            _A_INDEX[a_position(_lane, _i)] = _lane * 8 + _i
        for _i in range(4):
            _B_INDEX[b_position(_lane, _i)] = _lane * 4 + _i

    @cuda.jit(device=True)
    def pack_half2(lo, hi):
        """lo and hi rounded to float16 (nearest even) in one 32-bit register, lo in the low half."""
        return np.array([lo, hi], np.float16).view(np.uint32)[0]

    import ml_dtypes

    def _float16_halves(words):
        return words.view(np.float16).astype(np.float32)

    def _bfloat16_halves(words):
        # a bfloat16 is the high 16 bits of the float32 of the same value
        return (words.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    def _warp_mma(registers, cs, scratch, warp, lane, halves_of):
        cuda.syncthreads()                          # the previous call's readers are done with scratch
        for k, register in enumerate(registers):
            scratch[warp, lane, k] = register
        cuda.syncthreads()
        halves = halves_of(scratch[warp])                                  # (32, 12): lane, then low half first
        a = halves[:, :8].reshape(-1)[_A_INDEX]
        b = halves[:, 8:].reshape(-1)[_B_INDEX]
        d = [np.float32(0.0)] * 4
        for i, c in enumerate(cs):
            row, col = c_position(lane, i)
            d[i] = np.float32(np.dot(a[row], b[:, col]) + np.float32(c))
        return d[0], d[1], d[2], d[3]

    @cuda.jit(device=True)
    def pack_bf162(lo, hi):
        """lo and hi (as float32) rounded to bfloat16 (nearest even) in one 32-bit register, lo in the low half."""
        with np.errstate(over="ignore", invalid="ignore"):          # inf and NaN convert as the GPU's do
            return np.array([lo, hi], np.float32).astype(ml_dtypes.bfloat16).view(np.uint32)[0]

    @cuda.jit(device=True)
    def mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch, warp, lane):
        """D = A B + C over this warp with bfloat16 A and B (see the module docstring); this lane's d0..d3."""
        return _warp_mma((a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3), scratch, warp, lane, _bfloat16_halves)

    @cuda.jit(device=True)
    def mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch, warp, lane):
        """D = A B + C over this warp (see the module docstring); returns this lane's d0..d3."""
        return _warp_mma((a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3), scratch, warp, lane, _float16_halves)

    @cuda.jit(device=True)
    def _quad_values(x, y, scratch, warp, lane):
        cuda.syncthreads()
        scratch[warp, lane, 0] = x
        scratch[warp, lane, 1] = y
        cuda.syncthreads()
        first = lane - lane % 4
        return scratch[warp, first:first + 4, 0], scratch[warp, first:first + 4, 1]

    @cuda.jit(device=True)
    def quad_max2(x, y, scratch, warp, lane):
        """(max of x, max of y) over the 4 lanes of this lane's quad."""
        xs, ys = _quad_values(x, y, scratch, warp, lane)
        return np.float32(xs.max()), np.float32(ys.max())

    @cuda.jit(device=True)
    def quad_sum2(x, y, scratch, warp, lane):
        """(sum of x, sum of y) over the 4 lanes of this lane's quad."""
        xs, ys = _quad_values(x, y, scratch, warp, lane)
        return np.float32(xs.sum()), np.float32(ys.sum())
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _cvt_f16x2(typingctx, hi, lo):
        """cvt.rn.f16x2.f32 d, hi, lo: the first source goes to the upper half (PTX ISA 9.7.9.21, cvt)."""
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f"), args)

        return sig, codegen

    @intrinsic
    def _cvt_bf16x2(typingctx, hi, lo):
        """cvt.rn.bf16x2.f32 d, hi, lo: the first source goes to the upper half (PTX ISA, cvt)."""
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"), args)

        return sig, codegen

    def _mma_intrinsic(input_type: str):
        """The intrinsic of mma.sync.aligned.m16n8k16.row.col.f32.<input_type>.<input_type>.f32."""
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            u32, f32 = types.uint32, types.float32
            sig = types.UniTuple(f32, 4)(u32, u32, u32, u32, u32, u32, f32, f32, f32, f32)

            def codegen(context, builder, sig, args):
                f, i = ir.FloatType(), ir.IntType(32)
                fnty = ir.FunctionType(ir.LiteralStructType([f] * 4), [i] * 6 + [f] * 4)
                # side_effect: a warp-collective instruction must not be moved, merged or dropped by the optimizer.
                asm = ir.InlineAsm(fnty, f"mma.sync.aligned.m16n8k16.row.col.f32.{input_type}.{input_type}.f32 "
                                         "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                                   "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=True)
                out = builder.call(asm, args)
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(out, k) for k in range(4)])

            return sig, codegen

        mma.__name__ = mma.__qualname__ = f"_mma_sync_{input_type}"
        return intrinsic(mma)

    _mma_sync, _mma_sync_bf16 = _mma_intrinsic("f16"), _mma_intrinsic("bf16")

    # Plain device functions: NVVM inlines them (the kernels' PTX has no calls), and numba-level inlining
    # (inline="always") only lengthens the compile.
    @cuda.jit(device=True)
    def pack_half2(lo, hi):
        """lo and hi rounded to float16 (nearest even) in one 32-bit register, lo in the low half."""
        return _cvt_f16x2(np.float32(hi), np.float32(lo))

    @cuda.jit(device=True)
    def mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch, warp, lane):
        """D = A B + C over this warp (see the module docstring); returns this lane's d0..d3 (scratch unused)."""
        return _mma_sync(a0, a1, a2, a3, b0, b1, np.float32(c0), np.float32(c1), np.float32(c2), np.float32(c3))

    @cuda.jit(device=True)
    def pack_bf162(lo, hi):
        """lo and hi (as float32) rounded to bfloat16 (nearest even) in one 32-bit register, lo in the low half."""
        return _cvt_bf16x2(np.float32(hi), np.float32(lo))

    @cuda.jit(device=True)
    def mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch, warp, lane):
        """D = A B + C over this warp with bfloat16 A and B; this lane's d0..d3 (scratch unused)."""
        return _mma_sync_bf16(a0, a1, a2, a3, b0, b1, np.float32(c0), np.float32(c1), np.float32(c2),
                              np.float32(c3))

    @cuda.jit(device=True)
    def quad_max2(x, y, scratch, warp, lane):
        """(max of x, max of y) over the 4 lanes of this lane's quad: two butterfly shuffles each."""
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
        y = max(y, cuda.shfl_xor_sync(FULL_MASK, y, 1))
        return max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2)), max(y, cuda.shfl_xor_sync(FULL_MASK, y, 2))

    @cuda.jit(device=True)
    def quad_sum2(x, y, scratch, warp, lane):
        """(sum of x, sum of y) over the 4 lanes of this lane's quad: two butterfly shuffles each."""
        x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
        y += cuda.shfl_xor_sync(FULL_MASK, y, 1)
        return x + cuda.shfl_xor_sync(FULL_MASK, x, 2), y + cuda.shfl_xor_sync(FULL_MASK, y, 2)


@cuda.jit(device=True)
def bf162_floats(pair):
    """The two bfloat16 of `pair` as float32 (exact), low half first: each moved to the high half of a word."""
    return float_from_bits((pair & 0xFFFF) << 16), float_from_bits(pair & 0xFFFF0000)
