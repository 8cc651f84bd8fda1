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
from collections.abc import MutableSequence
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
    """How a cache's values were quantized: the stored codes and scales, so that a destination with the same
    rule copies the codes as they are (lossless).

    Parameters
    ----------
    kind : str
        "int8_group" or "int4_group" (OpenPPL: one scale per `quant_group` elements of head_dim, per token and
        head), or a per-tensor kind, one scale for the whole tensor: "int8" (TensorRT-LLM), "fp8_e4m3"
        (TensorRT-LLM, vLLM "fp8", FlashInfer), "fp8_e5m2" (vLLM, FlashInfer). Decoded value = code * scale.
    key_codes, value_codes : array
        `(num_kv_heads, tokens, stored head_dim)` in the cache's dtype: int8 (int4: two codes a byte, so the
        stored head_dim is head_dim / 2), or the fp8 dtype (or uint8 holding its bytes).
    key_scale, value_scale : array or float
        Group kinds: `(num_kv_heads, tokens, head_dim / quant_group)` in the scale tensor's float dtype;
        per-tensor kinds: one positive finite float each.
    quant_group : int, default 0
        Elements sharing a scale (group kinds; divides head_dim, even for int4); unused by per-tensor kinds.
    """
    kind: str
    key_codes: np.ndarray
    value_codes: np.ndarray
    key_scale: object
    value_scale: object
    quant_group: int = 0


@dataclass
class KV:
    """One sequence's keys and values in one layer, in token order: what `export` returns and `import_` writes.

    Built, it is checked at once (and again by every import, before anything is written): an error names the
    field, as `kv.value`, `kv.positions`, `kv.quant.key_codes`.

    Parameters
    ----------
    key : array
        `(num_kv_heads, tokens, head_dim)`, float16, bfloat16, float32 or float64; a NumPy or GPU array.
    value : array
        `(num_kv_heads, tokens, v_head_dim)`, the heads and tokens of `key` (v_head_dim differs from head_dim
        only for ONNX, whose `past_value` may be narrower or wider).
    positions : array of int
        `(tokens,)`: the position each token holds, non-negative and increasing (token order). Stored as
        int64. Usually `0 ... tokens - 1`; a cyclic TensorRT-LLM cache holds its sink tokens and the last
        window, so its export has a gap. TensorRT-LLM imports put each token at the slot of its position; the
        other formats write the tokens at `0 ... tokens - 1` in order.
    rotated : bool or None, default True
        True when the keys carry RoPE (what attention reads in most formats), False for un-rotated keys
        (TensorRT-LLM StreamingLLM), None when RoPE does not apply (an encoder's cross-attention keys).
    quant : Quant or None, default None
        What produced the values of a quantized cache (its codes and scales), None for a float cache.

    Raises
    ------
    TypeError
        A field of the wrong type or dtype: key or value not a float array, positions not integers, rotated not
        a bool or None, quant not a `Quant` (or its codes not of its kind's dtype).
    ValueError
        Shapes that disagree (key and value heads or tokens, one position per token, codes and scales against
        the values), positions negative or not increasing, a per-tensor scale not positive and finite.
    """
    key: np.ndarray
    value: np.ndarray
    positions: np.ndarray
    rotated: bool | None = True
    quant: Quant | None = None

    def __post_init__(self):
        self.positions = _positions("kv.positions", self.positions)
        check_kv(self)

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.key.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.key.shape[2])


def _positions(name: str, positions) -> np.ndarray:
    """Positions as a host int64 array (an empty list too); other dtypes are refused, not cast."""
    if isinstance(positions, (str, bytes, dict, set)) or positions is None:
        raise TypeError(f"{name}: expected an integer array (tokens,), got {type(positions).__name__}")
    try:
        p = np.asarray(arrays.to_host(positions))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: expected an integer array (tokens,), got {type(positions).__name__}") from e
    if p.size == 0 and p.dtype.kind == "f":
        p = p.astype(np.int64)                             # np.asarray([]) is float64
    if p.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {p.dtype}")
    return p.astype(np.int64, copy=False)


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray) or arrays.is_device_array(x)


