"""Lower bounds on a kernel call's time from counted work: what each resource of an H100 SXM needs, never a timing.

The model takes one call's work (`Work`: the bytes it moves from DRAM and from L2, its shared-memory wavefronts and
L1 sectors, its mma, exp2 and FMA work, its LSU and total warp instructions, its launches and grid, and the chain of
dependent global round trips one warp's key-loop trip waits on) and a `Machine`, and `ceilings` returns a time for
every resource:

    DRAM        DRAM bytes / achievable HBM bandwidth
    L2          bytes served by L2 (global loads beyond the DRAM bytes) / L2 bandwidth
    shared      shared-memory wavefronts / (1 a clock per SM)                          } on the busiest SM:
    L1          global sectors / (4 a clock per SM)                                    } ceil(blocks / SMs) of
    tensor      mma.sync m16n8k16 / (mma.sync's rate, below wgmma's, a clock per SM)    } the grid's blocks, at
    wgmma       wgmma work in m16n8k16 units / (1 a clock per SM)                      } the clock NVIDIA's
    FMA         float32 FLOPs / (2 x 128 lanes a clock per SM)                         } tensor peak assumes
    MUFU        MUFU.EX2 warp instructions / (16 lanes = half a warp a clock per SM)   }
    LSU         LDS / STS / SHFL warp instructions / (1 a clock per SM)                }
    issue       every warp instruction of the call / (4 schedulers a clock per SM)     }
    launch      kernel launches x the least a launch costs
    latency     Little's law: warp trips x one trip's chain of dependent round trips x their latency, over the
                warps the busy SMs hold at once (average bytes in flight, not the peak)
    waves       the busiest SM's waves of resident blocks x one block's serial chain (the partial last wave)

The call cannot run faster than the largest (`Bounds.bound_us`, `Bounds.limiter`); `Bounds.ranked` lists the rest in
order. Each term is a lower bound: every unit at its rate, the work of a term spread as evenly as the grid allows,
every count the least the call can do (the SASS path the lab counts is the shortest through each loop trip that
still does the trip's memory, mma, exp and barrier work). Each rate in `Machine` says where it comes from
(`Machine.sources`); where a figure could not be verified the comment says so and the rate errs high, so the term
stays a lower bound.

`bounds(metrics, ...)` is the same model fed from the lab's recordings (Nsight Compute's metric names); `ceilings`
takes plain statistics, so kernels the lab does not record (a published kernel's SASS statistics) go through the
same terms. Figures are labelled `counted` (read off a recording, times the grid scale) or `derived`.
"""

from __future__ import annotations

import math
import operator
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
    """The rates of one GPU that each bound divides by; `sources` says where each comes from."""
    name: str
    sms: int
    clock_hz: float                       # the SM clock every per-clock rate runs at
    hbm_peak_bytes_per_s: float           # the datasheet's HBM bandwidth
    hbm_bytes_per_s: float                # what a streaming kernel reaches of it: the DRAM term's rate
    l2_bytes_per_s: float                 # L2 to the SMs, all of them together
    shared_wavefronts_per_clock: int      # per SM
    l1_sectors_per_clock: int             # per SM, 32-byte sectors
    issue_per_clock: int                  # warp instructions per SM per clock (one per scheduler)
    mma_per_clock: float                  # mma.sync m16n8k16 (4096 FLOPs) per SM per clock, float16 into float32
    wgmma_per_clock: float                # the same work issued as wgmma (the datasheet's dense peak)
    fma_per_clock: int                    # float32 FMA lanes (2 FLOPs each) per SM per clock
    ex2_per_clock: int                    # MUFU.EX2 lanes per SM per clock
    lsu_per_clock: float                  # LDS / STS / SHFL warp instructions per SM per clock (MIO issue)
    hbm_latency_s: float                  # a load that misses L2, unloaded
    l2_latency_s: float                   # a load that hits L2, unloaded
    near_latency_s: float                 # a load an earlier load's line may serve: an L1 hit
    launch_s: float                       # the least one kernel launch of a call costs
    sources: dict = field(default_factory=dict, compare=False, hash=False)


