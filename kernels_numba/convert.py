"""Moving one sequence's K or V between a cache and the canonical (heads, tokens, head_dim) form: one gather kernel
(export: cache -> float values, plus the stored codes and group scales) and one scatter kernel (import: values ->
the cache's codes by its rule, or the codes copied as they are).

Both address a cache the way cacheattn.convert's sites do: element (h, t, j) of a flat array sits at
`token_offset[t] + h * stride_h + (j // chunk) * stride_chunk + (j % chunk) * stride_in` (a `Where`), so one body
serves every layout of every format: the layout lives in those numbers. Codes of a kind numba lacks (bfloat16,
fp8) travel as their integer bits (uint16 / uint8 views) and are decoded and encoded here with integer and
float32 arithmetic.
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple

import numpy as np
from numba import cuda

from ._launch import caller_stream, ceil_div, empty_like_kind, launch, to_kind
from ._numerics import rounder

# Element (h, t, j) of `data` sits at token_offset[t] + h*stride_h + (j // chunk)*stride_chunk + (j % chunk)*stride_in.
Where = namedtuple("Where", "data token_offset stride_h chunk stride_chunk stride_in")

# How a cache stores a value (the `kind` of a launch).
FLOAT, BF16, INT8, E4M3, E5M2, GROUP8, GROUP4 = range(7)
# Minifloats as (mantissa bits, exponent bias, largest finite value, all-ones exponent is inf/NaN).
FORMATS = {BF16: (7, 127, 3.3895313892515355e38, True), E4M3: (3, 7, 448.0, False), E5M2: (2, 15, 57344.0, True)}


def where(data, token_offset, stride_h, chunk, stride_chunk, stride_in) -> Where:
    i64 = np.int64
    return Where(data, token_offset, i64(stride_h), i64(chunk), i64(stride_chunk), i64(stride_in))


@cuda.jit(device=True, inline="always")
def _offset(w, h, t, j):
    return w.token_offset[t] + h * w.stride_h + (j // w.chunk) * w.stride_chunk + (j % w.chunk) * w.stride_in


def _minifloat(kind):
    """(decode(bits) -> float32, encode(float32) -> bits) of a minifloat kind: round to nearest even, saturate
    at the largest finite value (fp8's rule; bfloat16 never reaches it from float32 inputs in range)."""
    mant, bias, largest, ieee = FORMATS[kind]
    sign_bit = 1 + mant + (8 if kind == BF16 else 5 if kind == E5M2 else 4) - 1
    exp_mask = (1 << (sign_bit - mant)) - 1
    min_exp = 1 - bias                                            # exponent of the smallest normal

    @cuda.jit(device=True, inline="always")
    def decode(bits):
        bits = np.int32(bits)
        e = (bits >> mant) & exp_mask
        m = bits & ((1 << mant) - 1)
        sign = -1.0 if (bits >> sign_bit) & 1 else 1.0
        if ieee and e == exp_mask:
            return np.float32(sign * math.inf) if m == 0 else np.float32(math.nan)
        if not ieee and e == exp_mask and m == (1 << mant) - 1:  # e4m3fn: only S.1111.111 is NaN
            return np.float32(math.nan)
        if e == 0:
            return np.float32(sign * math.ldexp(np.float64(m), int(min_exp - mant)))
        return np.float32(sign * math.ldexp(1.0 + m / (1 << mant), int(e - bias)))

    @cuda.jit(device=True, inline="always")
    def encode(x):
        a = np.float64(x)
        sign = 1 if a < 0 else 0
        a = min(abs(a), largest)                                   # saturate (NaN is not expected here)
        if a == 0:
            return sign << sign_bit
        _, e = math.frexp(a)                                       # 2^(e-1) <= a < 2^e
        quantum = math.ldexp(1.0, max(e - 1, min_exp) - mant)
        y = min(round(a / quantum) * quantum, largest)             # round() is half to even
        if y == 0:
            return sign << sign_bit
        _, e = math.frexp(y)
        if e - 1 < min_exp:                                        # subnormal
            return (sign << sign_bit) | np.int32(round(y / math.ldexp(1.0, min_exp - mant)))
        m = np.int32(round((y / math.ldexp(1.0, e - 1) - 1.0) * (1 << mant)))
        return (sign << sign_bit) | ((e - 1 + bias) << mant) | m

    return decode, encode


@functools.cache
def gather_kernel(kind: int, scale_dtype: str):
    """One thread per (h, t, d): values[h, t, d] (float32) from the cache; codes[h, t, j] the stored element
    (int4: the byte, written by the even d); group_scales[h, t, g] (written by the group's first d)."""
    round_scale = rounder(scale_dtype)
    decode = _minifloat(kind)[0] if kind in FORMATS else None

    @cuda.jit
    def gather(src, scales, heads, tokens, head_dim, quant_group, scale, values, codes, group_scales):
        i = cuda.grid(1)
        if i >= heads * tokens * head_dim:
            return
        h, t, d = i // (tokens * head_dim), (i // head_dim) % tokens, i % head_dim
        j = d // 2 if kind == GROUP4 else d
        raw = src.data[_offset(src, h, t, j)]
        if kind == FLOAT:
            v = np.float32(raw)
        elif kind == INT8:
            v = np.float32(raw) * scale
        elif kind == GROUP8 or kind == GROUP4:
            q = np.int32(raw)
            if kind == GROUP4:
                q = (q >> (4 * (d & 1))) & 0xF                    # element 2i: the low nibble
                q = q - 16 if q >= 8 else q
            s = scales.data[_offset(scales, h, t, d // quant_group)]
            v = round_scale(np.float32(q) * np.float32(s))        # the product in the scale tensor's dtype
            if d % quant_group == 0:
                group_scales[h, t, d // quant_group] = s
        elif kind == BF16:
            v = decode(raw)
        else:
            v = decode(raw) * scale
        values[h, t, d] = v
        if kind != GROUP4 or d % 2 == 0:
            codes[h, t, j] = raw

    return gather


@functools.cache
def scatter_kernel(kind: int, scale_dtype: str, copy: bool, divide: bool):
    """One thread per (h, t, unit), unit = one element, or one quant group for the group kinds: the cache's
    codes of values[h, t, :] by its rule (copy: codes and group scales written as given). divide: per-tensor
    codes are x / scale (vLLM, FlashInfer), else x * scale (TensorRT-LLM passes 1/s)."""
    round_in = rounder(scale_dtype)
    encode = _minifloat(kind)[1] if kind in FORMATS else None
    qmax = 127 if kind == GROUP8 else 7

    @cuda.jit
    def scatter(dst, scales, heads, tokens, head_dim, unit, scale, values, codes, group_scales):
        i = cuda.grid(1)
        units = head_dim // unit
        if i >= heads * tokens * units:
            return
        h, t, g = i // (tokens * units), (i // units) % tokens, i % units
        if kind == GROUP8 or kind == GROUP4:
            if copy:
                s = group_scales[h, t, g]
            else:
                absmax = np.float32(0)                             # OpenPPL: in the scale dtype
                for d in range(g * unit, (g + 1) * unit):
                    absmax = max(absmax, abs(round_in(values[h, t, d])))
                s = max(round_in(absmax / qmax), round_in(np.float32(1e-5)))
            scales.data[_offset(scales, h, t, g)] = s
            for d in range(g * unit, (g + 1) * unit, 2 if kind == GROUP4 else 1):
                if copy:
                    code = codes[h, t, d // 2 if kind == GROUP4 else d]
                else:
                    q0 = min(max(round(round_in(round_in(values[h, t, d]) / s)), -qmax), qmax)
                    code = q0
                    if kind == GROUP4:
                        q1 = min(max(round(round_in(round_in(values[h, t, d + 1]) / s)), -qmax), qmax)
                        byte = (q0 & 0xF) | ((q1 & 0xF) << 4)
                        code = byte - 256 if byte >= 128 else byte
                dst.data[_offset(dst, h, t, d // 2 if kind == GROUP4 else d)] = code
            return
        d = g
        if copy:
            dst.data[_offset(dst, h, t, d)] = codes[h, t, d]
            return
        x = values[h, t, d]
        if kind == FLOAT:
            dst.data[_offset(dst, h, t, d)] = x
        elif kind == BF16:
            dst.data[_offset(dst, h, t, d)] = encode(x)
        else:
            x = x / scale if divide else x * scale
            if kind == INT8:
                dst.data[_offset(dst, h, t, d)] = min(max(round(x), -128), 127)
            else:
                dst.data[_offset(dst, h, t, d)] = encode(x)

    return scatter


def _output(like, shape, dtype):
    """A new array of like's kind: floats from empty_like_kind (NaN-poisoned under the tests), integer codes
    zero-filled (a poison NaN has no integer)."""
    if np.dtype(dtype).kind == "f":
        return empty_like_kind(like, shape, dtype)
    return to_kind(like, np.zeros(shape, dtype))


def gather(src: Where, scales: Where | None, *, kind: int, heads: int, tokens: int, head_dim: int, stored_dim: int,
           quant_group: int = 1, scale: float = 1.0, scale_dtype="float32", threads: int = 128):
    """(values float32 (heads, tokens, head_dim), codes (heads, tokens, stored_dim) of the cache's dtype,
    group scales (heads, tokens, head_dim / quant_group) or None), on the caller's stream."""
    like = src.data
    values = _output(like, (heads, tokens, head_dim), np.float32)
    codes = _output(like, (heads, tokens, stored_dim), src.data.dtype)
    grouped = kind in (GROUP8, GROUP4)
    group_scales = _output(like, (heads, tokens, head_dim // quant_group) if grouped else (1, 1, 1),
                                   scales.data.dtype if grouped else np.float32)
    scales = scales if grouped else src
    n = heads * tokens * head_dim
    if n:
        launch(gather_kernel(kind, np.dtype(scale_dtype).name), ceil_div(n, threads), threads,
               caller_stream(like), src, scales, heads, tokens, head_dim, quant_group, np.float32(scale), values,
               codes, group_scales)
    return values, codes, (group_scales if grouped else None)


def scatter(dst: Where, scales: Where | None, values, codes=None, group_scales=None, *, kind: int, heads: int,
            tokens: int, head_dim: int, quant_group: int = 1, scale: float = 1.0, divide: bool = False,
            scale_dtype="float32", threads: int = 128) -> None:
    """Write one sequence's values (or, given codes, its codes and group scales as they are) into the cache."""
    like = dst.data
    copy = codes is not None
    grouped = kind in (GROUP8, GROUP4)
    unit = quant_group if grouped else 1
    if values is None:                                  # placeholders the kernel does not read
        values = _output(like, (1, 1, 1), np.float32)
    if codes is None:
        codes = _output(like, (1, 1, 1), dst.data.dtype)
    if group_scales is None:
        group_scales = _output(like, (1, 1, 1), scales.data.dtype if grouped else np.float32)
    n = heads * tokens * (head_dim // unit)
    if n:
        launch(scatter_kernel(kind, np.dtype(scale_dtype).name, copy, divide), ceil_div(n, threads), threads,
               caller_stream(like), dst, scales if grouped else dst, heads, tokens, head_dim, unit, np.float32(scale),
               values, codes, group_scales)


__all__ = ["Where", "where", "gather", "scatter", "gather_kernel", "scatter_kernel", "to_kind", "FLOAT", "BF16",
           "INT8", "E4M3", "E5M2", "GROUP8", "GROUP4"]