def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def check_kv(kv, name: str = "kv") -> KV:
    """Every promise of KV's docstring (shapes, dtypes, positions, quant); returns kv, with its positions made
    an int64 host array again if they were replaced since it was built."""
    if not isinstance(kv, KV):
        raise TypeError(f"{name}: expected a cacheattn.convert.KV, got {type(kv).__name__}")
    for field_name in ("key", "value"):
        x = getattr(kv, field_name)
        if not _is_array(x):
            raise TypeError(f"{name}.{field_name}: expected a NumPy or GPU array, got {type(x).__name__}")
        if not is_float(x.dtype):
            raise TypeError(f"{name}.{field_name}: expected float16, bfloat16, float32 or float64, got {x.dtype}")
        if len(x.shape) != 3:
            raise ValueError(f"{name}.{field_name}: expected shape (num_kv_heads, tokens, head_dim), "
                             f"got {_shape(x)}")
    heads, tokens = _shape(kv.key)[:2]
    if _shape(kv.value)[:2] != (heads, tokens):
        raise ValueError(f"{name}.value: expected the num_kv_heads and tokens of {name}.key ({heads}, {tokens}), "
                         f"got {_shape(kv.value)[:2]}")
    positions = kv.positions
    if not (isinstance(positions, np.ndarray) and positions.dtype == np.int64):
        positions = _positions(f"{name}.positions", positions)
    if positions.shape != (tokens,):
        raise ValueError(f"{name}.positions: expected one position per token of {name}.key, shape ({tokens},), "
                         f"got {positions.shape}")
    if tokens and positions.min() < 0:
        raise ValueError(f"{name}.positions: expected non-negative positions, got {int(positions.min())}")
    if tokens > 1 and np.any(np.diff(positions) <= 0):
        i = int(np.argmax(np.diff(positions) <= 0))
        raise ValueError(f"{name}.positions: expected increasing positions (token order), got "
                         f"{int(positions[i])} then {int(positions[i + 1])}")
    if kv.rotated is not None and not isinstance(kv.rotated, (bool, np.bool_)):
        raise TypeError(f"{name}.rotated: expected True, False or None, got {kv.rotated!r}")
    if kv.quant is not None:
        _check_quant(kv.quant, f"{name}.quant", _shape(kv.key), _shape(kv.value))
    if positions is not kv.positions:
        kv = KV(kv.key, kv.value, positions, kv.rotated, kv.quant)
    return kv


def _check_quant(q, name: str, key_shape: tuple, value_shape: tuple) -> None:
    if not isinstance(q, Quant):
        raise TypeError(f"{name}: expected a cacheattn.convert.Quant or None, got {type(q).__name__}")
    if q.kind not in GROUP_KINDS + TENSOR_KINDS:
        raise ValueError(f"{name}.kind: expected one of {GROUP_KINDS + TENSOR_KINDS}, got {q.kind!r}")
    codes_dtypes = (np.dtype(np.int8),) if q.kind in GROUP_KINDS + ("int8",) else \
        (fp8_dtype(q.kind), np.dtype(np.uint8))
    halve = 2 if q.kind == "int4_group" else 1
    group = q.kind in GROUP_KINDS
    if group:
        qg = q.quant_group
        if isinstance(qg, bool) or not isinstance(qg, (int, np.integer)):
            raise TypeError(f"{name}.quant_group: expected an int, got {qg!r}")
        if qg < 1 or key_shape[2] % qg or value_shape[2] % qg or (halve == 2 and qg % 2):
            raise ValueError(f"{name}.quant_group: expected an (even for int4) divisor of head_dim "
                             f"{key_shape[2]}, got {qg}")
    for field_name, codes, scale, shape in (("key", q.key_codes, q.key_scale, key_shape),
                                            ("value", q.value_codes, q.value_scale, value_shape)):
        if not _is_array(codes):
            raise TypeError(f"{name}.{field_name}_codes: expected a NumPy or GPU array, got {type(codes).__name__}")
        if np.dtype(codes.dtype) not in codes_dtypes:
            raise TypeError(f"{name}.{field_name}_codes: expected {codes_dtypes[0]} for kind {q.kind!r}, "
                            f"got {codes.dtype}")
        want = (shape[0], shape[1], shape[2] // halve)
        if _shape(codes) != want:
            raise ValueError(f"{name}.{field_name}_codes: expected shape {want} (the values' heads and tokens, "
                             f"stored head_dim), got {_shape(codes)}")
        if group:
            if not _is_array(scale) or not is_float(scale.dtype):
                raise TypeError(f"{name}.{field_name}_scale: expected a float array for kind {q.kind!r}, got "
                                f"{getattr(scale, 'dtype', type(scale).__name__)}")
            want = (shape[0], shape[1], shape[2] // q.quant_group)
            if _shape(scale) != want:
                raise ValueError(f"{name}.{field_name}_scale: expected shape {want} (head_dim / quant_group "
                                 f"last), got {_shape(scale)}")
        else:
            positive_scalar(f"{name}.{field_name}_scale", scale)


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

def take_pages(free_pages, count: int, *, num_pages: int, meaning: str = "page numbers", used=None,
               name: str = "free_pages") -> list:
    """The first `count` pages of the caller's free list; not removed yet: `commit_pages` does that once every
    check has passed. The whole list is checked, not only the pages taken now: integers in [0, num_pages),
    each once, none held by another sequence (`used`: page -> its holder) - a page listed twice would otherwise
    go to two sequences by two imports. None: no list, []."""
    if free_pages is None:
        return []
    if not isinstance(free_pages, MutableSequence):
        raise TypeError(f"{name}: expected a list of {meaning} (import removes the ones it takes from its front), "
                        f"got {type(free_pages).__name__}")
    for p in free_pages:
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)):
            raise TypeError(f"{name}: expected integer {meaning}, got {p!r}")
    pages = [int(p) for p in free_pages]
    check_index(name, np.asarray(pages, np.int64), 0, num_pages, meaning)
    if len(set(pages)) != len(pages):
        twice = next(p for i, p in enumerate(pages) if p in pages[:i])
        raise ValueError(f"{name}: expected distinct {meaning}, got {twice} twice")
    held = [p for p in pages if p in (used or {})]
    if held:
        raise ValueError(f"{name}: expected {meaning} no other sequence holds, got {held[0]} ({used[held[0]]} "
                         f"holds it)")
    if len(pages) < count:
        raise ValueError(f"{name}: expected at least {count} free pages for this sequence, got {len(pages)}")
    return pages[:count]