# H100 SXM5 microbenchmarks at 1.98 GHz, CUDA 12.8: https://github.com/ahmadsharif1/cuda_study (README.md).
_CUDA_STUDY = "ahmadsharif1/cuda_study README.md"

H100_SXM = Machine(
    name="H100 SXM5",
    # 132 SMs: NVIDIA H100 Tensor Core GPU datasheet; Hopper architecture whitepaper (SXM5: 132 of GH100's 144).
    sms=132,
    # 1.83 GHz: the datasheet's 989.4 dense float16 TFLOP/s is 132 SMs x 4,096 FLOPs a clock x 1.83 GHz, the clock
    # NVIDIA's peak assumes under load; the 1.98 GHz maximum (nvidia-smi "Max Clocks") is not held by a busy SM, so
    # bounds at 1.98 GHz were ~8% too fast.
    clock_hz=1.83e9,
    # 3.35 TB/s of HBM3: datasheet, "GPU memory bandwidth", H100 SXM.
    hbm_peak_bytes_per_s=3.35e12,
    # What a kernel can reach: copy / STREAM-style kernels on H100 SXM are reported at about 3.0-3.1 TB/s (~90-93%
    # of 3.35; Luo et al., arXiv 2501.12084, benchmark Hopper's global-memory throughput; their table could not be
    # read here). The one H100 SXM5 copy measured that could be read reached less: 1.99 TB/s on 132 SMs, 2.03 TB/s
    # on 528 blocks (256 MB, read + write counted; ahmadsharif1/cuda_study on GitHub, README.md, "3b. HBM
    # Bandwidth Scaling"). 3.1 TB/s, above both, so the DRAM term stays a lower bound.
    hbm_bytes_per_s=3.1e12,
    # L2 to the SMs: microbenchmarks (Chips and Cheese, "Nvidia's H100: Funny L2, and Tons of Bandwidth", on the
    # 114-SM PCIe card; Luo et al., arXiv 2402.13499) put it at several TB/s (their tables could not be read here).
    # On an H100 SXM5, a copy through L2 (__ldcg / __stcg, 16 MB resident) measured 3.2 TB/s on 132 SMs and 3.6
    # TB/s on 528 blocks (ahmadsharif1/cuda_study on GitHub, README.md, "3c. L2 Bandwidth Scaling"). 12 TB/s, well
    # above every figure found, keeps the term a lower bound.
    l2_bytes_per_s=12e12,
    # One 128-byte wavefront (32 banks x 4 bytes) per clock per SM: CUDA C++ Programming Guide, "Shared Memory".
    shared_wavefronts_per_clock=1,
    # L1 moves 128 bytes (4 sectors) per clock per SM, the same data path as shared memory (Hopper tuning guide).
    l1_sectors_per_clock=4,
    # Four warp schedulers per SM, one warp instruction each per clock: Hopper architecture whitepaper.
    issue_per_clock=4,
    # mma.sync is not wgmma: on Hopper the legacy warp-level mma reaches well under the warpgroup wgmma's rate (Luo
    # et al., arXiv 2402.13499, "Tensor Core" section, measure mma against wgmma on an H800; FlashAttention-3
    # reports mma.sync kernels near 35-40% of the H100 peak). No figure for mma.sync alone could be read here (their
    # table included): two thirds of the dense peak (~660 TFLOP/s), above those reports, keeps the tensor term a
    # bound, but unverified.
    mma_per_clock=2 / 3,
    # wgmma: the datasheet's 989.4 dense TFLOP/s = 4,096 FLOPs (one m16n8k16) per clock per SM at 1.83 GHz.
    wgmma_per_clock=1.0,
    # 128 float32 lanes per SM (four processing blocks of 32): Hopper architecture whitepaper.
    fma_per_clock=128,
    # 16 exp2 results per clock per SM: CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table
    # (compute capability 9.0, 32-bit exp2/log2/sin/cos), half a warp instruction a clock.
    ex2_per_clock=16,
    # Shared loads / stores and shuffles go through the MIO queue: 32 shuffle results per clock per SM (the
    # programming guide's throughput table, "warp shuffle"), one warp instruction a clock per SM.
    lsu_per_clock=1.0,
    # 570 SM clocks at 1.98 GHz = 288 ns: an H100 SXM5 pointer chase through 256 MB, one thread, lines 128 bytes
    # apart, L2 flushed first: 570.5 clocks, 288.1 ns (ahmadsharif1/cuda_study on GitHub, README.md, "3a. Memory
    # Latency"). A GH200 pointer chase reports 690 clocks (markdewing/AI_kernels on GitHub, latency/README.md);
    # the lower figure is taken, so the term errs to a faster machine. Unloaded: queues add to it under load, so
    # it is a lower bound on each round trip. Luo et al. (arXiv 2402.13499) measure an H800's; their table could
    # not be read here.
    hbm_latency_s=570 / 1.98e9,
    # 259 clocks at 1.98 GHz = 131 ns: the same H100 SXM5 source's L2 hit (4 MB through __ldcg: 259.9 clocks,
    # 131.3 ns), below the GH200 source's 281 clocks.
    l2_latency_s=259 / 1.98e9,
    # 30 clocks at 1.98 GHz = 15 ns: a round trip that an earlier load's line may serve from L1, charged at less
    # than the L1 hit the same H100 SXM5 source measures (40.2 clocks, 20.3 ns; shared memory 28.6 clocks) and the
    # few tens of clocks other Hopper microbenchmarks report.
    near_latency_s=30 / 1.98e9,
    # A kernel launch costs a few µs (NVIDIA technical blog, "Getting Started with CUDA Graphs": a few µs per
    # short kernel launched back to back in a stream); not measured here on an H100, so 2 µs, the low end.
    launch_s=2e-6,
    sources={
        "sms": "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 132 SMs)",
        "clock_hz": "datasheet: 989.4 dense FP16 TFLOP/s = 132 SMs x 4096 FLOP/clk x 1.83 GHz",
        "hbm_peak_bytes_per_s": "datasheet: 3.35 TB/s HBM3 (H100 SXM)",
        "hbm_bytes_per_s": "copy/STREAM kernels reach ~90-93% of 3.35 TB/s on H100 SXM (Luo et al., arXiv "
                           "2501.12084; table not read here); an H100 SXM5 copy measured 2.0 TB/s "
                           f"({_CUDA_STUDY}, 3b): 3.1 TB/s, above both",
        "l2_bytes_per_s": f"an H100 SXM5 copy through L2 measured 3.6 TB/s ({_CUDA_STUDY}, 3c; Chips and Cheese, H100 "
                          "PCIe, and Luo et al., arXiv 2402.13499, not read here): 12 TB/s, well above",
        "shared_wavefronts_per_clock": "CUDA C++ Programming Guide, Shared Memory: 32 banks x 4 B per clock",
        "l1_sectors_per_clock": "Hopper tuning guide: L1 and shared memory one 128 B/clk data path",
        "issue_per_clock": "Hopper whitepaper: 4 warp schedulers per SM, 1 instruction/clk each",
        "mma_per_clock": "mma.sync at 494 of wgmma's 757 TFLOP/s, 65%, on an H800 (Luo et al., arXiv 2501.12084, "
                         "as quoted in waynehacking8/blackwell-tensorcore-kernels README.md; the paper's table not "
                         "read here): 2/3 of the dense peak, on the fast side of it",
        "wgmma_per_clock": "datasheet dense FP16 peak: one m16n8k16 per clock per SM at 1.83 GHz",
        "fma_per_clock": "Hopper whitepaper: 128 FP32 lanes per SM",
        "ex2_per_clock": "CUDA C++ Programming Guide throughput table, cc 9.0: 16 exp2 per clock per SM",
        "lsu_per_clock": "CUDA C++ Programming Guide throughput table, cc 9.0: 32 shuffle results per clock per SM",
        "hbm_latency_s": f"570 clocks at 1.98 GHz, H100 SXM5 pointer chase ({_CUDA_STUDY}, 3a: 570.5), unloaded; "
                         "below a GH200's 690 (markdewing/AI_kernels latency/README.md)",
        "l2_latency_s": f"259 clocks at 1.98 GHz, L2 hit, the same H100 SXM5 pointer chase ({_CUDA_STUDY}, 3a: 259.9)",
        "near_latency_s": f"30 clocks at 1.98 GHz, below the H100 SXM5 L1 hit of 40.2 clocks ({_CUDA_STUDY}, 3a)",
        "launch_s": "a few µs per launch (NVIDIA blog, Getting Started with CUDA Graphs); 2 µs, the low end, "
                    "not measured here",
    },
)

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


