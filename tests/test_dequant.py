"""The magic-number dequantization of rung 3 (`kernels_numba._dequant`): its simulator twins against the
document's rule (`reference.quant.dequantize`, q times a float16 scale rounded to float16) on every int8 and int4
code, bit for bit, the e4m3 conversion against the TensorRT-LLM decode's value / 256 on every code, and all of
them against a second formulation of the PTX instructions they stand for (prmt, lop3, integer and f16x2
arithmetic written from the ISA's definitions, the float16 arithmetic in float64).

On a GPU the same names are inline PTX; `python -m kernels_numba.ptx_check --family rung3` compiles and assembles
them for sm_80 and sm_90, and the rung-3 kernel tests run them. No kernel calls the e4m3 conversion yet, so a
test here compiles one that does, for both. The sm_89+ conversion by cvt.rn.f16x2.e4m3x2 is checked against the
integer one on every code and compiled for sm_80 (where `e4m3x4_to_half2_for` picks the integer one), sm_89 and
sm_90, down to the machine code's F2FP.
"""

import functools
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from intrinsics_compile import compile_kernels, count

import cacheattn
import cacheattn.testing as kit
from kernels_numba import _dequant as dq
from kernels_numba._cache import scale_loads
from kernels_numba.trtllm_common import e4m3_decode
from reference.quant import dequantize, pack_int4

from strategies import DEEP, PPLCase

pytestmark = pytest.mark.skipif(not dq.SIMULATED, reason="the twins exist in the simulator only")

RNG = np.random.default_rng(20240607)


def _scales():
    """float16 scales over the whole range: normal ones of every binade, ones whose products are subnormal, ones
    whose products overflow to inf, and the smallest the document stores (1e-5, itself subnormal in float16)."""
    normal = np.float16(2.0) ** RNG.integers(-14, 8, 48).astype(np.float16) * RNG.uniform(1, 2, 48).astype(np.float16)
    subnormal = RNG.uniform(6e-8, 6e-6, 24).astype(np.float16)
    large = RNG.uniform(500, 65504, 16).astype(np.float16)
    return np.concatenate([normal, subnormal, large, np.float16([1e-5, 1.0])]).astype(np.float16)


def _bits(x):
    return np.asarray(x, np.float16).view(np.uint16)


# ----------------------------------------------------------------------------- the ISA, written independently

def _isa_prmt(a, b, selector):
    """prmt.b32 (PTX ISA, default mode): the eight bytes {b, a}, b3..b0 a3..a0 numbered 7..0; result byte i is
    the byte that bits 0..2 of nibble i of the selector number, or, with bit 3 of the nibble set, that byte's
    msb replicated over all 8 bits."""
    table = np.frombuffer(np.array([a, b], np.uint32).tobytes(), np.uint8)
    picks = []
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = table[nibble & 7]
        picks.append((0xFF if byte >= 0x80 else 0x00) if nibble & 8 else byte)
    return int(np.frombuffer(bytes(picks), np.uint32)[0])


def _isa_lop3(a, b, c, lut):
    """lop3.b32: bit k of the result is bit (a_k * 4 + b_k * 2 + c_k) of the lookup table."""
    out = 0
    for k in range(32):
        index = ((a >> k) & 1) * 4 + ((b >> k) & 1) * 2 + ((c >> k) & 1)
        out |= ((lut >> index) & 1) << k
    return out


def _isa_add(a, b):
    """add.u32: the sum modulo 2**32."""
    return (a + b) % 2**32


def _isa_shl(a, n):
    """shl.b32: the low 32 bits of a * 2**n."""
    return a * 2**n % 2**32


def _isa_f16x2(word):
    return np.array([word], np.uint32).view(np.float16).astype(np.float64)


def _isa_pack(values):
    """Round two float64 values to float16 once (nearest even; past the largest float16, inf), as a .rn f16x2
    result."""
    with np.errstate(over="ignore"):
        return int(np.asarray(values, np.float64).astype(np.float16).view(np.uint32)[0])


def _isa_int8(word):
    u = word ^ 0x80808080
    magic = _isa_f16x2(0x64806480)
    return [_isa_pack(_isa_f16x2(_isa_prmt(u, 0x64646464, sel)) - magic) for sel in (0x4140, 0x4342)]


