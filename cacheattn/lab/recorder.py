"""Nsight-style memory counters and compute-sanitizer-style findings, counted in numba's CUDA simulator.

The simulator runs every CUDA thread of a block as a Python thread and hands the kernel NumPy arrays, so every
load and store of every thread passes through Python: `record()` puts a thin wrapper around each array a launch
receives (its arguments, also inside tuples and named tuples) and around each shared array it allocates, and
attributes every `__getitem__` / `__setitem__` to a thread, an access site and a byte range.

What is counted (Nsight Compute's names and meanings):

    l1tex__t_requests_pipe_lsu_mem_global_op_ld/st.sum      one per warp per executed global load/store
    l1tex__t_sectors_pipe_lsu_mem_global_op_ld/st.sum       distinct 32-byte sectors of each request, summed
    l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld/st.sum  per shared request, the most distinct 4-byte words
                                                            one of the 32 banks serves (8-byte accesses a
                                                            half-warp at a time, 16-byte a quarter-warp)
    l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld/st.sum  wavefronts minus the fewest the width allows
    dram__bytes_read/write.sum                              32 x the distinct global sectors a launch reads /
                                                            writes (an L2 that holds the working set)

A request is what the lanes of one warp do at one dynamic execution of one access site: the site is the source line
and column of the access (a device function's access is its own site; the simulator twins of `load16` and `load8`
count at the line that calls them), and the k-th execution of a site by one lane meets the k-th execution by the
other lanes. Warps are formed from the linear thread id x + y Dx + z Dx Dy. That is exact while the lanes of a warp
take the same path; where they diverge, lanes that execute a site a different number of times are paired by count,
not by time: a loop with a lane-dependent trip count gives the GPU's requests only if every lane's k-th visit is the
same instruction issue, which holds for the masked-off tail of such a loop but not for lanes that re-converge
through different branches. Addresses count from each array's own start, as if every allocation were sector-aligned
(cudaMalloc aligns to 256 bytes). Local arrays and scalars are registers: not counted.

Shared arrays that only stand in for registers in the simulator (the twins of warp shuffles, `mma.sync` and
ldmatrix's row exchange in `kernels_numba._warp` / `_mma` / `_async_copy`) are neither counted nor checked, and the
barriers those twins hold are not barriers for the race check, because on a GPU neither exists.

The twins of `kernels_numba._async_copy` count as the instructions they stand for, at the line that calls them:
    cp_async16       (LDGSTS.128) a 16-byte global load a lane (requests, sectors, DRAM bytes as LDG.128's) and a
                     16-byte shared store a lane (wavefronts and bank conflicts as STS.128's: a quarter-warp at a
                     time), both one instruction: `Recording.async_copies["cp_async_requests"]` says how many;
                     cp_async16_at alike, but a zero-fill copy (src-size 0) reads no global byte;
    ldmatrix_x4*     (LDSM.x4, .trans alike) a 16-byte shared load a lane at the row address the lane supplies:
                     lanes 8j .. 8j + 7 give the 8 rows of matrix j, which one wavefront serves when their 16-byte
                     chunks fall in 8 distinct groups of 4 banks (address / 16 mod 8); rows that share a group
                     but not an address take a wavefront each. That is the quarter-warp rule of 16-byte loads,
                     each quarter-warp one matrix: 4 wavefronts at least, `ldmatrix_requests` of them. NVIDIA's
                     manuals give no ldmatrix rule; this is the one its GTC 2020 talk on A100 tensor-core kernels
                     (A. Kerr, "Developing CUDA Kernels to Push Tensor Cores to the Absolute Limit", S21745)
                     designs its XOR-swizzled layouts by (each 8-lane phase reads 128 bytes, conflict-free when
                     the 8 rows' 16-byte chunks hit distinct bank groups), and an unswizzled 128-byte row stride
                     profiles as an 8-way conflict, 8 wavefronts a matrix
                     (https://kernelengineering.vizuara.ai/a/tc-kernel-2-fragments-swizzling.html).
The copy's shared store counts where it is issued: its bytes take part in the race check then (the twin's own
pending-copy check covers reads before the wait).

Findings (`Recording.hazards`), once per (kind, array, pair of sites), with a count:
    race            two threads of one block touch one shared word between two barriers, at least one writes;
    uninitialized   a shared word read before any thread of the block wrote it (shared memory is per block: the
                    simulator hands every block the same array, a GPU gives each its own);
    out_of_bounds   an index outside its array, negative ones included (NumPy wraps a[-1]); recorded before the
                    access runs, so before a launch that then fails.
Words are 4 bytes, or the element where it is narrower (a byte array's bytes are separate words). Global memory is
bounds-checked only: racecheck and initcheck here look at shared memory.

Details: indexing that makes a sub-array (a row, a slice) is no access; its elements are, and taking a view's values
at once (`np.asarray(view)`, as the `load16` and `load8` twins do) is one access of all its bytes. Arrays that are
views of the same memory (K and V of one cache) are one array, named `k_src.data=v_src.data`. `cuda.atomic.*`
accesses are no load/store requests and never race with each other; their sectors count as read and written. Blocks
run as the simulator runs them, except that the main thread sleeps until one of the block's threads reaches a
barrier or ends (the simulator's own loop polls without pause, taking the interpreter from the threads it waits
for). """

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

