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
from the full launch's figures: lower bounds on time, never timings. Every case and rung needs the committed SASS
of each kernel its call launches (`sass_key`, `other_key`): the attention's gives the issue, MUFU, latency and
wave terms, and each other launch adds its own issue time (its grid, read off the launcher, times what one of its
warps runs at least: launches in series add); a kernel without SASS is SassMissing, never a bound from part of
the terms. Every launch of a run goes to one pool of `jobs`
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
from functools import partial
from pathlib import Path

import numpy as np

from kernels_numba._attention_gqa_mma import KEY_TILE as DECODE_TRIP
from kernels_numba._attention_vector import keys_per_step

from .. import _console, bounds
from . import recorder, sass
from .cases import ALL_LAB_CASES, LAB_CASES, BenchCase, FTBenchCase, OnnxBenchCase, TrtBenchCase, TrtContextBenchCase

RUNGS = (1, 2, 3, 4, 5)
THREADS = 128
HMMA = recorder.HMMA
# The causal prefill's prompt lengths: the shortest whose counts lie on the parabola through the full launch's
# (multiples of every rung's query tile and of rungs 1-4's key step; rung 5's step of 64 keys masks the same
# share of its last step at each; tests/test_lab_counters.py checks a fourth point). They reproduce the counts of
# 64, 128 and 192 tokens at a sixteenth of the simulator's time.
PREFILL_POINTS = (16, 32, 48)
# Rung 6 (the FlashAttention-2 prefill, OpenPPL's float16 caches) holds 64 query rows a block and walks 64-key tiles:
# its counts lie on a parabola through multiples of 64 only.
FLASH_RUNG, FLASH_POINTS = 6, (64, 128, 192)
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
        decode = replace(LAB_CASES[0], head_dim=sass.QUICK_HEAD_DIM,
                         label=f"{LAB_CASES[0].label} head_dim {sass.QUICK_HEAD_DIM}")
        return [Plan(decode, cut_down(decode), (64, 128))]
    out = []
    for case in ALL_LAB_CASES:
        counted = cut_down(case)
        if case.new_tokens > 1:
            # Rung 6 is counted at whole 64-row query tiles (FLASH_POINTS): below one, every point is one tile.
            flash = FLASH_RUNG in case.rungs or (type(case) is BenchCase and case.quant_bit == 0)
            rungs = case.rungs + ((FLASH_RUNG,) if flash and FLASH_RUNG not in case.rungs else ())
            out.append(Plan(case, counted, PREFILL_POINTS, rungs=rungs,
                            split_points=((FLASH_RUNG, FLASH_POINTS),) if flash else ()))
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
    # cp.async / ldmatrix instructions, where the call has them (the other rungs' figures stay as they were)
    out.update({name: n for name, n in rec.async_copies.items() if n})
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


class SassMissing(ValueError):
    """A case and rung whose kernel has no committed SASS variant (docs/kernel-ladder-sass.json) at its shape: the
    terms read from machine code (issue, LSU, MUFU, latency, waves) cannot be bounded."""


OPERATORS = {BenchCase: "ppl", TrtBenchCase: "trtllm", TrtContextBenchCase: "trtllm", OnnxBenchCase: "onnx",
             FTBenchCase: "ft"}        # the SASS variants' name of each bench case's operator


def _operator(case) -> str:
    operator = OPERATORS.get(type(case))
    if operator is None:
        raise SassMissing(f"{case.label}: {type(case).__name__} is no bench case the SASS variants cover")
    return operator


def sass_key(case, rung: int) -> str:
    """The committed SASS variant (docs/kernel-ladder-sass.json) of the kernel `case`'s call runs at `rung`:
    OpenPPL's launch (decode, or prefill for a prompt), TensorRT-LLM's generation step (its rung 4 runs rung 3's
    loop, writing split-K partials) and context step, ONNX's decode, FasterTransformer's cross attention (each
    compiled as its bench case launches it); a head_dim other than the headline's names its own variant (the lab's
    quick run, FasterTransformer's 64)."""
    operator = _operator(case)
    if type(case) is TrtBenchCase and rung == 4:
        rung = 3
    return sass.Variant(rung, case.cache, "prefill" if case.new_tokens > 1 else "decode", operator,
                        case.head_dim).key