def _isa_int4(word):
    out = []
    for w in (word, word >> 8):
        low = _isa_f16x2(_isa_lop3(w, 0x000F000F, 0x64086408, 0x6A))
        high = _isa_f16x2(_isa_lop3(w, 0x00F000F0, 0x64806480, 0x6A))
        out += [_isa_pack(low - _isa_f16x2(0x64086408)),
                _isa_pack(high * _isa_f16x2(0x2C002C00) + _isa_f16x2(0xD480D480))]
    return out


def _isa_e4m3(word):
    magnitudes = word & 0x7F7F7F7F
    flagged = _isa_lop3(magnitudes, _isa_add(magnitudes, 0x01010101), 0x80808080, 0xF8)
    return [_isa_shl(_isa_prmt(flagged, word, sel), 7) & 0xFF80FF80 for sel in (0xD1C0, 0xF3E2)]


# ------------------------------------------------------------------------------------------------------ tests

def _int8_words():
    """Every int8 code in every byte position: 256 words of 4 codes, code c at byte k of word (c + 67 k) % 256."""
    codes = (np.arange(256)[:, None] + 67 * np.arange(4)[None, :]) % 256 - 128
    return codes.astype(np.int8), codes.astype(np.int8).view(np.uint32)[:, 0]


def test_int8_codes_become_their_float16_pairs():
    codes, words = _int8_words()
    for code, word in zip(codes, words):
        pairs = dq.int8x4_to_half2(word)
        assert [int(p) for p in pairs] == _isa_int8(int(word))
        got = np.array([int(p) for p in pairs], np.uint32).view(np.float16)
        want = np.array([code[a] for pair in dq.INT8_PAIR_ELEMENTS for a in pair], np.float16)
        assert np.array_equal(_bits(got), _bits(want))


def _int4_words():
    """Every int4 code in every nibble position: 16 x 4 words of 8 codes, code c at nibble k of word
    (c + 5 k + shift) % 16, two's complement."""
    out = []
    for shift in range(4):
        codes = (np.arange(16)[:, None] + 5 * np.arange(8)[None, :] + shift) % 16
        out.append(np.where(codes >= 8, codes - 16, codes).astype(np.int8))
    codes = np.concatenate(out)
    return codes, pack_int4(codes).view(np.uint32)[:, 0]


def test_int4_codes_become_their_float16_pairs_in_interleaved_order():
    codes, words = _int4_words()
    for code, word in zip(codes, words):
        pairs = dq.int4x8_to_half2(word)
        assert [int(p) for p in pairs] == _isa_int4(int(word))
        got = np.array([int(p) for p in pairs], np.uint32).view(np.float16)
        want = np.array([code[a] for pair in dq.INT4_PAIR_ELEMENTS for a in pair], np.float16)
        assert np.array_equal(_bits(got), _bits(want))


def _e4m3_words():
    """Every e4m3 code in every byte position (code c at byte k of word (c + 67 k) % 256), then random words."""
    ordered = (np.arange(256)[:, None] + 67 * np.arange(4)[None, :]) % 256
    codes = np.concatenate([ordered, RNG.integers(0, 256, (256, 4))]).astype(np.uint8)
    return codes, codes.view(np.uint32)[:, 0]


def test_e4m3_codes_become_their_value_over_256():
    """Each code's float16 is the TensorRT-LLM decode's value / 256 bit for bit (signed zeros, subnormals, +-448
    included); the NaN codes 0x7f and 0xff give a NaN."""
    with np.errstate(invalid="ignore"):
        values = np.array([e4m3_decode(c) for c in range(256)], np.float64)
    want_halves = (values / 256).astype(np.float16)     # exact: every e4m3 value / 256 is a float16
    assert np.array_equal(np.flatnonzero(np.isnan(values)), [0x7F, 0xFF])
    codes, words = _e4m3_words()
    for code, word in zip(codes, words):
        pairs = dq.e4m3x4_to_half2(word)
        assert [int(p) for p in pairs] == _isa_e4m3(int(word))
        got = np.array([int(p) for p in pairs], np.uint32).view(np.float16)
        elements = [code[a] for pair in dq.E4M3_PAIR_ELEMENTS for a in pair]
        want = want_halves[elements]
        nan = np.isin(elements, [0x7F, 0xFF])
        assert np.array_equal(np.isnan(got), nan), code
        assert np.array_equal(_bits(got[~nan]), _bits(want[~nan])), code


