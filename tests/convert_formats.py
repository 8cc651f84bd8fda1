"""Destination caches of every cacheattn.convert format for the property tests, each filled with random bytes
before a conversion writes one sequence, and each with its own NumPy-indexing reader (`native`) written from the
format's documented shape, independent of the converter's element sites: the tests read a converted sequence
back through it and mark the bytes the sequence owns with it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import numpy as np

from cacheattn import convert
from reference import trtllm_gpt_attention as trt

BATCH, SEQUENCE, CAPACITY = 3, 1, 16          # three sequences, the tests convert the middle one; 16 slots each


def torch_available() -> bool:
    """torch and transformers are installed (looked up, not imported: collecting the tests stays fast)."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


# Every variant a test may draw: (format, options).
VARIANTS = (
    [("ppl", dict(cache_layout=lay, quant_bit=qb, cache_mode=mode, dtype=dt))
     for lay in range(4) for qb in (0, 8, 4) for mode in (0, 1) for dt in ("float32", "float16")]
    + [("trtllm", dict(paged=p, quant=q, window=w, sinks=s, streamingllm=st, dtype=dt))
       for p in (False, True) for q in (0, 64, 128) for (w, s) in ((64, 0), (8, 0), (8, 2)) for st in (False, True)
       for dt in ("float32", "float16") if not (st and w == 64)]
    + [("onnx", dict(dtype=dt)) for dt in ("float32", "float16")]
    + [("ft", dict(batch_major=bm, layered=ly, dtype=dt)) for bm in (True, False) for ly in (False, True)
       for dt in ("float32", "float16")]
    + [("vllm", dict(layout=lay, cache_dtype=cd, dtype=dt)) for lay in ("classic", "NHD", "HND")
       for cd in ("auto", "fp8", "fp8_e5m2") for dt in ("float32", "float16")]
    + [("flashinfer", dict(kv_layout=lay, split=sp, cache_dtype=cd)) for lay in ("NHD", "HND") for sp in (False, True)
       for cd in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")]
    + [("hf", dict(dtype=dt)) for dt in ("float32", "float16", "bfloat16")]
)


def _random_bytes(rng, shape, dtype):
    dtype = np.dtype(dtype)
    return rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def _np_dtype(name):
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, name, None) or name)


@dataclass
class Layout:
    """One destination (or source) cache of a format, its page tables and how to read one sequence natively."""
    format: str
    options: dict
    arrays: dict                         # name -> the caller's arrays (tables included)
    args: dict                           # Cache arguments for import
    free_pages: list | None
    layer_idx: int = 0
    info: dict = field(default_factory=dict)

    def cache(self) -> convert.Cache:
        return convert.Cache(self.format, **self.args)

    def export_cache(self, tokens: int, positions: np.ndarray) -> convert.Cache:
        """The Cache with the length bookkeeping a caller keeps after writing `tokens` tokens (last position
        + 1 for TensorRT-LLM)."""
        a = dict(self.args)
        lengths = np.zeros(BATCH, np.int64)
        lengths[SEQUENCE] = tokens
        if self.format == "ppl":
            a["kvstarts"] = np.concatenate([[0], np.cumsum(lengths)])
        elif self.format == "trtllm":
            lengths[SEQUENCE] = int(positions.max()) + 1 if tokens else 0
            a["sequence_length"] = lengths
        elif self.format == "onnx":
            a["nonpad_kv_seqlen"] = lengths
        elif self.format == "ft":
            a["encoder_sequence_length"] = lengths
        elif self.format == "vllm":
            a["seq_lens"] = lengths
        elif self.format == "hf":
            a["seq_len"] = tokens
        return convert.Cache(self.format, **a)

    def byte_arrays(self) -> dict:
        """name -> array whose bytes a conversion may change only inside the sequence's slots."""
        if self.format == "hf":
            layer = self.args["past_key_values"].layers[0]
            return {"keys": layer.keys, "values": layer.values}
        return {n: a for n, a in self.arrays.items() if n not in TABLES and a is not None}