class Figure:
    """One number with what it is: `counted` (off the recording, scaled to the grid) or `derived`, and `how` it was
    made. `how` may be a format string followed by its arguments, formatted the first time it is read: the plan
    builds a few dozen Figures for every new shape it sees, on the host, and reads only their values."""
    __slots__ = ("value", "unit", "basis", "_how", "_args")

    def __init__(self, value: float, unit: str, basis: str, how: str, *args):
        self.value, self.unit, self.basis, self._how, self._args = value, unit, basis, how, args

    @property
    def how(self) -> str:
        if self._args:
            self._how, self._args = self._how.format(*self._args), ()
        return self._how

    def _fields(self):
        return self.value, self.unit, self.basis, self.how

    def __eq__(self, other):
        return self._fields() == other._fields() if isinstance(other, Figure) else NotImplemented

    def __hash__(self):
        return hash(self._fields())

    def __iter__(self):
        return iter(self._fields())

    def __repr__(self):
        return f"Figure(value={self.value!r}, unit={self.unit!r}, basis={self.basis!r}, how={self.how!r})"

    def __str__(self):
        return f"{_fmt(self.value)} {self.unit} ({self.basis}: {self.how})"


@dataclass
class Work:
    """What one call does, over every launch of it: the input of `ceilings`.

    Every field is a total for the call (all launches, the full grid) unless it says otherwise; a field left at 0
    (or None) leaves its term out.

    Attributes
    ----------
    dram_bytes : float
        Bytes read from and written to DRAM (each byte once: an L2 that holds what the call re-reads).
    l2_bytes : float
        Global-load bytes served by L2 rather than DRAM (what the loads asked for beyond the DRAM bytes: a prefill's
        K/V read again by every query tile).
    shared_wavefronts, l1_sectors : float
        Shared-memory wavefronts (loads + stores) and global sectors through L1 (loads + stores).
    mma : float
        mma.sync m16n8k16 instructions (4,096 FLOPs each) at mma.sync's rate; `wgmma`: the same unit of work issued
        as wgmma, at the dense peak.
    fma_flops : float
        FLOPs run as float32 FMA on the CUDA cores.
    ex2 : float
        MUFU.EX2 warp instructions.
    lsu_instructions : float
        LDS, STS (and LDSM) and SHFL warp instructions: the MIO queue's issue.
    warp_instructions : float
        Every warp instruction the call issues (every trip of every loop, what runs once per warp, every launch).
    launches : int
        Kernel launches of the call.
    blocks : int or None
        Blocks of the call's main launch, each an equal share of the per-SM work: the per-SM terms charge the
        busiest SM, which runs ceil(blocks / SMs) of them. None: the work spreads evenly over every SM.
    blocks_per_sm : int or None
        Blocks an SM holds at once (registers, shared memory, threads: `cacheattn.lab.sass.occupancy`), for the
        latency and wave terms; `warps_per_block` their warps.
    warp_trips : float
        Key-loop trips of every warp of the main launch together (the masked tail included).
    chain_hbm, chain_l2, chain_near : float
        Dependent global round trips one warp's trip waits on in series (a load whose address needs an earlier
        load's value, or that issues behind an instruction waiting on one), charged at HBM's latency (16-byte K/V
        loads), at L2's (the same loads where the call's K/V come mostly from L2: a prefill's re-reads) and at an
        L1 hit's (narrower loads: page entries, indices, scales).
    trip_bytes : float
        Bytes one warp's trip loads (for the average bytes in flight shown beside the latency term).
    """
    dram_bytes: float = 0.0
    l2_bytes: float = 0.0
    shared_wavefronts: float = 0.0
    l1_sectors: float = 0.0
    mma: float = 0.0
    wgmma: float = 0.0
    fma_flops: float = 0.0
    ex2: float = 0.0
    lsu_instructions: float = 0.0
    warp_instructions: float = 0.0
    launches: int = 0
    blocks: int | None = None
    blocks_per_sm: int | None = None
    warps_per_block: int | None = None
    warp_trips: float = 0.0
    chain_hbm: float = 0.0
    chain_l2: float = 0.0
    chain_near: float = 0.0
    trip_bytes: float = 0.0


