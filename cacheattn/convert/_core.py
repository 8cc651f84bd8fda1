"""The canonical form every format converts through, and the machinery the format modules share.

Canonical form (`KV`), per sequence and layer: K and V as float arrays (num_kv_heads, tokens, head_dim) in token
order, the positions those tokens hold, whether the keys carry RoPE, and the quantization that produced them
(`Quant`: the stored codes and scales, so that a destination with the same rule takes the codes as they are).

Every format locates one sequence's elements the same way (`Site`): element (h, t, j) of K (or V, or a scale
tensor) lives at flat element offset `token_offset[t] + h * stride_h + (j // chunk) * stride_chunk +
(j % chunk) * stride_in` of a C-contiguous array. `chunk` is head_dim for plain layouts and the x of the layouts
that split head_dim by 16 bytes (vLLM's key cache, FasterTransformer's cross cache). The NumPy path gathers and
scatters with these offsets; the kernels (kernels_numba/convert.py) take the same four numbers and the array.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import numpy as np

from reference import quant as group_quant
from reference import rope as rope_ref
from reference import trtllm_gpt_attention as trt

from .. import _arrays as arrays

# Quantization kinds, each with its decode rule value = code * scale:
#   int8_group / int4_group   OpenPPL: one scale per quant_group elements of head_dim, per token and head
#   int8 / fp8_e4m3 / fp8_e5m2 one scale for the whole tensor (TensorRT-LLM, vLLM, FlashInfer)
GROUP_KINDS = ("int8_group", "int4_group")
TENSOR_KINDS = ("int8", "fp8_e4m3", "fp8_e5m2")
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def fp8_dtype(kind: str) -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.float8_e4m3fn if kind == "fp8_e4m3" else ml_dtypes.float8_e5m2)


@dataclass
class Quant:
    """How a cache's values were quantized: kind, the stored codes (num_kv_heads, tokens, stored head_dim) in
    the cache's dtype, and the scales (group kinds: arrays (num_kv_heads, tokens, head_dim / quant_group) in
    the scale tensor's dtype; per-tensor kinds: one float each for K and V)."""
    kind: str
    key_codes: np.ndarray
    value_codes: np.ndarray
    key_scale: object
    value_scale: object
    quant_group: int = 0


@dataclass
class KV:
    """One sequence's keys and values in one layer, in token order.

    key, value: float (num_kv_heads, tokens, head_dim); positions: int64 (tokens,) the positions they hold (a
    cyclic cache holds its sink tokens and the last window); rotated: True when the keys carry RoPE (what
    attention reads in most formats), False for un-rotated keys (TensorRT-LLM StreamingLLM), None when RoPE
    does not apply (cross-attention keys of an encoder); quant: what produced the values, or None for a float
    cache.
    """
    key: np.ndarray
    value: np.ndarray
    positions: np.ndarray
    rotated: bool | None = True
    quant: Quant | None = None

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.key.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.key.shape[2])


@dataclass(frozen=True)
class Rope:
    """The rotary embedding to add (or remove) when a source and a destination disagree on rotated keys:
    rotary_embedding_dim, rotary_embedding_base and the pairing style ("gpt_neox" halves or "gptj" pairs), as
    TensorRT-LLM's gpt_attention names them; rotary_inv_freq overrides the frequencies."""
    rotary_embedding_dim: int
    rotary_embedding_base: float = 10000.0
    style: str = rope_ref.GPT_NEOX
    rotary_inv_freq: np.ndarray | None = field(default=None, compare=False)

    def rotate(self, key: np.ndarray, positions: np.ndarray, *, undo: bool = False) -> np.ndarray:
        """key (Hkv, T, D) rotated at `positions` (or rotated back); float64 arithmetic, key's dtype out."""
        freq = (np.asarray(self.rotary_inv_freq, np.float64) if self.rotary_inv_freq is not None else
                rope_ref.inv_freq(self.rotary_embedding_dim, self.rotary_embedding_base, np.float64))
        at = positions.astype(np.float64) * (-1.0 if undo else 1.0)
        turned = rope_ref.rotate(key.astype(np.float64).transpose(1, 0, 2), at, freq, self.style)  # (T, Hkv, D)
        return turned.transpose(1, 0, 2).astype(key.dtype)


# ---------------------------------------------------------------------------------------------- sites