TABLES = ("cachestarts", "kv_cache_block_offsets", "block_tables", "kv_indptr", "kv_indices", "kv_last_page_len")


def build(format: str, options: dict, *, heads: int, head_dim: int, tokens: int, rng, scales=(1.0, 1.0)) -> Layout:
    """A random-filled cache of `format` able to take `tokens` tokens as sequence SEQUENCE; per-tensor quantized
    caches use `scales` (K, V)."""
    return _BUILDERS[format](options, heads, head_dim, tokens, rng, scales)


def _free_list(rng, count, taken):
    free = [p for p in range(count) if p not in taken]
    rng.shuffle(free)
    return free


def _ppl(o, H, D, T, rng, scales):
    from reference.cache_layout import DYNAMIC_LAYOUTS
    axes = DYNAMIC_LAYOUTS[o["cache_layout"]].split()
    qb, ps, L, group = o["quant_bit"], 4, 2, 4
    max_t = BATCH * CAPACITY
    ext = dict(T=max_t, L=L, KV=2, H=H, D=D // 2 if qb == 4 else D)
    cache = _random_bytes(rng, [ext[n] for n in axes], np.int8 if qb else o["dtype"])
    scale = (rng.uniform(0.5, 2, [ext[n] if n != "D" else D // group for n in axes]).astype(o["dtype"])
             if qb else None)
    free = None
    if o["cache_mode"] == 0:
        cachestarts = np.arange(BATCH, dtype=np.int64) * CAPACITY
    else:
        pages = rng.permutation(max_t // ps)
        cachestarts = (pages[:BATCH * 4].reshape(BATCH, 4) * ps).astype(np.int64)
        free = _free_list(rng, max_t // ps, set(pages[:BATCH * 4].tolist()) - set(cachestarts[SEQUENCE] // ps))
    arrays = dict(cache=cache, scale=scale, cachestarts=cachestarts)
    args = dict(arrays, num_layer=L, quant_bit=qb, quant_group=group, cache_mode=o["cache_mode"],
                cache_layout=o["cache_layout"], page_size=ps)
    return Layout("ppl", o, arrays, args, free, layer_idx=1)


def _trtllm(o, H, D, T, rng, scales):
    dtype = {0: o["dtype"], 64: np.int8, 128: trt.fp8_e4m3()}[o["quant"]]
    args = dict(host_max_attention_window_sizes=np.array([o["window"]], np.int32),
                host_sink_token_length=np.array([o["sinks"]], np.int32), streamingllm=o["streamingllm"],
                kv_cache_quant_mode=o["quant"], paged_kv_cache=o["paged"], tokens_per_block=4)
    if o["quant"]:
        args["kv_quant_orig_scale"] = np.array([scales[0]], np.float32)       # one scale for K and V
    free = None
    if o["paged"]:
        blocks, L = 24, 2
        pool = _random_bytes(rng, (blocks, L, 2, H, 4, D), dtype)
        taken = rng.permutation(blocks)[:BATCH * 6].reshape(BATCH, 6)
        offsets = np.stack([taken * L * 2, taken * L * 2 + 1], axis=1)[None].astype(np.int32)  # (1, B, 2, 6)
        free = _free_list(rng, blocks, set(taken.ravel().tolist()) - set(taken[SEQUENCE].tolist()))
        arrays = dict(kv_cache_pool=pool, kv_cache_block_offsets=offsets)
        layer = 1
    else:
        arrays = dict(past_key_value=_random_bytes(rng, (BATCH, 2, H, 24, D), dtype))
        layer = 0
    return Layout("trtllm", o, arrays, {**args, **arrays}, free, layer_idx=layer)


def _onnx(o, H, D, T, rng, scales):
    arrays = dict(past_key=_random_bytes(rng, (BATCH, H, CAPACITY, D), o["dtype"]),
                  past_value=_random_bytes(rng, (BATCH, H, CAPACITY, D), o["dtype"]))
    return Layout("onnx", o, arrays, dict(arrays), None)


def _ft(o, H, D, T, rng, scales):
    x = 16 // np.dtype(o["dtype"]).itemsize
    lead = (2,) if o["layered"] else ()
    if o["batch_major"]:
        k, v = lead + (BATCH, H, D // x, CAPACITY, x), lead + (BATCH, H, CAPACITY, D)
    else:
        k = v = lead + (BATCH, CAPACITY, H, D)
    arrays = dict(key_cache=_random_bytes(rng, k, o["dtype"]), value_cache=_random_bytes(rng, v, o["dtype"]))
    return Layout("ft", o, arrays, dict(arrays, is_batch_major_cache=o["batch_major"]), None,
                  layer_idx=1 if o["layered"] else 0)


def _vllm(o, H, D, T, rng, scales):
    fp8 = o["cache_dtype"] != "auto"
    num_blocks, bs = 20, 4
    taken = rng.permutation(num_blocks)[:BATCH * 4].reshape(BATCH, 4).astype(np.int32)
    free = _free_list(rng, num_blocks, set(taken.ravel().tolist()) - set(taken[SEQUENCE].tolist()))
    args = dict(block_tables=taken, kv_cache_dtype=o["cache_dtype"])
    if fp8:
        args.update(k_scale=scales[0], v_scale=scales[1])
    if o["layout"] == "classic":
        dtype = np.uint8 if fp8 else o["dtype"]                  # vLLM holds fp8 bytes as uint8 here
        x = 16 // np.dtype(dtype).itemsize
        arrays = dict(key_cache=_random_bytes(rng, (num_blocks, H, D // x, bs, x), dtype),
                      value_cache=_random_bytes(rng, (num_blocks, H, D, bs), dtype))
    else:
        dtype = convert._core.fp8_dtype("fp8_e4m3" if o["cache_dtype"] == "fp8" else "fp8_e5m2") if fp8 else o["dtype"]
        shape = (2, num_blocks, bs, H, D) if o["layout"] == "NHD" else (2, num_blocks, H, bs, D)
        arrays = dict(kv_cache=_random_bytes(rng, shape, dtype))
        args["kv_cache_layout"] = o["layout"]
    arrays["block_tables"] = taken
    return Layout("vllm", o, arrays, {**args, **arrays}, free)


def _flashinfer(o, H, D, T, rng, scales):
    ps, max_pages = 4, 20
    dtype = _np_dtype(o["cache_dtype"])
    inner = (ps, H, D) if o["kv_layout"] == "NHD" else (H, ps, D)
    need = -(-T // ps)
    counts = np.array([3, need, 2])
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    indices = rng.permutation(max_pages)[:indptr[-1]].astype(np.int32)
    free = _free_list(rng, max_pages, set(indices.tolist()) - set(indices[indptr[1]:indptr[2]].tolist()))
    last = np.array([2, 1, 4], np.int32)
    if o["split"]:
        arrays = dict(k_cache=_random_bytes(rng, (max_pages, *inner), dtype),
                      v_cache=_random_bytes(rng, (max_pages, *inner), dtype))
        cache = (arrays["k_cache"], arrays["v_cache"])
    else:
        arrays = dict(paged_kv_cache=_random_bytes(rng, (max_pages, 2, *inner), dtype))
        cache = arrays["paged_kv_cache"]
    tables = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)
    args = dict(paged_kv_cache=cache, kv_layout=o["kv_layout"], **tables)
    if dtype.itemsize == 1:
        args.update(k_scale=scales[0], v_scale=scales[1])
    return Layout("flashinfer", o, {**arrays, **tables}, args, free)


def _hf(o, H, D, T, rng, scales):
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    dt = getattr(torch, o["dtype"])
    noise = [torch.from_numpy(rng.standard_normal((BATCH, H, CAPACITY, D)).astype(np.float32)).to(dt)
             for _ in range(2)]
    cache.update(noise[0], noise[1], 0)
    return Layout("hf", o, {}, dict(past_key_values=cache), None)


_BUILDERS = dict(ppl=_ppl, trtllm=_trtllm, onnx=_onnx, ft=_ft, vllm=_vllm, flashinfer=_flashinfer, hf=_hf)


# Per-tensor scales that keep random N(0, 2) values inside each code's range (no saturation).
HEADROOM = {"int8": 100.0, "fp8_e4m3": 300.0, "fp8_e5m2": 20000.0}


def random_kv(rng, heads, head_dim, tokens) -> convert.KV:
    return convert.KV((2 * rng.standard_normal((heads, tokens, head_dim))).astype(np.float32),
                      (2 * rng.standard_normal((heads, tokens, head_dim))).astype(np.float32), np.arange(tokens))


def per_tensor_kind(variant):
    fmt, o = variant
    if fmt == "trtllm":
        return {64: "int8", 128: "fp8_e4m3"}.get(o["quant"])
    if fmt == "vllm":
        return {"fp8": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}.get(o["cache_dtype"])
    if fmt == "flashinfer":
        return {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}.get(o["cache_dtype"])
    return None


def make(variant, shape, kv: convert.KV, rng, tokens):
    """A random-filled layout of `variant` with scales that fit kv (TensorRT-LLM: one scale for K and V)."""
    kind = per_tensor_kind(variant)
    scales = (1.0, 1.0)
    if kind:
        k, v = float(np.abs(kv.key).max()) / HEADROOM[kind], float(np.abs(kv.value).max()) / HEADROOM[kind]
        scales = (max(k, v), max(k, v)) if variant[0] == "trtllm" else (k, v)
    return build(variant[0], variant[1], heads=shape["heads"], head_dim=shape["head_dim"], tokens=tokens, rng=rng,
                 scales=scales)


def stored(kv: convert.KV):
    """What the destination holds, as the format stores it: codes (and group scales) or float values."""
    if kv.quant is None:
        return [kv.key, kv.value]
    q = kv.quant
    out = [q.key_codes, q.value_codes]
    if q.kind.endswith("group"):
        out += [q.key_scale, q.value_scale]
    return out


def free_pages(layout):
    """import_'s free_pages argument for a layout whose page table takes fresh pages."""
    return {"free_pages": layout.free_pages} if layout.free_pages is not None else {}


# ---------------------------------------------------------------------------------------------- native readers

def native(layout: Layout, positions: np.ndarray, tokens: int) -> list:
    """[(array name, view function, index, to_htd)] for K and V (and OpenPPL's scales): view(arr)[index] are the
    sequence's stored elements, to_htd turns them into (heads, tokens, stored head_dim). Written from each
    format's documented shape with plain NumPy indexing."""
    f, o, a, b = layout.format, layout.options, layout.arrays, SEQUENCE
    p = np.arange(tokens)
    ident = lambda x: x                                                          # noqa: E731
    t_first = lambda x: x.transpose(1, 0, 2)                                     # (T, H, D) -> (H, T, D)
    if f == "ppl":
        from reference.cache_layout import DYNAMIC_LAYOUTS
        axes = DYNAMIC_LAYOUTS[o["cache_layout"]].split()
        cs, ps = a["cachestarts"], 4
        slots = cs[b] + p if o["cache_mode"] == 0 else cs[b, p // ps] + p % ps
        # The scalar layer and K/V indices with the slots array put the slots first: (T, H, D) in every layout.
        return [(name, ident, tuple({"T": slots, "L": 1, "KV": kv}.get(n, slice(None)) for n in axes), t_first)
                for name in (("cache", "scale") if o["quant_bit"] else ("cache",)) for kv in (0, 1)]
    if f == "trtllm":
        W, S = o["window"], o["sinks"]
        bubble = trt.paged_bubble(S, 4) if o["paged"] else 0
        slots = np.where(positions < S, positions, S + bubble + (positions - S) % (W - S))
        if not o["paged"]:
            return [("past_key_value", ident, (b, kv, slice(None), slots), t_first) for kv in (0, 1)]
        offsets = a["kv_cache_block_offsets"]
        L = a["kv_cache_pool"].shape[1]
        blocks = lambda pool: pool.reshape(-1, *pool.shape[3:])                 # noqa: E731
        return [("kv_cache_pool", blocks, (offsets[0, b, kv, slots // 4] + 2 * (L - 1), slice(None), slots % 4),
                 t_first) for kv in (0, 1)]
    if f == "onnx":
        return [(n, ident, (b, slice(None), p), t_first) for n in ("past_key", "past_value")]
    if f == "ft":
        lead = (1,) if o["layered"] else ()
        if o["batch_major"]:
            def k_htd(x):                                                       # (H, Dh/x, T, x)
                return x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)
            return [("key_cache", ident, lead + (b, slice(None), slice(None), slice(0, tokens)), k_htd),
                    ("value_cache", ident, lead + (b, slice(None), slice(0, tokens)), ident)]
        return [(n, ident, lead + (b, slice(0, tokens)), t_first) for n in ("key_cache", "value_cache")]
    if f == "vllm":
        table = a["block_tables"]
        blocks, rows = table[b, p // 4], p % 4
        if o["layout"] == "classic":
            def k_htd(x):                                                       # (T, H, D/x, x)
                return x.reshape(*x.shape[:2], -1).transpose(1, 0, 2)
            return [("key_cache", ident, (blocks, slice(None), slice(None), rows, slice(None)), k_htd),
                    ("value_cache", ident, (blocks, slice(None), slice(None), rows), t_first)]
        if o["layout"] == "NHD":
            return [("kv_cache", ident, (kv, blocks, rows), t_first) for kv in (0, 1)]
        return [("kv_cache", ident, (kv, blocks, slice(None), rows), t_first) for kv in (0, 1)]
    if f == "flashinfer":
        indptr, indices = a["kv_indptr"], a["kv_indices"]
        pages, rows = indices[indptr[b] + p // 4], p % 4
        if o["split"]:
            idx = (pages, rows) if o["kv_layout"] == "NHD" else (pages, slice(None), rows)
            return [(n, ident, idx, t_first) for n in ("k_cache", "v_cache")]
        return [("paged_kv_cache", ident, (pages, kv, rows) if o["kv_layout"] == "NHD" else
                 (pages, kv, slice(None), rows), t_first) for kv in (0, 1)]
    if f == "hf":
        return [(n, ident, (b, slice(None), p), t_first) for n in ("keys", "values")]
    raise AssertionError(f)


def read_native(layout: Layout, positions: np.ndarray, tokens: int) -> list:
    """The sequence's stored elements per native() entry, (heads, tokens, stored head_dim) each."""
    arrays = layout.byte_arrays()
    out = []
    for name, view, idx, to_htd in native(layout, positions, tokens):
        arr = arrays[name]
        if layout.format == "hf":
            import torch
            arr = arr.float() if arr.dtype == torch.bfloat16 else arr
            arr = arr.numpy()
        out.append(to_htd(view(arr)[idx]))
    return out


def owned_mask(layout: Layout, name: str, positions: np.ndarray, tokens: int) -> np.ndarray:
    """Bytes of array `name` that the sequence's elements occupy."""
    arr = layout.byte_arrays()[name]
    itemsize = arr.element_size() if layout.format == "hf" else np.dtype(arr.dtype).itemsize
    mask = np.zeros(tuple(arr.shape), bool)
    for n, view, idx, _ in native(layout, positions, tokens):
        if n == name:
            view(mask)[idx] = True
    return np.repeat(mask.reshape(-1), itemsize)


def as_bytes(x) -> np.ndarray:
    """A copy of an array's (or a CPU torch tensor's) bytes."""
    if not isinstance(x, np.ndarray):
        import torch
        return x.detach().contiguous().view(torch.uint8).numpy().reshape(-1).copy()
    return x.reshape(-1).view(np.uint8).copy()