def commit_pages(free_pages, count: int) -> None:
    if free_pages is not None and count:
        del free_pages[:count]


def check_own(name: str, pages, used: dict, meaning: str = "page numbers") -> None:
    """The pages one sequence writes are distinct and held by no other sequence (`used`: page -> its holder):
    two tokens in one slot, or a slot another sequence reads, would silently lose a token."""
    pages = [int(p) for p in np.asarray(pages).reshape(-1)]
    seen = set()
    for p in pages:
        if p in seen:
            raise ValueError(f"{name}: expected distinct {meaning} for this sequence, got {p} twice")
        seen.add(p)
        if p in used:
            raise ValueError(f"{name}: expected {meaning} no other sequence holds, got {p} ({used[p]} holds it)")


def check_index(name: str, index: np.ndarray, low: int, high: int, meaning: str) -> None:
    """Every index in [low, high): a converter never follows a table entry outside its cache."""
    if index.size and (index.min() < low or index.max() >= high):
        bad = index[(index < low) | (index >= high)][0]
        raise ValueError(f"{name}: expected {meaning} in [{low}, {high}), got {int(bad)}")


def check_sequence(name: str, sequence, count: int) -> int:
    if isinstance(sequence, (bool, np.bool_)) or not isinstance(sequence, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(sequence).__name__} {sequence!r}")
    if not 0 <= sequence < count:
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


def check_writable(name: str, x) -> None:
    """An array import writes: a read-only NumPy array (a broadcast view, a frozen buffer) would fail midway."""
    if isinstance(x, np.ndarray) and not x.flags["WRITEABLE"]:
        raise ValueError(f"{name}: expected a writable array, got a read-only one")