@dataclass
class Bounds:
    """Per-resource lower bounds on time (µs) of one call, and the figures behind them."""
    machine: Machine
    resources: dict = field(default_factory=dict)     # name -> Figure in µs (derived)
    figures: dict = field(default_factory=dict)       # name -> Figure (counted or derived)
    # The resources as last ranked, their names largest bound first, and the largest: made again only when a term
    # is added, removed or replaced (the plan reads them several times a candidate).
    _order: tuple = field(default=(None, [], None), init=False, repr=False, compare=False)

    def _ranking(self) -> tuple:
        terms = tuple(self.resources.items())
        if terms != self._order[0]:
            def value(name):
                return self.resources[name].value
            self._order = (terms, sorted(self.resources, key=lambda name: -value(name)),
                           max(self.resources, key=value) if terms else None)
        return self._order

    @property
    def ranked(self) -> list:
        """The resources' names, largest bound first."""
        return list(self._ranking()[1])

    @property
    def limiter(self) -> str:
        """The resource with the largest bound."""
        limiter = self._ranking()[2]
        if limiter is None:
            raise ValueError("resources: no resource has a bound")
        return limiter

    @property
    def bound_us(self) -> float:
        """The call cannot run faster than this (derived, a lower bound on time)."""
        return self.resources[self.limiter].value

    @property
    def hbm_share(self) -> float:
        """Share of the datasheet's HBM bandwidth the call would use running at its bound: the operator's bytes (the
        floor, when a case was given, else the DRAM bytes) over the bound time, over the bandwidth."""
        moved = self.figures["floor bytes"].value if "floor bytes" in self.figures else self.figures["DRAM bytes"].value
        return moved / (self.bound_us * 1e-6) / self.machine.hbm_peak_bytes_per_s

    def summary(self) -> str:
        """'cannot run faster than X µs (limited by R; then S, T)', then each resource and figure."""
        then = ", ".join(self.ranked[1:3])
        lines = [f"cannot run faster than {self.bound_us:.2f} µs (lower bound, derived; limited by {self.limiter}"
                 f"{'; then ' + then if then else ''}), {self.hbm_share:.0%} of HBM bandwidth on {self.machine.name}"]
        lines += [f"  {name:<14} ≥ {self.resources[name]}" for name in self.ranked]
        lines += [f"  {name:<22} {fig}" for name, fig in self.figures.items()]
        return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _total(metrics: dict, names) -> int | None:
    present = [metrics[name] for name in names if name in metrics]
    return sum(present) if present else None