def other_key(case, kernel: str) -> str:
    """The committed SASS variant of `kernel`, a launch of `case`'s call other than its attention (the cache store,
    a copy, TensorRT-LLM's preprocess, the split-K combine): the `sass.OTHER_VARIANTS` entry of the case's
    operator, phase and head_dim with that kernel (and its cache format, but for the combine, which reads float16
    partials). SassMissing when there is none."""
    operator, phase = _operator(case), "prefill" if case.new_tokens > 1 else "decode"
    for variant in sass.OTHER_VARIANTS:
        if (variant.operator, variant.phase, variant.head_dim, variant.part) == (operator, phase, case.head_dim,
                                                                                kernel) \
                and (variant.cache == case.cache or kernel == "combine_kernel"):
            return variant.key
    raise SassMissing(f"{case.label}: no SASS variant of its {kernel} launch in sass.OTHER_VARIANTS")


def sass_variant(case, rung: int, threads: int, machine: dict | None = None, kernel: str | None = None) -> dict:
    """The committed SASS figures of `case`'s kernel at `rung` (`sass_key`), or of `kernel`, one of its call's
    other launches (`other_key`), checked: the variant is there, at the case's head_dim and block size, with the
    paths the bounds read (the key loop's trip and chain, what a warp runs once, the occupancy; an other launch:
    what its warp runs). SassMissing naming the case and the file otherwise (never a bound from part of them)."""
    machine = machine or sass.committed()
    if machine.get("target") != "sm_90":
        raise ValueError(f"{sass.COMMITTED.name}: compiled for {machine.get('target')!r}; the bounds model an H100 "
                         f"(sm_90): write it again with python -m cacheattn.lab.sass --write")
    key = sass_key(case, rung) if kernel is None else other_key(case, kernel)
    where = f"{case.label} rung {rung}" + ("" if kernel is None else f" ({kernel})")
    variant = machine.get("variants", {}).get(key)
    if variant is None:
        raise SassMissing(f"{where}: {sass.COMMITTED.name} has no variant {key!r}: write it again with python -m "
                          f"cacheattn.lab.sass --write")
    # each variant says its own shape; a file written before they did, the headline shapes for all
    shapes = machine.get("shapes", {})
    compiled = (variant.get("head_dim", shapes.get("head_dim")), variant.get("threads", shapes.get("threads")))
    if (case.head_dim, threads) != compiled:
        raise SassMissing(f"{where}: {sass.COMMITTED.name} compiles {key!r} at head_dim {compiled[0]}, "
                          f"{compiled[1]} threads, not {case.head_dim}, {threads}")
    loop = variant.get("key_loop", {})
    missing = [name for name in ("trip", "chain") if kernel is None and name not in loop] + (
        [] if "once_per_warp" in variant else ["once_per_warp"]) + (
        [] if "blocks_per_sm" in variant.get("occupancy", {}) else ["occupancy"])
    if missing:
        raise ValueError(f"{sass.COMMITTED.name}: variant {key!r} ({where}) lacks {', '.join(missing)}: write it "
                         f"again with python -m cacheattn.lab.sass --write")
    return variant


def _launch_grids(call) -> list[tuple]:
    """(kernel name, blocks) of every launch `call()` makes, in order, recorded and never run: each launcher
    module's `launch` is swapped for one that notes the grid."""
    import importlib
    import pkgutil
    from contextlib import ExitStack
    from unittest import mock

    import kernels_numba
    from kernels_numba import _launch

    seen = []

    def note(kernel, grid, threads, stream, *args):
        name = getattr(kernel, "py_func", getattr(kernel, "fn", kernel)).__name__
        seen.append((name, math.prod(grid) if isinstance(grid, tuple) else int(grid)))

    modules = [importlib.import_module(f"kernels_numba.{info.name}")
               for info in pkgutil.iter_modules(kernels_numba.__path__) if not info.ispkg]
    original = _launch.launch
    with ExitStack() as stack:
        stack.enter_context(_launch.recorded_launches())          # outputs allocated as zeros, nothing runs
        for module in modules:
            if getattr(module, "launch", None) is original:
                stack.enter_context(mock.patch.object(module, "launch", note))
        call()
    return seen


