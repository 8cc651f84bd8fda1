"""The NumPy references at serving shapes: what a CPU user of `cacheattn.hf` (backend="reference") waits for.

`python -m cacheattn bench --cpu` prints this table after the ONNX peer comparison. The shapes are those of
`bench --hf`'s model, one attention layer of a 4-layer Llama with 8 query heads, 2 kv heads and head_dim 64,
serving 8 requests: decode (one new token each after a 512-token prompt and up to 32 generated tokens, so
contexts of 513 to 548) and prefill (8 prompts of 512 tokens in one call). Every operator is called through
`cacheattn.<operator>(..., backend="reference")`, validation included, float32 unless the cache is quantized.

Each row is the median and the spread (min to max) of `repeat` calls after a warm-up; the cases take turns
call by call, so a busy machine slows them all alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import cacheattn

from ..examples import FTCase, OnnxCase, PPLCase, TrtCase, build_ft, build_onnx, build_ppl, build_trt

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BATCH, PROMPT = 8, 2, 64, 4, 8, 512


@dataclass(frozen=True)
class Shapes:
    """One serving configuration: `batch` requests, decode contexts past + 1 with past in
    [prompt, prompt + 4·(batch-1)], prefill of `prompt` tokens per request."""
    batch: int = BATCH
    prompt: int = PROMPT
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    layers: int = LAYERS

    @property
    def past(self) -> tuple:
        return tuple(self.prompt + 4 * b for b in range(self.batch))


TINY = Shapes(batch=2, prompt=12, heads=4, kv_heads=2, head_dim=32, layers=2)


def _ppl(shapes: Shapes, *, decode: bool, quant_bit: int = 0, cache_mode: int = 1) -> Callable[[], object]:
    """MultiHeadCacheAttention on layer 1 of a 4-layer pool, paged (16-token pages) or offset."""
    seqlens = (1,) * shapes.batch if decode else (shapes.prompt,) * shapes.batch
    past = shapes.past if decode else (0,) * shapes.batch
    case = PPLCase(seqlens=seqlens, past=past, decoding_batches=shapes.batch if decode else 0,
                   num_heads=shapes.heads, num_kv_heads=shapes.kv_heads, head_dim=shapes.head_dim,
                   dtype="float32", quant_bit=quant_bit, quant_group=8, scale_dtype="float32", cache_layout=0,
                   cache_mode=cache_mode, page_size=16, num_layer=shapes.layers, layer_idx=1, is_causal=True,
                   is_alibi=False, mask="none", mask_pad=0, seed=0)
    inputs = build_ppl(case)      # the call rewrites the same slots with the same values: repeatable in place
    return lambda: cacheattn.multi_head_cache_attention(**inputs, **case.attrs(), backend="reference")


def _onnx(shapes: Shapes, *, decode: bool) -> Callable[[], object]:
    """ONNX Attention with past/present: decode pads the batch to the longest past (a bool mask hides the
    padding, as a server batching different lengths must); prefill is causal over 512 fresh tokens."""
    longest = max(shapes.past)
    case = OnnxCase(batch=shapes.batch, q_heads=shapes.heads, kv_heads=shapes.kv_heads,
                    q_len=1 if decode else shapes.prompt, kv_len=1 if decode else shapes.prompt,
                    past_len=longest if decode else 0, head_size=shapes.head_dim, v_head_size=shapes.head_dim,
                    three_d=False, dtype="float32", mask="none", mask_shape=(), is_causal=0 if decode else 1,
                    nonpad=None, softcap=0.0, scale=None, left_window_size=-1, right_window_size=-1,
                    qk_matmul_output_mode=0, seed=0)
    inputs = build_onnx(case)
    if decode:
        keys = np.arange(longest + 1)
        mask = (keys < np.asarray(shapes.past)[:, None]) | (keys == longest)      # (B, T): own past + new token
        inputs["attn_mask"] = mask[:, None, None, :]                                  # (B, 1, 1, T)
    return lambda: cacheattn.onnx_attention(**inputs, **case.attrs(), backend="reference")


def _trt(shapes: Shapes, *, decode: bool, quant: int = 0) -> Callable[[], object]:
    """gpt_attention on a paged pool (16-token blocks): generation steps or one context phase."""
    capacity = shapes.prompt + 4 * shapes.batch + 8
    if decode:
        contexts, generations = (), tuple((shapes.prompt, p) for p in shapes.past)
    else:
        contexts, generations = ((0, shapes.prompt),) * shapes.batch, ()
    case = TrtCase(contexts=contexts, generations=generations, beam_width=1, num_heads=shapes.heads,
                   num_kv_heads=shapes.kv_heads, head_size=shapes.head_dim, dtype="float32", capacity=capacity,
                   window=capacity, paged=True, tokens_per_block=16, quant=quant, num_layers=shapes.layers,
                   layer_idx=1)
    inputs = build_trt(case)
    return lambda: cacheattn.gpt_attention(**inputs, backend="reference")


def _ft(shapes: Shapes, *, step: int) -> Callable[[], object]:
    """FasterTransformer cross attention over a 512-token encoder output: step 1 fills the caches, later
    steps read them."""
    d_model = shapes.heads * shapes.head_dim
    case = FTCase(lengths=shapes.past, mem_len=max(shapes.past), head_num=shapes.heads,
                  size_per_head=shapes.head_dim, d_model=d_model, mem_d_model=d_model, dtype="float32",
                  is_batch_major_cache=True, step=step, finished=None, num_tasks=0, ia3_tasks=None,
                  max_decoder_seq_len=0, context_buf=False, q_scaling=1.0, seed=0)
    inputs = build_ft(case)
    return lambda: cacheattn.cross_attention(**inputs, **case.attrs(), backend="reference")


def cases(shapes: Shapes = Shapes()) -> dict:
    """{label: zero-argument call} of every operator the hf engine calls, at `shapes`."""
    b, p = shapes.batch, shapes.prompt
    return {
        f"PPL MHCA decode B{b} paged float32": _ppl(shapes, decode=True),
        f"PPL MHCA decode B{b} paged int8": _ppl(shapes, decode=True, quant_bit=8),
        f"PPL MHCA decode B{b} paged int4": _ppl(shapes, decode=True, quant_bit=4),
        f"PPL MHCA decode B{b} offset float32": _ppl(shapes, decode=True, cache_mode=0),
        f"PPL MHCA prefill B{b}x{p} paged float32": _ppl(shapes, decode=False),
        f"PPL MHCA prefill B{b}x{p} paged int8": _ppl(shapes, decode=False, quant_bit=8),
        f"ONNX decode B{b} past/present": _onnx(shapes, decode=True),
        f"ONNX prefill B{b}x{p} causal": _onnx(shapes, decode=False),
        f"TRT-LLM generation B{b} paged float32": _trt(shapes, decode=True),
        f"TRT-LLM generation B{b} paged int8": _trt(shapes, decode=True, quant=64),
        f"TRT-LLM generation B{b} paged fp8": _trt(shapes, decode=True, quant=128),
        f"TRT-LLM context B{b}x{p} paged float32": _trt(shapes, decode=False),
        f"FT cross attention step 1 B{b}": _ft(shapes, step=1),
        f"FT cross attention step 2 B{b}": _ft(shapes, step=2),
    }


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure(calls: dict, repeat: int, clock: str = "wall") -> dict:
    """{label: list of milliseconds}, `repeat` per call after one warm-up, the calls taking turns. clock "cpu"
    counts this process's CPU time instead of the wall clock: steadier on a machine shared with other work
    (set OPENBLAS_NUM_THREADS=1 so that BLAS threads do not add their time)."""
    now = CLOCKS[clock]
    for call in calls.values():
        call()
    times = {label: [] for label in calls}
    for _ in range(repeat):
        for label, call in calls.items():
            start = now()
            call()
            times[label].append((now() - start) * 1e3)
    return times


def bench_reference(repeat: int = 7, shapes: Shapes = Shapes(), only: str = "", clock: str = "wall") -> dict:
    """Print (and return) the reference's milliseconds per call, median [min, max], for every case whose label
    contains `only`."""
    from .. import _console

    calls = {label: call for label, call in cases(shapes).items() if only in label}
    times = measure(calls, repeat, clock)
    ms = lambda v: f"{v:.2f}"
    _console.table(f"NumPy references through cacheattn (backend='reference'), {shapes.heads}/{shapes.kv_heads} "
                   f"heads, head_dim {shapes.head_dim}; {clock} ms per call, median [min, max] of {repeat}, "
                   "taking turns",
                   [_console.Column("case"), _console.Column("median", "median_ms", ms, right=True),
                    _console.Column("min", "min_ms", ms, right=True), _console.Column("max", "max_ms", ms, right=True)],
                   [(label, float(np.median(t)), min(t), max(t)) for label, t in times.items()])
    return times
