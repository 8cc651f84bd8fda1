"""python -m cacheattn bench: kernel timings against peers measured in the same run.

On a GPU, for a decode batch shaped like a served 8B-class model (32 query heads, 8 kv heads,
head_dim 128, paged cache), it times
  - fused   : multi_head_cache_attention (store + attention straight from the paged cache)
  - unfused : dynamic_key_value_cache (dequantized packed K/V) + dynamic_multi_head_attention
  - torch   : torch's scaled_dot_product_attention on dense float16 K/V with the heads repeated
              (when torch is installed), the attention alone, no cache work
and reports median milliseconds, the fused kernel's ratio to each peer, and the cache bytes it
reads per second. Without a GPU there is nothing to time: it says so and times the reference.
"""

from __future__ import annotations

import time

import numpy as np

import cacheattn

from . import _console
from .examples import PPLCase, build_ppl, copy_inputs


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


def bench(repeat: int = 20) -> int:
    if not _gpu():
        case = _decode_case(4, (100, 200, 300, 400), 8)
        inputs = build_ppl(case)
        ms = _median_ms(lambda: cacheattn.multi_head_cache_attention(**copy_inputs(inputs), **case.attrs()),
                        max(3, repeat // 4), lambda: None)
        _console.say("No GPU: kernel benchmarks need one (python -m cacheattn bench on a CUDA machine).")
        _console.say(f"reference (NumPy) decode, 4 requests, 32/8 heads, Dh 128, int8 paged: {ms:.1f} ms per call")
        return 0
    return _bench_gpu(repeat)


def _gpu() -> bool:
    """`python -m cacheattn` switched numba to the simulator when it found no GPU."""
    from numba import config
    return not config.ENABLE_CUDASIM


BENCH_COLUMNS = ("config", "fused ms", "unfused ms", "torch ms", "fused/unfused", "fused/torch", "cache GB/s")


def _bench_gpu(repeat):
    import cupy

    rng = np.random.default_rng(0)
    configs = [(batch, mean_past, quant_bit) for batch, mean_past in ((16, 1024), (32, 2048), (64, 4096))
               for quant_bit in (0, 8)]
    rows = []
    with _console.progress(len(configs), "bench") as step:
        for batch, mean_past, quant_bit in configs:
            past = tuple(int(p) for p in rng.integers(mean_past // 2, mean_past * 3 // 2, batch))
            case = _decode_case(batch, past, quant_bit)
            host = build_ppl(case)
            dev = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in host.items()}
            sync = cupy.cuda.get_current_stream().synchronize
            fused = _median_ms(lambda dev=dev, case=case: cacheattn.multi_head_cache_attention(**dev, **case.attrs()),
                               repeat, sync)
            unfused = _median_ms(lambda dev=dev, case=case: _unfused(dev, case), repeat, sync)
            torch_ms = _torch_peer(host, case, repeat)
            kv_bytes = sum(case.kvlens) * case.num_kv_heads * 2 * (
                case.head_dim * (1 if quant_bit else 2) + (case.head_dim // 8) * 2 * bool(quant_bit))
            label = f"decode B={batch} kv~{mean_past} {'int8' if quant_bit else 'fp16'} cache"
            rows.append((label, f"{fused:.3f}", f"{unfused:.3f}", f"{torch_ms:.3f}" if torch_ms else "-",
                         f"{fused / unfused:.2f}", f"{fused / torch_ms:.2f}" if torch_ms else "-",
                         f"{kv_bytes / fused / 1e6:.1f}"))
            step(label)
    _console.table("fused cache attention vs peers (median of the repeats)", BENCH_COLUMNS, rows,
                   right=BENCH_COLUMNS[1:])
    return 0


def _unfused(dev, case):
    key, value = cacheattn.dynamic_key_value_cache(
        dev["current_key"], dev["current_value"], dev["seqstarts"], dev["kvstarts"], dev["cachestarts"],
        dev["start_pos"], dev["max_seqlen"], dev["max_kvlen"], dev["cache"], dev["scale"], quant_bit=case.quant_bit,
        quant_group=case.quant_group, cache_mode=case.cache_mode, page_size=case.page_size)
    return cacheattn.dynamic_multi_head_attention(
        dev["query"], key, value, dev["seqstarts"], dev["kvstarts"], case.decoding_batches, dev["max_seqlen"],
        dev["max_kvlen"], num_heads=case.num_heads, head_dim=case.head_dim, is_causal=True,
        num_kv_heads=case.num_kv_heads)


def _torch_peer(host, case, repeat):
    """torch SDPA on padded dense K/V (B, H, max_kvlen, Dh); None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    batch, heads, dim, kv = case.batch, case.num_heads, case.head_dim, max(case.kvlens)
    q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.float16)
    k = torch.randn(batch, heads, kv, dim, device="cuda", dtype=torch.float16)
    v = torch.randn(batch, heads, kv, dim, device="cuda", dtype=torch.float16)
    return _median_ms(lambda: F.scaled_dot_product_attention(q, k, v), repeat, torch.cuda.synchronize)
