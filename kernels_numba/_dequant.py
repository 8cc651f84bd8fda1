"""Magic-number dequantization: int8, int4 and FP8 e4m3 cache codes to float16 pairs in a few bit operations, for
rung 3.

A float16 with exponent field 25 (bits 0x6400) holds 1024 + m exactly for every 10-bit m, so writing a code u
in [0, 1024) into the low bits of 0x6400 *is* the float16 1024 + u, and one float16 subtraction of the magic
leaves u minus whatever bias the code carried. Two values share one 32-bit `.f16x2` register, so each step
handles a pair:

    int8x4_to_half2(word) -> (h01, h23)
        word holds 4 signed codes, element k in byte k. xor 0x80808080 makes each byte q + 128 (unsigned);
        prmt.b32 places bytes 0, 1 (then 2, 3) under a 0x64 high byte: the float16 pair 1024 + 128 + q; one
        sub.rn.f16x2 of 1152 leaves q. 1 xor + 2 prmt + 2 sub per 4 values.
    int4x8_to_half2(word) -> (h04, h15, h26, h37)
        word holds 8 two's-complement nibbles, element k in bits 4k .. 4k + 3 (the cache's order: element 2i in
        the low nibble of byte i). lop3.b32 computes (word & mask) ^ magic in one instruction: mask 0x000f000f
        keeps nibbles 0 and 4, and xor with 0x64086408 both flips bit 3 (nibble n -> q + 8, unsigned) and
        writes the 0x6400 exponent into the bits the mask cleared, giving 1024 + 8 + q, which a sub.rn.f16x2 of
        1032 turns into q. Mask 0x00f000f0 keeps nibbles 1 and 5 four bits higher: 1024 + 16 (q + 8), which one
        fma.rn.f16x2 by 1/16 and -72 turns into q. One shift by 8 brings nibbles 2, 6 and 3, 7 to the same
        places. 1 shift + 4 lop3 + 2 sub + 2 fma per 8 values; the pairs come out as elements (k, k + 4).
    e4m3x4_to_half2(word) -> (h01, h23)
        word holds 4 FP8 e4m3 codes (the fn variant: bias 7, no infinities, 0x7f and 0xff NaN), element k in
        byte k. Each comes out as its value / 256, exactly: float16's exponent bias is 8 more than e4m3's, so the
        code's exponent and mantissa bits at float16 bits 7..13 and its sign at bit 15 are value / 256, subnormals
        included (the caller folds the 256 into its scale). So no float16 arithmetic, only moving bits: and
        0x7f7f7f7f keeps each byte's magnitude; add 0x01010101 carries into bit 7 of exactly the bytes whose
        magnitude is 0x7f (the NaN codes); one lop3.b32 puts those carries above the magnitudes (a flagged byte:
        bit 7 NaN, bits 0..6 exponent and mantissa). prmt.b32 of the flagged word and the codes lays out
        [flagged byte k, code k's sign replicated, flagged byte k + 1, code k + 1's sign replicated] (a selector
        nibble with bit 3 set replicates the picked byte's sign), so one shl by 7 puts each flagged byte at bits
        7..14 of its half (a NaN flag completes the all-ones float16 exponent, whose mantissa bits are already
        nonzero) and bit 0 of the sign byte above it at bit 15; and 0xff80ff80 clears the other sign copies,
        shifted into the high half's low mantissa bits. 1 and + 1 add + 1 lop3 + 2 prmt + 2 shl + 2 and per 4
        values (2.25 a value); integer instructions only, so sm_80 too (cvt.rn.f16x2.e4m3x2 needs sm_89).
    e4m3x4_to_half2_cvt(word) -> (h01, h23)
        the same pairs of value / 256 in two cvt.rn.f16x2.e4m3x2 (sm_89+: one instruction converts two codes,
        byte 0 of its 16-bit source to the low half) and two mul.rn.f16x2 by 2^-8 (exact: every e4m3 value / 256
        is a float16). Bit for bit e4m3x4_to_half2's except the NaN codes: the conversion gives the canonical
        float16 NaN 0x7fff for both 0x7f and 0xff, sign dropped (what CUDA's cuda_fp8.hpp gives in its software
        version of this conversion for GPUs without it; the twin models that, untested on hardware here) and the
        multiply keeps a NaN, where e4m3x4_to_half2 gives 0x7f80 and 0xff80. A NaN either way. 2 cvt + 2 mul per
        4 values (ptxas folds the split of the word into the cvt's operands).
    e4m3x4_to_half2_for(cc) -> e4m3x4_to_half2_cvt for a compute capability of (8, 9) or later, else
        e4m3x4_to_half2: what a kernel builder picks for its target (PTX ISA, cvt: .e4m3x2 sources need sm_89).
    e4m3x4_to_half2_target(word) -> the conversion `e4m3x4_to_half2_for` picks for the compute capability the
        calling kernel is being compiled for, chosen while it compiles: one kernel object serves every target
        (a launcher builds its kernels before it knows where they run, and one build is compiled for sm_80 and
        sm_90 alike). Call it from the kernel or an inline="always" device function, whose body is compiled
        with the kernel. In the simulator, the cvt's twin.
    scale_half2(word_a, word_b, selector) -> the pair of float16 scales a value pair is multiplied by:
        one prmt.b32 of two words of scales (selector: which 16-bit half of each).
    permute_bytes(word_a, word_b, selector) -> prmt.b32 itself: result byte i is byte (selector >> 4i) & 7 of
        the 8 bytes word_b:word_a (0..3 from word_a), or that byte's sign copied to all 8 bits where bit 3 of
        the nibble is set. The tensor-core decode interleaves two keys' codes with it, so that one unpacking
        yields a (key, next key) pair of one element (`INTERLEAVE_*`).
    mul_half2(values, scales) -> mul.rn.f16x2: each code times its scale, rounded to float16 once. Every int8
        and int4 code is exact in float16 and the product of an 8-bit code and an 11-bit significand is exact
        in float32, so this is bit for bit the document's q * scale rounded to a float16 scale's dtype.
    half2_floats(pair) -> (low, high) as float32 (cvt.f32.f16 each): for the float32 dot products.
    load_bits2 / load_bits4(data, index) -> the 2 / 4 bytes at data[index] as a uint32 (zero-extended): a
        chunk's float16 group scales in one load.

Every subtraction and multiply carries .rn, which PTX never contracts into an fma: the code generator may fuse a
plain mul.f16x2 with a later add, which would change the rounding.

numba-cuda has no half2, prmt or lop3 API, so on a GPU these are `@intrinsic`s emitting inline PTX through
llvmlite's `ir.InlineAsm` (as `_mma.py` and `_vector.py` do). numba's CUDA simulator cannot run PTX: there each
is a NumPy twin that computes the same bits, step by step the same way (the byte permutation, the float16
arithmetic in float16), so the kernels' results in the simulator are the GPU's.
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda

SIMULATED = bool(config.ENABLE_CUDASIM)

# The magic numbers, as float16 pairs (high half, low half the same).
INT8_BIAS = 0x80808080          # xor: each signed byte q -> q + 128 unsigned
INT8_MAGIC = 0x64806480         # float16 1152 = 1024 + 128
INT8_PAIRS = (0x4140, 0x4342)   # prmt selectors: bytes 0, 1 (2, 3) of the word, each under byte 4 (0x64)
EXPONENT_BYTES = 0x64646464     # prmt's second source: the 0x64 high byte of every result half
INT4_LOW_MASK, INT4_LOW_MAGIC = 0x000F000F, 0x64086408      # nibbles 0, 4; 0x6400 | bit 3 flipped
INT4_HIGH_MASK, INT4_HIGH_MAGIC = 0x00F000F0, 0x64806480    # nibbles 1, 5; 0x6400 | bit 7 flipped
INT4_LOW_SUB = 0x64086408       # float16 1032 = 1024 + 8
INT4_HIGH_MUL = 0x2C002C00      # float16 1/16
INT4_HIGH_ADD = 0xD480D480      # float16 -72 = -(1024 + 128) / 16
LOP3_AND_XOR = 0x6A             # lop3 lookup table of (a & b) ^ c: (0xF0 & 0xCC) ^ 0xAA
LOP3_OR_AND = 0xF8              # lop3 lookup table of a | (b & c): 0xF0 | (0xCC & 0xAA)
E4M3_MAGNITUDE = 0x7F7F7F7F     # and: each code without its sign
E4M3_NAN_CARRY = 0x01010101     # add: a magnitude of 0x7f, and only that, carries into the byte's bit 7
E4M3_NAN_FLAG = 0x80808080      # the carries, placed above the magnitudes
# prmt selectors of (flagged word, code word): flagged byte k, code byte k's sign replicated (nibble 8 | 4 + k),
# flagged byte k + 1, code byte k + 1's sign replicated, for k = 0 and 2
E4M3_PAIRS = (0xD1C0, 0xF3E2)
E4M3_SHIFT = 7                  # flagged byte to bits 7..14 of its half, the sign byte's bit 0 to bit 15
E4M3_KEEP = 0xFF80FF80          # clears the low sign byte's other copies, shifted into bits 16..22
E4M3_CVT_SCALE = 0x1C001C00      # float16 2^-8 in both halves: cvt gives the value, the decode wants value / 256
E4M3_CVT_NAN = 0x7FFF           # the float16 a NaN code converts to (canonical NaN)
E4M3_CVT_CC = (8, 9)            # the first compute capability with cvt.rn.f16x2.e4m3x2
INT4_PAIR_ELEMENTS = ((0, 4), (1, 5), (2, 6), (3, 7))       # elements of int4x8_to_half2's four pairs
INT8_PAIR_ELEMENTS = ((0, 1), (2, 3))
E4M3_PAIR_ELEMENTS = ((0, 1), (2, 3))
# permute_bytes selectors that interleave two words a, b (bytes a0..a3, b0..b3): a's and b's low or high 16 bits
# side by side (float16 pairs, or 4 int4 codes each), and a's and b's bytes alternating (int8 codes).
INTERLEAVE_HALVES = (0x5410, 0x7632)     # (a0 a1 b0 b1), (a2 a3 b2 b3)
INTERLEAVE_BYTES = (0x5140, 0x7362)      # (a0 b0 a1 b1), (a2 b2 a3 b3)


def pair_selector(half_a: int, half_b: int) -> int:
    """prmt selector of scale_half2: the low result half is half `half_a` (0 low, 1 high) of the first word,
    the high result half is half `half_b` of the second."""
    return (2 * half_a) | (2 * half_a + 1) << 4 | (4 + 2 * half_b) << 8 | (5 + 2 * half_b) << 12


if SIMULATED:
    import ml_dtypes

    def _halves(word):
        """The two float16 of a uint32 word, low half first, as a float16 array."""
        return np.array([int(word) & 0xFFFFFFFF], np.uint32).view(np.float16)

    def _word(halves):
        return int(np.asarray(halves, np.float16).view(np.uint32)[0])

    def _permute(a, b, selector):
        """prmt.b32 (default mode): result byte i is byte (selector >> 4i) & 7 of the 8 bytes b:a, or that
        byte's sign replicated (0x00 or 0xff) where bit 3 of the nibble is set."""
        source = (int(b) & 0xFFFFFFFF) << 32 | (int(a) & 0xFFFFFFFF)
        out = 0
        for i in range(4):
            nibble = (selector >> (4 * i)) & 0xF
            byte = (source >> (8 * (nibble & 7))) & 0xFF
            if nibble & 8:
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * i)
        return out

    @cuda.jit(device=True)
    def int8x4_to_half2(word):
        """The 4 signed bytes of `word` as two float16 pairs: elements (0, 1) and (2, 3)."""
        biased = (int(word) ^ INT8_BIAS) & 0xFFFFFFFF
        magic = _halves(INT8_MAGIC)
        return tuple(np.uint32(_word(_halves(_permute(biased, EXPONENT_BYTES, sel)) - magic)) for sel in INT8_PAIRS)

    @cuda.jit(device=True)
    def int4x8_to_half2(word):
        """The 8 signed nibbles of `word` as four float16 pairs: elements (0, 4), (1, 5), (2, 6), (3, 7)."""
        out = []
        for shifted in ((int(word) & 0xFFFFFFFF), (int(word) & 0xFFFFFFFF) >> 8):
            low = _halves((shifted & INT4_LOW_MASK) ^ INT4_LOW_MAGIC) - _halves(INT4_LOW_SUB)
            high = _halves((shifted & INT4_HIGH_MASK) ^ INT4_HIGH_MAGIC)
            # fma.rn.f16x2: one rounding of the exact product plus the addend; both steps are exact here, so
            # float32 (which holds them) and one rounding to float16 give the fma's bits
            high = (high.astype(np.float32) * _halves(INT4_HIGH_MUL).astype(np.float32)
                    + _halves(INT4_HIGH_ADD).astype(np.float32)).astype(np.float16)
            out += [np.uint32(_word(low)), np.uint32(_word(high))]
        return out[0], out[1], out[2], out[3]

    @cuda.jit(device=True)
    def e4m3x4_to_half2(word):
        """The 4 e4m3 codes of `word` as two float16 pairs of value / 256: elements (0, 1) and (2, 3); NaN for the
        NaN codes. 9 integer instructions per 4 values."""
        codes = int(word) & 0xFFFFFFFF
        magnitudes = codes & E4M3_MAGNITUDE
        carries = (magnitudes + E4M3_NAN_CARRY) & 0xFFFFFFFF
        flagged = magnitudes | (carries & E4M3_NAN_FLAG)                  # the lop3
        return tuple(np.uint32(((_permute(flagged, codes, sel) << E4M3_SHIFT) & 0xFFFFFFFF) & E4M3_KEEP)
                     for sel in E4M3_PAIRS)

    @cuda.jit(device=True)
    def e4m3x4_to_half2_cvt(word):
        """e4m3x4_to_half2 by cvt.rn.f16x2.e4m3x2 (sm_89+): the same pairs; the NaN codes give 0x7fff."""
        codes = np.array([int(word) & 0xFFFFFFFF], np.uint32).view(np.uint8)
        with np.errstate(invalid="ignore"):
            values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float16)     # the cvt: exact
        halves = values * _halves(E4M3_CVT_SCALE)[0]                             # the mul.rn.f16x2: exact
        bits = halves.view(np.uint16).copy()
        bits[np.isnan(halves)] = E4M3_CVT_NAN
        words = bits.view(np.uint32)
        return np.uint32(words[0]), np.uint32(words[1])

    e4m3x4_to_half2_target = e4m3x4_to_half2_cvt     # the simulator models an sm_90

    @cuda.jit(device=True)
    def scale_half2(word_a, word_b, selector):
        """The float16 pair (half of word_a, half of word_b) that `selector` (pair_selector) picks."""
        return np.uint32(_permute(word_a, word_b, selector))

    @cuda.jit(device=True)
    def permute_bytes(word_a, word_b, selector):
        """prmt.b32: byte i of the result is byte (selector >> 4i) & 7 of word_b:word_a (its sign replicated
        where bit 3 of the nibble is set)."""
        return np.uint32(_permute(word_a, word_b, selector))

    @cuda.jit(device=True)
    def mul_half2(values, scales):
        """values * scales, each half rounded to float16 (nearest even) once."""
        with np.errstate(over="ignore"):                # a product past 65504 is inf, as on the GPU
            product = (_halves(values).astype(np.float32) * _halves(scales).astype(np.float32)).astype(np.float16)
        return np.uint32(_word(product))

    @cuda.jit(device=True)
    def half2_floats(pair):
        """The two float16 of `pair` widened to float32, low half first."""
        halves = _halves(pair).astype(np.float32)
        return halves[0], halves[1]

    @cuda.jit(device=True)
    def mul_half2_by(values, scales, half):
        """values * (half `half` of scales, both lanes), each rounded to float16 once."""
        return mul_half2(values, np.uint32(_permute(scales, scales, pair_selector(half, half))))

    @cuda.jit(device=True)
    def load_bits2(data, index):
        """The 2 bytes of element `index` of the 1-D array `data` as a uint32 (upper half 0)."""
        return np.uint32(np.asarray(data[index:index + 2 // data.itemsize]).view(np.uint16)[0])

    @cuda.jit(device=True)
    def load_bits4(data, index):
        """The 4 bytes from element `index` of the 1-D array `data` as a uint32 (little-endian)."""
        return np.uint32(np.asarray(data[index:index + 4 // data.itemsize]).view(np.uint32)[0])
else:
    from llvmlite import ir
    from numba import types
    from numba.core import targetconfig
    from numba.cuda.extending import intrinsic

    from ._vector import element_pointer

    _WORD = ir.IntType(32)

    def _words_asm(name: str, inputs: int, outputs: int, text):
        """An intrinsic of `inputs` uint32 arguments returning `outputs` uint32 (a tuple when several), whose body is
        the inline PTX `text` ($0.. the outputs, then the inputs; every operand a 32-bit register), or `text(cc)`
        for the compute capability of the compile it is lowered in."""
        constraints = ",".join(["=r"] * outputs + ["r"] * inputs)

        def typer(typingctx, *args):
            if len(args) != inputs or not all(isinstance(a, types.Integer) for a in args):
                return None
            result = types.uint32 if outputs == 1 else types.UniTuple(types.uint32, outputs)

            def codegen(context, builder, sig, llargs):
                words = [context.cast(builder, v, t, types.uint32) for v, t in zip(llargs, sig.args)]
                out_type = _WORD if outputs == 1 else ir.LiteralStructType([_WORD] * outputs)
                body = text(targetconfig.ConfigStack().top().compute_capability) if callable(text) else text
                value = builder.call(ir.InlineAsm(ir.FunctionType(out_type, [_WORD] * inputs), body, constraints),
                                     words)
                if outputs == 1:
                    return value
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(value, k) for k in range(outputs)])

            return result(*[types.uint32] * inputs), codegen

        # intrinsic reads the arguments off the typing function's signature: spell them out
        if inputs == 1:
            def typing(typingctx, a0):
                return typer(typingctx, a0)
        elif inputs == 2:
            def typing(typingctx, a0, a1):
                return typer(typingctx, a0, a1)
        else:
            def typing(typingctx, a0, a1, a2):
                return typer(typingctx, a0, a1, a2)
        typing.__name__ = typing.__qualname__ = name
        return intrinsic(typing)

    _int8x4 = _words_asm("_int8x4", 1, 2, (
        "{ .reg .b32 u, e, m; "
        f"xor.b32 u, $2, {INT8_BIAS:#x}; mov.b32 e, {EXPONENT_BYTES:#x}; mov.b32 m, {INT8_MAGIC:#x}; "
        f"prmt.b32 $0, u, e, {INT8_PAIRS[0]:#x}; prmt.b32 $1, u, e, {INT8_PAIRS[1]:#x}; "
        "sub.rn.f16x2 $0, $0, m; sub.rn.f16x2 $1, $1, m; }"))

    _int4x8 = _words_asm("_int4x8", 1, 4, (
        "{ .reg .b32 s, c, k, a; "
        f"mov.b32 c, {INT4_LOW_SUB:#x}; mov.b32 k, {INT4_HIGH_MUL:#x}; mov.b32 a, {INT4_HIGH_ADD:#x}; "
        f"shr.u32 s, $4, 8; "
        f"lop3.b32 $0, $4, {INT4_LOW_MASK:#x}, {INT4_LOW_MAGIC:#x}, {LOP3_AND_XOR:#x}; "
        f"lop3.b32 $1, $4, {INT4_HIGH_MASK:#x}, {INT4_HIGH_MAGIC:#x}, {LOP3_AND_XOR:#x}; "
        f"lop3.b32 $2, s, {INT4_LOW_MASK:#x}, {INT4_LOW_MAGIC:#x}, {LOP3_AND_XOR:#x}; "
        f"lop3.b32 $3, s, {INT4_HIGH_MASK:#x}, {INT4_HIGH_MAGIC:#x}, {LOP3_AND_XOR:#x}; "
        "sub.rn.f16x2 $0, $0, c; fma.rn.f16x2 $1, $1, k, a; "
        "sub.rn.f16x2 $2, $2, c; fma.rn.f16x2 $3, $3, k, a; }"))

    _E4M3X4 = (
        "{ .reg .b32 m, c; "
        f"and.b32 m, $2, {E4M3_MAGNITUDE:#x}; add.u32 c, m, {E4M3_NAN_CARRY:#x}; "
        f"lop3.b32 m, m, c, {E4M3_NAN_FLAG:#x}, {LOP3_OR_AND:#x}; "
        f"prmt.b32 $0, m, $2, {E4M3_PAIRS[0]:#x}; prmt.b32 $1, m, $2, {E4M3_PAIRS[1]:#x}; "
        f"shl.b32 $0, $0, {E4M3_SHIFT}; shl.b32 $1, $1, {E4M3_SHIFT}; "
        f"and.b32 $0, $0, {E4M3_KEEP:#x}; and.b32 $1, $1, {E4M3_KEEP:#x}; }}")
    _E4M3X4_CVT = (
        "{ .reg .b16 l, h; .reg .b32 s; "
        f"mov.b32 {{l, h}}, $2; mov.b32 s, {E4M3_CVT_SCALE:#x}; "
        "cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; "
        "mul.rn.f16x2 $0, $0, s; mul.rn.f16x2 $1, $1, s; }")
    _e4m3x4 = _words_asm("_e4m3x4", 1, 2, _E4M3X4)
    _e4m3x4_cvt = _words_asm("_e4m3x4_cvt", 1, 2, _E4M3X4_CVT)
    # the body of e4m3x4_to_half2_for(cc), for the cc being compiled (None outside a compile: the integer one)
    _e4m3x4_target = _words_asm("_e4m3x4_target", 1, 2, lambda cc: _E4M3X4_CVT if cc and
                                e4m3x4_to_half2_for(tuple(cc)) is e4m3x4_to_half2_cvt else _E4M3X4)

    _prmt = _words_asm("_prmt", 3, 1, "prmt.b32 $0, $1, $2, $3;")
    _mul = _words_asm("_mul", 2, 1, "mul.rn.f16x2 $0, $1, $2;")
    # one half of the scale word times both values: ptxas reads the half in place (the multiply's operand swizzle)
    _mul_low = _words_asm("_mul_low", 2, 1, "{ .reg .b16 l, h; .reg .b32 s; mov.b32 {l, h}, $2; mov.b32 s, {l, l}; "
                                            "mul.rn.f16x2 $0, $1, s; }")
    _mul_high = _words_asm("_mul_high", 2, 1, "{ .reg .b16 l, h; .reg .b32 s; mov.b32 {l, h}, $2; mov.b32 s, {h, h}; "
                                              "mul.rn.f16x2 $0, $1, s; }")

    @intrinsic
    def _floats(typingctx, pair):
        """cvt.f32.f16 of each half of a .f16x2 register."""
        if not isinstance(pair, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            word = context.cast(builder, args[0], sig.args[0], types.uint32)
            f = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f, f]), [_WORD]),
                               "{ .reg .f16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
                               "=f,=f,r")
            out = builder.call(asm, [word])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, k) for k in range(2)])

        return types.UniTuple(types.float32, 2)(types.uint32), codegen

    def _scalar_load(width: int):
        """An intrinsic: one ld.global.nc.u<width> from the address of data[index] (1-D array, aligned to its
        size), zero-extended to a uint32."""
        if width == 16:
            text = "{ .reg .u64 g; .reg .b16 t; cvta.to.global.u64 g, $1; ld.global.nc.b16 t, [g]; cvt.u32.u16 $0, t; }"
        else:
            text = "{ .reg .u64 g; cvta.to.global.u64 g, $1; ld.global.nc.u32 $0, [g]; }"

        def load(typingctx, data, index):
            if not (isinstance(data, types.Array) and data.ndim == 1 and isinstance(index, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                pointer = element_pointer(context, builder, sig, args)
                asm = ir.InlineAsm(ir.FunctionType(_WORD, [pointer.type]), text, "=r,l")
                return builder.call(asm, [pointer])

            return types.uint32(data, index), codegen

        load.__name__ = load.__qualname__ = f"load_bits{width // 8}"
        return intrinsic(load)

    load_bits2 = _scalar_load(16)
    load_bits4 = _scalar_load(32)

    # Plain device functions around the intrinsics (NVVM inlines them), with the simulator twins' names.
    @cuda.jit(device=True)
    def int8x4_to_half2(word):
        """The 4 signed bytes of `word` as two float16 pairs: elements (0, 1) and (2, 3)."""
        return _int8x4(word)

    @cuda.jit(device=True)
    def int4x8_to_half2(word):
        """The 8 signed nibbles of `word` as four float16 pairs: elements (0, 4), (1, 5), (2, 6), (3, 7)."""
        return _int4x8(word)

    @cuda.jit(device=True)
    def e4m3x4_to_half2(word):
        """The 4 e4m3 codes of `word` as two float16 pairs of value / 256: elements (0, 1) and (2, 3); NaN for the
        NaN codes. 9 integer instructions per 4 values."""
        return _e4m3x4(word)

    @cuda.jit(device=True)
    def e4m3x4_to_half2_cvt(word):
        """e4m3x4_to_half2 by cvt.rn.f16x2.e4m3x2 (sm_89+): the same pairs; the NaN codes give 0x7fff."""
        return _e4m3x4_cvt(word)

    @cuda.jit(device=True, inline="always")
    def e4m3x4_to_half2_target(word):
        """e4m3x4_to_half2_for(the compiled target)'s pairs: cvt.rn.f16x2.e4m3x2 from sm_89 on, the integer path
        before (inlined into the kernel, so it is chosen in the kernel's compile)."""
        return _e4m3x4_target(word)

    @cuda.jit(device=True)
    def scale_half2(word_a, word_b, selector):
        """The float16 pair (half of word_a, half of word_b) that `selector` (pair_selector) picks."""
        return _prmt(word_a, word_b, selector)

    @cuda.jit(device=True)
    def permute_bytes(word_a, word_b, selector):
        """prmt.b32: byte i of the result is byte (selector >> 4i) & 7 of word_b:word_a (its sign replicated
        where bit 3 of the nibble is set)."""
        return _prmt(word_a, word_b, selector)

    @cuda.jit(device=True)
    def mul_half2(values, scales):
        """values * scales, each half rounded to float16 (nearest even) once."""
        return _mul(values, scales)

    @cuda.jit(device=True)
    def half2_floats(pair):
        """The two float16 of `pair` widened to float32, low half first."""
        return _floats(pair)

    @cuda.jit(device=True, inline="always")
    def mul_half2_by(values, scales, half):
        """values * (half `half` of scales, both lanes), each rounded to float16 once: mul_half2 with the pair
        scale_half2(scales, scales, pair_selector(half, half)) gives, without the prmt (half: a constant)."""
        if half == 0:
            return _mul_low(values, scales)
        return _mul_high(values, scales)


def e4m3x4_to_half2_for(cc):
    """The e4m3 conversion a kernel compiled for compute capability `cc` (a (major, minor) pair) calls:
    e4m3x4_to_half2_cvt from (8, 9) on, where cvt.rn.f16x2.e4m3x2 exists; e4m3x4_to_half2 before."""
    if not (isinstance(cc, tuple) and len(cc) == 2 and all(isinstance(v, int) and v >= 0 for v in cc)):
        raise ValueError(f"e4m3x4_to_half2_for: cc must be a (major, minor) pair of integers such as (9, 0), "
                         f"got {cc!r}")
    return e4m3x4_to_half2_cvt if cc >= E4M3_CVT_CC else e4m3x4_to_half2