def other_launches(plan: Plan, rung: int, threads: int = THREADS) -> dict:
    """{kernel: blocks of the full launch} of the call's launches other than its attention (the cache store, a
    copy, TensorRT-LLM's preprocess, the split-K combine). Their grids come from the launchers themselves: the
    call is recorded (never run) with the full case's heads and head_dim, at the counted requests and at each
    counted length, fitted along the sequence as the counts are and scaled by the requests (the grids of these
    launches hold the heads whole, so only the requests scale)."""
    lengths = plan.points_for(rung)
    per_length = []
    for length in lengths:
        case = replace(plan.at(length), num_heads=plan.case.num_heads, num_kv_heads=plan.case.num_kv_heads,
                       head_dim=plan.case.head_dim)
        blocks = {}
        for name, count in _launch_grids(partial(case.call, rung, threads, plan.splits(rung, threads))):
            if "attention" not in name:
                blocks[name] = blocks.get(name, 0) + count
        per_length.append(blocks)
    names = dict.fromkeys(name for blocks in per_length for name in blocks)
    scale = plan.case.batch / plan.counted.batch
    return {name: round(fit(lengths, [blocks.get(name, 0) for blocks in per_length], plan.full_length) * scale)
            for name in names}


def warp_trips(full: dict, plan: Plan, rung: int, threads: int) -> float:
    """Key-loop trips of every warp of the attention launch together, the masked tail trips included: each warp
    takes a trip per block step however few keys the last step has left (for a prefill, whose blocks see
    different key counts, the keys over the step, a lower bound)."""
    case, warps = plan.case, threads // 32
    blocks = full["attention blocks"]
    keys = full["kv_must_see"] / (2 * case.row_bytes) / blocks          # keys a block sees, on average
    if rung == 1:
        from kernels_numba._attention_core import plan_tiles
        rows = case.new_tokens
        step, per_step = plan_tiles(case.num_heads, case.num_kv_heads, rows, case.head_dim, case.head_dim)[2], warps
    elif rung == 2:
        step, per_step = warps, warps                                   # a warp per key
    elif rung in (3, 4):
        step, per_step = keys_per_step(case.head_dim, case_chunk(case, rung), warps), warps
    elif not plan.prefill:                                              # the register-fed decode kernel
        step, per_step = DECODE_TRIP * warps, warps
    elif rung == FLASH_RUNG:                                            # the block's warps on one key tile
        from kernels_numba._attention_flash import key_tile
        step, per_step = key_tile(case.head_dim), warps
    else:
        from kernels_numba._attention_mma import KEY_TILE, plan_mma_rows
        row_tiles = plan_mma_rows(case.num_heads, case.num_kv_heads, case.new_tokens, warps, case.head_dim)[2]
        step, per_step = KEY_TILE * (warps // row_tiles), warps
    steps = keys / step if plan.prefill else math.ceil(keys / step - 1e-9)
    return blocks * steps * per_step


def call_work(shown: dict, plan: Plan, rung: int, threads: int) -> tuple:
    """(bounds.Work, SASS keys, None) of one rung's call: the counted figures (DRAM, L2, shared, L1, mma or FMA, the
    call's launches) and, from the committed SASS of its kernel, what a warp issues (every trip of the shortest
    path through the key loop, the masked tail included, plus what runs once per warp; and what every warp of the
    call's other launches runs at least, `other_launches`), its MUFU and LSU work, and the chain of dependent
    round trips of a trip. The keys: the attention's variant, then each other launch's, joined by " + ".
    SassMissing when the SASS lacks one of the call's kernels (never a bound from part of the terms)."""
    full, case = shown["full"], plan.case
    dram = full[recorder.DRAM_READ] + full[recorder.DRAM_WRITE]
    # Global loads the lanes asked for beyond the DRAM bytes: re-reads served by L2 (a prefill's K/V, read by
    # every query tile).
    l2 = max(0.0, full["global_ld_bytes_requested"] - full[recorder.DRAM_READ])
    shared_requests = full["shared_ld_requests"] + full["shared_st_requests"]
    # (a cp.async is one instruction behind a global load request and a shared store request)
    counted_instructions = (full[bounds.GLOBAL_LOAD_REQUESTS] + full["l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"]
                            + shared_requests + full[HMMA] + full["barriers"] - full.get("cp_async_requests", 0))
    work = dict(dram_bytes=dram, l2_bytes=l2,
                shared_wavefronts=full[recorder.WAVEFRONTS_LD] + full[recorder.WAVEFRONTS_ST],
                l1_sectors=full[recorder.SECTORS_LD] + full["l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum"],
                mma=full[HMMA], fma_flops=0.0 if full[HMMA] else case.flops, lsu_instructions=shared_requests,
                warp_instructions=counted_instructions, launches=round(shown["counted"][-1]["launches"]),
                blocks=round(full["attention blocks"]), warps_per_block=threads // 32)
    # No SASS, no bound: SassMissing rather than a bound without its issue, latency and wave terms.
    variant = sass_variant(case, rung, threads)
    trips = warp_trips(full, plan, rung, threads)
    warps = full["attention blocks"] * (threads // 32)
    trip, once, chain = variant["key_loop"]["trip"], variant["once_per_warp"], variant["key_loop"]["chain"]
    issued = trips * trip["total"] + warps * once["total"]
    # The call's other launches run before or after the attention, in series on one stream: each one's issue time
    # (its warps x what one warp runs at least, on its own busiest SM) adds to the attention's. The term charges
    # the attention's busiest SM, so each is weighed by its busiest share over the attention's. Their DRAM bytes
    # are in the counts already (the recorder counts every launch of the call).
    main_share = bounds.busiest_share(work["blocks"], bounds.H100_SXM)
    keys = [sass_key(case, rung)]
    others = shown["other launches"] if "other launches" in shown else other_launches(plan, rung, threads)
    for kernel, blocks in others.items():
        other = sass_variant(case, rung, threads, kernel=kernel)
        keys.append(other_key(case, kernel))
        issued += (blocks * (threads // 32) * other["once_per_warp"]["total"]
                   * bounds.busiest_share(blocks, bounds.H100_SXM) / main_share)
    work.update(warp_instructions=max(issued, counted_instructions),
                ex2=trips * trip["EX2"] + warps * once["EX2"],
                lsu_instructions=shared_requests + trips * trip["SHFL"] + warps * once["SHFL"],
                blocks_per_sm=variant["occupancy"]["blocks_per_sm"], warp_trips=trips, chain_near=chain["near"],
                trip_bytes=chain["trip_bytes"])
    # A K/V load waits on HBM where the call reads its K/V from DRAM once; where most of what it loads was loaded
    # before (a prefill's query tiles re-read the same keys), the wait is an L2 hit's.
    work["chain_l2" if l2 > dram else "chain_hbm"] = chain["hbm"]
    return bounds.Work(**work), " + ".join(keys), None


def lower_bounds(shown: dict, plan: Plan, rung: int, threads: int = THREADS) -> tuple:
    """(Bounds, SASS keys, None) of one rung's call from its full-launch figures (`call_work`)."""
    work, key, why = call_work(shown, plan, rung, threads)
    b = bounds.ceilings(work, bounds.H100_SXM, floor_bytes=plan.case.floor_bytes, label=plan.case.label)
    return b, key, why


def bound_figures(b: bounds.Bounds, case: BenchCase, key: str | None, why: str | None) -> dict:
    """What the written result keeps of a rung's bounds: the bound, the term that sets it and the next two, every
    term (µs), the figures behind the SASS terms, and where they come from."""
    out = {"DRAM / floor (derived)": round(b.figures["DRAM / floor"].value, 3),
           "lower bound µs (derived)": round(b.bound_us, 1),
           "limited by": b.limiter,
           "then": b.ranked[1:3],
           "HBM share at the bound": round(b.hbm_share, 3)}
    if case.new_tokens > 1:
        out["TFLOP/s at most (derived)"] = round(case.flops / (b.bound_us * 1e-6) / 1e12, 1)
    out.update({f"{name} µs (derived)": round(b.resources[name].value, 1) for name in b.ranked})
    for name in ("trip chain", "in flight B/SM", "in flight / needed", "waves"):
        if name in b.figures:
            out[f"{name} ({b.figures[name].unit or 'count'})"] = round(b.figures[name].value, 3)
    out["SASS"] = key if key is not None else f"none: {why}; issue, MUFU, latency and wave terms from counts only"
    # The names pages written against the earlier model read (now the model's terms, bounds like the others).
    # (A trip whose machine code waits on no load in series, rung 6's cp.async loop, has no latency term.)
    if key is not None:
        out["issue µs (SASS estimate)"] = out["issue µs (derived)"]
        if "latency µs (derived)" in out:
            out["latency µs (Little's law estimate)"] = out["latency µs (derived)"]
        if "in flight / needed" in b.figures:
            out["loads in flight / needed (SASS estimate)"] = round(b.figures["in flight / needed"].value, 3)
    if case.new_tokens > 1:
        out["TFLOP/s at the bound (derived)"] = out["TFLOP/s at most (derived)"]
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
            **derivations(full, points, plan, rung, threads, splits)}
    return result


def default_call(plan: Plan, threads: int = THREADS) -> dict:
    """What the operator's default call (no rung asked for) runs for the full launch: its rung, split count, block
    size and reason (OpenPPL: `cacheattn.choose_kernel`'s choice), and the rung column whose counts are that call's
    (None when the default runs another split count or block size than the column was counted at)."""
    chosen = plan.case.default_plan(threads)
    same = chosen["threads"] == threads and chosen["rung"] in plan.rungs \
        and chosen["num_splits"] == plan.splits(chosen["rung"], threads)
    return {**chosen, "counted as": str(chosen["rung"]) if same else None}


def derivations(full: dict, counted: list, plan: Plan, rung: int, threads: int, splits: int,
                others: dict | None = None) -> dict:
    """A rung's derived ratios and bounds from its full-launch figures and its counted points (no counting), and
    the grids of its call's other launches, which the bounds read: `others` as written with the counts, else read
    off the launchers (`other_launches`: recorded, not run). Like the counts, they move only with a launcher."""
    others = other_launches(plan, rung, threads) if others is None else others
    b, key, why = lower_bounds({"full": full, "counted": counted, "other launches": others}, plan, rung, threads)
    return {"derived": derived(full, plan, splits), "other launches": others,
            "bounds": bound_figures(b, plan.case, key, why)}


def rederive(result: dict) -> dict:
    """`result` (what `ladder` returned) with every derivation made again from its full-launch figures (and the
    grids of the other launches written beside them; read off the launchers where a rung has none): after a change
    to the bound model or to the committed SASS that moves no count."""
    by_label = {p.case.label: p for p in plans() + plans(quick=True)}
    result["machine"], result["note"] = asdict(bounds.H100_SXM), NOTE
    for label, case in every_case(result):
        case["operator"] = by_label[label].case.operator
        case["default"] = default_call(by_label[label], case["threads"])
        for rung, shown in case["rungs"].items():
            shown.update(derivations(shown["full"], shown["counted"], by_label[label], int(rung), case["threads"],
                                     shown["derived"]["splits"], shown.get("other launches")))
    return result


def section(case) -> str:
    """Where a written result keeps a case: OpenPPL's bench cases under "cases" (the ladder page's rungs and its
    plot), the other operators' under "operators"."""
    return "cases" if isinstance(case, BenchCase) else "operators"


def every_case(result: dict):
    """(label, case) of every case a written result holds, OpenPPL's first."""
    return [item for key in ("cases", "operators") for item in result.get(key, {}).items()]


NOTE = ("counted in numba's CUDA simulator on cut-down launches and scaled to the full grid (see "
        "cacheattn/lab/counters.py); DRAM bytes count every distinct sector of a launch once (an L2 that holds the "
        "working set); the bounds are derived lower bounds on time, never timings: the largest of every term of "
        "cacheattn.bounds (machine.sources cites each rate), the SASS terms read from docs/kernel-ladder-sass.json")


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
    result = {"machine": asdict(bounds.H100_SXM), "note": NOTE, "cases": {}}
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
    if isinstance(value, list):
        return ", ".join(map(str, value))
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
                 "scaled across the grid (cacheattn/lab/counters.py says how). DRAM bytes: every distinct 32-byte "
                 "sector of a launch once (an L2 that holds the working set). Rows marked derived are lower bounds on "
                 f"the call's time on an {bounds.H100_SXM.name} (cacheattn.bounds: each resource at its cited rate, "
                 "the busiest SM's share of the blocks), never timings; the bound is the largest. The issue, MUFU, "
                 "latency and wave rows read the committed SASS (docs/kernel-ladder-sass.json): every trip of the "
                 "shortest path through the key loop that does its memory, mma, exp and barrier work, the masked "
                 "tail included, plus what a warp runs once, plus what every warp of the call's other launches "
                 "runs at least; the chain of dependent round trips of a trip at HBM's unloaded latency, over the "
                 "warps an SM holds.")


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
    """Write a run, with the bound model held against outside kernels (`calibration.entries`) beside it."""
    from . import calibration

    result = {**result, "calibration": calibration.entries()}
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
        line = (f"{_short(label):<10} ≥ {b['lower bound µs (derived)']:>7,.1f} µs (bound: {_limits(b)}; "
                f"{b['HBM share at the bound']:.0%} of HBM); DRAM/floor {b['DRAM / floor (derived)']:.3f}; K/V sectors "
                f"{d['K/V ld sector efficiency']:.0%} used, read {d['K/V reads per block (loaded / must see)']:.2f}x "
                f"a block; {conflicts}")
        if d["splits"] > 1:
            line += f"; {d['splits']} splits, {d['blocks (attention)']} blocks"
        if d["HMMA / (FLOPs / 4096)"]:
            line += f"; HMMA {d['HMMA / (FLOPs / 4096)']:.2f}x FLOPs/4096"
        if "TFLOP/s at most (derived)" in b:
            line += f"; ≤ {b['TFLOP/s at most (derived)']:.0f} TFLOP/s (bound)"
        lines.append(line)
    return "\n".join(lines)


def _limits(b: dict) -> str:
    """'limited by X; then Y, Z' of a written rung's bounds."""
    then = ", ".join(f"{name} ≥ {b[name + ' µs (derived)']:,.1f}" for name in b.get("then", []))
    return f"{b['limited by']}" + (f"; then {then}" if then else "")


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
                                  else "", f"; ≤ {b['TFLOP/s at most (derived)']:.0f} TFLOP/s (bound)"
                                  if "TFLOP/s at most (derived)" in b else ""))
            lines.append(f"  rung {rung}: ≥ {b['lower bound µs (derived)']:>7,.1f} µs (bound: {_limits(b)}; "
                         f"{b['HBM share at the bound']:.0%} of HBM); DRAM/floor {b['DRAM / floor (derived)']:.3f}; "
                         f"K/V sectors {_share(d['K/V ld sector efficiency'])} used, read "
                         f"{d['K/V reads per block (loaded / must see)']:.2f}x a block; {conflicts}"
                         f"{arithmetic}{mark}")
    return "\n".join(lines)
