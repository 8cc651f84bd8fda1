"""Move one sequence's KV cache between the formats of OpenPPL, TensorRT-LLM, ONNX, FasterTransformer, vLLM,
FlashInfer and transformers, through one canonical form (`KV`).

    kv = convert.export("ppl", cache, scale, kvstarts=..., cachestarts=..., sequence=0, layer_idx=1, ...)
    convert.import_("trtllm", kv, kv_cache_pool=pool, kv_cache_block_offsets=offsets, sequence=0, ...)
    convert.convert(convert.Cache("ppl", cache=..., ...), convert.Cache("vllm", key_cache=..., ...),
                    sequence=0, layer_idx=1, free_pages=free)

Arguments keep each system's own names (`cachestarts`, `kv_cache_block_offsets`, `block_tables`, `kv_indptr`,
`past_key`, ...); `help(convert.export)` and `help(convert.import_)` list each format's. Import writes only the
slots of the sequence and layer it is given (and, with `free_pages`, that sequence's row of the page table);
every check (the `KV` included) runs before the first write. Lossless where the destination holds the source
exactly (a float of at least the source's precision; the same quantization rule and scales: the codes are
copied); otherwise the destination's own rule requantizes, within `error_bound`.

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

import contextlib
import importlib
import inspect

import numpy as np

from .._validate import check_int
from . import _core
from ._core import KV, Quant, Rope, step_bound

FORMATS = ("ppl", "trtllm", "onnx", "ft", "vllm", "flashinfer", "hf")
# Arguments convert passes itself, never taken from a Cache.
_CALL_ARGUMENTS = ("kv", "sequence", "layer_idx", "free_pages", "backend")


def _module(format: str):
    if not isinstance(format, str):
        raise TypeError(f"format: expected one of {FORMATS}, got {type(format).__name__}")
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")
    return importlib.import_module(f"{__name__}.{format}")


def _parameters(function) -> list:
    return [n for n, p in inspect.signature(function).parameters.items() if p.kind != p.VAR_KEYWORD]


def _call(function, arguments: dict, **extra):
    """function(**arguments, **extra) with only the parameters it takes (a Cache holds both directions')."""
    params = inspect.signature(function).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return function(**arguments, **extra)
    return function(**{k: v for k, v in {**arguments, **extra}.items() if k in params})


class Cache:
    """A cache in one format with the arguments that locate its sequences, for `convert` and `error_bound`.

    `Cache("vllm", key_cache=..., value_cache=..., block_tables=..., seq_lens=...)`: the arguments are the
    format's own, by name, as `export` and `import_` list them (a Cache holds both directions': a source needs
    export's, a destination import_'s, and each call takes the ones it uses). `sequence`, `layer_idx` and
    `free_pages` are `convert`'s arguments, not a Cache's.

    Parameters
    ----------
    format : str
        One of "ppl", "trtllm", "onnx", "ft", "vllm", "flashinfer", "hf".
    **arguments
        The format's arrays, tables and attributes (see `export` and `import_`).

    Raises
    ------
    TypeError
        An argument the format does not take (a misspelt name would otherwise be ignored), or one of
        `sequence`, `layer_idx`, `free_pages`, `kv`, `backend`.
    ValueError
        An unknown format.
    """

    def __init__(self, format: str, **arguments):
        self.module = _module(format)
        self.format = format
        known = (set(_parameters(self.module.export)) | set(_parameters(self.module.import_)) |
                 set(_parameters(self.module.rule))) - set(_CALL_ARGUMENTS)
        for name in arguments:
            if name in _CALL_ARGUMENTS:
                raise TypeError(f"{name}: an argument of convert (sequence, layer_idx, dst_layer_idx, free_pages), "
                                f"not of a Cache")
            if name not in known:
                raise TypeError(f"{name}: not an argument of the {format} format; it takes "
                                f"{', '.join(sorted(known))}")
        self.arguments = arguments

    def __repr__(self) -> str:
        return f"Cache({self.format!r}, {', '.join(self.arguments)})"


def _layer_arguments(module, format, kwargs: dict) -> dict:
    """Formats whose tensors hold one layer (ONNX, vLLM, FlashInfer) take no layer_idx: 0 is dropped, another
    value is refused (pass that layer's tensors)."""
    if "layer_idx" in kwargs and "layer_idx" not in inspect.signature(module.export).parameters:
        layer_idx = kwargs.pop("layer_idx")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, (int, np.integer)):
            raise TypeError(f"layer_idx: expected an int, got {type(layer_idx).__name__}")
        if layer_idx != 0:
            raise ValueError(f"layer_idx: the {format} format's tensors hold one layer; pass that layer's tensors "
                             f"with layer_idx 0, got {layer_idx}")
    return kwargs