# Outside the simulator: a kernel calling the conversion, compiled for each architecture and assembled (ptxas,
# when installed); it prints the conversion's inline PTX, which numba copies between begin/end markers.
E4M3_COMPILE = """
from numba import cuda, types
from kernels_numba import _dequant as dq, ptx_check

ptx_check._allow_device_functions_without_gpu()

def convert(words, out):
    i = cuda.grid(1)
    if i < words.size:
        out[2 * i], out[2 * i + 1] = dq.e4m3x4_to_half2(words[i])

for cc in ((8, 0), (9, 0)):
    ptx_check._target_cc[0] = cc
    ptx, _ = cuda.compile_ptx(convert, (types.uint32[::1], types.uint32[::1]), cc=cc)
    asm = ptx.split("begin inline asm")[1].split("// end inline asm")[0]
    print(f"sm_{cc[0]}{cc[1]}{ptx_check._assemble(ptx, cc)}|{' '.join(asm.split())}")
"""


def test_e4m3_conversion_compiles_for_sm_80_and_sm_90_in_nine_integer_instructions():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-c", E4M3_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert [line.split(",")[0] for line in lines] == ["sm_80", "sm_90"], run.stdout
    for line in lines:
        asm = line.split("|")[1]
        ops = [op.split()[0] for op in asm.strip("{} ").split(";") if op.strip()]
        opcodes = Counter(op for op in ops if not op.startswith("."))             # not the .reg declaration
        assert opcodes == {"and.b32": 3, "add.u32": 1, "lop3.b32": 1, "prmt.b32": 2, "shl.b32": 2}, asm


def _isa_e4m3_cvt(word):
    """cvt.rn.f16x2.e4m3x2 of each half of the word (byte 0 of a half to its low float16: the value, exact; a NaN
    code to the canonical float16 NaN 0x7fff), then mul.rn.f16x2 by 2^-8 (exact; a NaN stays 0x7fff)."""
    out = []
    for half in (word & 0xFFFF, word >> 16):
        halves = []
        for code in (half & 0xFF, half >> 8):
            with np.errstate(invalid="ignore"):
                value = e4m3_decode(code)
            halves.append(0x7FFF if np.isnan(value) else _isa_pack([value * 2.0**-8, 0.0]) & 0xFFFF)
        out.append(halves[0] | halves[1] << 16)
    return out


def test_e4m3_cvt_path_is_the_integer_path_bit_for_bit():
    """e4m3x4_to_half2_cvt (sm_89+) against e4m3x4_to_half2 (sm_80) on every code in every byte position and on
    random words: the same float16 bits except the two NaN codes, where the integer path keeps the code's sign
    (0x7f -> 0x7f80, 0xff -> 0xff80) and the conversion gives the canonical NaN (0x7fff for both); NaN either way.
    And both against the ISA's cvt and mul written apart."""
    codes, words = _e4m3_words()
    for code, word in zip(codes, words):
        cvt = [int(p) for p in dq.e4m3x4_to_half2_cvt(word)]
        assert cvt == _isa_e4m3_cvt(int(word)), code
        integer = [int(p) for p in dq.e4m3x4_to_half2(word)]
        elements = [code[a] for pair in dq.E4M3_PAIR_ELEMENTS for a in pair]
        cvt_bits = np.array(cvt, np.uint32).view(np.uint16)
        integer_bits = np.array(integer, np.uint32).view(np.uint16)
        nan = np.isin(elements, [0x7F, 0xFF])
        assert np.array_equal(cvt_bits[~nan], integer_bits[~nan]), code
        assert (cvt_bits[nan] == dq.E4M3_CVT_NAN).all(), code
        assert np.array_equal(integer_bits[nan], np.where(np.array(elements)[nan] == 0x7F, 0x7F80, 0xFF80)), code
        assert np.isnan(cvt_bits[nan].view(np.float16)).all() and np.isnan(integer_bits[nan].view(np.float16)).all()
    assert sum(0x7F in c or 0xFF in c for c in codes) >= 8                       # NaN codes in every position