def table(name: str, x, *, ndim: int | None = None, written: bool = False) -> np.ndarray:
    """A host copy of an integer table or length argument (NumPy, GPU array, or a list where import only reads
    it), checked: integers, `ndim` dimensions. written: import writes it, so it must be a writable integer
    NumPy or GPU array."""
    if written:
        if not _is_array(x):
            raise TypeError(f"{name}: expected a NumPy or GPU integer array (import writes it), got "
                            f"{type(x).__name__}")
        check_writable(name, x)
    if x is None or isinstance(x, (str, bytes, dict, set)):
        raise TypeError(f"{name}: expected an integer array, got {type(x).__name__}")
    try:
        t = host(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: expected an integer array, got {type(x).__name__}") from e
    if t.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension{'s' if ndim != 1 else ''}, got shape {t.shape}")
    return t


def lengths(name: str, x, count: int, high: int | None = None, meaning: str = "") -> np.ndarray:
    """A per-sequence length vector (count,) of integers in [0, high]."""
    t = table(name, x)
    if t.shape != (count,):
        raise ValueError(f"{name}: expected one length per sequence, shape ({count},){meaning}, got {t.shape}")
    bad = (t < 0) | (t > high) if high is not None else t < 0
    if bad.any():
        span = f"in [0, {high}]" if high is not None else ">= 0"
        raise ValueError(f"{name}: expected lengths {span}, got {int(t[bad][0])}")
    return t.astype(np.int64)


def positive_scalar(name: str, x, default=None) -> np.float32:
    """One positive finite float (a Python float, a NumPy scalar or a one-element array); None: `default`."""
    if x is None and default is not None:
        x = default
    if x is None or isinstance(x, (str, bytes, bool, np.bool_)):
        raise TypeError(f"{name}: expected one positive float, got {x!r}")
    try:
        value = np.asarray(arrays.to_host(x), np.float32).reshape(-1)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: expected one positive float, got {type(x).__name__}") from e
    if value.size != 1 or not np.isfinite(value[0]) or value[0] <= 0:
        raise ValueError(f"{name}: expected one positive finite float, got {x!r}")
    return np.float32(value[0])


def check_choice_str(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    """A flag: Python or NumPy bool, or 0 / 1."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")


def check_rotated(name: str, value) -> bool | None:
    """True, False or None (RoPE does not apply)."""
    return None if value is None else check_bool(name, value)


def check_kv_fits(kv: KV, heads: int, head_dim: int, where: str, v_head_dim: int | None = None) -> None:
    """kv has the destination's heads and head_dim, keys and values alike (values: v_head_dim if it differs)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    got = (kv.num_kv_heads, kv.head_dim, int(kv.value.shape[2]))
    if got != (heads, head_dim, v_head_dim):
        raise ValueError(f"kv: expected {heads} heads, head_dim {head_dim} (keys) and {v_head_dim} (values) for "
                         f"{where}, got {got[0]} heads, {got[1]} and {got[2]}")


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


def copies_codes(kv: KV, kind, dtype, scale_dtype=None, scale=(None, None), quant_group: int = 0) -> bool:
    """Whether a destination of this rule takes kv's codes as they are: the same kind and stored dtype, and the
    same scales (group kinds: the same quant_group and scale dtype; per-tensor kinds: the same two floats)."""
    q = kv.quant
    if q is None or q.kind != kind or storage_dtype(q.key_codes.dtype) != storage_dtype(dtype):
        return False
    if kind in GROUP_KINDS:
        return q.quant_group == quant_group and np.dtype(q.key_scale.dtype) == np.dtype(scale_dtype)
    return np.float32(q.key_scale) == np.float32(scale[0]) and np.float32(q.value_scale) == np.float32(scale[1])


def codes_for(kv: KV, kind, *, dtype, scale=(None, None), inverse_scale=(None, None), scale_dtype=None,
              quant_group: int = 0):
    """(k_codes, v_codes, k_scales, v_scales) a destination stores for kv: the source's own codes when the rule
    and scales are the same (lossless), else the values encoded by the destination's rule."""
    q = kv.quant
    if kind is not None and copies_codes(kv, kind, dtype, scale_dtype, scale, quant_group):
        group = kind in GROUP_KINDS
        return q.key_codes, q.value_codes, (q.key_scale if group else None), (q.value_scale if group else None)
    kc, ks = encode(kind, kv.key, dtype=dtype, scale=scale[0], inverse_scale=inverse_scale[0],
                    scale_dtype=scale_dtype, quant_group=quant_group)
    vc, vs = encode(kind, kv.value, dtype=dtype, scale=scale[1], inverse_scale=inverse_scale[1],
                    scale_dtype=scale_dtype, quant_group=quant_group)
    return kc, vc, ks, vs


def check_finite(kv: KV, kind) -> None:
    """Values a destination quantizes are finite: a NaN or an infinity has no code (an int8 cast of NaN is
    undefined, and one infinity in a group makes its scale infinite). A float destination casts them as they are."""
    for field_name in ("key", "value"):
        x = getattr(kv, field_name)
        if isinstance(x, np.ndarray):
            finite = np.isfinite(x)
        else:
            import cupy
            finite = cupy.isfinite(cupy.asarray(x)).get()
        if not finite.all():
            at = tuple(int(i) for i in np.argwhere(~finite)[0])
            raise ValueError(f"kv.{field_name}: expected finite values to quantize ({kind}), got "
                             f"{float(np.asarray(arrays.to_host(x))[at])} at (head, token, element) {at}")


def prepare_pair(kv: KV, kind, k_site: Site, v_site: Site, scale_sites=None, *, scale=(None, None),
                 inverse_scale=(None, None), quant_group: int = 0):
    """Everything import needs before it writes: returns write(), which stores kv at the two sites (the
    destination's codes, and group scales at scale_sites). The NumPy path encodes now; the kernels encode as
    they write (after every check has passed either way)."""
    dtype = k_site.array.dtype
    scale_dtype = None if scale_sites is None else scale_sites[0].array.dtype
    if kind is not None and not copies_codes(kv, kind, dtype, scale_dtype, scale, quant_group):
        check_finite(kv, kind)
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
    copy = kind is not None and copies_codes(kv, kind, dtype, None if scale_sites is None else
                                             scale_sites[0].array.dtype, scale, quant_group)
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
    if not isinstance(name, str):
        raise TypeError(f"backend: expected one of {arrays.BACKENDS}, got {type(name).__name__}")
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