_AT_LEAST_ONE = frozenset(("blocks", "blocks_per_sm", "warps_per_block"))
# Read in one step each (`ceilings` checks every field on every call, the plan's included).
_AT_LEAST_ONE_FIELDS = operator.attrgetter(*sorted(_AT_LEAST_ONE))
_COUNTS = operator.attrgetter(*(name for name in Work.__dataclass_fields__ if name not in _AT_LEAST_ONE))
# The per-SM terms, in their order: (resource, Work field, Machine rate, times, per, what the rate counts); the
# rate is times x the Machine's figure / per, and its source is the Machine's source of that figure.
_PER_SM = (("shared", "shared_wavefronts", "shared_wavefronts_per_clock", 1, 1, "wavefronts"),
           ("L1", "l1_sectors", "l1_sectors_per_clock", 1, 1, "sectors"),
           ("tensor", "mma", "mma_per_clock", 1, 1, "mma.sync m16n8k16"),
           ("wgmma", "wgmma", "wgmma_per_clock", 1, 1, "wgmma (m16n8k16 units)"),
           ("FMA", "fma_flops", "fma_per_clock", 2, 1, "FLOPs"),                # 2 FLOPs a lane
           ("MUFU", "ex2", "ex2_per_clock", 1, 32, "MUFU.EX2 warp instructions"),   # lanes to warp instructions
           ("LSU", "lsu_instructions", "lsu_per_clock", 1, 1, "LDS/STS/SHFL warp instructions"),
           ("issue", "warp_instructions", "issue_per_clock", 1, 1, "warp instructions"))


