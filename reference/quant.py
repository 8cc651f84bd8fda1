"""Group-wise linear cache quantization ("KeyValueCache Quantization", OpenPPL pmx).

Every `quant_group` consecutive elements of head_dim, within one token and one
head, share one scale:

    scale = max(max|x| / qmax, 1e-5)          qmax = 127 (int8) or 7 (int4)
    q     = clip(round_half_even(x / scale), -qmax, qmax)
    x'    = q * scale

Precision follows upstream: the scale and x / scale are computed in the input
dtype (float16 inputs use float16 arithmetic), the scale is stored in the scale
tensor's dtype, and dequantization multiplies in the scale tensor's dtype.

int4 is this project's extension (the document lists it, upstream refuses it):
two values per byte of an int8 array whose last dim is head_dim / 2, element 2i
in the low nibble and 2i+1 in the high nibble, both two's complement.
"""

from __future__ import annotations

import numpy as np

QMAX = {8: 127, 4: 7}
MIN_SCALE = 1e-5


# spec: ppl-kvc/quant-bit, ppl-kvc/quant-group, ppl-mhca/quant-bit, ppl-mhca/quant-group
def quantize(x: np.ndarray, quant_bit: int, quant_group: int, scale_dtype) -> tuple[np.ndarray, np.ndarray]:
    """Return (scale, q) for x (..., Dh); the document's order is `k_scale, k_quant = quant(current_key)`.

    scale: (..., Dh / quant_group) in scale_dtype; q: int8 (..., Dh), or (..., Dh / 2) packed for int4.
    """
    t = x.dtype.type
    groups = x.reshape(*x.shape[:-1], -1, quant_group)                  # (..., Dh/G, G)
    absmax = np.abs(groups).max(axis=-1)                                 # (..., Dh/G), input dtype
    scale = np.maximum(absmax / t(QMAX[quant_bit]), t(MIN_SCALE))        # input-dtype arithmetic, as upstream
    q = np.rint(groups / scale[..., None])                               # rint rounds half to even
    q = np.clip(q, -QMAX[quant_bit], QMAX[quant_bit]).astype(np.int8)
    q = q.reshape(x.shape)                                               # (..., Dh)
    if quant_bit == 4:
        q = pack_int4(q)                                                 # (..., Dh/2)
    return scale.astype(scale_dtype), q


# spec: ppl-kvc/dequant
def dequantize(q: np.ndarray, scale: np.ndarray, quant_bit: int, quant_group: int, out_dtype) -> np.ndarray:
    """x' = q * scale, multiplied in the scale's dtype, then cast to out_dtype. Returns (..., Dh)."""
    if quant_bit == 4:
        q = unpack_int4(q)                                               # (..., Dh)
    groups = q.reshape(*q.shape[:-1], -1, quant_group)                   # (..., Dh/G, G)
    x = groups.astype(scale.dtype)
    x *= scale[..., None]                                                # scale-dtype product, in place
    return x.reshape(q.shape).astype(out_dtype, copy=False)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """(..., Dh) int8 values in [-8, 7] -> (..., Dh/2) int8 bytes; element 2i in the low nibble."""
    low = q[..., 0::2].astype(np.uint8) & 0x0F
    high = q[..., 1::2].astype(np.uint8) & 0x0F
    return ((high << 4) | low).view(np.int8)


def _signed_nibbles() -> np.ndarray:
    """(256, 2) int8: the (low, high) nibbles of every byte value, each sign-extended from two's complement."""
    b = np.arange(256, dtype=np.uint8)
    nibbles = np.stack([b & 0x0F, b >> 4], axis=-1).astype(np.int8)
    return np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.int8)


_NIBBLES = _signed_nibbles()


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """(..., Dh/2) int8 bytes -> (..., Dh) int8 values; sign-extends each two's-complement nibble."""
    nibbles = np.take(_NIBBLES, packed.view(np.uint8), axis=0)           # (..., Dh/2, 2): a table lookup per byte
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def stored_head_dim(head_dim: int, quant_bit: int) -> int:
    """Last dim of the cache tensor: int4 packs two values per byte."""
    return head_dim // 2 if quant_bit == 4 else head_dim