def test_the_e4m3_conversion_is_picked_by_compute_capability():
    assert dq.e4m3x4_to_half2_for((8, 0)) is dq.e4m3x4_to_half2
    assert dq.e4m3x4_to_half2_for((8, 6)) is dq.e4m3x4_to_half2
    for cc in ((8, 9), (9, 0), (10, 0)):
        assert dq.e4m3x4_to_half2_for(cc) is dq.e4m3x4_to_half2_cvt
    for bad in ("89", [9, 0], (9,), ("9", "0"), (9, -1)):
        with pytest.raises(ValueError, match=r"e4m3x4_to_half2_for: cc must be a \(major, minor\) pair"):
            dq.e4m3x4_to_half2_for(bad)


E4M3_FOR_COMPILE = """
from kernels_numba import _dequant as dq


def build(cc):
    convert = dq.e4m3x4_to_half2_for(cc)

    def kernel(words, out):
        i = cuda.grid(1)
        if i < words.size:
            out[2 * i], out[2 * i + 1] = convert(words[i])

    return kernel, (types.uint32[::1], types.uint32[::1])
"""


# One kernel object for every target: the conversion is chosen while each compile lowers it.
E4M3_TARGET_COMPILE = E4M3_FOR_COMPILE.replace("dq.e4m3x4_to_half2_for(cc)", "dq.e4m3x4_to_half2_target")
assert E4M3_TARGET_COMPILE != E4M3_FOR_COMPILE


# The compile-time choice is another compile for three targets: the deep tier's.
TARGET_DEEP = pytest.mark.skipif(not DEEP, reason="the deep tier: CACHEATTN_EXAMPLES=2 or more (.ci/run)")


@pytest.mark.parametrize("script", [E4M3_FOR_COMPILE, pytest.param(E4M3_TARGET_COMPILE, marks=TARGET_DEEP)],
                         ids=["for(cc)", "target"])
def test_e4m3_conversion_for_sm_89_and_later_is_two_f2fp(script):
    """The conversion a kernel builder picks (or the compile picks, `e4m3x4_to_half2_target`): on sm_80 the integer
    path (two PRMT, no F2FP); on sm_89 and sm_90 two cvt.rn.f16x2.e4m3x2 (F2FP.F16.E4M3.UNPACK_B in the machine
    code) and two f16x2 multiplies (the 2^-8)."""
    compiled = compile_kernels(script, ccs=((8, 0), (8, 9), (9, 0)))
    ops = compiled["sm_80"]["opcodes"]
    assert count(ops, "PRMT") == 2 and count(ops, "F2FP") == 0, ops
    for cc in ("sm_89", "sm_90"):
        ptx, ops = compiled[cc]["ptx"], compiled[cc]["opcodes"]
        assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2, cc
        # ptxas may issue a multiply as an HFMA2 with a -0 addend (on sm_90 one goes to the MMA pipe: HFMA2.MMA)
        assert count(ops, "F2FP.F16.E4M3.UNPACK_B") == 2, (cc, ops)
        assert count(ops, "HMUL2") + count(ops, "HFMA2") == 2, (cc, ops)
        assert count(ops, "PRMT") == 0, (cc, ops)