def busiest_share(blocks: int | None, machine: Machine) -> float:
    """How much more than the average share of the per-SM work the busiest SM runs: ceil(blocks / SMs) x SMs /
    blocks (8 blocks use 8 of 132 SMs: 16.5x; 512 put 4 on some SMs where the average is 3.88)."""
    return 1.0 if blocks is None else math.ceil(blocks / machine.sms) * machine.sms / blocks


def ceilings(work: Work, machine: Machine = H100_SXM, *, floor_bytes: float | None = None,
             label: str = "") -> Bounds:
    """Every term of the bound model for one call's `work` on `machine` (see the module docstring for the terms).

    Parameters
    ----------
    work : Work
        The call's work in plain statistics (counted by the lab, or read off another kernel's SASS and launch).
    machine : Machine
        The rates (`H100_SXM`).
    floor_bytes : float, optional
        The bytes the operator must move (K/V once, Q, O), for `Bounds.hbm_share` and DRAM / floor; `label` names it.

    Returns
    -------
    Bounds
        `.resources` (µs each, with its rate and the rate's source), `.ranked`, `.limiter`, `.bound_us`,
        `.hbm_share`, `.figures`, `.summary()`.

    Raises
    ------
    ValueError
        A negative figure, blocks below 1, or work that gives no term at all.
    """
    try:                # every field at once; field by field only to name the one at fault
        checked = min(_COUNTS(work)) >= 0 and all(value is None or value >= 1 for value in _AT_LEAST_ONE_FIELDS(work))
    except TypeError:   # a count left None
        checked = False
    if not checked:
        for name, value in vars(work).items():
            if value is not None and value < (1 if name in _AT_LEAST_ONE else 0):
                expected = "at least 1 (or None)" if name in _AT_LEAST_ONE else "a count of at least 0"
                raise ValueError(f"work.{name}: expected {expected}, got {value!r}")
    out = Bounds(machine)
    m, ghz = machine, machine.clock_hz / 1e9
    busiest = busiest_share(work.blocks, m)
    per_clock = m.sms * m.clock_hz / busiest           # SM clocks a second the busiest SM stands for
    if work.blocks is not None:
        out.figures["busiest SM"] = Figure(busiest, "x", "derived", "ceil({} blocks / {} SMs) over the average share",
                                           work.blocks, m.sms)
    src = m.sources
    if work.dram_bytes or floor_bytes is not None:
        out.figures["DRAM bytes"] = Figure(work.dram_bytes, "B", "counted", "read + write")
        out.resources["DRAM"] = Figure(work.dram_bytes / m.hbm_bytes_per_s * 1e6, "µs", "derived",
                                       "DRAM bytes / {:g} TB/s; {}", m.hbm_bytes_per_s / 1e12,
                                       src.get("hbm_bytes_per_s", ""))
    if floor_bytes is not None:
        out.figures["floor bytes"] = Figure(floor_bytes, "B", "derived", "{}: K/V once, Q, O", label)
        out.figures["DRAM / floor"] = Figure(work.dram_bytes / floor_bytes, "x", "derived", "1.00 is the floor")
    if work.l2_bytes:
        out.figures["L2 bytes"] = Figure(work.l2_bytes, "B", "counted", "global loads beyond the DRAM bytes")
        out.resources["L2"] = Figure(work.l2_bytes / m.l2_bytes_per_s * 1e6, "µs", "derived",
                                     "L2 bytes / {:g} TB/s; {}", m.l2_bytes_per_s / 1e12, src.get("l2_bytes_per_s", ""))
    for name, field_, rate_field, times, per, what in _PER_SM:
        amount = getattr(work, field_)
        if amount:
            rate = times * getattr(m, rate_field) / per
            out.resources[name] = Figure(amount / (rate * per_clock) * 1e6, "µs", "derived",
                                         "{} / ({:g} a clock x {} SMs x {:g} GHz); {}", what, rate, m.sms, ghz,
                                         src.get(rate_field, ""))
    if work.launches:
        out.resources["launch"] = Figure(work.launches * m.launch_s * 1e6, "µs", "derived",
                                         "{} launches x {:g} µs; {}", work.launches, m.launch_s * 1e6,
                                         src.get("launch_s", ""))
    trip_s = work.chain_hbm * m.hbm_latency_s + work.chain_l2 * m.l2_latency_s + work.chain_near * m.near_latency_s
    if work.warp_trips and trip_s and work.blocks and work.blocks_per_sm and work.warps_per_block:
        on_busiest = math.ceil(work.blocks / m.sms)
        warps_held = min(work.blocks_per_sm, on_busiest) * work.warps_per_block
        busy = min(m.sms, work.blocks)
        out.figures["trip chain"] = Figure(trip_s * 1e9, "ns", "derived",
                                           "{:g} HBM x {:.0f} ns + {:g} L2 x {:.0f} ns + {:g} near x {:.0f} ns",
                                           work.chain_hbm, m.hbm_latency_s * 1e9, work.chain_l2, m.l2_latency_s * 1e9,
                                           work.chain_near, m.near_latency_s * 1e9)
        if work.trip_bytes:
            in_flight = work.trip_bytes / trip_s * m.hbm_latency_s * warps_held
            needed = m.hbm_bytes_per_s * m.hbm_latency_s / m.sms
            out.figures["in flight B/SM"] = Figure(in_flight, "B", "derived",
                                                   "average: {:g} B a trip over its chain x {} warps",
                                                   work.trip_bytes, warps_held)
            out.figures["in flight / needed"] = Figure(in_flight / needed, "x", "derived",
                                                       "1.00 hides HBM's latency")
        out.resources["latency"] = Figure(work.warp_trips * trip_s / (busy * warps_held) * 1e6, "µs", "derived",
                                          "{:,.0f} warp trips x {:.0f} ns / ({} SMs x {} warps held); {}",
                                          work.warp_trips, trip_s * 1e9, busy, warps_held,
                                          src.get("hbm_latency_s", ""))
        # The partial last wave: the busiest SM's blocks in waves of blocks_per_sm, each a block's serial chain.
        waves = math.ceil(on_busiest / work.blocks_per_sm)
        per_warp = work.warp_trips / (work.blocks * work.warps_per_block)
        out.figures["waves"] = Figure(waves, "", "derived", "ceil({} blocks / {} resident) on the busiest SM",
                                      on_busiest, work.blocks_per_sm)
        out.resources["waves"] = Figure(waves * per_warp * trip_s * 1e6, "µs", "derived",
                                        "{} waves x {:,.1f} trips a warp x {:.0f} ns", waves, per_warp, trip_s * 1e9)
    if not out.resources:
        raise ValueError(f"work: no term has work to bound, got {work!r}")
    return out