def export(format: str, *args, sequence: int, backend: str = "auto", **kwargs) -> KV:
    """One sequence (and layer, where the format holds several) of a cache in `format`, as a `KV`.

    Parameters
    ----------
    format : str
        "ppl", "trtllm", "onnx", "ft", "vllm", "flashinfer" or "hf".
    *args
        The format's leading arguments in order, where it has some (ppl: `cache`, `scale`; onnx: `past_key`,
        `past_value`, `nonpad_kv_seqlen`; ft: `key_cache`, `value_cache`, `encoder_sequence_length`;
        flashinfer: `paged_kv_cache`; hf: `past_key_values`); they may be passed by name too.
    sequence : int
        The sequence (batch row, request) to read.
    backend : str, default "auto"
        "auto" (the gather kernel for GPU caches, NumPy for NumPy ones), "reference" or "numba" (the kernel;
        in the simulator for NumPy caches).
    **kwargs
        The format's arguments, by the format's names: the tables below. `layer_idx` 0 is accepted (and
        ignored) by the formats whose tensors hold one layer (onnx, vllm, flashinfer).

    Returns
    -------
    KV
        The tokens the cache holds for the sequence, in token order, with their positions, whether the keys
        carry RoPE, and (quantized caches) the stored codes and scales. Float32 values for the per-tensor
        quantized kinds, the scale dtype for OpenPPL's groups, the cache's dtype for a float cache.

    Raises
    ------
    TypeError
        A wrong type or dtype (an array that is not one, a table of floats, a non-int `sequence`), named by its
        argument.
    ValueError
        An unknown format, a shape or value out of range (a table entry outside the cache, a length past its
        capacity), named by its argument.

    Notes
    -----
    Each format's arguments. Tables of ints may be NumPy arrays, GPU arrays or lists; caches are C-contiguous
    NumPy or GPU arrays.

    **`ppl`** OpenPPL's dynamic-batching cache (`cache`, `scale` may come first, in order). `cache` holds every
    layer's K and V in `cache_layout`'s axis order: 0 `(MaxT, L, 2, H, Dh)`, 1 `(L, MaxT, 2, H, Dh)`,
    2 `(L, 2, MaxT, H, Dh)`, 3 `(L, 2, H, MaxT, Dh)`.

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `cache` | required | float, or int8 with `quant_bit` (int4: Dh / 2 bytes), in the axes above |
    | `scale` | optional | `quant_bit` 8 or 4: group scales, `cache`'s axes with Dh / `quant_group` last |
    | `kvstarts` | required | int `(B + 1,)`: sequence b holds `kvstarts[b + 1] - kvstarts[b]` tokens |
    | `cachestarts` | required | int; `cache_mode` 0: `(B,)` first slots; 1: `(B, max_pages)` page token offsets |
    | `num_layer` | optional | L (default 1) |
    | `layer_idx` | optional | the layer, in [0, `num_layer`) (default 0) |
    | `quant_bit` | optional | 0 (float, default), 8 (int8 groups) or 4 (int4 groups) |
    | `quant_group` | optional | elements sharing one scale (default 8) |
    | `cache_mode` | optional | 0 offsets (default), 1 paged |
    | `cache_layout` | optional | 0 ... 3 (default 0) |
    | `page_size` | optional | tokens a page, `cache_mode` 1 (default 128) |
    | `rotated` | optional | whether the stored keys carry RoPE (default True) |

    **`trtllm`** TensorRT-LLM: `past_key_value` (one layer), or `kv_cache_pool` with `kv_cache_block_offsets`
    (`paged_kv_cache=True`). A window W = `host_max_attention_window_sizes[layer_idx]` makes a longer cache
    cyclic: it holds the S = `host_sink_token_length[0]` sinks and the last W - S tokens.

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `past_key_value` | optional | contiguous: `(batch_beam, 2, num_kv_heads, max_seqlen, head_size)` |
    | `kv_cache_pool` | optional | paged: `(num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_size)` |
    | `kv_cache_block_offsets` | optional | int `(num_pools, batch_beam, 2, max_blocks)`: block · layers · 2 + kv |
    | `sequence_length` | required | int `(batch_beam,)`: the tokens each row has seen |
    | `host_max_attention_window_sizes` | required | int: W per layer (a shorter list repeats) |
    | `host_sink_token_length` | required | int `(1,)`: S, in [0, W) |
    | `layer_idx` | optional | the model layer: the pool's layer, and its window (default 0) |
    | `paged_kv_cache` | optional | True: the pool (default False) |
    | `tokens_per_block` | optional | a power of two (default 64) |
    | `streamingllm` | optional | keys stored un-rotated: the KV says `rotated=False` (default False) |
    | `kv_cache_quant_mode` | optional | 0 (default), 64 INT8, 128 FP8 (e4m3) |
    | `kv_quant_orig_scale` | optional | INT8 / FP8: the scale s (value = code · s) |
    | `kv_orig_quant_scale` | optional | INT8 / FP8: 1 / s (default 1 / `kv_quant_orig_scale`) |

    **`onnx`** ONNX Attention's past tensors (in order: `past_key`, `past_value`, `nonpad_kv_seqlen`)

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `past_key` | required | `(batch_size, kv_num_heads, past_sequence_length, head_size)`, float |
    | `past_value` | required | `(batch_size, kv_num_heads, past_sequence_length, v_head_size)` |
    | `nonpad_kv_seqlen` | optional | int `(batch_size,)`: the real tokens of each batch (default: all) |
    | `rotated` | optional | whether the keys carry RoPE (default True) |

    **`ft`** FasterTransformer's cross-attention cache (in order: `key_cache`, `value_cache`,
    `encoder_sequence_length`); x = 16 bytes / element size, and a leading layer axis is accepted.

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `key_cache` | required | batch-major `[B, H, Dh / x, mem_max_seq_len, x]`, else `[B, mem_max_seq_len, H, Dh]` |
    | `value_cache` | required | batch-major `[B, H, mem_max_seq_len, Dh]`, else `[B, mem_max_seq_len, H, Dh]` |
    | `encoder_sequence_length` | required | int `(B,)`: each batch's encoder tokens |
    | `is_batch_major_cache` | optional | which layout (default True) |
    | `layer_idx` | optional | with a leading layer axis: the layer (default 0) |

    **`vllm`** vLLM, one layer: `key_cache` with `value_cache` (classic; x = 16 bytes / element size), or
    `kv_cache` (V1; HND swaps block_size and num_kv_heads)

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `key_cache` | optional | `[num_blocks, num_kv_heads, head_size / x, block_size, x]` |
    | `value_cache` | optional | `[num_blocks, num_kv_heads, head_size, block_size]` |
    | `kv_cache` | optional | `(2, num_blocks, block_size, num_kv_heads, head_size)` (NHD) |
    | `block_tables` | required | int `(num_seqs, max_blocks)`: row r lists request r's blocks in token order |
    | `seq_lens` | required | int `(num_seqs,)`: each request's tokens |
    | `kv_cache_dtype` | optional | "auto" (float, default), "fp8" (= "fp8_e4m3") or "fp8_e5m2" (or uint8 bytes) |
    | `kv_cache_layout` | optional | "NHD" (default) or "HND", of `kv_cache` |
    | `k_scale` | optional | fp8: keys' value = code · `k_scale` (default 1.0) |
    | `v_scale` | optional | fp8: values' value = code · `v_scale` (default 1.0) |

    **`flashinfer`** FlashInfer's pages and CSR page table (`paged_kv_cache` may come first): one tensor
    `[max_num_pages, 2, page_size, num_kv_heads, head_dim]` (NHD; HND swaps page_size and num_kv_heads), or a
    (K, V) pair of that shape without the 2; float or fp8.

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `paged_kv_cache` | required | the pages, as above |
    | `kv_indptr` | required | int `(batch + 1,)`: request b's pages are `kv_indices[kv_indptr[b]:kv_indptr[b + 1]]` |
    | `kv_indices` | required | int: the page ids, request after request |
    | `kv_last_page_len` | required | int `(batch,)`: tokens in each request's last page, 1 ... page_size |
    | `kv_layout` | optional | "NHD" (default) or "HND" |
    | `k_scale` | optional | fp8: keys' value = code · `k_scale` (default 1.0) |
    | `v_scale` | optional | fp8: values' value = code · `v_scale` (default 1.0) |

    **`hf`** transformers' `DynamicCache` (imports torch): `layers[layer_idx].keys` and `.values` are
    `[batch, num_kv_heads, seq_len, head_dim]`

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `past_key_values` | required | the cache |
    | `layer_idx` | optional | the layer (default 0) |
    | `seq_len` | optional | the tokens to read (default: the layer's whole length) |

    Examples
    --------
    >>> import numpy as np
    >>> from cacheattn import convert
    >>> key_cache = np.arange(2 * 1 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 1, 4, 4)  # head_size 4
    >>> value_cache = -np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4)
    >>> kv = convert.export("vllm", key_cache=key_cache, value_cache=value_cache,
    ...                     block_tables=np.array([[1, 0]]), seq_lens=np.array([5]), sequence=0)
    >>> kv.key.shape, kv.positions.tolist(), bool(np.array_equal(kv.key[0, 4], key_cache[0, 0, 0, 0]))
    ((1, 5, 4), [0, 1, 2, 3, 4], True)
    """
    module = _module(format)
    with _core.backend(backend):
        return module.export(*args, sequence=sequence, **_layer_arguments(module, format, kwargs))


