"""python -m cacheattn lab: the counters of every rung of the kernel ladder, per bench case, and the lower bounds they
give on an H100 SXM.

The bench cases (`cases.LAB_CASES`, OpenPPL's: the headline paged GQA decode, B = 64 at context 4096, with
float16, int8 and int4 caches; B = 1 at context 32768; a causal prefill of 4096 tokens; 32 query / 8 kv heads,
head_dim 128; then `cases.OPERATOR_CASES`, the other operators' decode at the headline shape: TensorRT-LLM's
generation step with float16, INT8 and FP8 caches and its context step of 4096 tokens, ONNX with past,
FasterTransformer's cross-attention step) are far
too large for numba's CUDA simulator, which runs every thread in Python. Each is counted on launches of the same
block shape cut down twice:

- **across the grid**: one kv head with its GQA group of 4 query heads (1 in multi-head cross attention), and 2
  requests (decode B = 64) or 1. Blocks
  of different kv heads or requests do the same work on other bytes, so every figure of the full launch is the
  counted one times (requests x kv heads, full over counted);
- **along the sequence**: the same launch at a few lengths (`Plan.points`): decode at two context lengths, where
  every figure is a + b x keys (a: the query, the output, the block's setup; b: one key's loads, sectors and
  wavefronts), and the causal prefill at three prompt lengths (`PREFILL_POINTS`), where it is a + b N + c N^2
  (blocks of later query tiles walk more keys). The fit through the counted points, taken at the full length, is
  exact when every count is such a polynomial: the points are multiples of every rung's query tile and key step,
  and a test counts one more point and checks the fit predicts it.

Rung 4 runs at the split count its launcher picks for the *full* grid (`_split_k.choose_splits`: 1 for the B = 64
decode, whose 512 blocks fill 132 SMs; 33 for B = 1, its 8 blocks x 33 = 264 blocks), and its decode points are
multiples of splits x keys per step, so every split walks whole steps.

Every call is the whole operator (OpenPPL's `multi_head_cache_attention`: the cache store, then attention, then rung
4's combine; TensorRT-LLM's preprocess, attention, combine; ONNX's present copies, then attention; FasterTransformer's
query bias, then attention), recorded by `lab.record()`, at each rung its call offers (`case.rungs`), and each case
records what the operator's default call (no rung asked for) runs for the full launch (`default_call`: OpenPPL
`cacheattn.choose_kernel`'s choice), whose counts are that rung's column. The bounds (`bounds.bounds`) are derived
from the full launch's figures: lower bounds on time, never timings. Every launch of a run goes to one pool of `jobs`
processes, the longest first (`job_cost`).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kernels_numba._attention_gqa_mma import KEY_TILE as DECODE_TRIP
from kernels_numba._attention_vector import keys_per_step

from .. import _console, bounds
from . import recorder, sass
from .cases import ALL_LAB_CASES, LAB_CASES, BenchCase, TrtBenchCase

RUNGS = (1, 2, 3, 4, 5)
THREADS = 128
HMMA = recorder.HMMA
# The causal prefill's prompt lengths: the shortest whose counts lie on the parabola through the full launch's
# (multiples of every rung's query tile and of rungs 1-4's key step; rung 5's step of 64 keys masks the same
# share of its last step at each; tests/test_lab_counters.py checks a fourth point). They reproduce the counts of
# 64, 128 and 192 tokens at a sixteenth of the simulator's time.
PREFILL_POINTS = (16, 32, 48)
# The decode's context lengths: where the page table's DRAM sectors grow as the keys do, so the fit through them
# leaves the DRAM bytes within 0.01% of the full launch's; rung 1, the slowest to count and bound by shared memory
# (whose counts are linear from the shortest), at half of them.
DECODE_POINTS = (128, 256)
RUNG1_DECODE_POINTS = (64, 128)


@dataclass(frozen=True)
class Plan:
    """How one bench case is counted: `counted` is the case cut down across the grid; `points` are the lengths
    (decode: cached tokens + 1, the keys; prefill: new tokens) the launch is counted at, the fit's degree one less
    than their number."""
    case: BenchCase
    counted: BenchCase
    points: tuple
    rungs: tuple = RUNGS
    split_points: tuple = ()         # (rung, points) of the rungs that split: multiples of splits x keys per step

    def points_for(self, rung: int) -> tuple:
        for split_rung, points in self.split_points:
            if split_rung == rung:
                return points
        return RUNG1_DECODE_POINTS if rung == 1 and self.points == DECODE_POINTS else self.points

    def splits(self, rung: int, threads: int = THREADS) -> int:
        """The split count `rung` runs the *full* launch at (1 where it does not split)."""
        return self.case.splits(rung, threads) if rung in (1, 4, 5) and not self.prefill else 1

    @property
    def prefill(self) -> bool:
        return self.case.new_tokens > 1

    @property
    def grid_scale(self) -> float:
        """Requests x kv heads of the full launch over the counted launch's."""
        return (self.case.batch * self.case.num_kv_heads) / (self.counted.batch * self.counted.num_kv_heads)

    @property
    def full_length(self) -> int:
        return self.case.new_tokens if self.prefill else self.case.kvlen

    def at(self, length: int) -> BenchCase:
        """The counted case at one of the points."""
        if self.prefill:
            return replace(self.counted, new_tokens=length, context=0, label=f"{self.counted.label} N{length}")
        if hasattr(self.counted, "with_keys"):          # a case whose keys are not a cache plus the new token
            return self.counted.with_keys(length)
        return replace(self.counted, context=length - 1, label=f"{self.counted.label} kv{length}")