def bounds(metrics: dict, scale: float = 1.0, *, case: FloorCase | None = None,
           warp_instructions: float | None = None, mma: float | None = None, fma_flops: float | None = None,
           blocks: int | None = None, machine: Machine = H100_SXM, **work) -> Bounds:
    """`ceilings` fed from figures counted on a scaled-down launch (`cacheattn.lab.record()`'s metrics).

    Parameters
    ----------
    metrics : dict
        Nsight Compute metric name -> count (`rec.metrics`): DRAM bytes read / written, global load / store
        sectors, shared wavefronts and bank conflicts; a missing metric leaves its resource out.
    scale : float
        Blocks of the full grid per block counted (the per-block figures scale with the grid).
    case : FloorCase, optional
        The bench case: adds the floor (the bytes the operator must move) and DRAM bytes ÷ floor.
    warp_instructions, mma, fma_flops, blocks
        As `Work`'s fields, already at full scale.
    machine : Machine
        The rates (H100_SXM).
    **work
        Any other `Work` field (l2_bytes, ex2, lsu_instructions, launches, blocks_per_sm, ...), at full scale.

    Returns
    -------
    Bounds
    """
    if scale <= 0:
        raise ValueError(f"scale: expected the positive ratio of full-grid blocks to counted blocks, got {scale!r}")
    if blocks is not None and blocks < 1:
        raise ValueError(f"blocks: expected the full grid's block count, at least 1, got {blocks!r}")
    dram = _total(metrics, (DRAM_READ, DRAM_WRITE))
    wavefronts = _total(metrics, SHARED_WAVEFRONTS)
    sectors = _total(metrics, GLOBAL_SECTORS)
    if dram is None and wavefronts is None and sectors is None and not (warp_instructions or mma or fma_flops
                                                                        or work):
        raise ValueError("metrics: none of the DRAM, shared-memory or global-sector metrics is present, and no "
                         f"warp_instructions, mma or fma_flops was given; got {sorted(metrics)}")
    load = Work(dram_bytes=(dram or 0) * scale, shared_wavefronts=(wavefronts or 0) * scale,
                l1_sectors=(sectors or 0) * scale, mma=mma or 0.0, fma_flops=fma_flops or 0.0,
                warp_instructions=warp_instructions or 0.0, blocks=blocks, **work)
    out = ceilings(load, machine, floor_bytes=None if case is None else case.floor_bytes,
                   label="" if case is None else case.label)
    scaled = f"counted x {scale:g}" if scale != 1 else "counted"
    if dram is not None:
        out.figures["DRAM bytes"] = Figure(dram * scale, "B", "counted", f"{scaled}, read + write")
    elif "DRAM" in out.resources and case is not None and not load.dram_bytes:
        del out.resources["DRAM"]                     # a floor was given but no DRAM bytes were counted
    if wavefronts is not None:
        out.figures["shared wavefronts"] = Figure(wavefronts * scale, "", "counted", f"{scaled}, loads + stores")
        conflicts = _total(metrics, SHARED_CONFLICTS)
        if conflicts is not None:
            out.figures["bank conflicts"] = Figure(conflicts * scale, "", "counted", f"{scaled}, loads + stores")
    if sectors is not None:
        out.figures["global sectors"] = Figure(sectors * scale, "", "counted", f"{scaled}, through L1, loads + stores")
    if GLOBAL_LOAD_BYTES in metrics and metrics.get(GLOBAL_LOAD_SECTORS):
        out.figures["sector efficiency"] = Figure(metrics[GLOBAL_LOAD_BYTES] / (32 * metrics[GLOBAL_LOAD_SECTORS]),
                                                  "", "derived", "bytes the lanes asked for / (32 x load sectors)")
    if not out.resources:
        raise ValueError(f"metrics: nothing to bound in {sorted(metrics)}")
    return out