def import_(format: str, kv: KV, *args, sequence: int, backend: str = "auto", **kwargs) -> dict:
    """Write `kv` into the caller's cache in `format` as sequence `sequence`.

    Only that sequence's slots (of that layer) are written, and with `free_pages` its row of the page table;
    every argument, `kv` included, is checked before the first write, so a failed import leaves every cache
    and table as it was. Keys are written as kv holds them (`convert` adds or removes RoPE). Quantized
    destinations encode by their own rule, unless kv holds codes of that rule and scales (then copied).

    Parameters
    ----------
    format : str
        "ppl", "trtllm", "onnx", "ft", "vllm", "flashinfer" or "hf".
    kv : KV
        The tokens to write (from `export`, or built by hand).
    *args
        The format's leading arguments in order, where it has some (ppl: `cache`, `scale`; onnx: `past_key`,
        `past_value`; ft: `key_cache`, `value_cache`; flashinfer: `paged_kv_cache`; hf: `past_key_values`).
    sequence : int
        The sequence (batch row, request) to write.
    backend : str, default "auto"
        "auto" (the scatter kernel for GPU caches, NumPy for NumPy ones), "reference" or "numba".
    **kwargs
        The format's arguments, by the format's names: the tables below. `free_pages`, where a format takes
        it, is a list of free page numbers: the sequence takes the first pages it needs from the front, and
        they leave the list once the import has written them. `layer_idx` 0 is accepted by the one-layer
        formats (onnx, vllm, flashinfer).

    Returns
    -------
    dict
        What the caller's length bookkeeping needs, in the format's own names (import does not write lengths
        except FlashInfer's `kv_last_page_len`): ppl `{"slots", "pages"}`; trtllm `{"sequence_length", "slots",
        "pages"}` (last position + 1); onnx `{"nonpad_kv_seqlen"}`; ft `{"encoder_sequence_length"}`; vllm
        `{"seq_lens", "pages"}`; flashinfer `{"pages"}`; hf `{"seq_len"}`. `pages`: those taken from
        `free_pages` (flashinfer: the request's pages).

    Raises
    ------
    TypeError
        A wrong type or dtype, named by its argument (`kv` and its fields as `kv.key`, `kv.positions`, ...; a
        `free_pages` that is not a list).
    ValueError
        A shape or value out of range, named by its argument: kv's heads or head_dim against the cache, a page
        id outside the cache, the same page twice, a page another sequence holds, too few free pages, a
        window of 0, non-finite values for a quantized cache.

    Notes
    -----
    Each format's arguments. Caches are C-contiguous, writable NumPy or GPU arrays; the tables import writes
    are integer NumPy or GPU arrays (the others may be lists). Pages another sequence holds are refused as this
    one's: FlashInfer's CSR table says which they are; ppl, trtllm and vllm tables are padded, so there the
    other sequences' lengths say it (`kvstarts`, `sequence_length`, `seq_lens`, optional).

    **`ppl`** OpenPPL (`cache`, `scale` may come first, in order). `cache` holds every layer's K and V in
    `cache_layout`'s axis order: 0 `(MaxT, L, 2, H, Dh)`, 1 `(L, MaxT, 2, H, Dh)`, 2 `(L, 2, MaxT, H, Dh)`,
    3 `(L, 2, H, MaxT, Dh)`. The sequence's slots of layer `layer_idx` are written; a page p taken from
    `free_pages` enters `cachestarts` as its token offset p · `page_size`.

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `cache` | required | float, or int8 with `quant_bit` (int4: Dh / 2 bytes), in the axes above |
    | `scale` | optional | `quant_bit` 8 or 4: group scales, `cache`'s axes with Dh / `quant_group` last (written) |
    | `cachestarts` | required | int; `cache_mode` 0: `(B,)` first slots; 1: `(B, max_pages)` page token offsets |
    | `num_layer` | optional | L (default 1) |
    | `layer_idx` | optional | the layer written (default 0) |
    | `quant_bit` | optional | 0 (default), 8 or 4: OpenPPL's group quantization |
    | `quant_group` | optional | elements sharing one scale (default 8) |
    | `cache_mode` | optional | 0 offsets (default), 1 paged |
    | `cache_layout` | optional | 0 ... 3 (default 0) |
    | `page_size` | optional | tokens a page (default 128) |
    | `free_pages` | optional | `cache_mode` 1: free page numbers in [0, MaxT / `page_size`) |
    | `kvstarts` | optional | int `(B + 1,)`, read only: the other sequences' lengths; their slots are refused |

    **`trtllm`** TensorRT-LLM: `past_key_value` (one layer), or `kv_cache_pool` with `kv_cache_block_offsets`
    (`paged_kv_cache=True`). Each token goes to the cyclic slot of its position: with a window W and S sinks,
    a later token overwrites an earlier one W - S positions back (not written).

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `past_key_value` | optional | contiguous: `(batch_beam, 2, num_kv_heads, max_seqlen, head_size)` |
    | `kv_cache_pool` | optional | paged: `(num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_size)` |
    | `kv_cache_block_offsets` | optional | int `(num_pools, batch_beam, 2, max_blocks)`; `free_pages` sets the row's |
    | `host_max_attention_window_sizes` | required | int: W per layer (a shorter list repeats) |
    | `host_sink_token_length` | required | int `(1,)`: S, in [0, W) |
    | `layer_idx` | optional | the model layer: the pool's layer, and its window (default 0) |
    | `paged_kv_cache` | optional | True: the pool (default False) |
    | `tokens_per_block` | optional | a power of two (default 64) |
    | `streamingllm` | optional | the cache stores un-rotated keys (default False) |
    | `kv_cache_quant_mode` | optional | 0, 64 INT8, 128 FP8: code = sat(round(x · `kv_orig_quant_scale`)) |
    | `kv_quant_orig_scale` | optional | INT8 / FP8: the scale s |
    | `kv_orig_quant_scale` | optional | INT8 / FP8: 1 / s (default 1 / `kv_quant_orig_scale`) |
    | `free_pages` | optional | paged: free blocks in [0, num_blocks); offsets block · num_layers · 2 + kv |
    | `sequence_length` | optional | int `(batch_beam,)`, read only: the other rows' lengths; their blocks are refused |

    **`onnx`** ONNX Attention's past tensors (in order: `past_key`, `past_value`); T ≤ past_sequence_length

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `past_key` | required | `(batch_size, kv_num_heads, past_sequence_length, head_size)`, float |
    | `past_value` | required | `(batch_size, kv_num_heads, past_sequence_length, v_head_size)` |

    **`ft`** FasterTransformer's cross cache (in order: `key_cache`, `value_cache`); x = 16 bytes / element
    size, a leading layer axis is accepted, T ≤ mem_max_seq_len

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `key_cache` | required | batch-major `[B, H, Dh / x, mem_max_seq_len, x]`, else `[B, mem_max_seq_len, H, Dh]` |
    | `value_cache` | required | batch-major `[B, H, mem_max_seq_len, Dh]`, else `[B, mem_max_seq_len, H, Dh]` |
    | `is_batch_major_cache` | optional | which layout (default True) |
    | `layer_idx` | optional | with a leading layer axis: the layer (default 0) |

    **`vllm`** vLLM, one layer: `key_cache` with `value_cache` (classic; x = 16 bytes / element size), or
    `kv_cache` (V1; HND swaps block_size and num_kv_heads)

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `key_cache` | optional | `[num_blocks, num_kv_heads, head_size / x, block_size, x]` |
    | `value_cache` | optional | `[num_blocks, num_kv_heads, head_size, block_size]` |
    | `kv_cache` | optional | `(2, num_blocks, block_size, num_kv_heads, head_size)` (NHD) |
    | `block_tables` | required | int `(num_seqs, max_blocks)`; `free_pages` sets the row's first ceil(T / block_size) |
    | `kv_cache_dtype` | optional | "auto" (default), "fp8" (= "fp8_e4m3") or "fp8_e5m2": code = sat(x / scale) |
    | `kv_cache_layout` | optional | "NHD" (default) or "HND", of `kv_cache` |
    | `k_scale` | optional | fp8 keys' scale (default 1.0) |
    | `v_scale` | optional | fp8 values' scale (default 1.0) |
    | `free_pages` | optional | free block numbers in [0, num_blocks) |
    | `seq_lens` | optional | int `(num_seqs,)`, read only: the other requests' lengths; their blocks are refused |

    **`flashinfer`** FlashInfer's pages and CSR page table (`paged_kv_cache` may come first): one tensor
    `[max_num_pages, 2, page_size, num_kv_heads, head_dim]` (NHD; HND swaps page_size and num_kv_heads), or a
    (K, V) pair of that shape without the 2; float or fp8.

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `paged_kv_cache` | required | the pages, as above |
    | `kv_indptr` | required | int `(batch + 1,)`, read only: request b owns exactly ceil(T / page_size) entries |
    | `kv_indices` | required | int page ids (another request's are refused); `free_pages` sets b's entries |
    | `kv_last_page_len` | required | int `(batch,)`: entry b is set to the tokens of b's last page |
    | `kv_layout` | optional | "NHD" (default) or "HND" |
    | `k_scale` | optional | fp8 keys' scale (default 1.0) |
    | `v_scale` | optional | fp8 values' scale (default 1.0) |
    | `free_pages` | optional | free page ids in [0, max_num_pages) |

    **`hf`** transformers' `DynamicCache` (imports torch): `layers[layer_idx].keys` and `.values` are
    `[batch, num_kv_heads, seq_len, head_dim]`, T ≤ seq_len

    | argument | | shape, dtype: meaning |
    |---|---|---|
    | `past_key_values` | required | the cache (a layer it does not hold yet is created, batch row 0) |
    | `layer_idx` | optional | the layer (default 0) |
    | `dtype` | optional | a new layer's torch dtype (default float32) |

    Examples
    --------
    >>> import numpy as np
    >>> from cacheattn import convert
    >>> rng = np.random.default_rng(0)
    >>> kv = convert.KV(rng.standard_normal((1, 5, 4)).astype(np.float32),
    ...                 rng.standard_normal((1, 5, 4)).astype(np.float32), np.arange(5))
    >>> kv_cache = np.zeros((2, 3, 4, 1, 4), np.float32)            # V1 NHD: 3 blocks of 4 tokens
    >>> block_tables, free = np.zeros((2, 2), np.int32), [2, 0, 1]
    >>> convert.import_("vllm", kv, kv_cache=kv_cache, block_tables=block_tables, sequence=1, free_pages=free)
    {'seq_lens': 5, 'pages': [2, 0]}
    >>> block_tables[1].tolist(), free, bool(np.array_equal(kv_cache[0, 0, 0, 0], kv.key[0, 4]))
    ([2, 0], [1], True)
    >>> convert.import_("vllm", kv, kv_cache=kv_cache, block_tables=block_tables, sequence=0, free_pages=[1, 1])
    Traceback (most recent call last):
    ...
    ValueError: free_pages: expected distinct block numbers, got 1 twice
    """
    module = _module(format)
    kv = _core.check_kv(kv)
    with _core.backend(backend):
        return module.import_(kv, *args, sequence=sequence, **_layer_arguments(module, format, kwargs))


