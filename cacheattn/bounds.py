"""Lower bounds on a kernel's time from counted figures: what each resource of an H100 SXM needs, never a timing.

A launch counted in the simulator (`cacheattn.lab.record`, Nsight Compute's metric names) on a few blocks of the
real block shape gives per-block figures; the full grid has `scale` times as many blocks doing the same work, so
its figures are the counted ones times `scale`. Each resource then needs at least

    DRAM            (dram__bytes_read.sum + dram__bytes_write.sum) x scale / HBM bandwidth
    shared memory   (shared wavefronts, loads + stores) x scale / (1 wavefront per clock per SM x SMs x clock)
    L1 (global)     (global sectors, loads + stores) x scale / (4 sectors per clock per SM x SMs x clock)
    issue           warp instructions (from the SASS loop) / (4 schedulers x SMs x clock), when given
    tensor cores    mma.m16n8k16 count / (1 per clock per SM x SMs x clock), when given

and the kernel cannot run faster than the largest of them. Every shared, L1, issue or tensor bound assumes every
unit runs at its peak and the work spreads over the SMs as evenly as the grid allows (given the block count, the
busiest SM runs ceil(blocks / SMs) blocks: 8 blocks keep 124 SMs idle): a lower bound, reached by no real kernel.
DRAM bytes as the recorder counts them assume an L2 that holds the working set, so every byte comes from DRAM once.

Figures are labelled `counted` (read off the recording, times the grid scale) or `derived` (computed from counted
figures and the machine model); none is a measurement of time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol


class FloorCase(Protocol):
    """What a bound needs of a bench case (`cacheattn.lab.cases.BenchCase`): the bytes any kernel must move and a
    label. The model is a leaf that the kernel choice and the lab both import, so it names no lab type."""
    floor_bytes: float
    label: str

# ----------------------------------------------------------------------------------------------------- the machine


@dataclass(frozen=True)
class Machine:
    """Peak rates of one GPU, the unit each bound divides by."""
    name: str
    sms: int
    hbm_bytes_per_s: float
    clock_hz: float
    shared_wavefronts_per_clock: int      # per SM
    l1_sectors_per_clock: int             # per SM, 32-byte sectors
    issue_per_clock: int                  # warp instructions per SM per clock (one per scheduler)
    mma_per_clock: float                  # mma.m16n8k16 (4096 FLOPs) per SM per clock, dense float16
    fma_per_clock: int                    # float32 FMA (2 FLOPs) per SM per clock on the CUDA cores


H100_SXM = Machine(
    name="H100 SXM5",
    # 132 SMs: NVIDIA H100 Tensor Core GPU datasheet and the Hopper architecture whitepaper (SXM5 product: 132 SMs
    # of the full GH100's 144).
    sms=132,
    # 3.35 TB/s of HBM3: NVIDIA H100 Tensor Core GPU datasheet, "GPU memory bandwidth", H100 SXM.
    hbm_bytes_per_s=3.35e12,
    # 1.98 GHz: the H100 SXM5's maximum SM clock (nvidia-smi -q, "Max Clocks: SM 1980 MHz"); every per-clock bound
    # uses it, so the bounds are the fastest the clock allows.
    clock_hz=1.98e9,
    # Shared memory serves one 128-byte wavefront (32 banks x 4 bytes) per clock per SM: CUDA C++ Programming
    # Guide, "Shared Memory" of compute capability 5.x and later (32 banks, 32 bits per bank per clock).
    shared_wavefronts_per_clock=1,
    # L1 moves 128 bytes (4 sectors) per clock per SM, the same data path as shared memory (Hopper tuning guide:
    # L1 and shared memory are one unit); 132 x 128 B x 1.98 GHz = 33 TB/s.
    l1_sectors_per_clock=4,
    # Four warp schedulers per SM, each issuing one warp instruction per clock: Hopper architecture whitepaper
    # (SM: four processing blocks, each with its own warp scheduler and dispatch unit).
    issue_per_clock=4,
    # Dense float16 with float32 accumulation: 989.4 TFLOP/s at 1.83 GHz over 132 SMs (datasheet) = 4096 FLOPs per
    # clock per SM, one m16n8k16 (16 x 8 x 16 x 2 FLOPs). mma.sync on Hopper reaches less than the wgmma rate.
    mma_per_clock=1.0,
    # 128 float32 lanes per SM (four processing blocks of 32: Hopper architecture whitepaper), an FMA each per
    # clock: 132 x 128 x 2 FLOPs x 1.98 GHz = 66.9 TFLOP/s, the datasheet's 67 for the SXM5.
    fma_per_clock=128,
)

# A load that misses L2 waits this many SM clocks for HBM before its data arrive: 690 clocks, the "Main Memory"
# latency a pointer-chasing microbenchmark measured on a GH200 (the Hopper GPU with HBM3; markdewing/AI_kernels on
# GitHub, latency/README.md, which also lists 281 clocks for L2). Unloaded latency: under load, queues add to it.
HBM_LATENCY_CLOCKS = 690

# ----------------------------------------------------------------------------------------------------------- bounds

DRAM_READ, DRAM_WRITE = "dram__bytes_read.sum", "dram__bytes_write.sum"
GLOBAL_SECTORS = ("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum")
GLOBAL_LOAD_SECTORS = GLOBAL_SECTORS[0]
GLOBAL_LOAD_REQUESTS = "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"
# The bytes the lanes of global loads asked for (Nsight Compute: smsp__sass_data_bytes_mem_global_op_ld.sum); the
# sector efficiency is these over 32 x the sectors they touched.
GLOBAL_LOAD_BYTES = "smsp__sass_data_bytes_mem_global_op_ld.sum"
SHARED_WAVEFRONTS = ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
                     "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum")
SHARED_CONFLICTS = ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
                    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum")


@dataclass(frozen=True)
class Figure:
    """One number with what it is: `counted` (off the recording, scaled to the grid) or `derived`."""
    value: float
    unit: str
    basis: str            # "counted" or "derived"
    how: str

    def __str__(self):
        return f"{_fmt(self.value)} {self.unit} ({self.basis}: {self.how})"


@dataclass
class Bounds:
    """Per-resource lower bounds on time (µs) of one launch over the full grid, and the figures behind them."""
    machine: Machine
    resources: dict = field(default_factory=dict)     # name -> Figure in µs (derived)
    figures: dict = field(default_factory=dict)       # name -> Figure (counted or derived)

    @property
    def limiter(self) -> str:
        """The resource with the largest bound."""
        return max(self.resources, key=lambda name: self.resources[name].value)

    @property
    def bound_us(self) -> float:
        """The kernel cannot run faster than this (derived, a lower bound on time)."""
        return self.resources[self.limiter].value

    @property
    def hbm_share(self) -> float:
        """Share of the HBM bandwidth the kernel would use running at its bound: the operator's bytes (the floor,
        when a case was given, else the DRAM bytes counted) over the bound time, over the bandwidth."""
        moved = self.figures["floor bytes"].value if "floor bytes" in self.figures else self.figures["DRAM bytes"].value
        return moved / (self.bound_us * 1e-6) / self.machine.hbm_bytes_per_s

    def summary(self) -> str:
        """'cannot run faster than X µs (limited by R), Y% of HBM bandwidth', then each resource and figure."""
        lines = [f"cannot run faster than {self.bound_us:.2f} µs (lower bound, derived; limited by {self.limiter}), "
                 f"{self.hbm_share:.0%} of HBM bandwidth on {self.machine.name}"]
        lines += [f"  {name:<14} ≥ {fig}" for name, fig in self.resources.items()]
        lines += [f"  {name:<22} {fig}" for name, fig in self.figures.items()]
        return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _total(metrics: dict, names) -> int | None:
    present = [metrics[name] for name in names if name in metrics]
    return sum(present) if present else None


def bounds(metrics: dict, scale: float = 1.0, *, case: FloorCase | None = None,
           warp_instructions: float | None = None, mma: float | None = None, fma_flops: float | None = None,
           blocks: int | None = None, machine: Machine = H100_SXM) -> Bounds:
    """Lower bounds on the time of the full grid from figures counted on a scaled-down launch.

    Parameters
    ----------
    metrics : dict
        Nsight Compute metric name -> count, as `cacheattn.lab.record()` gives them (`rec.metrics`): DRAM bytes
        read / written, global load / store sectors, shared wavefronts and bank conflicts; a missing metric leaves
        its resource out.
    scale : float
        Blocks of the full grid per block counted (the per-block figures scale with the grid).
    case : FloorCase, optional
        The bench case (`cacheattn.lab.cases.BenchCase`): adds the floor (the bytes the operator must move) and
        DRAM bytes ÷ floor.
    warp_instructions : float, optional
        Warp instructions the full grid issues, for the issue bound; already at full scale. From the SASS key loop
        (`cacheattn.lab.sass`) its length times the trips of every warp is an estimate, not a bound: a static count
        includes instructions a branch skips and counts an inner loop's body once.
    mma : float, optional
        mma.m16n8k16 instructions of the full grid, for the tensor-core bound; already at full scale.
    fma_flops : float, optional
        FLOPs the full grid runs as float32 FMA on the CUDA cores (a kernel without mma: the operator's FLOPs), for
        the FMA bound. Derived from the operator, not counted: the simulator counts memory, not arithmetic.
    blocks : int, optional
        Blocks of the full grid, each doing an equal share of the work. The per-SM bounds (shared, L1, issue,
        tensor) then charge the busiest SM, which runs ceil(blocks / SMs) of them: 8 blocks use 8 of 132 SMs,
        512 blocks put 4 on some SMs where the average is 3.88. Without it the work spreads evenly over all SMs.
    machine : Machine
        Peak rates (H100_SXM).

    Returns
    -------
    Bounds
        `.resources` (µs each), `.limiter`, `.bound_us`, `.hbm_share`, `.figures`, `.summary()`.
    """
    if scale <= 0:
        raise ValueError(f"scale: expected the positive ratio of full-grid blocks to counted blocks, got {scale!r}")
    if blocks is not None and blocks < 1:
        raise ValueError(f"blocks: expected the full grid's block count, at least 1, got {blocks!r}")
    out = Bounds(machine)
    # The rate of the SMs the busiest one stands for: SMs x clock, over its extra share of the blocks.
    busiest = 1.0 if blocks is None else math.ceil(blocks / machine.sms) * machine.sms / blocks
    per_clock = machine.sms * machine.clock_hz / busiest
    if blocks is not None:
        out.figures["busiest SM"] = Figure(busiest, "x", "derived", f"ceil({blocks} blocks / {machine.sms} SMs) "
                                                                      f"over the average share")
    scaled = f"counted x {scale:g}" if scale != 1 else "counted"

    dram = _total(metrics, (DRAM_READ, DRAM_WRITE))
    if dram is not None:
        dram *= scale
        out.figures["DRAM bytes"] = Figure(dram, "B", "counted", f"{scaled}, read + write")
        out.resources["DRAM"] = Figure(dram / machine.hbm_bytes_per_s * 1e6, "µs", "derived",
                                       f"DRAM bytes / {machine.hbm_bytes_per_s / 1e12:g} TB/s")
    if case is not None:
        out.figures["floor bytes"] = Figure(case.floor_bytes, "B", "derived", f"{case.label}: K/V once, Q, O")
        if dram is not None:
            out.figures["DRAM / floor"] = Figure(dram / case.floor_bytes, "x", "derived", "1.00 is the floor")

    wavefronts = _total(metrics, SHARED_WAVEFRONTS)
    if wavefronts is not None:
        wavefronts *= scale
        out.figures["shared wavefronts"] = Figure(wavefronts, "", "counted", f"{scaled}, loads + stores")
        out.resources["shared"] = Figure(wavefronts / (machine.shared_wavefronts_per_clock * per_clock) * 1e6, "µs",
                                         "derived", f"wavefronts / ({machine.shared_wavefronts_per_clock} per clock "
                                                    f"x {machine.sms} SMs x {machine.clock_hz / 1e9:g} GHz)")
        conflicts = _total(metrics, SHARED_CONFLICTS)
        if conflicts is not None:
            out.figures["bank conflicts"] = Figure(conflicts * scale, "", "counted", f"{scaled}, loads + stores")

    sectors = _total(metrics, GLOBAL_SECTORS)
    if sectors is not None:
        sectors *= scale
        out.figures["global sectors"] = Figure(sectors, "", "counted", f"{scaled}, through L1, loads + stores")
        out.resources["L1"] = Figure(sectors / (machine.l1_sectors_per_clock * per_clock) * 1e6, "µs", "derived",
                                     f"sectors / ({machine.l1_sectors_per_clock} per clock x {machine.sms} SMs x "
                                     f"{machine.clock_hz / 1e9:g} GHz)")
    if GLOBAL_LOAD_BYTES in metrics and metrics.get(GLOBAL_LOAD_SECTORS):
        out.figures["sector efficiency"] = Figure(metrics[GLOBAL_LOAD_BYTES] / (32 * metrics[GLOBAL_LOAD_SECTORS]),
                                                  "", "derived", "bytes the lanes asked for / (32 x load sectors)")
    if warp_instructions is not None:
        out.figures["warp instructions"] = Figure(warp_instructions, "", "derived", "as given, from the SASS")
        out.resources["issue"] = Figure(warp_instructions / (machine.issue_per_clock * per_clock) * 1e6, "µs",
                                        "derived", f"warp instructions / ({machine.issue_per_clock} per clock x "
                                                   f"{machine.sms} SMs x {machine.clock_hz / 1e9:g} GHz)")
    if mma is not None:
        out.figures["mma"] = Figure(mma, "", "derived", "mma.m16n8k16 of the full grid")
        out.resources["tensor"] = Figure(mma / (machine.mma_per_clock * per_clock) * 1e6, "µs", "derived",
                                         f"mma / ({machine.mma_per_clock:g} per clock x {machine.sms} SMs x "
                                         f"{machine.clock_hz / 1e9:g} GHz)")
    if fma_flops is not None:
        out.figures["FMA FLOPs"] = Figure(fma_flops, "", "derived", "the operator's FLOPs, on the CUDA cores")
        out.resources["FMA"] = Figure(fma_flops / (2 * machine.fma_per_clock * per_clock) * 1e6, "µs", "derived",
                                      f"FLOPs / (2 x {machine.fma_per_clock} per clock x {machine.sms} SMs x "
                                      f"{machine.clock_hz / 1e9:g} GHz)")
    if not out.resources:
        raise ValueError("metrics: none of the DRAM, shared-memory or global-sector metrics is present, and no "
                         f"warp_instructions, mma or fma_flops was given; got {sorted(metrics)}")
    return out


def latency_bound(dram_bytes: float, in_flight_per_warp: float, warps_per_sm: int, *, blocks: int | None = None,
                  latency_clocks: float = HBM_LATENCY_CLOCKS, machine: Machine = H100_SXM) -> dict:
    """Little's law for the loads: HBM delivers its bandwidth only while every SM keeps bandwidth x latency / SMs
    bytes of loads in flight. A warp has at most `in_flight_per_warp` bytes issued and not yet waited on (from the
    SASS key loop, `cacheattn.lab.sass.loads_in_flight`), and an SM holds `warps_per_sm` of them (the occupancy), so
    the SMs that hold blocks move at most in-flight bytes / latency each, and the DRAM bytes take at least

        DRAM bytes / (in flight per SM x busy SMs / latency)

    A lower bound like the throughput bounds (every warp at its peak in flight all the time, the latency unloaded);
    the kernel cannot beat the larger of it and the DRAM bound. `blocks`: the grid's blocks, when fewer SMs than all
    hold one. Returns Figures (derived): needed and held bytes per SM, their ratio, and the bound in µs."""
    if in_flight_per_warp <= 0 or warps_per_sm <= 0:
        raise ValueError(f"in_flight_per_warp, warps_per_sm: expected positive figures, got {in_flight_per_warp!r}, "
                         f"{warps_per_sm!r}")
    latency_s = latency_clocks / machine.clock_hz
    needed = machine.hbm_bytes_per_s * latency_s / machine.sms
    held = in_flight_per_warp * warps_per_sm
    busy = machine.sms if blocks is None else min(machine.sms, blocks)
    rate = min(machine.hbm_bytes_per_s, held * busy / latency_s)
    return {"needed B/SM": Figure(needed, "B", "derived", f"{machine.hbm_bytes_per_s / 1e12:g} TB/s x "
                                                          f"{latency_clocks:g} clocks / {machine.sms} SMs"),
            "in flight B/SM": Figure(held, "B", "derived", f"{in_flight_per_warp:g} B a warp x {warps_per_sm} warps"),
            "in flight / needed": Figure(held / needed, "x", "derived", "1.00 hides the latency"),
            "latency": Figure(dram_bytes / rate * 1e6, "µs", "derived", "DRAM bytes / min(HBM bandwidth, "
                                                                       "in flight x SMs / latency)")}