def cut_down(case: BenchCase, head_dim: int | None = None) -> BenchCase:
    """`case` with one kv head and its GQA group (4 query heads in the GQA cases, 1 in multi-head attention), two
    requests at most (the counted launch's grid)."""
    return replace(case, label=f"{case.label} (counted)", batch=min(case.batch, 2),
                   num_heads=case.num_heads // case.num_kv_heads, num_kv_heads=1, head_dim=head_dim or case.head_dim)


def case_chunk(case, rung: int) -> int:
    """Elements a lane of `rung` loads at once from the case's cache (`_cache.chunk_elements`)."""
    return case.chunk(rung)


def split_steps(case, threads: int = THREADS) -> dict:
    """{rung: (split count, keys a block takes per step)} of the rungs that split the full launch of `case`, as its
    operator picks them on a 132-SM GPU (OpenPPL: `choose_kernel`; TensorRT-LLM: multi-block mode): rung 4, and
    rung 5's decode kernel (a warp's trip of 16 keys a step)."""
    out = {4: (case.splits(4, threads), keys_per_step(case.head_dim, case.chunk(3), threads // 32))}
    if 5 in case.rungs:
        out[5] = (case.splits(5, threads), DECODE_TRIP * (threads // 32))
    return out


def plans(quick: bool = False) -> list[Plan]:
    """Every bench case's counting plan (OpenPPL's five, then the other operators'); quick (CI): the float16 decode
    alone, head_dim 64, short contexts."""
    # Decode points: multiples of every rung's keys per block step (rung 5: 4 warps x 16 keys; rung 1: 32).
    if quick:
        decode = replace(LAB_CASES[0], head_dim=64, label=f"{LAB_CASES[0].label} head_dim 64")
        return [Plan(decode, cut_down(decode), (64, 128))]
    out = []
    for case in ALL_LAB_CASES:
        counted = cut_down(case)
        if case.new_tokens > 1:
            out.append(Plan(case, counted, PREFILL_POINTS, rungs=case.rungs))
            continue
        if 1 in case.rungs and case.splits(1) > 1:
            raise ValueError(f"{case.label}: rung 1 splits the full launch; its points would need its key tile")
        split_points = tuple((rung, (splits * step, 2 * splits * step))
                             for rung, (splits, step) in split_steps(case).items() if splits > 1)
        out.append(Plan(case, counted, DECODE_POINTS, rungs=case.rungs, split_points=split_points))
    return out


# ------------------------------------------------------------------------------------------------------- counting

def count_rung(case, rung: int, threads: int = THREADS, num_splits: int = 1) -> recorder.Recording:
    """One call of `case`'s operator at `rung` (rung 4, and TensorRT-LLM's rung 1, at `num_splits`), recorded."""
    with recorder.record() as rec:
        case.call(rung, threads, num_splits)
    return rec


def figures(rec: recorder.Recording, case: BenchCase) -> dict:
    """Every count of one recording in one flat dict: the Nsight metrics, the extras, the K/V loads alone, the
    attention launch's blocks, and the K/V bytes its blocks must see (each block every key visible to its rows,
    K and V, once)."""
    out = dict(rec.metrics)
    out.update(rec.extra)
    names = (case.kv_arrays,) if isinstance(case.kv_arrays, str) else case.kv_arrays
    attention = [launch for launch in rec.launches if "attention" in launch.kernel]
    # the attention kernel's K/V loads (ONNX's rung-1 copy kernel reads the same past before it)
    kv = [f for launch in attention for name, f in launch.arrays.items() if any(n in name for n in names)]
    for key in ("ld_requests", "ld_sectors", "ld_bytes_requested"):
        out[f"kv_{key}"] = sum(f[key] for f in kv)
    (grid_x, grid_y, grid_z), = {launch.grid for launch in attention}
    out["attention blocks"] = grid_x * grid_y * grid_z
    q_tile = math.ceil(case.new_tokens / grid_x)
    visible = sum(min(case.kvlen, case.context + (t + 1) * q_tile) for t in range(grid_x))
    out["kv_must_see"] = visible * grid_y * case.batch * 2 * case.row_bytes
    out["hazards"] = len(rec.hazards)
    return out


def _count(job):
    plan, rung, length, threads, splits = job
    case = plan.at(length)
    return figures(count_rung(case, rung, threads, splits), case)


def _job_label(job) -> str:
    """What a progress bar says of one counted launch: the case, the rung and the length."""
    plan, rung, length = job[:3]
    return f"{_short(plan.case.label)} rung {rung}, {length} {'new tokens' if plan.prefill else 'keys'}"


def launches(selected, rungs=None) -> int:
    """How many launches counting the plans `selected` at `rungs` (default: each plan's) records: the progress
    bar's total."""
    return sum(len(plan_jobs(plan, rungs=rungs)) for plan in selected)


def fit(points, values, at: float) -> float:
    """The polynomial of degree len(points) - 1 through (points, values), at `at` (exact for integer counts that
    are such a polynomial; rounded back to the nearest integer when the value is a count)."""
    coefficients = np.polyfit(np.asarray(points, np.float64), np.asarray(values, np.float64), len(points) - 1)
    return float(np.polyval(coefficients, at))


def full_figures(lengths, plan: Plan, counted: list[dict]) -> dict:
    """The full launch's figures from the figures counted at `lengths`: fitted along the sequence, times the grid
    scale."""
    out = {}
    for key in counted[0]:
        value = fit(lengths, [c[key] for c in counted], plan.full_length)
        out[key] = value if key == "hazards" else value * plan.grid_scale
    out["hazards"] = max(c["hazards"] for c in counted)
    return out


# --------------------------------------------------------------------------------------------------- derivations

def derived(full: dict, plan: Plan, splits: int) -> dict:
    """The ratios a kernel engineer reads first, from the full launch's figures."""
    def ratio(a, b):
        return round(a / b, 3) if b else None

    case = plan.case
    mma_floor = case.flops / 4096
    return {"K/V ld sectors/request": ratio(full["kv_ld_sectors"], full["kv_ld_requests"]),
            "K/V ld sector efficiency": ratio(full["kv_ld_bytes_requested"], 32 * full["kv_ld_sectors"]),
            # the K/V loads are the values (KV_ARRAYS); kv_must_see counts whole rows, scales included
            "K/V reads per block (loaded / must see)": ratio(full["kv_ld_bytes_requested"],
                                                             full["kv_must_see"] * case.value_bytes / case.row_bytes),
            "global ld sector efficiency": ratio(full["global_ld_bytes_requested"],
                                                 32 * full[recorder.SECTORS_LD]),
            "shared ld wavefronts/request": ratio(full[recorder.WAVEFRONTS_LD], full["shared_ld_requests"]),
            "shared st wavefronts/request": ratio(full[recorder.WAVEFRONTS_ST], full["shared_st_requests"]),
            "barriers (warp-level) per key a block sees": ratio(full["barriers"],
                                                                full["kv_must_see"] / (2 * case.row_bytes)),
            "HMMA / (FLOPs / 4096)": ratio(full[HMMA], mma_floor) if full[HMMA] else None,
            "blocks (attention)": round(full["attention blocks"]),
            "splits": splits}


def lower_bounds(full: dict, plan: Plan) -> bounds.Bounds:
    """The full launch's per-resource lower bounds (derived), its work spread over the SMs by its blocks."""
    metrics = {name: full[name] for name in recorder.METRICS}
    metrics[bounds.GLOBAL_LOAD_BYTES] = full["global_ld_bytes_requested"]
    # A rung without mma runs the operator's multiply-adds as float32 FMA on the CUDA cores.
    return bounds.bounds(metrics, case=plan.case, mma=full[HMMA] or None,
                         fma_flops=None if full[HMMA] else plan.case.flops, blocks=round(full["attention blocks"]))


def sass_key(case, rung: int) -> str | None:
    """The committed SASS variant (docs/kernel-ladder-sass.json) of `case`'s decode kernel at `rung`: OpenPPL's
    launch, or TensorRT-LLM's generation step; None for the other operators (their kernels are not compiled
    there)."""
    prefix = {BenchCase: "", TrtBenchCase: "trtllm-"}.get(type(case))
    return None if prefix is None else f"{prefix}rung{rung}-{case.cache}-decode"


def issue_estimate(full: dict, plan: Plan, rung: int, threads: int) -> float | None:
    """Microseconds the busiest SM needs to issue the key loop's warp instructions: the loop body of the committed
    SASS (docs/kernel-ladder-sass.json, decode at head_dim 128, 128 threads) once per trip of every warp. An
    estimate, not a bound: the static body holds the instructions of branches a trip skips, so it over-counts
    those; it leaves out what runs outside the loop. For rungs 2 to 5 in decode, whose loop holds no inner loop
    but page walks, each counted once: a walk runs at most once a trip while a page holds a block's step of keys
    (rung 5: its register-fed decode kernel, a warp's trip of 16 keys)."""
    case, machine = plan.case, sass.committed()
    shapes = machine["shapes"]
    variant = machine["variants"].get(sass_key(case, rung))
    if (plan.prefill or rung not in (2, 3, 4, 5) or variant is None
            or variant["key_loop"]["inner_loops"] > variant["key_loop"].get("walk_loops", 0)
            or (case.head_dim, threads) != (shapes["head_dim"], shapes["threads"])):
        return None
    warps = threads // 32
    if rung == 2:
        keys_per_trip = 1                              # a warp per key
    elif rung == 5:                                    # a warp's trip of keys
        if variant["kernel"] != "gqa_decode_attention_kernel" or case.page_size % DECODE_TRIP:
            return None
        keys_per_trip = DECODE_TRIP
    else:                                              # a tile of keys per lane group
        step = keys_per_step(case.head_dim, case_chunk(case, rung), warps)
        if case.cache_mode == 1 and case.page_size < step:
            return None                                # a walk may run more than once a trip
        keys_per_trip = step // warps
    trips = full["kv_must_see"] / (2 * case.row_bytes) / keys_per_trip
    issue = bounds.bounds({}, warp_instructions=trips * variant["key_loop"]["mix"]["total"],
                          blocks=round(full["attention blocks"]))
    return issue.resources["issue"].value


def latency_figures(full: dict, plan: Plan, rung: int, threads: int) -> dict | None:
    """Little's law for the key loop's loads (`bounds.latency_bound`): the most bytes a warp of the committed SASS
    has in flight at once (`sass.loads_in_flight`, decode at head_dim 128, 128 threads) x the warps an SM holds
    (`sass.occupancy`), against what HBM needs per SM, and the time that leaves the DRAM bytes. An estimate, like
    the issue row, never taken as the limit: the bytes in flight come from one pass over the static loop body, the
    latency is an unloaded microbenchmark's. None where the committed SASS has no such variant or another shape (as
    `issue_estimate`)."""
    case, machine = plan.case, sass.committed()
    shapes = machine["shapes"]
    variant = machine["variants"].get(sass_key(case, rung))
    if (plan.prefill or rung not in (2, 3, 4, 5) or variant is None or "in_flight" not in variant["key_loop"]
            or (case.head_dim, threads) != (shapes["head_dim"], shapes["threads"])):
        return None
    figures = bounds.latency_bound(full[recorder.DRAM_READ] + full[recorder.DRAM_WRITE],
                                   variant["key_loop"]["in_flight"]["peak"], variant["occupancy"]["warps_per_sm"],
                                   blocks=round(full["attention blocks"]))
    return {"loads in flight / needed (SASS estimate)": round(figures["in flight / needed"].value, 3),
            "latency µs (Little's law estimate)": round(figures["latency"].value, 1)}


def bound_figures(b: bounds.Bounds, case: BenchCase) -> dict:
    out = {"DRAM / floor (derived)": round(b.figures["DRAM / floor"].value, 3),
           "lower bound µs (derived)": round(b.bound_us, 1),
           "limited by": b.limiter,
           "HBM share at the bound": round(b.hbm_share, 3)}
    if case.new_tokens > 1:
        out["TFLOP/s at the bound (derived)"] = round(case.flops / (b.bound_us * 1e-6) / 1e12, 1)
    out.update({f"{name} µs (derived)": round(fig.value, 1) for name, fig in b.resources.items()})
    return out


def plan_jobs(plan: Plan, threads: int = THREADS, rungs=None) -> list[tuple]:
    """The launches counting `plan` takes: (plan, rung, length, threads, splits) each."""
    rungs = [r for r in rungs or plan.rungs if r in plan.rungs]
    return [(plan, rung, length, threads, plan.splits(rung, threads)) for rung in rungs
            for length in plan.points_for(rung)]


def job_cost(job) -> float:
    """A rough relative cost of counting one launch in the simulator (threads x key-loop trips: decode grows with
    the keys, the causal prefill with their square; rung 1 stages every key through shared memory): the order
    the pool takes them, longest first, so neither process idles at the end."""
    plan, rung, length = job[:3]
    per_key = {1: 3.0, 2: 1.5, 5: 1.2}.get(rung, 0.7) * plan.counted.batch
    return per_key * (length * length / 24 if plan.prefill else length / 2 if rung == 4 else length)


def count_jobs(work: list, jobs: int = 1, on_count=None) -> list[dict]:
    """The figures of every launch of `work`, in its order; `jobs` processes side by side, taking the longest
    launches first. on_count(label): once per counted launch, as it finishes (a progress bar's step)."""
    on_count = on_count or (lambda label: None)
    if jobs <= 1:
        counted = []
        for job in work:
            counted.append(_count(job))
            on_count(_job_label(job))
        return counted
    order = sorted(range(len(work)), key=lambda i: -job_cost(work[i]))
    # One pool for every case, fresh interpreters, not forks: the parent may be drawing a progress bar from a
    # thread, and a fork taken while that thread holds the stderr lock would leave the child unable to write a
    # warning.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_count, work[i]): i for i in order}
        for future in as_completed(futures):
            on_count(_job_label(work[futures[future]]))
        done = {i: future.result() for future, i in futures.items()}
    return [done[i] for i in range(len(work))]


def count_plan(plan: Plan, threads: int = THREADS, jobs: int = 1, rungs=None, on_count=None) -> dict:
    """Every rung of one plan: the counted points, the full launch's figures, derived ratios and bounds.
    on_count(label) is called once per counted launch, as it finishes (a progress bar's step)."""
    work = plan_jobs(plan, threads, rungs)
    return assemble(plan, work, count_jobs(work, jobs, on_count), threads)


def assemble(plan: Plan, work: list, counted: list, threads: int = THREADS) -> dict:
    """One plan's result from its launches (`plan_jobs`) and their figures: per rung the counted points, the full
    launch's figures, derived ratios and bounds; and what the operator's default call runs (`default`)."""
    n = len(plan.points)
    result = {"case": asdict(plan.case), "operator": plan.case.operator, "counted": asdict(plan.counted),
              "points": list(plan.points),
              "fit": f"degree {n - 1} in {'new tokens' if plan.prefill else 'keys'}", "grid_scale": plan.grid_scale,
              "threads": threads, "default": default_call(plan, threads), "rungs": {}}
    by_rung = {}
    for job, figures_ in zip(work, counted):
        by_rung.setdefault(job[1], []).append(figures_)
    for rung, points in by_rung.items():
        lengths = plan.points_for(rung)
        full = full_figures(lengths, plan, points)
        splits = plan.splits(rung, threads)
        result["rungs"][str(rung)] = {
            "points": list(lengths), "counted": points, "full": {k: round(v, 1) for k, v in full.items()},
            **derivations(full, plan, rung, threads, splits)}
    return result


def default_call(plan: Plan, threads: int = THREADS) -> dict:
    """What the operator's default call (no rung asked for) runs for the full launch: its rung, split count, block
    size and reason (OpenPPL: `cacheattn.choose_kernel`'s choice), and the rung column whose counts are that call's
    (None when the default runs another split count or block size than the column was counted at)."""
    chosen = plan.case.default_plan(threads)
    same = chosen["threads"] == threads and chosen["rung"] in plan.rungs \
        and chosen["num_splits"] == plan.splits(chosen["rung"], threads)
    return {**chosen, "counted as": str(chosen["rung"]) if same else None}


def derivations(full: dict, plan: Plan, rung: int, threads: int, splits: int) -> dict:
    """A rung's derived ratios and bounds from its full-launch figures (no counting)."""
    out = {"derived": derived(full, plan, splits), "bounds": bound_figures(lower_bounds(full, plan), plan.case)}
    issue = issue_estimate(full, plan, rung, threads)
    if issue is not None:
        out["bounds"]["issue µs (SASS estimate)"] = round(issue, 1)
    out["bounds"].update(latency_figures(full, plan, rung, threads) or {})
    return out


def rederive(result: dict) -> dict:
    """`result` (what `ladder` returned) with every derivation made again from its full-launch figures: after a
    change to the bound model or to the committed SASS that moves no count."""
    by_label = {p.case.label: p for p in plans() + plans(quick=True)}
    for label, case in every_case(result):
        case["operator"] = by_label[label].case.operator
        case["default"] = default_call(by_label[label], case["threads"])
        for rung, shown in case["rungs"].items():
            shown.update(derivations(shown["full"], by_label[label], int(rung), case["threads"],
                                     shown["derived"]["splits"]))
    return result


def section(case) -> str:
    """Where a written result keeps a case: OpenPPL's bench cases under "cases" (the ladder page's rungs and its
    plot), the other operators' under "operators"."""
    return "cases" if isinstance(case, BenchCase) else "operators"


def every_case(result: dict):
    """(label, case) of every case a written result holds, OpenPPL's first."""
    return [item for key in ("cases", "operators") for item in result.get(key, {}).items()]


def selected_plans(quick: bool = False, cases=None) -> list[Plan]:
    """The plans `ladder` counts: every bench case's, or those whose labels `cases` names."""
    return [p for p in plans(quick) if cases is None or p.case.label in cases]


def ladder(quick: bool = False, threads: int = THREADS, jobs: int = 1, cases=None, rungs=None,
           on_count=None) -> dict:
    """Every bench case x rung (or the `cases` labels and `rungs` named): a JSON-ready dict (what `--format json`
    and the ladder page read). on_count(label): once per counted launch (`count_plan`)."""
    selected = selected_plans(quick, cases)
    work = {p.case.label: plan_jobs(p, threads, rungs) for p in selected}
    every = [job for jobs_ in work.values() for job in jobs_]
    counted = iter(count_jobs(every, jobs, on_count))        # one pool for every case's launches
    result = {"machine": asdict(bounds.H100_SXM),
              "note": "counted in numba's CUDA simulator on cut-down launches and scaled to the full grid (see "
                      "cacheattn/lab/counters.py); DRAM bytes count every distinct sector of a launch once (an L2 "
                      "that holds the working set); the bounds are derived lower bounds on time, never timings",
              "cases": {}}
    for p in selected:
        shown = assemble(p, work[p.case.label], [next(counted) for _ in work[p.case.label]], threads)
        result.setdefault(section(p.case), {})[p.case.label] = shown
    return result


def splice(result: dict, into: dict) -> dict:
    """`into` (a written ladder) with the cases x rungs of `result` put in their places, every derivation then made
    again: recounting the rungs a kernel change touched keeps the rest of a full run."""
    for key in ("cases", "operators"):
        for label, case in result.get(key, {}).items():
            held = into.setdefault(key, {})
            if label not in held:
                held[label] = case                       # a case the file did not count yet
            elif case["threads"] != held[label]["threads"]:
                raise ValueError(f"{label} at {case['threads']} threads is not in the file to update")
            else:
                held[label]["rungs"].update(case["rungs"])
        if key in into:          # in the order the code lists the cases (one counted for the first time included)
            order = {known.label: i for i, known in enumerate(ALL_LAB_CASES)}
            into[key] = dict(sorted(into[key].items(), key=lambda item: order.get(item[0], len(order))))
    return rederive(into)


# --------------------------------------------------------------------------------------------------------- tables

def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1000:
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:.3g}"


FULL_ROWS = (recorder.SECTORS_LD, recorder.WAVEFRONTS_LD, recorder.WAVEFRONTS_ST, recorder.CONFLICTS_LD,
             recorder.CONFLICTS_ST, recorder.DRAM_READ, recorder.DRAM_WRITE, HMMA)


def print_case(label: str, result: dict) -> None:
    """Figure per row, rung per column (in the command's --format: text, markdown, or a JSON document)."""
    rungs = {f"rung {rung}": shown for rung, shown in result["rungs"].items()}
    default = result.get("default") or {}
    # The operator's default call beside the rungs, as the column of the rung it runs (when there are others).
    if default.get("counted as") in result["rungs"] and len(rungs) > 1:
        rungs[f"default (rung {default['counted as']})"] = result["rungs"][default["counted as"]]
    first = next(iter(rungs.values()))
    rows = [[f"{name} (full, counted)"] + [r["full"][name] for r in rungs.values()] for name in FULL_ROWS]
    rows += [[name] + [r["derived"][name] for r in rungs.values()] for name in first["derived"]]
    rows.append(["findings (race, uninitialized, out of bounds)"] + [r["full"]["hazards"] for r in rungs.values()])
    bound_names = dict.fromkeys(name for r in rungs.values() for name in r["bounds"])    # rungs differ: FMA, issue
    rows += [[name] + [r["bounds"].get(name) for r in rungs.values()] for name in bound_names]
    columns = [_console.Column("figure", key="metric")] + [
        _console.Column(name, key=name.split(" (")[0].replace(" ", "_"), show=_cell, right=True) for name in rungs]
    counted = result["counted"]
    along = result["fit"].split(" in ")[-1]         # keys, or new tokens
    _console.table(f"{label}: counted with {counted['num_heads']} q / {counted['num_kv_heads']} kv head, batch "
                   f"{counted['batch']}, at {', '.join(map(str, result['points']))} {along} ({result['fit']}), "
                   f"x {result['grid_scale']:g} across the grid; head_dim {counted['head_dim']}, "
                   f"{result['threads']} threads",
                   columns, rows)
    if default:
        _console.say(f"{result.get('operator', BenchCase.operator)}'s default call: rung {default['rung']}, "
                     f"{default['num_splits']} split(s), {default['threads']} threads ({default['reason']})")


def print_ladder(result: dict) -> None:
    for label, case in every_case(result):
        print_case(label, case)
    _console.say("Counted in numba's CUDA simulator on cut-down launches, never timed: one kv head with its query "
                 "heads (4 in GQA, 1 in multi-head attention), at the lengths named, fitted along the sequence and "
                 "scaled across the grid "
                 "(cacheattn/lab/counters.py says how). DRAM bytes: every distinct 32-byte sector of a launch once "
                 "(an L2 that holds the working set). Rows marked derived are lower bounds on the full launch's "
                 f"time on an {bounds.H100_SXM.name} (its peak rates, the busiest SM's share of the blocks), never "
                 "timings. The issue row is an estimate, not a bound: the key loop's static SASS body once per trip "
                 "of every warp. The latency row, an estimate too, is Little's law: the loads a warp of the SASS key "
                 "loop has in flight at most, times the warps an SM holds, against HBM's bandwidth x its latency per "
                 "SM.")


# The command line's names of the bench cases.
CASE_NAMES = dict(zip(("decode", "decode-int8", "decode-int4", "decode-32k", "prefill-4k", "trtllm-decode",
                       "trtllm-decode-int8", "trtllm-decode-fp8", "trtllm-context", "onnx-decode", "ft-cross"),
                      (case.label for case in ALL_LAB_CASES)))


def main(quick: bool = False, cases=None, rungs=None, jobs: int | None = None, write: Path | None = None,
         rederive_file: Path | None = None, update: Path | None = None) -> int:
    """quick: the float16 decode at head_dim 64 (CI); otherwise the named bench cases (`CASE_NAMES`; all of them when
    none is named) at head_dim 128, at the `rungs` named (all when none is). write: a file for the JSON as well.
    rederive_file: no counting; that file's derivations made again (and written back unless `write` names another
    file). update: a written file that takes what was counted in place of its own figures (`splice`)."""
    jobs = jobs or (1 if quick else min(2, os.cpu_count() or 1))
    if rederive_file is not None:
        result = rederive(json.loads(rederive_file.read_text()))
        write = write or rederive_file
    else:
        labels = [CASE_NAMES[c] for c in cases] if cases else None
        # A bar on stderr when it is a terminal (the full run takes minutes): one step per launch.
        with _console.progress(launches(selected_plans(quick, labels), rungs), "counting launches") as step:
            result = ladder(quick, jobs=jobs, cases=labels, rungs=rungs, on_count=step)
    if update is not None:
        try:
            write_json(update, splice(result, json.loads(update.read_text())))
        except ValueError as exc:
            print(f"python -m cacheattn lab --update: {exc}", file=sys.stderr)
            return 2
    if write is not None:
        write_json(write, result)
    print_ladder(result)
    return 0


def write_json(path: Path, result: dict) -> None:
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------------------- the ladder page

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "kernel-ladder-counts.json"


def committed(path: Path = COMMITTED) -> dict:
    """The committed full run (`python -m cacheattn lab --write docs/kernel-ladder-counts.json`), which the ladder
    page shows; tests/test_lab_counters.py recounts one of its points to keep it current."""
    return json.loads(path.read_text())


def _short(label: str) -> str:
    return label.replace("decode B64 ctx4096 paged ", "B64 ").replace("decode B1 ctx32768 paged fp16", "B1 32k") \
        .replace("prefill B1 4096 tokens fp16", "prefill 4k").replace("trtllm generation B64 ctx4096 paged ", "TRT ") \
        .replace("trtllm context B1 4096 tokens fp16", "TRT context 4k") \
        .replace("onnx decode B64 past4096 fp16", "ONNX B64").replace("ft cross-attention B64 enc1024 fp16", "FT cross")


def case_of(label: str, fields: dict):
    """The bench case a written result names (an OpenPPL case the file holds but the code no longer lists: from
    its fields)."""
    known = {case.label: case for case in ALL_LAB_CASES}
    return known.get(label) or BenchCase(**fields)


def rung_summary(result: dict, rung: int) -> str:
    """One rung against every bench case, a line each: its lower bound and limiter, DRAM / floor, how much of its
    K/V sectors it uses, how often a block reads its K/V, bank conflicts per key, and HMMA over the FLOPs."""
    lines = []
    for label, case in result["cases"].items():
        r = case["rungs"].get(str(rung))
        if r is None:
            continue
        b, d = r["bounds"], r["derived"]
        conflicts = key_loop_conflicts(r, case_of(label, case["case"]).row_bytes)
        line = (f"{_short(label):<10} ≥ {b['lower bound µs (derived)']:>7,.1f} µs ({b['limited by']}, "
                f"{b['HBM share at the bound']:.0%} of HBM); DRAM/floor {b['DRAM / floor (derived)']:.3f}; K/V sectors "
                f"{d['K/V ld sector efficiency']:.0%} used, read {d['K/V reads per block (loaded / must see)']:.2f}x "
                f"a block; {conflicts}")
        if d["splits"] > 1:
            line += f"; {d['splits']} splits, {d['blocks (attention)']} blocks"
        if d["HMMA / (FLOPs / 4096)"]:
            line += f"; HMMA {d['HMMA / (FLOPs / 4096)']:.2f}x FLOPs/4096"
        if "issue µs (SASS estimate)" in b:
            line += f"; issue ≈ {b['issue µs (SASS estimate)']:,.0f} µs (SASS estimate)"
        if "TFLOP/s at the bound (derived)" in b:
            line += f"; {b['TFLOP/s at the bound (derived)']:.0f} TFLOP/s"
        lines.append(line)
    return "\n".join(lines)


def key_loop_conflicts(shown: dict, row_bytes: int) -> str:
    """A rung's shared-memory bank conflicts (loads and stores) as the key loop adds them, per key a block sees:
    the slope between its last two counted points, so what a block does once (the warps' merge at the end) is
    told apart; for a decode, whose counts are linear in the keys, that once-a-block part too."""
    def keys_and_conflicts(point):
        return (point["kv_must_see"] / (2 * row_bytes),
                point[recorder.CONFLICTS_LD] + point[recorder.CONFLICTS_ST])

    (keys0, conflicts0), (keys1, conflicts1) = map(keys_and_conflicts, shown["counted"][-2:])
    per_key = (conflicts1 - conflicts0) / (keys1 - keys0)
    text = f"{per_key:.2f} conflicts/key in the key loop"
    once = (conflicts1 - per_key * keys1) / shown["counted"][-1]["attention blocks"]
    if len(shown["counted"]) == 2 and round(once):
        text += f" + {once:,.0f} a block outside it"
    return text


def _share(x) -> str:
    """A fraction as a percentage, or "n/a" where the recorder attributed no load to the K/V arrays."""
    return "n/a" if x is None else f"{x:.0%}"


def operators_summary(result: dict) -> str:
    """Every case of the other operators, a line per rung counted: its lower bound and limiter, DRAM / floor, how
    much of its K/V sectors it uses and how often a block reads its K/V, bank conflicts per key; the rung the
    operator's default call runs marked `default`."""
    lines = []
    for label, case in result.get("operators", {}).items():
        default = case["default"]
        lines.append(f"{label} ({case['operator']}); default call: rung {default['rung']}, "
                     f"{default['num_splits']} split(s): {default['reason']}")
        row_bytes = case_of(label, case["case"]).row_bytes
        for rung, r in case["rungs"].items():
            b, d = r["bounds"], r["derived"]
            conflicts = key_loop_conflicts(r, row_bytes)
            mark = "  default" if default["counted as"] == rung else ""
            # A prefill is held by its arithmetic: its tensor-core work against the FLOPs, and the rate at its bound.
            arithmetic = "".join((f"; HMMA {d['HMMA / (FLOPs / 4096)']:.3f}x FLOPs/4096" if d["HMMA / (FLOPs / 4096)"]
                                  else "", f"; {b['TFLOP/s at the bound (derived)']:.0f} TFLOP/s"
                                  if "TFLOP/s at the bound (derived)" in b else ""))
            lines.append(f"  rung {rung}: ≥ {b['lower bound µs (derived)']:>7,.1f} µs ({b['limited by']}, "
                         f"{b['HBM share at the bound']:.0%} of HBM); DRAM/floor {b['DRAM / floor (derived)']:.3f}; "
                         f"K/V sectors {_share(d['K/V ld sector efficiency'])} used, read "
                         f"{d['K/V reads per block (loaded / must see)']:.2f}x a block; {conflicts}"
                         f"{arithmetic}{mark}")
    return "\n".join(lines)
