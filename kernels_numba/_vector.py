"""16- and 8-byte vector loads (and a 16-byte store) and the bit-level conversions that unpack them, for the kernel
ladder's third rung and the cache store.

numba-cuda has no vector load: indexing an array loads one element per instruction. `load16` is an
`@intrinsic` that emits one `ld.global.nc.v4.u32` (16 bytes through the read-only data path) from the address
of an array element and returns the four 32-bit words (`load8`: `ld.global.nc.v2.u32`, two words, for rung 3's
int4 chunks; `store16`: one `st.global.v4.u32` of four words to an element's address); the caller unpacks them in
registers with shifts
(int8, int4) or with `half_from_bits` / `float_from_bits` (float16, float32), which are bit casts in LLVM IR
(`cvt.f32.f16` and a plain register move in PTX).

The address must be aligned to the access's size and a load's bytes read-only during the kernel: the launcher
decides on the host that both hold before it picks the kernel that calls this (`_cache.vector_loads_ok`).

numba's CUDA simulator cannot run an intrinsic, so there the same three functions are NumPy views of the
same bytes: the simulator twin reads exactly the bits the GPU reads, and the shared unpacking code after it
is the same Python in both.
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda

VECTOR_BYTES = 16
SIMULATED = bool(config.ENABLE_CUDASIM)

if SIMULATED:
    @cuda.jit(device=True)
    def load16(data, index):
        """The 16 bytes from element `index` of the 1-D array `data` as four uint32 words (little-endian)."""
        words = np.asarray(data[index:index + VECTOR_BYTES // data.itemsize]).view(np.uint32)
        return words[0], words[1], words[2], words[3]

    @cuda.jit(device=True)
    def load8(data, index):
        """The 8 bytes from element `index` of the 1-D array `data` as two uint32 words (little-endian)."""
        words = np.asarray(data[index:index + 8 // data.itemsize]).view(np.uint32)
        return words[0], words[1]

    @cuda.jit(device=True)
    def store16(data, index, w0, w1, w2, w3):
        """Write the four uint32 words (little-endian) as the 16 bytes from element `index` of the 1-D array `data`."""
        data[index:index + VECTOR_BYTES // data.itemsize] = np.array([w0, w1, w2, w3], np.uint32).view(data.dtype)

    @cuda.jit(device=True)
    def half_from_bits(bits):
        """The float16 whose bits are the low 16 of `bits`, as a float32."""
        return np.float32(np.uint16(bits & 0xFFFF).view(np.float16))

    @cuda.jit(device=True)
    def float_from_bits(bits):
        """The float32 whose bits are `bits`."""
        return np.uint32(bits).view(np.float32)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _WORD = ir.IntType(32)

    def element_pointer(context, builder, sig, args):
        """The address of data[index] for an intrinsic called as (data, index): a 1-D array and an integer."""
        array_type, index_type = sig.args[:2]
        array = context.make_array(array_type)(context, builder, value=args[0])
        position = context.cast(builder, args[1], index_type, types.intp)
        return cgutils.get_item_pointer(context, builder, array_type, array, [position])

    def _vector_load(words):
        """An intrinsic: one ld.global.nc.v<words>.u32 from the address of data[index] (1-D array, aligned to
        4 * words bytes), the words as a tuple of uint32."""
        outputs = ", ".join(f"${k}" for k in range(words))
        asm_text = (f"{{ .reg .u64 g; cvta.to.global.u64 g, ${words}; "          # generic -> global address
                    f"ld.global.nc.v{words}.u32 {{{outputs}}}, [g]; }}")
        constraints = ",".join(["=r"] * words + ["l"])

        def load(typingctx, data, index):
            if not (isinstance(data, types.Array) and data.ndim == 1 and isinstance(index, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                pointer = element_pointer(context, builder, sig, args)
                asm_type = ir.FunctionType(ir.LiteralStructType([_WORD] * words), [pointer.type])
                loaded = builder.call(ir.InlineAsm(asm_type, asm_text, constraints), [pointer])
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(loaded, k) for k in range(words)])

            return types.UniTuple(types.uint32, words)(data, index), codegen

        load.__name__ = load.__qualname__ = f"load{4 * words}"
        return load

    load16 = intrinsic(_vector_load(4))
    load8 = intrinsic(_vector_load(2))

    @intrinsic
    def store16(typingctx, data, index, w0, w1, w2, w3):
        """One st.global.v4.u32 of the words w0..w3 (unsigned 32-bit) to the address of data[index] (a 1-D array,
        aligned to 16 bytes)."""
        words = (w0, w1, w2, w3)
        if not (isinstance(data, types.Array) and data.ndim == 1 and isinstance(index, types.Integer)
                and all(isinstance(w, types.Integer) for w in words)):
            return None

        def codegen(context, builder, sig, args):
            pointer = element_pointer(context, builder, sig, args)
            values = [context.cast(builder, a, t, types.uint32) for a, t in zip(args[2:], sig.args[2:])]
            asm_type = ir.FunctionType(ir.VoidType(), [pointer.type] + [_WORD] * 4)
            asm_text = "{ .reg .u64 g; cvta.to.global.u64 g, $0; st.global.v4.u32 [g], {$1, $2, $3, $4}; }"
            builder.call(ir.InlineAsm(asm_type, asm_text, "l,r,r,r,r,~{memory}", side_effect=True), [pointer] + values)
            return context.get_dummy_value()

        return types.none(data, index, *words), codegen

    @intrinsic
    def half_from_bits(typingctx, bits):
        """The float16 whose bits are the low 16 of `bits` (an unsigned 32-bit word), widened to float32."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            word = context.cast(builder, args[0], sig.args[0], types.uint32)
            half = builder.bitcast(builder.trunc(word, ir.IntType(16)), ir.HalfType())
            return builder.fpext(half, ir.FloatType())

        return types.float32(bits), codegen

    @intrinsic
    def float_from_bits(typingctx, bits):
        """The float32 whose bits are `bits` (an unsigned 32-bit word)."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            word = context.cast(builder, args[0], sig.args[0], types.uint32)
            return builder.bitcast(word, ir.FloatType())

        return types.float32(bits), codegen
