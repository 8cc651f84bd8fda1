"""python -m cacheattn lab: the counters of every rung of the kernel ladder on a scaled-down decode launch.

The bench's headline decode (`bench_gpu.GPU_CASES`: paged GQA decode, B = 64, context 4096, 32 query / 8 kv heads,
head_dim 128, float16 query) is cut to a few blocks of the same block shape: B = 2, 4 query heads on 1 kv head (the
same GQA group of 4), the same head_dim, page size and threads, and a shorter context. Each rung runs one
`multi_head_cache_attention` call (the cache store, then attention; rung 4 at the split count the full launch
gets, 1, as 512 blocks fill 132 SMs) under `lab.record()` in numba's CUDA simulator.

Per block the figures scale with the keys a block walks; over the launch with the number of blocks: the full grid
has B x kv heads = 512 attention blocks where this one has 2. Lower bounds per resource (DRAM, shared memory, L1
sectors) come from `cacheattn.lab.bounds` on the full launch's figures, estimated from the counted ones: in
decode nearly every counted byte, sector and wavefront belongs to a key a block walks, so each metric is scaled by
(attention blocks x keys per sequence x head_dim) of the full launch over those of the counted one. The query and
output (one row per head, a 1/kvlen share) are scaled with them, which overstates them slightly; the DRAM / floor
row shows how far the estimate sits from the bytes the operator must move.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import cacheattn

from .. import _console
from ..examples import build_ppl
from . import bounds, recorder
from .bench_gpu import GPU_CASES, BenchCase

HEADLINE = GPU_CASES[0]                    # decode B64 ctx4096 paged fp16
CACHES = {"float16": 0, "int8": 8, "int4": 4}
RUNGS = (1, 2, 3, 4, 5)
# The bound model's bench case for each cache format of the headline decode.
BOUND_CASES = {case.cache: case for case in bounds.CASES if case.name.startswith("decode B64 ctx4096")}


def scaled_case(cache: str = "float16", context: int = 255, head_dim: int = HEADLINE.head_dim,
                batch: int = 2) -> BenchCase:
    """The headline decode with `batch` requests on one kv head (its GQA group kept), `context` cached tokens."""
    group = HEADLINE.num_heads // HEADLINE.num_kv_heads
    return replace(HEADLINE, label=f"decode B{batch} ctx{context} paged {cache} (scaled)", batch=batch,
                   context=context, num_heads=group, num_kv_heads=1, head_dim=head_dim, quant_bit=CACHES[cache])


def count_rung(case: BenchCase, rung: int, threads: int = 128) -> recorder.Recording:
    """One multi_head_cache_attention call of `case` at `rung`, recorded."""
    ppl = case.ppl_case()
    extra = {"num_splits": 1} if rung == 4 else {}
    with recorder.record() as rec:
        cacheattn.multi_head_cache_attention(**build_ppl(ppl), **ppl.attrs(), backend="numba", threads=threads,
                                             rung=rung, **extra)
    return rec


def derived(rec: recorder.Recording) -> dict:
    """Ratios a kernel engineer reads first: sectors per request and sector efficiency (distinct bytes the lanes asked
    for / 32 x sectors) of the K/V loads and of all global loads, shared wavefronts per request, warp-level
    barriers."""
    m, x = rec.metrics, rec.extra

    def ratio(a, b):
        return round(a / b, 3) if b else None

    # The attention kernels name the cache K/V `k_src.data` / `v_src.data` (one array when they share a cache).
    kv = [figures for launch in rec.launches for name, figures in launch.arrays.items() if "_src.data" in name]
    kv_requests, kv_sectors, kv_asked = (sum(f[key] for f in kv) for key in
                                         ("ld_requests", "ld_sectors", "ld_bytes_requested"))
    return {"K/V ld sectors/request": ratio(kv_sectors, kv_requests),
            "K/V ld sector efficiency": ratio(kv_asked, 32 * kv_sectors),
            "global ld sectors/request": ratio(m[recorder.SECTORS_LD], m[recorder.GLOBAL_LD]),
            "global ld sector efficiency": ratio(x["global_ld_bytes_requested"], 32 * m[recorder.SECTORS_LD]),
            "global st sectors/request": ratio(m[recorder.SECTORS_ST], m[recorder.GLOBAL_ST]),
            "shared ld wavefronts/request": ratio(m[recorder.WAVEFRONTS_LD], x["shared_ld_requests"]),
            "shared st wavefronts/request": ratio(m[recorder.WAVEFRONTS_ST], x["shared_st_requests"]),
            "barriers (warp-level)": x["barriers"]}


def grid_scale(counted: BenchCase, full: BenchCase) -> float:
    """Full launch over counted launch: attention blocks x keys per sequence x head_dim (see the module docstring)."""
    def size(case):
        return case.batch * case.num_kv_heads * (case.context + case.new_tokens) * case.head_dim
    return size(full) / size(counted)


def lower_bounds(rec: recorder.Recording, counted: BenchCase, cache: str) -> bounds.Bounds:
    """The full headline decode's per-resource lower bounds (derived) from this recording's counts."""
    full = replace(HEADLINE, quant_bit=CACHES[cache])
    metrics = dict(rec.metrics, **{bounds.GLOBAL_LOAD_BYTES: rec.extra["global_ld_bytes_requested"]})
    return bounds.bounds(metrics, grid_scale(counted, full), case=BOUND_CASES[cache])


def _bound_figures(b: bounds.Bounds) -> dict:
    return {"DRAM / floor (derived)": round(b.figures["DRAM / floor"].value, 3),
            "lower bound µs (derived)": round(b.bound_us, 1),
            "limited by": b.limiter,
            "HBM share at the bound": round(b.hbm_share, 3),
            **{f"{name} µs (derived)": round(fig.value, 1) for name, fig in b.resources.items()}}


def ladder(cache: str = "float16", context: int = 255, head_dim: int = HEADLINE.head_dim, threads: int = 128,
           rungs=RUNGS) -> dict:
    """Every rung's counters on the scaled decode, and the full launch's lower bounds: a JSON-ready dict."""
    case = scaled_case(cache, context, head_dim)
    result = {"case": asdict(case), "full_case": asdict(replace(HEADLINE, quant_bit=CACHES[cache])),
              "threads": threads, "rungs": {}, "scale": grid_scale(case, replace(HEADLINE, quant_bit=CACHES[cache])),
              "note": "counted in numba's CUDA simulator; DRAM bytes count every distinct sector of a launch once "
                      "(an L2 that holds the working set); figures are counts, never timings"}
    for rung in rungs:
        rec = count_rung(case, rung, threads)
        result["rungs"][str(rung)] = {
            "metrics": dict(rec.metrics), "extra": dict(rec.extra), "derived": derived(rec),
            "hazards": len(rec.hazards), "bounds": _bound_figures(lower_bounds(rec, case, cache)),
            "launches": [{"kernel": launch.kernel, "grid": list(launch.grid), "block": list(launch.block),
                          "metrics": launch.metrics, "dram": {k: list(v) for k, v in launch.dram.items()}}
                         for launch in rec.launches]}
    return result


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:,}" if isinstance(value, int) else f"{value:.3g}"


def print_table(result: dict) -> None:
    """Metric per row, rung per column (in the command's --format: text, markdown, or a JSON document)."""
    rungs = result["rungs"]
    names = list(recorder.METRICS) + list(next(iter(rungs.values()))["derived"])
    rows = [[name] + [r["metrics"][name] if name in r["metrics"] else r["derived"][name] for r in rungs.values()]
            for name in names]
    rows.append(["findings (race, uninitialized, out of bounds)"] + [r["hazards"] for r in rungs.values()])
    first = next(iter(rungs.values()))["bounds"]
    rows += [[name] + [r["bounds"].get(name) for r in rungs.values()] for name in first]
    case, full = result["case"], result["full_case"]
    columns = [_console.Column("metric (counted)", key="metric")] + [
        _console.Column(f"rung {rung}", key=f"rung_{rung}", show=_cell, right=True) for rung in rungs]
    _console.table(f"{case['label']}: {case['num_heads']} q / {case['num_kv_heads']} kv heads, head_dim "
                   f"{case['head_dim']}, {result['threads']} threads, whole call (cache store + attention)",
                   columns, rows)
    _console.say(f"Counted in numba's CUDA simulator, never timed. DRAM bytes: every distinct 32-byte sector of a "
                 f"launch once (an L2 that holds the working set). The full launch ({full['label']}) has "
                 f"{full['batch'] * full['num_kv_heads']} attention blocks where this one has "
                 f"{case['batch'] * case['num_kv_heads']}, and {full['context']} cached tokens per request where "
                 f"this has {case['context']}. The rows marked derived are lower bounds on the full launch's time on "
                 f"an {bounds.H100_SXM.name}: every counted figure scaled by {result['scale']:,.0f} (attention blocks "
                 f"x keys x head_dim, full over counted), over the machine's peak rates; never timings.")


def main(cache: str = "float16", quick: bool = False) -> int:
    """quick: head_dim 64 and 63 cached tokens (CI); otherwise head_dim 128 and 255 tokens."""
    print_table(ladder(cache, context=63 if quick else 255, head_dim=64 if quick else HEADLINE.head_dim))
    return 0
