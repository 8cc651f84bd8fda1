"""Move one sequence's KV cache between the formats of OpenPPL, TensorRT-LLM, ONNX, FasterTransformer, vLLM,
FlashInfer and transformers, through one canonical form (`KV`).

    kv = convert.export("ppl", cache, scale, kvstarts=..., cachestarts=..., sequence=0, layer_idx=1, ...)
    convert.import_("trtllm", kv, kv_cache_pool=pool, kv_cache_block_offsets=offsets, sequence=0, ...)
    convert.convert(convert.Cache("ppl", cache=..., ...), convert.Cache("vllm", key_cache=..., ...),
                    sequence=0, layer_idx=1, free_pages=free)

Arguments keep each system's own names (`cachestarts`, `kv_cache_block_offsets`, `block_tables`, `kv_indptr`,
`past_key`, ...). Import writes only the slots of the sequence and layer it is given (and, with `free_pages`,
that sequence's row of the page table); every check runs before the first write. Lossless where the destination
holds the source exactly (a float of at least the source's precision; the same quantization rule and scales:
the codes are copied); otherwise the destination's own rule requantizes, within `error_bound`.

Formats (module: what it stores):
  ppl         OpenPPL dynamic cache, cache_layout 0-3, cache_mode 0/1, int8/int4 group scales (post-RoPE keys)
  trtllm      TensorRT-LLM contiguous past_key_value or paged pool, INT8/FP8, cyclic window and sinks
              (post-RoPE keys; StreamingLLM: un-rotated)
  onnx        ONNX Attention past_key / past_value (post-RoPE keys)
  ft          FasterTransformer cross cache, K split by x = 16 bytes (encoder keys: no RoPE)
  vllm        vLLM classic paged_attention or V1 flash layout, fp8 with k_scale / v_scale (post-RoPE keys)
  flashinfer  FlashInfer NHD / HND pages, CSR page table, fp8 with k_scale / v_scale (post-RoPE keys)
  hf          transformers DynamicCache layers (post-RoPE keys; imports torch when used)
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np

from . import _core
from ._core import KV, Quant, Rope, step_bound

FORMATS = ("ppl", "trtllm", "onnx", "ft", "vllm", "flashinfer", "hf")


def _module(format: str):
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")
    return importlib.import_module(f"{__name__}.{format}")


def _call(function, arguments: dict, **extra):
    """function(**arguments, **extra) with only the parameters it takes (a Cache holds both directions')."""
    params = inspect.signature(function).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return function(**arguments, **extra)
    return function(**{k: v for k, v in {**arguments, **extra}.items() if k in params})


class Cache:
    """A cache in one format with the arguments that locate its sequences: Cache("vllm", key_cache=...,
    value_cache=..., block_tables=..., seq_lens=...). Positional names follow the format's export."""

    def __init__(self, format: str, **arguments):
        self.module = _module(format)
        self.format = format
        self.arguments = arguments

    def __repr__(self) -> str:
        return f"Cache({self.format!r}, {', '.join(self.arguments)})"


def _layer_arguments(module, format, kwargs: dict) -> dict:
    """Formats whose tensors hold one layer (ONNX, vLLM, FlashInfer) take no layer_idx: 0 is dropped, another
    value is refused (pass that layer's tensors)."""
    if "layer_idx" in kwargs and "layer_idx" not in inspect.signature(module.export).parameters:
        layer_idx = kwargs.pop("layer_idx")
        if layer_idx != 0:
            raise ValueError(f"layer_idx: the {format} format's tensors hold one layer; pass that layer's tensors "
                             f"with layer_idx 0, got {layer_idx}")
    return kwargs


def export(format: str, *args, sequence: int, backend: str = "auto", **kwargs) -> KV:
    """One sequence (and layer, where the format holds several) of a cache in `format`, as a KV. backend:
    "auto" (the gather kernel for GPU caches, NumPy for NumPy ones), "reference" or "numba"."""
    module = _module(format)
    with _core.backend(backend):
        return module.export(*args, sequence=sequence, **_layer_arguments(module, format, kwargs))


def import_(format: str, kv: KV, *args, sequence: int, backend: str = "auto", **kwargs) -> dict:
    """Write kv into the caller's cache in `format` as sequence `sequence`; returns what the caller's length
    bookkeeping needs (the format's own names: sequence_length, seq_lens, nonpad_kv_seqlen, ...) and the pages
    taken from free_pages. Keys are written as kv holds them (`convert` adds or removes RoPE)."""
    if not isinstance(kv, KV):
        raise TypeError(f"kv: expected a cacheattn.convert.KV, got {type(kv).__name__}")
    module = _module(format)
    with _core.backend(backend):
        return module.import_(kv, *args, sequence=sequence, **_layer_arguments(module, format, kwargs))


def match_rope(kv: KV, rotated: bool | None, rope: Rope | None) -> KV:
    """kv with keys rotated (or rotated back) at their positions when the destination stores `rotated` keys and
    kv does not; rope (a `Rope`) says how. Rotation changes the values, so the result carries no codes."""
    if rotated is None or kv.rotated is None or rotated == kv.rotated:
        return kv
    if rope is None:
        raise ValueError(f"rope: required to {'add' if rotated else 'remove'} RoPE on the keys (the source stores "
                         f"{'un-' if not kv.rotated else ''}rotated keys, the destination the other), got None")
    key = rope.rotate(np.asarray(_core.arrays.to_host(kv.key), np.float32), kv.positions, undo=not rotated)
    return KV(key, kv.value, kv.positions, rotated, None)


def convert(src: Cache, dst: Cache, *, sequence: int, layer_idx: int = 0, dst_sequence: int | None = None,
            dst_layer_idx: int | None = None, rope: Rope | None = None, free_pages=None,
            backend: str = "auto") -> tuple[KV, dict]:
    """Export `sequence` / `layer_idx` of src and import it into dst (as `dst_sequence` / `dst_layer_idx`,
    the same by default), adding or removing RoPE with `rope` where the two disagree (StreamingLLM's
    un-rotated keys are rotated at their true positions). The layer indices apply to the formats whose tensors
    hold several layers (OpenPPL, TensorRT-LLM's pool, FasterTransformer's buffer, transformers); a one-layer
    side (ONNX, vLLM, FlashInfer, a contiguous TensorRT-LLM cache) is given that layer's tensors.
    Returns (the exported KV, import's result).
    backend as for export: GPU caches move through one gather and one scatter kernel per K and V."""
    with _core.backend(backend):
        return _convert(src, dst, sequence, layer_idx, dst_sequence, dst_layer_idx, rope, free_pages)


def _convert(src, dst, sequence, layer_idx, dst_sequence, dst_layer_idx, rope, free_pages):
    dst_layer_idx = layer_idx if dst_layer_idx is None else dst_layer_idx
    kv = _call(src.module.export, src.arguments, sequence=sequence, layer_idx=layer_idx)
    wanted = _call(dst.module.stores_rotated, dst.arguments)
    moved = match_rope(kv, wanted, rope)
    extra = dict(sequence=sequence if dst_sequence is None else dst_sequence, layer_idx=dst_layer_idx)
    if free_pages is not None:
        extra["free_pages"] = free_pages
    return kv, _call(dst.module.import_, dst.arguments, kv=moved, **extra)


def error_bound(dst: Cache, kv: KV) -> tuple[np.ndarray, np.ndarray]:
    """Per-element bounds (key, value), each (num_kv_heads, tokens, head_dim), on |value dst holds after
    importing kv - kv's value|: zero where dst holds kv exactly (same rule and scales, or a wider float),
    else half of dst's quantization step at that value (see `_core.step_bound`)."""
    r = _call(dst.module.rule, dst.arguments)
    q = kv.quant
    if q is not None and q.kind == r["kind"]:
        if q.kind.endswith("group"):                 # r["dtype"]: the scale tensor's dtype
            same_scales = q.quant_group == r.get("quant_group") and np.dtype(q.key_scale.dtype) == r["dtype"]
        else:
            same_scales = (np.dtype(q.key_codes.dtype) == r["dtype"] and np.float32(q.key_scale) == r["scale"][0]
                           and np.float32(q.value_scale) == r["scale"][1])
        if same_scales:
            return np.zeros(kv.key.shape), np.zeros(kv.value.shape)
    scales = r.get("scale", (None, None))
    pairs = ((kv.key, scales[0]), (kv.value, scales[1]))
    return tuple(step_bound(r["kind"], _core.arrays.to_host(x), dtype=r["dtype"], scale=s,
                            quant_group=r.get("quant_group", 0)) for x, s in pairs)


__all__ = ["FORMATS", "KV", "Quant", "Rope", "Cache", "export", "import_", "convert", "match_rope", "error_bound"]