SECTOR = 32
GLOBAL_LD = "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"
GLOBAL_ST = "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"
SECTORS_LD = "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"
SECTORS_ST = "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum"
WAVEFRONTS_LD = "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"
WAVEFRONTS_ST = "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"
CONFLICTS_LD = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
CONFLICTS_ST = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
DRAM_READ = "dram__bytes_read.sum"
DRAM_WRITE = "dram__bytes_write.sum"
METRICS = (GLOBAL_LD, GLOBAL_ST, SECTORS_LD, SECTORS_ST, WAVEFRONTS_LD, WAVEFRONTS_ST, CONFLICTS_LD, CONFLICTS_ST,
           DRAM_READ, DRAM_WRITE)

# Counts beside the Nsight metrics, under plain names: what the lanes asked for (sector efficiency), shared
# requests (wavefronts per request) and warp-level barriers.
# HMMA: warp-level mma.sync.m16n8k16 instructions executed (one HMMA.16816 each on sm_80 and later), Nsight
# Compute's smsp__inst_executed_pipe_tensor_op_hmma.sum, counted at the simulator twin of `_mma.mma_m16n8k16`.
HMMA = "smsp__inst_executed_pipe_tensor_op_hmma.sum"
EXTRA = ("global_ld_bytes_requested", "global_st_bytes_requested", "shared_ld_requests", "shared_st_requests",
         "barriers", HMMA, "launches", "blocks")
ASYNC_COPY_FIGURES = ("cp_async_requests", "ldmatrix_requests")
# Per source line (Nsight Compute's source view): requests, sectors and bytes asked for of global loads / stores,
# requests, wavefronts and bank conflicts of shared loads / stores.
LINE_FIGURES = ("global_ld_requests", "global_ld_sectors", "global_ld_bytes_requested", "global_st_requests",
                "global_st_sectors", "global_st_bytes_requested", "shared_ld_requests", "shared_ld_wavefronts",
                "shared_ld_conflicts", "shared_st_requests", "shared_st_wavefronts", "shared_st_conflicts")

# How a frame's code takes part in attributing an access (see Recording._site); _NORMAL is 0, never falsy-missed
# because lookups that find nothing return None.
_NORMAL, _TRANSPARENT, _ATOMIC, _EMULATED = 1, 2, 3, 4
_ARRAY_FIGURES = ("ld_requests", "ld_sectors", "ld_bytes_requested", "st_requests", "st_sectors", "st_bytes_requested")


@dataclass
class Hazard:
    """One sanitizer finding: `count` occurrences of `kind` on `array` at the same site(s).

    index: the first offending index; threads: ((blockIdx, threadIdx), ...) of the first occurrence (two for a
    race); lines: "file.py:line" of the site(s) (a race's two accesses, the earlier-executed first); sources: the
    text of those lines, stripped ("" where the source cannot be read)."""
    kind: str
    array: str
    index: object
    threads: tuple
    lines: tuple
    count: int = 1
    sources: tuple = ()

    def __str__(self):
        where = " / ".join(self.lines)
        who = ", ".join(f"block {b} thread {t}" for b, t in self.threads)
        return f"{self.kind}: {self.array}[{self.index}] at {where} ({who}), {self.count}x"


@dataclass
class Launch:
    """One recorded launch: kernel name, grid and block shape, its own counters, its DRAM bytes per global array
    (name -> (read, written)) and its requests per global array (name -> {ld_requests, ld_sectors, ld_bytes_requested,
    st_...}: the sector efficiency of the K/V loads alone, say)."""
    kernel: str
    grid: tuple
    block: tuple
    metrics: dict = field(default_factory=dict)
    dram: dict = field(default_factory=dict)
    arrays: dict = field(default_factory=dict)


class _Memory:
    """One global allocation or one shared array (per launch): a name for findings and its own address space."""
    __slots__ = ("name", "shared", "unit")

    def __init__(self, name: str, shared: bool, unit: int = 4):
        self.name, self.shared, self.unit = name, shared, unit


def _simulator():
    from numba import config
    if not config.ENABLE_CUDASIM:
        raise RuntimeError("cacheattn.lab.record() counts in numba's CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 "
                           "before numba is imported")
    from numba.cuda.simulator import kernel, kernelapi
    return kernel, kernelapi


class Tracked:
    """A kernel's view of one array under the recorder: indexing records the access, then does it."""
    __slots__ = ("_ary", "_mem", "_base", "_rec")

    def __init__(self, ary, mem, base, rec):
        self._ary, self._mem, self._base, self._rec = ary, mem, base, rec

    def __getitem__(self, key):
        rec = self._rec
        if rec._active:
            frame = sys._getframe(1)
            if rec._codes.get(frame.f_code) != _EMULATED:      # the twins' register scratch: most accesses
                view = rec._access(self, key, False, frame)
                if view is not None:
                    return view
        return self._ary[key]

    def __setitem__(self, key, value):
        rec = self._rec
        if rec._active:
            frame = sys._getframe(1)
            if rec._codes.get(frame.f_code) != _EMULATED:
                rec._access(self, key, True, frame)
        self._ary[key] = value

    def __array__(self, dtype=None, copy=None):
        # Taking the values of a view at once (the `load16` twin's np.asarray(data[i:i + n])) is one access
        # of all its bytes: a vector load.
        rec = self._rec
        if rec._active and self._ary.size:
            rec._vector_read(self, sys._getframe(1))
        return self._ary if dtype is None else self._ary.astype(dtype)

    def __len__(self):
        return len(self._ary)

    @property
    def shape(self):
        return self._rec._fake_shape(self._ary.shape)

    def __getattr__(self, name):
        if name.startswith("__"):
            # NumPy would take __array_interface__ / __array_struct__ from the wrapped array and read it without
            # a word to us; __array__ above is the one door.
            raise AttributeError(name)
        return getattr(self._ary, name)

    def __repr__(self):
        return f"Tracked({self._mem.name}, {self._ary.dtype}, {self._ary.shape})"


