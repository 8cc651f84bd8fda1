"""The GPU benchmark harness behind `python -m cacheattn bench` (and `bench --tiny` in the simulator).

What a figure needs before it means anything:
  - device time from CUDA events after a warm-up, the median of many calls;
  - inputs rotated through enough copies that their bytes exceed the L2 cache four times over, so a
    decode kernel reads HBM and not a cache the previous call warmed;
  - ceilings measured in the same run on the same device: device-to-device copy bandwidth (what a
    memory-bound decode kernel can at best reach) and a large float16 matmul rate (what a prefill can);
  - peers measured in the same run on the same problem: torch `scaled_dot_product_attention` with
    `enable_gqa` on the same K/V made contiguous, a plain CuPy implementation, FlashInfer if installed;
  - the host time of one call (launch and validation cost, measured without a sync), shown beside it.
Every row reports time, bytes moved and GB/s with its share of the copy bandwidth, TFLOP/s, and the
ratio to each peer; the run is printed as tables (`--format` text, markdown or json) with the GPU, driver and
versions, and written as bench.json and bench.md where `--out` names a folder.

`--tiny` runs the same harness in numba's CUDA simulator on tiny shapes, with the NumPy reference as the
peer and host timers instead of events: its figures mean nothing, but CI keeps every line of it working.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import cacheattn

from ..examples import PPLCase, build_ppl, copy_inputs
from .cases import GPU_CASES, TINY_CASES, BenchCase

L2_MULTIPLE = 4          # rotate inputs until their bytes exceed the L2 cache this many times


TINY_THREADS = 32        # the simulator's cost is per thread
# Every rung of the kernel ladder, timed beside the default call (the rung `choose_kernel` picks for the case):
# {peer name: rung}. Every case is a float16 query, which rung 5 needs.
LADDER_PEERS = {"rung 1 (shared-memory tiles)": 1, "rung 2 (warp per key)": 2, "rung 3 (16-byte loads)": 3,
                "rung 4 (split-K)": 4, "rung 5 (tensor cores, mma.sync)": 5}


@dataclass
class Row:
    label: str
    ms: float
    host_ms: float
    gb_per_s: float
    bandwidth_share: float       # of the measured copy bandwidth
    tflops: float
    peers_ms: dict = field(default_factory=dict)


class Device:
    """Arrays, timers and ceilings of where the harness runs: a CUDA GPU through CuPy, or the simulator."""

    def __init__(self, tiny: bool):
        self.tiny = tiny
        if tiny:
            self.xp = np
        else:
            import cupy
            self.xp = cupy

    def put(self, x):
        return x if self.tiny or not isinstance(x, np.ndarray) else self.xp.asarray(x)

    def median_ms(self, calls, repeat: int) -> float:
        """Median device milliseconds of calls[k % len(calls)]() after one warm-up call of each (none in the
        simulator, which compiles nothing)."""
        if self.tiny:
            times = []
            for k in range(repeat):
                start = time.perf_counter()
                calls[k % len(calls)]()
                times.append((time.perf_counter() - start) * 1e3)
            return float(np.median(times))
        import cupy
        for call in calls:
            call()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for k in range(repeat):
            start.record()
            calls[k % len(calls)]()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
        return float(np.median(times))

    def host_ms(self, call, repeat: int) -> float:
        """Median wall milliseconds of issuing one call (no sync): launch, validation and argument costs."""
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
            self.sync()
        return float(np.median(times))

    def sync(self):
        if not self.tiny:
            self.xp.cuda.get_current_stream().synchronize()

    def l2_bytes(self) -> int:
        if self.tiny:
            return 0
        return int(self.xp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"])

    def copy_bandwidth(self, repeat: int) -> float:
        """Bytes per second of a device-to-device copy (read + write), the memory-bound ceiling."""
        n = (1 << 20) if self.tiny else (1 << 30)
        src = self.xp.ones(n, np.uint8)
        dst = self.xp.empty_like(src)
        ms = self.median_ms([lambda: dst.__setitem__(Ellipsis, src)], repeat)
        return 2 * n / (ms * 1e-3)

    def matmul_rate(self, repeat: int) -> float:
        """float16 FLOP/s of an n x n x n matmul, the compute-bound ceiling."""
        n = 64 if self.tiny else 8192
        a = self.xp.ones((n, n), np.float16)
        ms = self.median_ms([lambda: a @ a], repeat)
        return 2.0 * n**3 / (ms * 1e-3)

    def describe(self) -> dict:
        info = {"python": platform.python_version(), "numpy": np.__version__}
        import numba
        info["numba"] = numba.__version__
        if self.tiny:
            info["device"] = "numba CUDA simulator (figures are not timings)"
            return info
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        info.update(device=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
                    sms=props["multiProcessorCount"], l2_bytes=props["l2CacheSize"],
                    driver=cupy.cuda.runtime.driverGetVersion(), cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                    cupy=cupy.__version__)
        try:
            import torch
            info["torch"] = torch.__version__
        except ImportError:
            pass
        return info


def _rotated_inputs(device: Device, case: BenchCase):
    """Enough device copies of the inputs that their bytes exceed L2_MULTIPLE x the L2 cache."""
    host = build_ppl(case.ppl_case())
    one = sum(v.nbytes for v in host.values() if isinstance(v, np.ndarray))
    copies = max(1, math.ceil(L2_MULTIPLE * device.l2_bytes() / one))
    return host, [{k: device.put(v) for k, v in copy_inputs(host).items()} for _ in range(copies)]


def _peers(device: Device, case: BenchCase, host: dict, repeat: int, threads: int) -> dict:
    """{peer: median ms} on the same problem; peers that are not installed are left out."""
    ppl = case.ppl_case()
    x = {k: device.put(v) for k, v in copy_inputs(host).items()}
    peers = {"unfused (KeyValueCache + MultiHeadAttention)": device.median_ms([lambda: _unfused(x, ppl, threads)],
                                                                              repeat)}
    # The kernel ladder's other rungs on the same problem (docs/kernel-ladder.md).
    for name, rung in LADDER_PEERS.items():
        rung_x = {k: device.put(v) for k, v in copy_inputs(host).items()}
        peers[name] = device.median_ms([lambda x=rung_x, rung=rung: cacheattn.multi_head_cache_attention(
            **x, **ppl.attrs(), backend="numba", threads=threads, rung=rung)], repeat)
    if device.tiny:
        ref = copy_inputs(host)
        peers["reference (NumPy)"] = device.median_ms(
            [lambda: cacheattn.multi_head_cache_attention(**ref, **ppl.attrs(), backend="reference")], repeat)
        return peers
    xp = device.xp
    batch, heads, kv_heads, dim = case.batch, case.num_heads, case.num_kv_heads, case.head_dim
    total, new = case.context + case.new_tokens, case.new_tokens
    # Dense contiguous K/V of the same sizes: what the peers get instead of our paged cache.
    def normal(*shape):
        return xp.random.standard_normal(shape, dtype=np.float32).astype(np.float16)

    k, v, q = normal(batch, kv_heads, total, dim), normal(batch, kv_heads, total, dim), normal(batch, heads, new, dim)
    group = heads // kv_heads

    def plain_cupy():
        qg = q.reshape(batch, kv_heads, group * new, dim)
        scores = (qg @ k.transpose(0, 1, 3, 2)).astype(np.float32) / math.sqrt(dim)
        if new > 1:                                            # bottom-right causal on the new tokens
            i = xp.arange(group * new).reshape(-1, 1) % new
            j = xp.arange(total).reshape(1, -1)
            scores = xp.where(j > total - new + i, -xp.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        p = xp.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        return p.astype(np.float16) @ v

    peers["plain CuPy"] = device.median_ms([plain_cupy], repeat)
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return peers
    tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
    causal = new > 1
    peers["torch SDPA (enable_gqa)"] = device.median_ms(
        [lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)], repeat)
    peers.update(flashinfer_peer(device, case, repeat))
    return peers


def flashinfer_peer(device: Device, case: BenchCase, repeat: int) -> dict:
    """FlashInfer's paged GQA decode on the same problem: {"FlashInfer": median ms}. Its own page layout
    ("NHD": (pages, 2, page_size, kv_heads, head_dim) float16, shuffled pages, the case's page size) through
    `BatchDecodeWithPagedKVCacheWrapper` (plan once, then run; begin_forward / forward in versions before 0.2).
    Not installed, or failing: {"FlashInfer (why)": NaN}, which the table lists as not measured.
    Decode cases only: the wrapper is FlashInfer's decode path."""
    if case.new_tokens != 1:
        return {}
    try:
        import flashinfer
        import torch
    except ImportError:
        return {"FlashInfer (not installed)": float("nan")}
    batch, total, page = case.batch, case.context + 1, case.page_size
    pages_per_request = -(-total // page)
    pages = batch * pages_per_request
    cuda = dict(device="cuda")
    try:
        kv = torch.randn(pages, 2, page, case.num_kv_heads, case.head_dim, dtype=torch.float16, **cuda)
        q = torch.randn(batch, case.num_heads, case.head_dim, dtype=torch.float16, **cuda)
        indptr = torch.arange(batch + 1, dtype=torch.int32, **cuda) * pages_per_request
        indices = torch.randperm(pages, **cuda).to(torch.int32)
        last_page_len = torch.full((batch,), total - (pages_per_request - 1) * page, dtype=torch.int32, **cuda)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, **cuda)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        plan = getattr(wrapper, "plan", None) or wrapper.begin_forward
        plan(indptr, indices, last_page_len, case.num_heads, case.num_kv_heads, case.head_dim, page)
        run = getattr(wrapper, "run", None) or wrapper.forward
        return {"FlashInfer": device.median_ms([lambda: run(q, kv)], repeat)}
    except Exception as exc:          # a JIT build or an unsupported shape: the table says so, the run goes on
        return {f"FlashInfer (failed: {type(exc).__name__})": float("nan")}


def _unfused(x: dict, case: PPLCase, threads: int):
    """Our own two-kernel path: dequantized packed K/V written out by KeyValueCache, then MultiHeadAttention."""
    key, value = cacheattn.dynamic_key_value_cache(
        x["current_key"], x["current_value"], x["seqstarts"], x["kvstarts"], x["cachestarts"], x["start_pos"],
        x["max_seqlen"], x["max_kvlen"], x["cache"], x["scale"], quant_bit=case.quant_bit,
        quant_group=case.quant_group, cache_mode=case.cache_mode, page_size=case.page_size, backend="numba",
        threads=threads)
    return cacheattn.dynamic_multi_head_attention(
        x["query"], key, value, x["seqstarts"], x["kvstarts"], case.decoding_batches, x["max_seqlen"],
        x["max_kvlen"], num_heads=case.num_heads, head_dim=case.head_dim, is_causal=True,
        num_kv_heads=case.num_kv_heads, backend="numba", threads=threads)


def run_harness(*, tiny: bool = False, repeat: int = 50, out_dir: Path | str | None = None,
                show: bool = True) -> dict:
    """Run every case; print the tables (unless show=False); write bench.json and bench.md into out_dir only when
    one is given; return the JSON object."""
    from .. import _console

    device = Device(tiny)
    repeat = 1 if tiny else repeat
    threads = TINY_THREADS if tiny else 128
    copy_bw = device.copy_bandwidth(repeat)
    matmul = device.matmul_rate(repeat)
    rows = []
    cases = TINY_CASES if tiny else GPU_CASES
    with _console.progress(len(cases), "bench cases") as step:
        for case in cases:
            host, inputs = _rotated_inputs(device, case)
            attrs = dict(case.ppl_case().attrs(), backend="numba", threads=threads)
            calls = [lambda x=x, attrs=attrs: cacheattn.multi_head_cache_attention(**x, **attrs) for x in inputs]
            ms = device.median_ms(calls, repeat)
            host_ms = device.host_ms(calls[0], max(1, repeat // 5))
            gb_per_s = case.must_move["kv"] / (ms * 1e-3) / 1e9
            rows.append(Row(case.label, ms, host_ms, gb_per_s, gb_per_s * 1e9 / copy_bw,
                            case.flops / (ms * 1e-3) / 1e12, _peers(device, case, host, repeat, threads)))
            step(f"{case.label}: {ms:.3f} ms")
    result = {"device": device.describe(), "copy_bandwidth_gb_per_s": copy_bw / 1e9,
              "fp16_matmul_tflops": matmul / 1e12, "repeat": repeat, "rows": [asdict(r) for r in rows]}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "bench.md").write_text(markdown_table(result))
    if show:
        for table in tables(result):
            _console.print_table(table)
        for line in _unmeasured_peers(result["rows"]):
            _console.say(line)
    return result


def _describe(result: dict) -> str:
    d = result["device"]
    return (f"Device: {d['device']}" + "".join(f", {k} {d[k]}" for k in ("driver", "cupy", "torch", "numba") if k in d)
            + f". Ceilings measured in this run: copy {result['copy_bandwidth_gb_per_s']:.0f} GB/s, float16 matmul "
            f"{result['fp16_matmul_tflops']:.1f} TFLOP/s; median of {result['repeat']} calls.")


def _ms(ms: float) -> str:
    return "-" if math.isnan(ms) else f"{ms:.3f}"


def tables(result: dict) -> list:
    """The run as two `_console` tables: our kernel per case against the ceilings, then every peer (the other
    rungs of the ladder among them) per case with its time, its ratio to ours and the TFLOP/s of its time."""
    from .. import _console

    ours = _console.make_table(_describe(result), (
        _console.Column("case", "label"), _console.Column("ms", show=_ms, right=True, means="device milliseconds"),
        _console.Column("host ms", "host_ms", _ms, right=True, means="issuing one call, no sync"),
        _console.Column("GB/s", "gb_per_s", lambda v: f"{v:.1f}", right=True, means="K/V bytes read per second"),
        _console.Column("% copy", "bandwidth_share", lambda v: f"{100 * v:.1f}", right=True,
                        means="of the copy bandwidth"),
        _console.Column("TFLOP/s", "tflops", lambda v: f"{v:.2f}", right=True)),
        [(r["label"], r["ms"], r["host_ms"], r["gb_per_s"], r["bandwidth_share"], r["tflops"])
         for r in result["rows"]])
    peers = _console.make_table("Peers and the other rungs on the same problems (- : not measured)", (
        _console.Column("case", "label"), _console.Column("peer"),
        _console.Column("ms", show=_ms, right=True),
        _console.Column("ratio", show=lambda v: "-" if math.isnan(v) else f"{v:.2f}x", right=True,
                        means="peer time / ours: above 1, ours is faster"),
        _console.Column("TFLOP/s", "tflops", lambda v: "-" if math.isnan(v) else f"{v:.2f}", right=True,
                        means="the case's flops in the peer's time")),
        [(r["label"], name, ms, ms / r["ms"], r["tflops"] * r["ms"] / ms)
         for r in result["rows"] for name, ms in r["peers_ms"].items()])
    return [ours, peers]


def markdown_table(result: dict) -> str:
    """bench.md: both tables in markdown, then the peers that were not measured."""
    from .. import _console
    return "\n".join(_console.render_markdown(t) for t in tables(result)) + "".join(
        line + "\n" for line in _unmeasured_peers(result["rows"]))


def _unmeasured_peers(rows: list) -> list:
    """A note under the tables for each peer recorded as NaN (not installed, or failed), once."""
    names = dict.fromkeys(name for r in rows for name, ms in r["peers_ms"].items() if math.isnan(ms))
    return ["", "Not measured: " + ", ".join(names) + "."] if names else []