def match_rope(kv: KV, rotated: bool | None, rope: Rope | None) -> KV:
    """kv with keys rotated (or rotated back) at their positions when the destination stores `rotated` keys and
    kv does not; rope (a `Rope`) says how. Rotation changes the values, so the result carries no codes."""
    kv = _core.check_kv(kv)
    rotated = _core.check_rotated("rotated", rotated)
    if rope is not None and not isinstance(rope, Rope):
        raise TypeError(f"rope: expected a cacheattn.convert.Rope or None, got {type(rope).__name__}")
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
    """Export `sequence` / `layer_idx` of src and import it into dst as `dst_sequence` / `dst_layer_idx`.

    Where the two disagree on RoPE, `rope` adds or removes it (StreamingLLM's un-rotated keys are rotated at
    their true positions). The layer indices apply to the formats whose tensors hold several layers (OpenPPL,
    TensorRT-LLM's pool, FasterTransformer's layered buffer, transformers); a one-layer side (ONNX, vLLM,
    FlashInfer, a contiguous TensorRT-LLM cache) is given that layer's tensors. Everything the import checks
    (`export`'s and `import_`'s checks, the page list) is checked before dst is written.

    Parameters
    ----------
    src : Cache
        The source: a format and its export arguments (the table under `export`).
    dst : Cache
        The destination: a format and its import arguments (the table under `import_`).
    sequence : int
        The sequence of src to move.
    layer_idx : int, default 0
        The layer of src (multi-layer formats).
    dst_sequence : int or None, default None
        The sequence of dst to write (None: `sequence`).
    dst_layer_idx : int or None, default None
        The layer of dst to write (None: `layer_idx`).
    rope : Rope or None, default None
        How to rotate keys when src and dst disagree on RoPE; required then.
    free_pages : list of int or None, default None
        dst's free pages, for the paged formats' import (see `import_`): the sequence takes its pages from the
        front, and they leave the list once written.
    backend : str, default "auto"
        As for `export`: GPU caches move through one gather and one scatter kernel per K and V.

    Returns
    -------
    tuple of (KV, dict)
        The exported KV (as src holds it) and import's result (see `import_`).

    Raises
    ------
    TypeError
        src or dst not a `Cache`, rope not a `Rope`, free_pages not a list, or what export and import raise.
    ValueError
        What export and import raise (dst's `sequence` and `layer_idx` errors are named `dst_sequence` and
        `dst_layer_idx` when those were given), or a layer index other than 0 that no side uses (a one-layer
        source's `layer_idx` with `dst_layer_idx` given or a one-layer destination; a one-layer destination's
        `dst_layer_idx`).

    Notes
    -----
    What a Cache needs: as a source, export's required arguments; as a destination, import_'s (`export`'s and
    `import_`'s tables give every argument's shape and meaning). A Cache may hold both lists: each call takes
    its own.

    | format | a source Cache needs (export) |
    |---|---|
    | `ppl` | `cache`, `kvstarts`, `cachestarts` |
    | `trtllm` | `sequence_length`, `host_max_attention_window_sizes`, `host_sink_token_length` |
    | `onnx` | `past_key`, `past_value` |
    | `ft` | `key_cache`, `value_cache`, `encoder_sequence_length` |
    | `vllm` | `block_tables`, `seq_lens` |
    | `flashinfer` | `paged_kv_cache`, `kv_indptr`, `kv_indices`, `kv_last_page_len` |
    | `hf` | `past_key_values` |

    | format | a destination Cache needs (import_) |
    |---|---|
    | `ppl` | `cache`, `cachestarts` |
    | `trtllm` | `host_max_attention_window_sizes`, `host_sink_token_length` |
    | `onnx` | `past_key`, `past_value` |
    | `ft` | `key_cache`, `value_cache` |
    | `vllm` | `block_tables` |
    | `flashinfer` | `paged_kv_cache`, `kv_indptr`, `kv_indices`, `kv_last_page_len` |
    | `hf` | `past_key_values` |

    The cache itself is optional in the tables of two formats, which take one of two forms: trtllm
    `past_key_value`, or `kv_cache_pool` with `kv_cache_block_offsets` and `paged_kv_cache=True`; vllm
    `key_cache` with `value_cache`, or `kv_cache`. Attributes that differ from their defaults (`cache_mode`,
    `quant_bit`, `kv_layout`, ...) belong in the Cache too.

    Examples
    --------
    >>> import numpy as np
    >>> from cacheattn import convert
    >>> rng = np.random.default_rng(0)
    >>> past_key = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)      # ONNX (B, Hkv, S, D)
    >>> past_value = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    >>> paged = np.zeros((4, 2, 4, 2, 8), np.float16)                       # FlashInfer NHD, 4 pages of 4
    >>> indptr, indices, last = np.array([0, 2]), np.zeros(2, np.int32), np.zeros(1, np.int32)
    >>> kv, info = convert.convert(
    ...     convert.Cache("onnx", past_key=past_key, past_value=past_value),
    ...     convert.Cache("flashinfer", paged_kv_cache=paged, kv_indptr=indptr, kv_indices=indices,
    ...                   kv_last_page_len=last), sequence=0, free_pages=[3, 1, 0])
    >>> info, indices.tolist(), last.tolist()
    ({'pages': [3, 1]}, [3, 1], [2])
    >>> bool(np.array_equal(paged[1, 0, 1], past_key[0, :, 5].astype(np.float16)))   # token 5: page 1, row 1
    True
    """
    for name, cache in (("src", src), ("dst", dst)):
        if not isinstance(cache, Cache):
            raise TypeError(f"{name}: expected a cacheattn.convert.Cache, got {type(cache).__name__}")
    check_int("sequence", sequence, low=0)
    check_int("layer_idx", layer_idx, low=0)
    if dst_sequence is not None:
        check_int("dst_sequence", dst_sequence, low=0)
    if dst_layer_idx is not None:
        check_int("dst_layer_idx", dst_layer_idx, low=0)
    if rope is not None and not isinstance(rope, Rope):
        raise TypeError(f"rope: expected a cacheattn.convert.Rope or None, got {type(rope).__name__}")
    # A layer index no side uses is a mistake, as export's and import_'s own layer_idx for the one-layer formats.
    layered = {name: "layer_idx" in inspect.signature(c.module.export).parameters for name, c in (("src", src),
                                                                                                 ("dst", dst))}
    if dst_layer_idx and not layered["dst"]:
        raise ValueError(f"dst_layer_idx: the {dst.format} format's tensors hold one layer; pass that layer's "
                         f"tensors with dst_layer_idx 0 or None, got {dst_layer_idx}")
    if layer_idx and not layered["src"] and (dst_layer_idx is not None or not layered["dst"]):
        why = "and dst_layer_idx names the destination's layer" if layered["dst"] else \
            f"and so does the {dst.format} destination"
        raise ValueError(f"layer_idx: expected 0, as no side uses it (the {src.format} source holds one layer, "
                         f"{why}), got {layer_idx}")
    with _core.backend(backend):
        return _convert(src, dst, sequence, layer_idx, dst_sequence, dst_layer_idx, rope, free_pages)