class Recording:
    """What `record()` collects: `metrics` (Nsight names, summed over launches), `extra`, `hazards`, `launches`,
    and `lines`: "file.py:line" -> {LINE_FIGURES name: count} over every launch (where in the source the sectors,
    wavefronts and conflicts are)."""

    def __init__(self):
        self.metrics = dict.fromkeys(METRICS, 0)
        self.extra = dict.fromkeys(EXTRA, 0)
        self.launches: list[Launch] = []
        self.lines: dict = {}
        # Warp-level instructions of the `_async_copy` twins: a cp.async is one instruction behind one global load
        # request and one shared store request (so `extra` counts it twice); an ldmatrix is one shared load request.
        self.async_copies = dict.fromkeys(ASYNC_COPY_FIGURES, 0)
        self._findings: dict = {}
        self._active = False
        self._lock = threading.Lock()
        self._codes: dict = {}
        self._sites: dict = {}
        self._site_names: list = []
        self._launch = None
        self._sim_dir = ""
        self._fake_shape = tuple
        self._mma_code = None

    # --- results ---------------------------------------------------------------------------------------------
    @property
    def hazards(self) -> list[Hazard]:
        return list(self._findings.values())

    def report(self) -> str:
        """The counters and findings as text (derived ratios beside the raw counts)."""
        m, x = self.metrics, self.extra
        lines = [f"{x['launches']} launch(es), {x['blocks']} block(s)"]
        width = max(len(k) for k in METRICS)
        for name in METRICS:
            lines.append(f"  {name:<{width}}  {m[name]:>12,}")
        derived = []
        for op, req, sec, asked in (("ld", GLOBAL_LD, SECTORS_LD, "global_ld_bytes_requested"),
                                    ("st", GLOBAL_ST, SECTORS_ST, "global_st_bytes_requested")):
            if m[req]:
                derived.append(f"global {op}: {m[sec] / m[req]:.2f} sectors/request, "
                               f"{100 * x[asked] / (SECTOR * m[sec]):.0f}% sector efficiency")
        for op, wav, req in (("ld", WAVEFRONTS_LD, "shared_ld_requests"), ("st", WAVEFRONTS_ST, "shared_st_requests")):
            if x[req]:
                derived.append(f"shared {op}: {m[wav] / x[req]:.2f} wavefronts/request")
        lines += [f"  {d}" for d in derived]
        lines.append("  (DRAM bytes: every distinct sector of a launch once, as an L2 that holds the working set)")
        lines.append(f"{len(self._findings)} finding(s)")
        lines += [f"  {h}" for h in self._findings.values()]
        return "\n".join(lines)

    # --- sites -----------------------------------------------------------------------------------------------
    def _code_kind(self, code):
        kind = self._codes.get(code)
        if kind is None:
            ours = code.co_filename.startswith(self._sim_dir) or code.co_filename == __file__
            kind = _TRANSPARENT if ours else _NORMAL
            self._codes[code] = kind
        return kind

    def _site(self, frame):
        """(site id, atomic) of the access made in `frame`, or None inside a register-emulating twin. The
        simulator's own frames (device-function calls, cuda.atomic.*) and this module's pass the access on to
        their caller."""
        atomic = False
        code = frame.f_code
        kind = self._codes.get(code) or self._code_kind(code)
        while kind != _NORMAL:
            if kind == _EMULATED:
                return None
            atomic = atomic or kind == _ATOMIC
            frame = frame.f_back
            code = frame.f_code
            kind = self._codes.get(code) or self._code_kind(code)
        key = (code, frame.f_lasti)
        site = self._sites.get(key)
        if site is None:
            line, _, col, _ = list(code.co_positions())[frame.f_lasti // 2]
            name = (code.co_filename, line, col)
            with self._lock:                              # threads meet new sites at once
                site = self._sites.get(name)
                if site is None:
                    site = self._sites[name] = len(self._site_names)
                    self._site_names.append(name)
                self._sites[key] = site
        return site, atomic

    def _line(self, site) -> str:
        path, line, _ = self._site_names[site]
        return source_line(path, line)[0]

    def _source(self, site) -> str:
        path, line, _ = self._site_names[site]
        return source_line(path, line)[1]

    # --- launches and blocks ---------------------------------------------------------------------------------
    def _begin_launch(self, name, grid, block):
        self._launch = {"name": name, "grid": tuple(grid), "block": tuple(block), "read": set(), "written": set(),
                        "metrics": Counter(), "shared": {}, "shared_views": {}, "global_arrays": {}}
        self._active = True

    def _end_launch(self):
        launch, self._launch = self._launch, None
        self._active = False
        if launch is None:
            return
        counts = launch["metrics"]
        counts[DRAM_READ] += SECTOR * len(launch["read"])
        counts[DRAM_WRITE] += SECTOR * len(launch["written"])
        counts["launches"] += 1
        for name in METRICS:
            self.metrics[name] += counts[name]
        for name in EXTRA:
            self.extra[name] += counts[name]
        arrays: dict = {}
        for which, sectors in ((0, launch["read"]), (1, launch["written"])):
            for mem, _ in sectors:
                arrays.setdefault(mem.name, [0, 0])[which] += SECTOR
        self.launches.append(Launch(launch["name"], launch["grid"], launch["block"],
                                    {name: counts[name] for name in METRICS},
                                    {name: tuple(v) for name, v in arrays.items()},
                                    {name: dict(zip(_ARRAY_FIGURES, figures))
                                     for name, figures in launch["global_arrays"].items()}))

    def _begin_block(self, block_idx):
        launch = self._launch
        if launch is not None:
            launch["block_idx"] = tuple(int(i) for i in block_idx)
            launch["global_requests"] = {}
            launch["shared_requests"] = {}
            launch["barrier_requests"] = set()
            launch["mma_requests"] = set()
            launch["async_requests"] = set()            # (kind, warp, site, k): one a warp-level cp.async / ldmatrix
            launch["shared_state"] = {}                 # per block: a GPU gives every block its own shared memory

    def _end_block(self):
        launch = self._launch
        if launch is None or "global_requests" not in launch:
            return
        counts = launch["metrics"]
        counts["blocks"] += 1
        counts["barriers"] += len(launch.pop("barrier_requests"))
        counts[HMMA] += len(launch.pop("mma_requests"))
        for kind, _, _, _ in launch.pop("async_requests"):
            self.async_copies[kind] += 1
        read, written = launch["read"], launch["written"]
        per_array = launch["global_arrays"]
        for (_, site, _, write), accesses in launch.pop("global_requests").items():
            sectors = {(mem, sector) for mem, offset, width in accesses
                       for sector in range(offset >> 5, ((offset + width - 1) >> 5) + 1)}
            asked = _distinct_bytes(accesses)
            counts[GLOBAL_ST if write else GLOBAL_LD] += 1
            counts[SECTORS_ST if write else SECTORS_LD] += len(sectors)
            counts["global_st_bytes_requested" if write else "global_ld_bytes_requested"] += asked
            self._count_line(site, "global_st" if write else "global_ld",
                             requests=1, sectors=len(sectors), bytes_requested=asked)
            (written if write else read).update(sectors)
            mems = {mem for mem, _, _ in accesses}
            for mem in mems:                              # almost always one array per request
                figures = per_array.setdefault(mem.name, [0, 0, 0, 0, 0, 0])
                figures[3 * write] += 1
                figures[3 * write + 1] += sum(1 for m, _ in sectors if m is mem)
                figures[3 * write + 2] += asked if len(mems) == 1 else \
                    _distinct_bytes({a for a in accesses if a[0] is mem})
        for (_, site, _, write), accesses in launch.pop("shared_requests").items():
            wavefronts, fewest = _wavefronts(accesses)
            counts[WAVEFRONTS_ST if write else WAVEFRONTS_LD] += wavefronts
            counts[CONFLICTS_ST if write else CONFLICTS_LD] += wavefronts - fewest
            counts["shared_st_requests" if write else "shared_ld_requests"] += 1
            self._count_line(site, "shared_st" if write else "shared_ld",
                             requests=1, wavefronts=wavefronts, conflicts=wavefronts - fewest)
        launch.pop("shared_state")

    def _count_line(self, site, prefix, **figures):
        line = self.lines.get(self._line(site))
        if line is None:
            line = self.lines[self._line(site)] = dict.fromkeys(LINE_FIGURES, 0)
        for name, value in figures.items():
            line[f"{prefix}_{name}"] += value

    def _barrier(self, thread, frame):
        """A syncthreads reached by `thread`: a new race epoch, unless a register-emulating twin holds it."""
        launch = self._launch
        if launch is None:
            return
        caller = frame
        while caller is not None and (self._codes.get(caller.f_code) or self._code_kind(caller.f_code)) == _TRANSPARENT:
            caller = caller.f_back
        if caller is not None and caller.f_code is self._mma_code:   # the mma twin's two barriers: one HMMA a warp
            counts = _thread_counts(thread)
            k = counts["mma"] = counts.get("mma", 0) + 1
            if k % 2:
                launch["mma_requests"].add((thread.thread_id >> 5, k))
            return
        where = self._site(frame)
        if where is None:
            return
        site = where[0]
        counts = _thread_counts(thread)
        k = counts[site] = counts.get(site, 0) + 1
        thread.lab_epoch = getattr(thread, "lab_epoch", 0) + 1
        launch["barrier_requests"].add((thread.thread_id >> 5, site, k))

    # --- accesses --------------------------------------------------------------------------------------------
    def _access(self, tracked, key, write, frame):
        """Record one indexing of `tracked`; returns a Tracked view when the indexing makes a sub-array."""
        launch = self._launch
        if launch is None or "global_requests" not in launch:
            return None
        ary = tracked._ary
        shape = ary.shape
        index = key
        if type(key) is not tuple:
            key = (key,)
        element = len(key) == len(shape)
        if element:
            for i in key:
                if type(i) is not int and not isinstance(i, np.integer):
                    element = False
                    break
        if element:
            where = self._site(frame)
            if where is None:
                return None
            offset = tracked._base
            out = False
            for i, n, stride in zip(key, shape, ary.strides):
                if i < 0 or i >= n:
                    out = True
                offset += int(i) * stride
            self._record(tracked, where, offset, ary.itemsize, write, index, out, frame)
            return None
        # A sub-array (a row of a 2-D array, a slice): no access yet; its elements are counted when indexed.
        out = _slice_out_of_bounds(key, shape)
        if out:
            where = self._site(frame)
            if where is not None:
                self._finding("out_of_bounds", tracked._mem.name, index, (where[0],), (_me(),))
        sub = ary[index]
        if not isinstance(sub, np.ndarray):
            return None
        if write:
            where = self._site(frame)
            if where is not None and sub.size:
                start = tracked._base + _byte_offset(ary, sub)
                self._record(tracked, where, start, sub.nbytes, True, index, False, frame)
            return None
        if self._site(frame) is None:
            return sub                                    # a twin's register rows: no tracking
        return Tracked(sub, tracked._mem, tracked._base + _byte_offset(ary, sub), self)

    def _vector_read(self, tracked, frame):
        launch = self._launch
        if launch is None or "global_requests" not in launch:
            return
        where = self._site(frame)
        if where is not None:
            ary = tracked._ary
            self._record(tracked, where, tracked._base, ary.nbytes, False, "vector", False, frame)

    def _async_call(self, kind, twin, args, frame, call):
        """A call of one of `_async_copy`'s twins (`_async_twins`), counted as the instruction it stands for, at
        the line that calls it (see the module docstring), then run on the arrays the twin expects."""
        if kind == "target":                              # keep the kernel's view of the shared array tracked
            shared = args[0]
            if not isinstance(shared, Tracked):
                return call(twin, *args)
            return Tracked(call(twin, shared._ary), shared._mem, shared._base, self)
        raw = [a._ary if isinstance(a, Tracked) else a for a in args]
        if kind == "copy":
            out = call(twin, *raw)                        # the twin checks alignment and bounds first
            dst, dst_index, src, src_index = args
            reads, writes = [(src, src_index)], [(dst, dst_index)]
        elif kind == "copy_at":                           # a zero-fill copy (full false) reads no global byte
            out = call(twin, *raw)
            dst, _, dst_index, src, src_index, full = args
            reads, writes = [(src, src_index)] if full else [], [(dst, dst_index)]
        else:                                             # ldmatrix: one 16-byte row a lane; _at adds an offset
            out = call(twin, *raw)
            row = args[1] + args[2] if kind == "ldmatrix_at" else args[1]
            reads, writes = [(args[0], row)], []
        where = self._site(frame)
        thread = threading.current_thread()
        if where is None or not hasattr(thread, "thread_id") or self._launch is None:
            return out
        for write, items in ((False, reads), (True, writes)):
            for tracked, index in items:
                if isinstance(tracked, Tracked):
                    offset = tracked._base + int(index) * tracked._ary.strides[0]
                    self._record(tracked, where, offset, 16, write, index, False, frame)
        counts = _thread_counts(thread)
        name = "cp_async_requests" if kind in ("copy", "copy_at") else "ldmatrix_requests"
        k = counts[(name, where[0])] = counts.get((name, where[0]), 0) + 1
        self._launch["async_requests"].add((name, thread.thread_id >> 5, where[0], k))
        return out

    def _record(self, tracked, where, offset, width, write, index, out, frame):
        site, atomic = where
        thread = threading.current_thread()
        mem = tracked._mem
        launch = self._launch
        if out:
            self._finding("out_of_bounds", mem.name, index, (site,), (_me(thread),))
        if not hasattr(thread, "thread_id"):
            return                                        # not a simulator thread (host code): not counted
        tid = thread.thread_id
        counts = _thread_counts(thread)
        k = counts[site] = counts.get(site, 0) + 1
        if not mem.shared:
            if atomic:                                    # read-modify-write; not a plain load/store request
                for sector in range(offset >> 5, ((offset + width - 1) >> 5) + 1):
                    launch["read"].add((mem, sector))
                    launch["written"].add((mem, sector))
            else:
                launch["global_requests"].setdefault((tid >> 5, site, k, write), set()).add((mem, offset, width))
            return
        if mem.name is None:
            mem.name = next((name for name, value in frame.f_locals.items() if value is tracked), "shared")
        if not atomic:
            launch["shared_requests"].setdefault((tid >> 5, site, k, write), []).append((tid & 31, offset, width))
        if not out:
            self._shared_hazards(mem, tid, thread, site, offset, width, write, atomic, index)

    def _shared_hazards(self, mem, tid, thread, site, offset, width, write, atomic, index):
        """racecheck and initcheck on the words this access touches (per block, per barrier epoch)."""
        epoch = getattr(thread, "lab_epoch", 0)
        unit = mem.unit
        raced = uninitialized = False
        with self._lock:
            state = self._launch["shared_state"].setdefault(mem, {})
            for word in range(offset - offset % unit, offset + width, unit):
                entry = state.get(word)
                if entry is None:
                    # write epoch, writer, its site; read epoch, reader, its site, another reader, its site; written
                    entry = state[word] = [-1, -1, -1, -1, -1, -1, -1, -1, False]
                if atomic:                                # atomics neither race with one another nor read garbage
                    entry[8] = True
                    continue
                if not write and not entry[8]:
                    uninitialized = True
                if entry[0] == epoch and entry[1] != tid:
                    raced = raced or (entry[2], entry[1])
                if write:
                    if entry[3] == epoch and not raced:
                        if entry[4] != tid:
                            raced = (entry[5], entry[4])
                        elif entry[6] >= 0:
                            raced = (entry[7], entry[6])
                    entry[0], entry[1], entry[2], entry[8] = epoch, tid, site, True
                elif entry[3] != epoch:
                    entry[3], entry[4], entry[5], entry[6], entry[7] = epoch, tid, site, -1, -1
                elif entry[4] != tid and entry[6] < 0:
                    entry[6], entry[7] = tid, site
        if uninitialized or raced:
            me = _me(thread)
            if uninitialized:
                self._finding("uninitialized", mem.name, index, (site,), (me,))
            if raced:
                other_site, other_tid = raced
                other = (me[0], _thread_idx(other_tid, self._launch["block"]))
                self._finding("race", mem.name, index, (other_site, site), (other, me))

    def _finding(self, kind, array, index, sites, threads):
        key = (kind, array, tuple(sorted(sites)))
        with self._lock:
            found = self._findings.get(key)
            if found is None:
                self._findings[key] = Hazard(kind, array, index, tuple(threads), tuple(self._line(s) for s in sites),
                                             sources=tuple(self._source(s) for s in sites))
            else:
                found.count += 1

    # --- wrapping --------------------------------------------------------------------------------------------
    def _wrap_argument(self, name, arg, retr, seen, devicearray, args_module):
        """The kernel's view of one argument: arrays wrapped (top-level NumPy arrays copied in and back, as the
        simulator does), tuples and named tuples rebuilt with their arrays wrapped in place, the rest as it is.
        Views of the same memory (K and V of one cache) are one array: `seen` maps memory to its wrapper."""
        if isinstance(arg, np.ndarray) and arg.ndim > 0 or isinstance(arg, (args_module.ArgHint,
                                                                             devicearray.FakeCUDAArray)):
            host = arg.value if isinstance(arg, args_module.ArgHint) else arg
            host = host._ary if isinstance(host, devicearray.FakeCUDAArray) else host
            found = self._seen(name, host, seen)
            if found is not None:
                return found
            if isinstance(arg, np.ndarray):
                device = args_module.InOut(arg).to_device(retr)
            elif isinstance(arg, args_module.ArgHint):
                device = arg.to_device(retr)
            else:
                device = arg
            ary = device._ary if isinstance(device, devicearray.FakeCUDAArray) else np.asarray(device)
            seen[_memory_key(host)] = tracked = Tracked(ary, _Memory(name, False), 0, self)
            return tracked
        if isinstance(arg, tuple):
            fields = getattr(arg, "_fields", None)
            items = []
            for i, item in enumerate(arg):
                label = f"{name}.{fields[i]}" if fields else f"{name}[{i}]"
                if isinstance(item, np.ndarray) and item.ndim > 0:
                    found = self._seen(label, item, seen)
                    if found is None:
                        found = seen[_memory_key(item)] = Tracked(item, _Memory(label, False), 0, self)
                    items.append(found)
                else:
                    items.append(self._wrap_argument(label, item, retr, seen, devicearray, args_module))
            return type(arg)(*items) if fields else tuple(items)
        return arg

    @staticmethod
    def _seen(name, ary, seen):
        found = seen.get(_memory_key(ary))
        if found is not None and name not in found._mem.name.split("="):
            found._mem.name += f"={name}"
        return found


def source_line(path: str, line: int) -> tuple[str, str]:
    """("file.py:line", the line's text stripped) of line `line` of the code compiled from `path`; a docs page's
    block (cacheattn._docs names it "page.md:first line") gives the page's own line."""
    page = _DOCS_BLOCK.match(path)
    if page:
        path, line = page.group(1), int(page.group(2)) + line
    return f"{os.path.basename(path)}:{line}", linecache.getline(path, line).strip()


def _memory_key(ary):
    return (ary.__array_interface__["data"][0], ary.nbytes, ary.dtype.str, ary.shape, ary.strides)


def _run_block(manager, thread_type, grid_point, args):
    """Run one block as the simulator does (a Python thread per CUDA thread; when every running thread waits at a
    barrier, all go on; the first exception stops the block and is raised), except that this thread sleeps until a
    thread reaches a barrier or ends, where the simulator's own loop polls without pause and takes the
    interpreter from the threads it waits for (the recorded run takes about half the time of a plain one)."""
    wake = threading.Event()
    failed = []

    def body():
        try:
            manager._f(*args)
        except BaseException:
            failed.append(threading.current_thread())
            raise
        finally:
            threading.current_thread().lab_done = True
            wake.set()

    threads = [thread_type(body, manager, grid_point, point, manager._debug)
               for point in np.ndindex(*manager._block_dim)]
    for thread in threads:
        thread.lab_wake, thread.lab_done = wake, False
        thread.start()
    running = threads
    while running:
        wake.wait(0.05)
        wake.clear()                                  # before looking: a later signal stays set for the next wait
        if failed:
            for thread in threads:
                thread.abort = True
                thread.syncthreads_blocked = False
                thread.syncthreads_event.set()
            failed[0].join()
            raise failed[0].exception[0].with_traceback(failed[0].exception[1])
        running = [thread for thread in running if not thread.lab_done]
        if running and all(thread.syncthreads_blocked for thread in running):
            for thread in running:
                thread.syncthreads_blocked = False
                thread.syncthreads_event.set()
    for thread in threads:
        thread.join()


def _wait_at_barrier(thread):
    """The simulator's barrier protocol (flag, wait for the block's release), then a word to _run_block."""
    if thread.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    thread.syncthreads_blocked = True
    thread.lab_wake.set()
    thread.syncthreads_event.wait()
    thread.syncthreads_event.clear()
    if thread.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _thread_counts(thread):
    try:
        return thread.lab_counts
    except AttributeError:
        thread.lab_counts = {}
        return thread.lab_counts


def _thread_idx(tid, block):
    bx, by = block[0], block[1] if len(block) > 1 else 1
    return (tid % bx, (tid // bx) % by, tid // (bx * by))


def _me(thread=None):
    thread = thread or threading.current_thread()
    block = getattr(thread, "blockIdx", None)
    idx = getattr(thread, "threadIdx", None)
    if block is None:
        return ((), ())
    return ((block.x, block.y, block.z), (idx.x, idx.y, idx.z))


def _byte_offset(parent, sub) -> int:
    return sub.__array_interface__["data"][0] - parent.__array_interface__["data"][0]


def _slice_out_of_bounds(key, shape) -> bool:
    """Does an index that makes a sub-array (integers and unit-step slices) reach outside the array?"""
    axis = 0
    for item in key:
        if axis >= len(shape):
            return False
        if isinstance(item, (int, np.integer)):
            if not 0 <= int(item) < shape[axis]:
                return True
        elif isinstance(item, slice):
            start, stop = item.start, item.stop
            if (start is not None and not 0 <= int(start) <= shape[axis]) or \
                    (stop is not None and not 0 <= int(stop) <= shape[axis]):
                return True
        else:
            return False                                  # Ellipsis, newaxis, fancy indices: not judged
        axis += 1
    return False


def _distinct_bytes(accesses) -> int:
    """Bytes the lanes of one request asked for, each byte once (lanes that read one address share it)."""
    if len({width for _, _, width in accesses}) == 1:
        return len(accesses) * next(iter(accesses))[2]
    spans = sorted((mem_id, offset, offset + width) for mem_id, offset, width in
                   ((id(mem), offset, width) for mem, offset, width in accesses))
    total, current = 0, None
    for mem_id, start, stop in spans:
        if current is not None and current[0] == mem_id and start <= current[2]:
            current = (mem_id, current[1], max(current[2], stop))
            continue
        if current is not None:
            total += current[2] - current[1]
        current = (mem_id, start, stop)
    return total + current[2] - current[1]


def _wavefronts(accesses):
    """(wavefronts, the fewest possible) of one shared request: 32 banks of 4-byte words; lanes in one group
    (the warp for <= 4-byte accesses, half-warps for 8, quarter-warps for 16) are served together, the bank with
    the most distinct words sets the group's wavefronts."""
    width = max(w for _, _, w in accesses)
    group_lanes = 32 if width <= 4 else max(1, 128 // width)
    groups: dict = {}
    for lane, offset, w in accesses:
        words = groups.setdefault(lane // group_lanes, set())
        for word in range(offset >> 2, ((offset + w - 1) >> 2) + 1):
            words.add(word)
    total = 0
    for words in groups.values():
        total += max(Counter(word & 31 for word in words).values())
    return total, len(groups)


_RECORDING: Recording | None = None
_SHARED_NAME = re.compile(r"(\w+)\s*=\s*(?:[\w.]+\()?cuda\.shared\.array")
_DOCS_BLOCK = re.compile(r"(.*\.md):(\d+)$")


def _emulating_codes():
    """Code of the simulator twins that stand in for registers (warp shuffles, mma.sync): their shared
    scratch is not memory on a GPU, and their barriers are not barriers there."""
    from kernels_numba import _async_copy, _mma, _warp
    twins = [_warp.xor_reduce, _warp.xor_reduce_many, _warp.transpose_sum, _warp.lane_values, _warp.warp_any,
             _warp.publish, _warp.from_lane, getattr(_mma, "_warp_mma", None), _mma._quad_values,
             getattr(_async_copy, "_ldmatrix", None)]
    # A twin missing from this build (no simulator: the intrinsics stand in) is None; a jitted one has its py_func.
    return [getattr(twin, "py_func", twin).__code__ for twin in twins if twin is not None]


def _async_twins():
    """{id(device function): kind} of `_async_copy`'s simulator twins the recorder counts as instructions
    (`Recording._async_call`): async_target (its view stays tracked), cp_async16 (and its _at form), the
    ldmatrix_x4 family."""
    from kernels_numba import _async_copy as ac
    if not ac.SIMULATED:
        return {}
    kinds = {"async_target": "target", "cp_async16": "copy", "cp_async16_at": "copy_at", "ldmatrix_x4": "ldmatrix",
             "ldmatrix_x4_trans": "ldmatrix", "ldmatrix_x4_at": "ldmatrix_at", "ldmatrix_x4_trans_at": "ldmatrix_at"}
    return {id(getattr(ac, name)): kind for name, kind in kinds.items()}


def _atomic_codes(kernelapi):
    """Code of the simulator's cuda.atomic.* functions: an access made through them is atomic."""
    return [f.__code__ for f in vars(kernelapi.FakeCUDAAtomic).values() if hasattr(f, "__code__")]


def _transparent_codes():
    """Code whose accesses count at its caller's line: the simulator twins of `load16` and `load8` (one vector
    load each)."""
    from kernels_numba import _vector
    return [load.py_func.__code__ for load in (_vector.load16, _vector.load8) if hasattr(load, "py_func")]


@contextmanager
def record():
    """Record every numba.cuda simulator launch inside the `with` block.

    Yields a `Recording`: `metrics` (Nsight Compute metric name -> int, summed over the launches), `extra`
    (bytes requested, shared requests, barriers, launches, blocks), `hazards` (race / uninitialized /
    out_of_bounds findings), `launches` (each launch's own metrics), `async_copies` (warp-level cp.async and
    ldmatrix instructions) and `report()`.

    Raises
    ------
    RuntimeError
        Outside numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1), or inside another `record()`.
    """
    global _RECORDING
    kernel_module, kernelapi = _simulator()
    if _RECORDING is not None:
        raise RuntimeError("cacheattn.lab.record() is already recording")
    from numba.cuda import types as numba_types
    from numba.cuda.errors import normalize_kernel_dimensions
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator import args as args_module
    from numba.cuda.simulator.cudadrv import devicearray

    rec = Recording()
    rec._sim_dir = os.path.dirname(kernel_module.__file__)
    rec._fake_shape = devicearray.FakeShape
    for code in _emulating_codes():
        rec._codes[code] = _EMULATED
    from kernels_numba import _mma
    # The mma twins (float16 and bfloat16) meet at their two barriers in one shared warp-collective step.
    rec._mma_code = getattr(_mma._warp_mma, "py_func", _mma._warp_mma).__code__
    for code in _transparent_codes():
        rec._codes[code] = _TRANSPARENT
    for code in _atomic_codes(kernelapi):
        rec._codes[code] = _ATOMIC

    # The four places the simulator is hooked, restored on the way out.
    kernel_call = kernel_module.FakeCUDAKernel.__call__
    block_run = kernel_module.BlockManager.run
    syncthreads = kernel_module.BlockThread.syncthreads
    shared_array = kernelapi.FakeCUDAShared.array

    twins = _async_twins()

    def launch(self, *args):
        if self._device or kernel_module._kernel_context is not None:
            kind = twins.get(id(self)) if self._device else None
            if kind is not None and rec._launch is not None:
                return rec._async_call(kind, self, args, sys._getframe(1), kernel_call)
            return kernel_call(self, *args)
        names = list(inspect.signature(self.fn).parameters)
        names += [f"arg{i}" for i in range(len(names), len(args))]
        retr, seen = [], {}
        wrapped = [rec._wrap_argument(n, a, retr, seen, devicearray, args_module) for n, a in zip(names, args)]
        grid, block = normalize_kernel_dimensions(self.grid_dim, self.block_dim)
        rec._begin_launch(getattr(self.fn, "__name__", "kernel"), grid, block)
        try:
            kernel_call(self, *wrapped)
        finally:
            rec._end_launch()
        for write_back in retr:
            write_back()

    def run(self, grid_point, *args):
        rec._begin_block(grid_point)
        try:
            _run_block(self, kernel_module.BlockThread, grid_point, args)
        finally:
            rec._end_block()

    def barrier(self):
        rec._barrier(self, sys._getframe(1))
        _wait_at_barrier(self)

    allocation_lock = threading.Lock()

    def shared(self, shape, dtype, alignment=None):
        # The simulator keys static allocations by the caller's file and line; so does this (calling the
        # original from here would give every allocation this line). Every thread of the block asks: one lock,
        # so all get the same array and the same wrapper.
        frame = sys._getframe(1)
        with allocation_lock:
            return allocate(self, frame, shape, dtype, alignment)

    def allocate(self, frame, shape, dtype, alignment):
        launch = rec._launch
        if shape == 0:
            raw, key = shared_array(self, shape, dtype, alignment), ("dynamic", id(self))
        else:
            if alignment is not None:
                raise RuntimeError("Array alignment is not supported in cudasim")
            if isinstance(dtype, numba_types.Type):
                dtype = numpy_support.as_dtype(dtype)
            caller = (frame.f_code.co_filename, frame.f_lineno)
            raw = self._allocations.get(caller)
            if raw is None:
                raw = self._allocations[caller] = np.empty(shape, dtype)
            key = ("static", id(raw))
        if launch is None:
            return raw
        memories, wrappers = launch["shared"], launch["shared_views"]
        found = wrappers.get((key, raw.dtype.str))
        if found is None:
            mem = memories.get(key)
            if mem is None:
                source = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
                match = _SHARED_NAME.search(source)
                # Without the source (code run from a string), the name the kernel gives it at its first access.
                mem = memories[key] = _Memory(match.group(1) if match else None, True,
                                              1 if shape == 0 else min(4, raw.dtype.itemsize))
            found = wrappers[(key, raw.dtype.str)] = Tracked(raw, mem, 0, rec)
        return found

    kernel_module.FakeCUDAKernel.__call__ = launch
    kernel_module.BlockManager.run = run
    kernel_module.BlockThread.syncthreads = barrier
    kernelapi.FakeCUDAShared.array = shared
    _RECORDING = rec
    try:
        yield rec
    finally:
        kernel_module.FakeCUDAKernel.__call__ = kernel_call
        kernel_module.BlockManager.run = block_run
        kernel_module.BlockThread.syncthreads = syncthreads
        kernelapi.FakeCUDAShared.array = shared_array
        _RECORDING = None