@pytest.mark.parametrize("quant_bit", [8, 4])
def test_scaled_pairs_are_the_documents_float16_products_bit_for_bit(quant_bit):
    """Every code times every scale of the spread, through the kernel's chain (pairs, a scale pair picked by
    prmt, mul.rn.f16x2, widened to float32), against reference.quant.dequantize with float16 scales."""
    qmax = 127 if quant_bit == 8 else 7
    codes = np.arange(-qmax - 1, qmax + 1, dtype=np.int8)
    scales = _scales()
    with np.errstate(over="ignore"):                                       # the large scales' products: inf
        want = dequantize(np.repeat(codes[None, :], len(scales), 0), np.repeat(scales[:, None], len(codes), 1),
                          8, 1, np.float16)                               # group 1: every code its own scale
    for i in range(0, len(scales) - 1, 2):
        scale_word = int(scales[i:i + 2].view(np.uint32)[0])
        for lo in range(0, len(codes), 2):
            # a pair of codes: the low with scale i, the high with scale i + 1 (selector: low half, high half)
            pair = int(np.array([codes[lo], codes[lo + 1]], np.float16).view(np.uint32)[0])
            scale = dq.scale_half2(scale_word, scale_word, dq.pair_selector(0, 1))
            assert int(scale) == _isa_prmt(scale_word, scale_word, dq.pair_selector(0, 1))
            product = dq.mul_half2(pair, scale)
            assert int(product) == _isa_pack(_isa_f16x2(pair) * _isa_f16x2(int(scale)))
            low, high = dq.half2_floats(product)
            got = np.array([low, high], np.float32).astype(np.float16)
            expected = np.array([want[i, lo], want[i + 1, lo + 1]], np.float16)
            assert np.array_equal(_bits(got), _bits(expected)), (codes[lo:lo + 2], scales[i:i + 2])


def test_a_pair_times_one_half_of_a_scale_word_is_the_picked_pair_product():
    """mul_half2_by (both values of a register in one group: its scale read in place) is mul_half2 by the pair
    scale_half2 picks of that half, and the ISA's product, on random codes and the spread of scales."""
    scales = _scales()
    for i in range(0, len(scales) - 1, 2):
        scale_word = int(scales[i:i + 2].view(np.uint32)[0])
        pair = int(np.array(RNG.integers(-8, 8, 2), np.float16).view(np.uint32)[0])
        for half in (0, 1):
            picked = dq.scale_half2(scale_word, scale_word, dq.pair_selector(half, half))
            got = int(dq.mul_half2_by(pair, scale_word, half))
            assert got == int(dq.mul_half2(pair, picked)) == _isa_pack(_isa_f16x2(pair) * _isa_f16x2(int(picked)))


MUL_BY_HALF_COMPILE = """
def build(cc):
    @cuda.jit
    def kernel(words, out):
        i = cuda.grid(1)
        if i < words.size:
            out[2 * i] = dq.mul_half2_by(words[i], words[i + 1], 0)
            out[2 * i + 1] = dq.mul_half2_by(words[i], words[i + 1], 1)

    return kernel, (types.uint32[::1], types.uint32[::1])
"""


def test_a_pair_times_one_half_compiles_to_one_multiply_and_no_prmt():
    """The half is read in place by the multiply (its operand swizzle), no prmt builds the pair: what saves the
    tensor-core decode a prmt a K register of int8 and int4."""
    compiled = compile_kernels("from kernels_numba import _dequant as dq\n" + MUL_BY_HALF_COMPILE)
    for cc, result in compiled.items():
        ops = result["opcodes"]
        assert count(ops, "HMUL2") + count(ops, "HFMA2") == 2 and count(ops, "PRMT") == 0, (cc, ops)


def test_scale_pairs_pick_either_half_of_either_word():
    a, b = (int(x) for x in RNG.integers(0, 2**32, 2, dtype=np.uint64))
    for half_a in (0, 1):
        for half_b in (0, 1):
            got = int(dq.scale_half2(a, b, dq.pair_selector(half_a, half_b)))
            assert got == (a >> (16 * half_a)) & 0xFFFF | ((b >> (16 * half_b)) & 0xFFFF) << 16