@contextlib.contextmanager
def _named(renames: dict):
    """Errors of dst's import that name `sequence` or `layer_idx` name the convert argument the caller gave."""
    try:
        yield
    except (TypeError, ValueError) as e:
        text = str(e)
        for old, new in renames.items():
            if text.startswith(f"{old}:"):
                raise type(e)(new + text[len(old):]) from None
        raise


def _convert(src, dst, sequence, layer_idx, dst_sequence, dst_layer_idx, rope, free_pages):
    renames = {k: v for k, v, given in (("sequence", "dst_sequence", dst_sequence),
                                        ("layer_idx", "dst_layer_idx", dst_layer_idx)) if given is not None}
    dst_layer_idx = layer_idx if dst_layer_idx is None else dst_layer_idx
    kv = _call(src.module.export, src.arguments, sequence=sequence, layer_idx=layer_idx)
    wanted = _call(dst.module.stores_rotated, dst.arguments)
    moved = match_rope(kv, wanted, rope)
    extra = dict(sequence=sequence if dst_sequence is None else dst_sequence, layer_idx=dst_layer_idx)
    if free_pages is not None:
        extra["free_pages"] = free_pages
    with _named(renames):
        return kv, _call(dst.module.import_, dst.arguments, kv=moved, **extra)


def error_bound(dst: Cache, kv: KV) -> tuple[np.ndarray, np.ndarray]:
    """Per-element bounds (key, value), each kv's shape, on |value dst holds after importing kv - kv's value|:
    zero where dst holds kv exactly (same rule and scales, or a wider float), else half of dst's quantization
    step at that value (see `_core.step_bound`)."""
    if not isinstance(dst, Cache):
        raise TypeError(f"dst: expected a cacheattn.convert.Cache, got {type(dst).__name__}")
    kv = _core.check_kv(kv)
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