def latency_bound(warp_trips: float, chain_hbm: float, chain_near: float = 0.0, *, chain_l2: float = 0.0,
                  blocks: int, blocks_per_sm: int, warps_per_block: int, trip_bytes: float = 0.0,
                  machine: Machine = H100_SXM) -> dict:
    """The latency and wave terms alone (`ceilings`), from the chain of dependent global round trips one warp's
    key-loop trip waits on (`cacheattn.lab.sass.dependent_chain`): Little's law with the *average* bytes a warp
    has in flight (a trip's bytes over its chain), not the most it ever has. Returns Figures (derived): latency
    and waves in µs, the trip's chain in ns and, given `trip_bytes`, the average bytes in flight per SM against
    what HBM needs."""
    if chain_hbm + chain_l2 + chain_near <= 0 or warp_trips <= 0:
        raise ValueError(f"warp_trips, chain_hbm + chain_l2 + chain_near: expected positive figures, got "
                         f"{warp_trips!r}, {chain_hbm!r} + {chain_l2!r} + {chain_near!r}")
    out = ceilings(Work(warp_trips=warp_trips, chain_hbm=chain_hbm, chain_l2=chain_l2, chain_near=chain_near,
                        blocks=blocks,
                        blocks_per_sm=blocks_per_sm, warps_per_block=warps_per_block, trip_bytes=trip_bytes),
                   machine)
    return {**{name: out.resources[name] for name in ("latency", "waves")},
            **{name: fig for name, fig in out.figures.items() if name != "busiest SM"}}