def test_permute_bytes_is_prmt_and_the_interleaves_pair_two_words():
    """permute_bytes against the ISA's prmt on random words and selectors (sign replication too); the interleave
    selectors put a's and b's halves (bytes) side by side, so int8x4_to_half2 / int4x8_to_half2 of an interleaved
    word give (a's code, b's code) pairs of one element."""
    for _ in range(32):
        a, b, selector = (int(x) for x in RNG.integers(0, 2**32, 3, dtype=np.uint64))
        selector &= 0xFFFF                                  # bit 3 of a nibble: the byte's sign replicated
        assert int(dq.permute_bytes(a, b, selector)) == _isa_prmt(a, b, selector)
    codes = RNG.integers(-128, 128, (2, 4)).astype(np.int8)
    a, b = (int(w) for w in codes.view(np.uint32)[:, 0])
    for half, selector in enumerate(dq.INTERLEAVE_BYTES):
        pairs = dq.int8x4_to_half2(dq.permute_bytes(a, b, selector))
        for k, pair in enumerate(pairs):
            got = np.array([int(pair)], np.uint32).view(np.float16)
            assert np.array_equal(got, codes[:, 2 * half + k].astype(np.float16))
    nibbles = RNG.integers(-8, 8, (2, 8)).astype(np.int8)
    a, b = (int(w) for w in pack_int4(nibbles).view(np.uint32)[:, 0])
    for half, selector in enumerate(dq.INTERLEAVE_HALVES):
        pairs = dq.int4x8_to_half2(dq.permute_bytes(a, b, selector))
        for k, pair in enumerate(pairs):
            got = np.array([int(pair)], np.uint32).view(np.float16)
            assert np.array_equal(got, nibbles[:, 4 * half + k].astype(np.float16))
    halves = RNG.standard_normal((2, 2)).astype(np.float16)
    a, b = (int(w) for w in halves.view(np.uint32)[:, 0])
    for k, selector in enumerate(dq.INTERLEAVE_HALVES):
        got = np.array([int(dq.permute_bytes(a, b, selector))], np.uint32).view(np.float16)
        assert np.array_equal(_bits(got), _bits(halves[:, k]))

def test_scale_loads_read_whole_groups_of_a_chunk():
    assert [scale_loads(g, 16) for g in (1, 2, 4, 8, 16, 32, 3, 24)] == [0, 8, 4, 2, 1, 1, 0, 0]


def test_bit_loads_read_the_bytes_at_an_element():
    scales = RNG.standard_normal(8).astype(np.float16)
    bits = scales.view(np.uint16).astype(np.uint32)
    assert int(dq.load_bits2(scales, 3)) == bits[3]
    assert int(dq.load_bits4(scales, 4)) == bits[4] | bits[5] << 16


@pytest.mark.parametrize("quant_bit,quant_group", [(4, 2), (8, 32)])
def test_rung_3_scales_pairs_across_groups(quant_bit, quant_group):
    """Rung 3 on groups other than the headline's 8: int4 in groups of 2 (a pair (k, k + 4) takes its two scales
    from different words of the chunk's 16-byte scale load), int8 in groups of 32 (one 2-byte scale a chunk),
    against the reference."""
    case = PPLCase(seqlens=(1, 2), past=(5, 9), decoding_batches=0, num_heads=4, num_kv_heads=2, head_dim=64,
                   dtype="float16", quant_bit=quant_bit, quant_group=quant_group, scale_dtype="float16",
                   cache_layout=0, cache_mode=1, page_size=4, num_layer=1, layer_idx=0, is_causal=True,
                   is_alibi=False, mask="none", mask_pad=0, seed=quant_group)
    impl = functools.partial(cacheattn.multi_head_cache_attention, backend="numba", threads=64, rung=3)
    kit.check_case("multi_head_cache_attention", impl, case)


def test_scales_off_a_16_byte_boundary_take_the_element_loads():
    """A chunk's scales come in one load of up to 16 bytes, so a cache whose scales do not start 16-byte aligned
    is read with element loads (decided on the host), not with misaligned vector loads."""
    from kernels_numba._cache import cache_source, vector_loads_ok

    data = np.zeros((8, 2, 64), np.int8)
    raw = np.zeros(2 * 8 * 2 * 8 + 32, np.uint8)
    first = -raw.ctypes.data % 16                               # the first 16-byte boundary in the buffer
    aligned = raw[first:first + 256].view(np.float16).reshape(8, 2, 8)
    shifted = raw[first + 2:first + 258].view(np.float16).reshape(8, 2, 8)
    starts = np.zeros((1, 1), np.int64)
    assert vector_loads_ok(cache_source(data, aligned, starts, 8, "T H D"), 8, 64)
    assert not vector_loads_ok(cache_source(data, shifted, starts, 8, "T H D"), 8, 64)