@dataclass
class Site:
    """Where one sequence's elements (h, t, j) live in a C-contiguous array (see the module docstring)."""
    array: object
    token_offset: np.ndarray          # (T,) int64
    heads: int
    stride_h: int
    width: int                        # j extent: stored head_dim (or head_dim / quant_group for scales)
    chunk: int
    stride_chunk: int
    stride_in: int

    def offsets(self) -> np.ndarray:
        """(heads, T, width) int64 flat element offsets."""
        j = np.arange(self.width)
        inner = (j // self.chunk) * self.stride_chunk + (j % self.chunk) * self.stride_in          # (width,)
        return (self.token_offset[None, :, None] + np.arange(self.heads)[:, None, None] * self.stride_h
                + inner[None, None, :])

    def read(self) -> np.ndarray:
        return self.array.reshape(-1)[self.offsets()]

    def write(self, values: np.ndarray) -> None:
        self.array.reshape(-1)[self.offsets()] = values


def element_strides(array) -> tuple[int, ...]:
    itemsize = np.dtype(array.dtype).itemsize
    return tuple(int(s) // itemsize for s in array.strides)


def site(array, axes: str, fixed: dict, token_axes: dict, *, width_axes: str = "D") -> Site:
    """A Site from named axes: `fixed` pins axes to one index (layer, K-or-V, ...), `token_axes` gives each
    token's index along the axes that locate a token ({axis: (T,) indices}); head axis "H"; head_dim along
    `width_axes`: "D", or "DC X" for head_dim split into chunks of x."""
    names = axes.split()
    es = dict(zip(names, element_strides(array)))
    ext = dict(zip(names, (int(s) for s in array.shape)))
    base = sum(int(i) * es[n] for n, i in fixed.items())
    T = len(next(iter(token_axes.values())))
    token_offset = np.full(T, base, np.int64)
    for n, idx in token_axes.items():
        token_offset = token_offset + np.asarray(idx, np.int64) * es[n]
    if width_axes == "D":
        return Site(array, token_offset, ext["H"], es["H"], ext["D"], ext["D"], 0, es["D"])
    chunks, x = width_axes.split()
    return Site(array, token_offset, ext["H"], es["H"], ext[chunks] * ext[x], ext[x], es[chunks], es[x])


# ---------------------------------------------------------------------------------------------- quantization

def decode(kind: str | None, codes: np.ndarray, scale, quant_group: int = 0) -> np.ndarray:
    """Stored codes -> float values by the kind's rule (None: a float cache, returned as it is)."""
    if kind is None:
        return codes
    if kind in GROUP_KINDS:
        bit = 8 if kind == "int8_group" else 4
        return group_quant.dequantize(codes, scale, bit, quant_group, scale.dtype)
    return trt.dequantize_kv(codes, scale)              # code * scale in float32: one rule for every per-tensor kind


def encode(kind: str | None, values: np.ndarray, *, dtype=None, scale=None, inverse_scale=None, scale_dtype=None,
           quant_group: int = 0):
    """Float values -> (codes, scales) by a destination's own rule.

    Float caches: a cast to `dtype`. Group kinds: OpenPPL's quantize in the scale tensor's dtype. Per-tensor
    kinds with `inverse_scale` (TensorRT-LLM: code = sat(round(x * (1/s)))), or with `scale` only (vLLM,
    FlashInfer: code = sat(round(x / s))).
    """
    if kind is None:
        return values.astype(dtype), None
    if kind in GROUP_KINDS:
        bit = 8 if kind == "int8_group" else 4
        scales, codes = group_quant.quantize(values.astype(scale_dtype), bit, quant_group, scale_dtype)
        return codes, scales
    x = values.astype(np.float32)
    if inverse_scale is not None:
        mode = trt.INT8_KV_CACHE if kind == "int8" else trt.FP8_KV_CACHE
        if kind == "fp8_e5m2":
            return np.clip(x * np.float32(inverse_scale), -FP8_MAX[kind], FP8_MAX[kind]).astype(fp8_dtype(kind)), None
        return trt.quantize_kv(x, inverse_scale, mode), None
    scaled = x / np.float32(scale)
    if kind == "int8":
        return np.clip(np.rint(scaled), -128, 127).astype(np.int8), None
    return np.clip(scaled, -FP8_MAX[kind], FP8_MAX[kind]).astype(fp8_dtype(kind)), None


def step_bound(kind: str | None, values: np.ndarray, *, dtype=None, scale=None, quant_group: int = 0) -> np.ndarray:
    """Per-element bound on |encode(values) decoded - values| for a destination: its quantization step, half.

    Float: half an ulp of the destination dtype (0 where it holds the value exactly). Group int8 / int4: half the
    group's scale (absmax / 127 or / 7), plus the roundings of OpenPPL's arithmetic in the scale dtype `dtype`.
    Per-tensor int8: s / 2 inside the range. FP8: half an ulp of the format at value / s (2^-4 of it for e4m3,
    2^-3 for e5m2; half the smallest subnormal below the normal range), times s. The per-tensor kinds add two
    float32 roundings (x * (1/s), code * s).
    """
    x = np.abs(values.astype(np.float64))
    if kind is None:
        if holds_exactly(values.dtype, dtype):
            return np.zeros_like(x)
        eps = float(finfo(dtype).eps)
        tiny = float(finfo(dtype).smallest_subnormal)
        return np.maximum(x * eps / 2, tiny / 2)
    if kind in GROUP_KINDS:
        # OpenPPL quantizes in the scale tensor's dtype (eps: its ulp at 1): x, max|x| / qmax, x / scale and
        # code * scale each round once, which can move a code across a rounding tie (qmax * eps of a step).
        qmax, eps = (127 if kind == "int8_group" else 7), float(finfo(dtype).eps)
        groups = x.reshape(*x.shape[:-1], -1, quant_group)
        step = np.maximum(groups.max(axis=-1, keepdims=True) / qmax, 1e-5)
        bound = step * (0.5 + qmax * eps) * (1 + 2 * eps) + 2 * eps * groups
        return np.broadcast_to(bound, groups.shape).reshape(x.shape)
    s = float(scale)
    float32_slack = x * 2.0 ** -21            # x * (1/s) and code * s are float32 products: a rounding each
    if kind == "int8":
        return s / 2 + float32_slack
    mantissa, min_exp = (3, -6) if kind == "fp8_e4m3" else (2, -14)
    e = np.floor(np.log2(np.maximum(x / s, 2.0 ** min_exp)))
    return 2.0 ** (e - mantissa - 1) * s + float32_slack


# ---------------------------------------------------------------------------------------------- page tables

def take_pages(free_pages, count: int, name: str = "free_pages") -> list:
    """The first `count` pages of the caller's free list (not removed yet: `commit_pages` does that after the
    writes); a clear error when the list is short."""
    if free_pages is None:
        return []
    if len(free_pages) < count:
        raise ValueError(f"{name}: expected at least {count} free pages for this sequence, got {len(free_pages)}")
    return [int(p) for p in list(free_pages)[:count]]


def commit_pages(free_pages, count: int) -> None:
    if free_pages is not None and count:
        del free_pages[:count]


def check_index(name: str, index: np.ndarray, low: int, high: int, meaning: str) -> None:
    """Every index in [low, high): a converter never follows a table entry outside its cache."""
    if index.size and (index.min() < low or index.max() >= high):
        bad = index[(index < low) | (index >= high)][0]
        raise ValueError(f"{name}: expected {meaning} in [{low}, {high}), got {int(bad)}")


def check_sequence(name: str, sequence, count: int) -> int:
    if isinstance(sequence, bool) or not isinstance(sequence, (int, np.integer)) or not 0 <= sequence < count:
        raise ValueError(f"{name}: expected an int in [0, {count}), got {sequence!r}")
    return int(sequence)


def check_cache_array(name: str, x):
    """A cache the converter writes: a C-contiguous NumPy array, or a GPU array (CuPy, __cuda_array_interface__)."""
    if not isinstance(x, np.ndarray) and not arrays.is_device_array(x):
        raise TypeError(f"{name}: expected a NumPy or GPU array, got {type(x).__name__}")
    flags = getattr(x, "flags", None)
    if flags is not None and not flags["C_CONTIGUOUS"]:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides}")
    return x


def host(x):
    """A host (NumPy) view or copy of a table or length argument, whichever side it lives on."""
    return np.asarray(arrays.to_host(x))


def assign(table, index, values) -> None:
    """table[index] = values for a host or GPU page table."""
    values = np.asarray(values)
    table[index] = values if isinstance(table, np.ndarray) else arrays.to_kind(table, values)


def is_float(dtype) -> bool:
    """A float cache dtype of 16 bits or more: float16, bfloat16 (ml_dtypes), float32, float64."""
    dtype = np.dtype(dtype)
    return (dtype.kind == "f" or dtype.name == "bfloat16") and dtype.itemsize >= 2


def finfo(dtype):
    """np.finfo, with ml_dtypes' for bfloat16 and the fp8 types."""
    import ml_dtypes
    return ml_dtypes.finfo(np.dtype(dtype))


def holds_exactly(source_dtype, dtype) -> bool:
    """Every value of source_dtype is a value of dtype (float16 -> float32, bfloat16 -> float32, ...)."""
    src, dst = finfo(source_dtype), finfo(dtype)
    return src.nmant <= dst.nmant and src.maxexp <= dst.maxexp and src.minexp >= dst.minexp


def read_pair(k_site: Site, v_site: Site, kind, k_scale, v_scale, quant_group, positions, rotated,
              scale_sites=None) -> KV:
    """Gather one sequence's K and V (and their scales) and decode them into a KV (float32 values on the
    kernels)."""
    if use_kernels(k_site.array):
        sc = scale_sites or (None, None)
        k_vals, k_codes, k_gs = _gather(k_site, kind, k_scale, quant_group, sc[0])
        v_vals, v_codes, v_gs = _gather(v_site, kind, v_scale, quant_group, sc[1])
        if kind in GROUP_KINDS:
            k_scale, v_scale = k_gs, v_gs
        quant = None if kind is None else Quant(kind, k_codes, v_codes, k_scale, v_scale, quant_group)
        return KV(k_vals, v_vals, np.asarray(positions, np.int64), rotated, quant)
    k_codes, v_codes = k_site.read(), v_site.read()
    if kind in GROUP_KINDS:
        k_scale, v_scale = scale_sites[0].read(), scale_sites[1].read()
    quant = None if kind is None else Quant(kind, k_codes, v_codes, k_scale, v_scale, quant_group)
    return KV(decode(kind, k_codes, k_scale, quant_group), decode(kind, v_codes, v_scale, quant_group),
              np.asarray(positions, np.int64), rotated, quant)


def codes_for(kv: KV, kind, *, dtype, scale=(None, None), inverse_scale=(None, None), scale_dtype=None,
              quant_group: int = 0):
    """(k_codes, v_codes, k_scales, v_scales) a destination stores for kv: the source's own codes when the rule
    and scales are the same (lossless), else the values encoded by the destination's rule."""
    q = kv.quant
    if q is not None and q.kind == kind and storage_dtype(q.key_codes.dtype) == storage_dtype(dtype):
        if kind in GROUP_KINDS and q.quant_group == quant_group and np.dtype(q.key_scale.dtype) == scale_dtype:
            return q.key_codes, q.value_codes, q.key_scale, q.value_scale
        if kind in TENSOR_KINDS and np.float32(q.key_scale) == np.float32(scale[0]) and \
                np.float32(q.value_scale) == np.float32(scale[1]):
            return q.key_codes, q.value_codes, None, None
    kc, ks = encode(kind, kv.key, dtype=dtype, scale=scale[0], inverse_scale=inverse_scale[0],
                    scale_dtype=scale_dtype, quant_group=quant_group)
    vc, vs = encode(kind, kv.value, dtype=dtype, scale=scale[1], inverse_scale=inverse_scale[1],
                    scale_dtype=scale_dtype, quant_group=quant_group)
    return kc, vc, ks, vs


def prepare_pair(kv: KV, kind, k_site: Site, v_site: Site, scale_sites=None, *, scale=(None, None),
                 inverse_scale=(None, None), quant_group: int = 0):
    """Everything import needs before it writes: returns write(), which stores kv at the two sites (the
    destination's codes, and group scales at scale_sites). The NumPy path encodes now; the kernels encode as
    they write (after every check has passed either way)."""
    dtype = k_site.array.dtype
    scale_dtype = None if scale_sites is None else scale_sites[0].array.dtype
    if use_kernels(k_site.array):
        return lambda: _scatter_pair(kv, kind, k_site, v_site, scale_sites, scale, inverse_scale, quant_group)
    kc, vc, ks, vs = codes_for(kv, kind, dtype=dtype, scale=scale, inverse_scale=inverse_scale,
                               scale_dtype=scale_dtype, quant_group=quant_group)

    def write():
        k_site.write(kc)
        v_site.write(vc)
        if scale_sites is not None:
            scale_sites[0].write(ks)
            scale_sites[1].write(vs)
    return write


def sc_dtype(scale_sites, i):
    return np.dtype(scale_sites[i].array.dtype)


def _beside(like, x, dtype, view=False):
    """x as a C-contiguous array of `like`'s kind in `dtype` (view: reinterpret the bits, for fp8 codes): a GPU
    array stays on the GPU, a host one is uploaded once."""
    if arrays.is_device_array(x) and not isinstance(like, np.ndarray):
        import cupy
        x = cupy.asarray(x)
        return cupy.ascontiguousarray(x.view(dtype) if view else x.astype(dtype, copy=False))
    host_x = np.asarray(arrays.to_host(x))
    host_x = host_x.view(dtype) if view else host_x.astype(dtype, copy=False)
    return arrays.to_kind(like, np.ascontiguousarray(host_x))


def _scatter_pair(kv, kind, k_site, v_site, scale_sites, scale, inverse_scale, quant_group):
    from kernels_numba import convert as kc
    q = kv.quant
    dtype = k_site.array.dtype
    copy = q is not None and q.kind == kind and storage_dtype(q.key_codes.dtype) == storage_dtype(dtype) and (
        (kind in GROUP_KINDS and q.quant_group == quant_group and
         np.dtype(q.key_scale.dtype) == np.dtype(scale_sites[0].array.dtype)) or
        (kind in TENSOR_KINDS and np.float32(q.key_scale) == np.float32(scale[0]) and
         np.float32(q.value_scale) == np.float32(scale[1])))
    for i, s in enumerate((k_site, v_site)):
        like = s.array
        per_tensor = inverse_scale[i] if inverse_scale[i] is not None else scale[i]
        values = None if copy else _beside(like, (kv.key, kv.value)[i], np.float32)
        codes = group_scales = None
        if copy:
            codes = _beside(like, (q.key_codes, q.value_codes)[i], storage_dtype(dtype), view=True)
            if kind in GROUP_KINDS:
                group_scales = _beside(like, (q.key_scale, q.value_scale)[i], sc_dtype(scale_sites, i))
        sc = None if scale_sites is None else scale_sites[i]
        kc.scatter(_where(s), None if sc is None else _where(sc), values, codes, group_scales,
                   kind=_kernel_kind(kind, dtype), heads=s.heads, tokens=len(s.token_offset),
                   head_dim=kv.head_dim, quant_group=max(quant_group, 1),
                   scale=1.0 if per_tensor is None else float(per_tensor), divide=inverse_scale[i] is None,
                   scale_dtype=np.float32 if sc is None else sc.array.dtype)


# ---------------------------------------------------------------------------------------------- backends

_BACKEND = contextvars.ContextVar("cacheattn_convert_backend", default="auto")


@contextlib.contextmanager
def backend(name: str):
    """Within: "reference" (NumPy gathers and scatters), "numba" (the kernels; NumPy arrays run them in the
    simulator) or "auto" (the kernels for GPU arrays)."""
    if name not in arrays.BACKENDS:
        raise ValueError(f"backend: expected one of {arrays.BACKENDS}, got {name!r}")
    token = _BACKEND.set(name)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def use_kernels(array) -> bool:
    chosen = _BACKEND.get()
    return chosen == "numba" or (chosen == "auto" and arrays.is_device_array(array))


def storage_dtype(dtype) -> np.dtype:
    """The dtype the kernels see: fp8 and bfloat16 (which numba lacks) as their bits."""
    dtype = np.dtype(dtype)
    if dtype.name.startswith("float8"):
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype


def _kernel_kind(kind, dtype):
    from kernels_numba import convert as kc
    if kind is None:
        return kc.BF16 if np.dtype(dtype).name == "bfloat16" else kc.FLOAT
    return {"int8": kc.INT8, "fp8_e4m3": kc.E4M3, "fp8_e5m2": kc.E5M2, "int8_group": kc.GROUP8,
            "int4_group": kc.GROUP4}[kind]


def _where(s: Site):
    from kernels_numba import convert as kc
    data = s.array.view(storage_dtype(s.array.dtype)).reshape(-1)
    return kc.where(data, arrays.to_kind(data, s.token_offset), s.stride_h, s.chunk, s.stride_chunk, s.stride_in)


def _gather(s: Site, kind, scale, quant_group, scale_site):
    """(values float32, codes, group scales) of one site through the gather kernel."""
    from kernels_numba import convert as kc
    values, codes, group_scales = kc.gather(
        _where(s), None if scale_site is None else _where(scale_site), kind=_kernel_kind(kind, s.array.dtype),
        heads=s.heads, tokens=len(s.token_offset), head_dim=s.width * (2 if kind == "int4_group" else 1),
        stored_dim=s.width, quant_group=max(quant_group, 1), scale=1.0 if scale is None else float(scale),
        scale_dtype=np.float32 if scale_site is None else scale_site.array.dtype)
    if storage_dtype(s.array.dtype) != np.dtype(s.array.dtype):
        codes = codes.view(s.array.dtype) if isinstance(codes, np.ndarray) else codes
    # Values in the dtype the NumPy path gives: a float16 cache's, a group's scale dtype (bfloat16, which CuPy
    # lacks, and the per-tensor kinds stay float32).
    like = s.array.dtype if kind is None else (scale_site.array.dtype if kind in GROUP_KINDS else np.float32)
    if np.dtype(like) == np.float16:
        values = values.astype(np.float16)
    return values, codes, group_scales


__all__ = ["KV", "Quant", "Rope", "Site", "site", "decode", "encode", "step_bound", "backend"]
