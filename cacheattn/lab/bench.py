"""python -m cacheattn bench: kernel timings against ceilings and peers measured in the same run.

On a GPU it runs the harness in `cacheattn.lab.bench_gpu` (decode and prefill shaped like a served
8B-class model: 32 query heads, 8 kv heads, head_dim 128, paged and offset caches, float16 and int8)
and prints its tables (bench.json and bench.md with `--out DIR`). `--tiny` runs that harness in the
simulator on tiny shapes (CI keeps it working). Without a GPU there is nothing to time: it says so and
times the reference.
"""

from __future__ import annotations

import time

import numpy as np

import cacheattn

from .. import _console
from ..examples import PPLCase, build_ppl, copy_inputs


def _decode_case(batch, past, quant_bit):
    return PPLCase(seqlens=(1,) * batch, past=past, decoding_batches=batch, num_heads=32, num_kv_heads=8,
                   head_dim=128, dtype="float16", quant_bit=quant_bit, quant_group=8, scale_dtype="float16",
                   cache_layout=0, cache_mode=1, page_size=64, num_layer=1, layer_idx=0, is_causal=True,
                   is_alibi=False, mask="none", mask_pad=0, seed=0)


def _median_ms(fn, repeat, sync):
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def bench(repeat: int = 20, tiny: bool = False, out_dir: str | None = None) -> int:
    """On a GPU: the harness (cacheattn.lab.bench_gpu), bench.json and bench.md written into out_dir when one is given.
    tiny: the same harness in the simulator on tiny shapes. Without a GPU: says so and times the reference."""
    if tiny or _gpu():
        from .bench_gpu import run_harness
        run_harness(tiny=tiny, repeat=repeat, out_dir=out_dir)
        return 0
    case = _decode_case(4, (100, 200, 300, 400), 8)
    inputs = build_ppl(case)
    ms = _median_ms(lambda: cacheattn.multi_head_cache_attention(**copy_inputs(inputs), **case.attrs()),
                    max(3, repeat // 4), lambda: None)
    _console.say("No GPU: kernel benchmarks need one (python -m cacheattn bench on a CUDA machine; --tiny runs the "
                 "harness in the simulator).")
    _console.say(f"reference (NumPy) decode, 4 requests, 32/8 heads, Dh 128, int8 paged: {ms:.1f} ms per call")
    return 0


def _gpu() -> bool:
    """`python -m cacheattn` switched numba to the simulator when it found no GPU."""
    from numba import config
    return not config.ENABLE_CUDASIM
