"""The machine code of every rung of the kernel ladder, read without a GPU.

For each rung (docs/kernel-ladder.md) and cache format at the headline shapes (32 query / 8 kv heads, head_dim 128,
quant_group 8 with float16 scales, a float16 query, 128 threads a block as the launchers use by default), this
records the OpenPPL launch the launcher makes (and TensorRT-LLM's generation step on rung 3, with its float16,
INT8 and FP8 caches), compiles the kernel to PTX (`cuda.compile_ptx`, in a process without
NUMBA_ENABLE_CUDASIM, as `kernels_numba.ptx_check` does), assembles it for sm_90 with `ptxas -v` (registers,
spills, static shared memory) and disassembles the cubin with `nvdisasm`. From those it derives

- the theoretical occupancy on sm_90 by the occupancy calculator's rules (`occupancy`);
- the key loop: the backward branch whose body holds the most global loads (the loop over keys; inner loops of
  rung 1 sit inside it), and its *static* instruction mix: each instruction of the body counted once, however
  often it runs (`instruction_mix`);
- for the bounds (`cacheattn.bounds`): the shortest path through one trip of the key loop that still does its
  memory, shuffle, mma, exp2 and barrier work (`trip_path`, `path_mix`), the shortest path a warp runs once around
  it (`outside_path`: prologue, the query's loads, merge, epilogue), and the chain of global round trips a trip
  waits on in series (`dependent_chain`).

    python -m cacheattn.lab.sass [--write docs/kernel-ladder-sass.json] [--rung 3] [--cache int8] [--operator trtllm]

The tools' output is cached on disk, keyed by the kernels' sources, the variant and the tools' versions, so a second
call costs a file read and the parsing. Everything here is counted from the compiler's output, never timed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The headline shapes of the ladder page and the lab's bench cases.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, QUANT_GROUP, THREADS = 32, 8, 128, 8, 128
CACHES = {"float16": 0, "int8": 8, "int4": 4}            # cache format -> OpenPPL quant_bit
# The kernel each rung launches for attention (rung 4: the split-K partials kernel; its combine is a small pass).
RUNG_KERNELS = {1: "attention_kernel", 2: "warp_attention_kernel", 3: "vector_attention_kernel",
                4: "vector_attention_kernel", 5: "mma_attention_kernel", 6: "flash_attention_kernel"}
# Where a phase runs another kernel than its rung's: rung 5 decodes on its register-fed GQA kernel.
PHASE_KERNELS = {(5, "decode"): "gqa_decode_attention_kernel"}
PREFILL_ROWS = 16          # query positions of the prefill variant: query tiles stop growing at 16 rows

# sm_90 (H100) limits the occupancy calculator uses: CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability" (9.0: 64 K 32-bit registers, 64 warps, 32 blocks and 228 KB of shared memory per SM,
# 1 KB of it reserved by the system for each block) and the CUDA Occupancy Calculator's allocation rules
# (registers granted per warp in units of 256, warps spread over 4 sub-partitions that each hold a quarter of the
# register file; shared memory granted in units of 128 bytes).
SM90 = dict(registers=65536, register_unit=256, sub_partitions=4, max_warps=64, max_blocks=32, shared_bytes=228 * 1024,
            shared_reserved_per_block=1024, shared_unit=128)

# The instruction classes the mix counts (`mix_class` sorts opcodes into them).
MIX_CLASSES = ("LDG.8", "LDG.16", "LDG.32", "LDG.64", "LDG.128", "STG", "LDS", "STS", "LDL", "STL", "SHFL", "BAR",
               "FFMA", "HFMA2", "HMMA", "MUFU.EX2", "total")


@dataclass(frozen=True)
class Variant:
    """One kernel of the ladder at the headline shapes: rung 1-5, cache format, decode (one query position) or
    prefill (PREFILL_ROWS positions, rung 5's case); OpenPPL's launch, or TensorRT-LLM's generation step
    (`operator` "trtllm": its own vector kernel, with its caches, TRT_CACHES)."""
    rung: int
    cache: str
    phase: str = "decode"
    operator: str = "ppl"

    @property
    def key(self) -> str:
        return f"{'' if self.operator == 'ppl' else self.operator + '-'}rung{self.rung}-{self.cache}-{self.phase}"

    @property
    def kernel(self) -> str:
        """The name of the kernel the launcher runs for this variant."""
        return PHASE_KERNELS.get((self.rung, self.phase), RUNG_KERNELS[self.rung])


TRT_CACHES = ("float16", "int8", "fp8")               # TensorRT-LLM's KV cache formats (one per-tensor scale)
# Every rung and cache of OpenPPL's launch; TensorRT-LLM's generation on rung 3 (its rung 4 is the same loop
# writing split-K partials) and on rung 5's decode kernel, its default at the headline decode.
VARIANTS = tuple([Variant(rung, cache) for rung in range(1, 6) for cache in CACHES]
                 + [Variant(5, cache, "prefill") for cache in CACHES]
                 + [Variant(rung, "float16", "prefill") for rung in range(1, 5)]
                 + [Variant(6, "float16", "prefill")]          # rung 6: the FlashAttention-2 prefill
                 + [Variant(rung, cache, operator="trtllm") for rung in (1, 3, 5) for cache in TRT_CACHES])


class ToolMissing(RuntimeError):
    """ptxas or nvdisasm is not installed (the `test` extra brings both as wheels)."""


def _nvidia_binary(name: str) -> str:
    """The path of a CUDA toolkit binary from the NVIDIA wheels (nvidia/<pkg>/bin/<name>), else from PATH."""
    try:
        import nvidia
        for root in nvidia.__path__:
            for found in sorted(Path(root).glob(f"*/bin/{name}")):
                return str(found)
    except ImportError:
        pass
    found = shutil.which(name)
    if found is None:
        raise ToolMissing(f"{name} not found: install the CUDA toolkit wheels (pip install -e \".[test]\" brings "
                          f"nvidia-cuda-nvcc-cu12 for ptxas and nvidia-cuda-nvdisasm for nvdisasm) or put {name} "
                          "on PATH")
    return found


def tool_versions() -> dict:
    """{'ptxas': 'release 12.9, V12.9.86', 'nvdisasm': ...}: the last line of each tool's --version."""
    out = {}
    for name in ("ptxas", "nvdisasm"):
        run = subprocess.run([_nvidia_binary(name), "--version"], capture_output=True, text=True)
        lines = [line for line in run.stdout.splitlines() if "release" in line] or run.stdout.splitlines()[-1:]
        out[name] = lines[-1].split("release", 1)[-1].strip(" ,") if lines else "unknown"
    return out


# ---------------------------------------------------------------------------------------------- parsing ptxas / SASS

_PTXAS_FIELDS = dict(registers=r"Used (\d+) registers", barriers=r"used (\d+) barriers", shared=r"(\d+) bytes smem",
                     stack=r"(\d+) bytes stack frame", spill_stores=r"(\d+) bytes spill stores",
                     spill_loads=r"(\d+) bytes spill loads")


def parse_ptxas(text: str) -> dict:
    """registers, barriers, shared (static bytes), stack, spill_stores, spill_loads from `ptxas -v` output of one
    entry function (a field ptxas leaves out is 0: it prints no 'bytes smem' for a kernel without shared memory, and
    puts other fields, such as 'bytes cumulative stack size', between them). ValueError when the text has no
    'Used N registers' line."""
    if re.search(_PTXAS_FIELDS["registers"], text) is None:
        raise ValueError(f"ptxas -v output without a 'Used N registers' line:\n{text[-2000:]}")
    used = next(line for line in text.splitlines() if re.search(_PTXAS_FIELDS["registers"], line))
    out = {}
    for name, pattern in _PTXAS_FIELDS.items():
        found = re.search(pattern, used if name in ("registers", "barriers", "shared") else text)
        out[name] = int(found.group(1)) if found else 0
    return out


_ADDRESS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/(.*)")
_ANNOTATION = re.compile(r"\(\*[^*]*\*\)|/\*[^*]*\*/")      # (*"SpillRefill"*), /* comments */
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse_sass(text: str) -> list[tuple[int, str, list]]:
    """(address, instruction, labels at it) of every instruction nvdisasm printed, in address order. The
    instruction keeps its predicate (`@P0 BRA ...`); comments and the trailing `;` are dropped."""
    out, pending = [], []
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _ADDRESS.match(line)
        if m:
            text = " ".join(_ANNOTATION.sub(" ", m.group(2)).replace(";", " ").split())
            out.append((int(m.group(1), 16), text, pending))
            pending = []
    return out


def opcode(instruction: str) -> str:
    """The mnemonic with its modifiers, without predicate or operands: '@!P0 LDG.E.128 R4, ...' -> 'LDG.E.128'."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def loops(instructions) -> list[tuple[int, int]]:
    """(first, last) indices into `instructions` of every loop: a branch to a label at or before it (a branch to
    itself, the trap after EXIT, is not a loop)."""
    where = {label: i for i, (_, _, labels) in enumerate(instructions) for label in labels}
    out = []
    for i, (_, text, _) in enumerate(instructions):
        if opcode(text).startswith("BRA"):
            target = _TARGET.search(text)
            if target and target.group(1) in where and where[target.group(1)] < i:
                out.append((where[target.group(1)], i))
    return out


def mix_class(op: str) -> str | None:
    """The MIX_CLASSES entry of one opcode, or None. Global loads by width: LDG.E (32 bits), .U8/.S8, .U16/.S16,
    .64, .128, whatever the cache modifiers (.CONSTANT, .EL, ...)."""
    parts = op.split(".")
    head = parts[0]
    if head == "LDG":
        for width in ("128", "64"):
            if width in parts:
                return f"LDG.{width}"
        if "U16" in parts or "S16" in parts:
            return "LDG.16"
        if "U8" in parts or "S8" in parts:
            return "LDG.8"
        return "LDG.32"
    if head == "MUFU":
        return "MUFU.EX2" if "EX2" in parts else None
    if head in ("STG", "LDS", "STS", "LDL", "STL", "SHFL", "BAR", "FFMA", "HFMA2", "HMMA"):
        return head
    return None


def instruction_mix(instructions) -> dict:
    """{class: static count} over `instructions` for every MIX_CLASSES entry (total: every instruction)."""
    counts = Counter(mix_class(opcode(text)) for _, text, _ in instructions)
    mix = {name: counts.get(name, 0) for name in MIX_CLASSES if name != "total"}
    mix["total"] = len(instructions)
    return mix


def key_loop(instructions) -> tuple[int, int]:
    """(first, last) of the key loop: the loop whose body holds the most global loads, the innermost of equals
    (the loop over keys loads K and V; rung 1's tile loads sit in inner loops that the key loop encloses, and it
    has more loads than any one of them). ValueError when the code has no loop with a global load."""
    def loads(span):
        return sum(opcode(text).startswith("LDG") for _, text, _ in instructions[span[0]:span[1] + 1])
    candidates = [span for span in loops(instructions) if loads(span) > 0]
    if not candidates:
        raise ValueError("no loop with a global load in this SASS: is it an attention kernel?")
    return max(candidates, key=lambda span: (loads(span), -(span[1] - span[0])))


def page_walks(instructions, spans) -> list[tuple[int, int]]:
    """The loops of `spans` that touch no memory: in the ladder's key loops, page walks (`_cache.page_walk`), which
    run at most once a trip while a page holds a block's step of keys. A loop that loads or stores (rung 1's
    tiles, rung 5's head_dim) runs many times a trip."""
    return [(a, b) for a, b in spans
            if not any(opcode(text).startswith(("LD", "ST")) for _, text, _ in instructions[a:b + 1])]


_REGISTER = re.compile(r"\bR(\d+)(\.64)?")
_NO_DESTINATION = ("ST", "RED", "ATOM", "BRA", "BAR", "EXIT", "BSYNC", "BSSY", "WARPSYNC", "CALL", "RET", "NOP")


def load_bytes(op: str) -> int:
    """Bytes one lane of a global load reads: .128 16, .64 8, .U16/.S16 2, .U8/.S8 1, else 4 (0: not a load).
    A cp.async (LDGSTS, global to shared) counts by its width the same way; its LDGDEPBAR (the commit) reads
    nothing."""
    if op.startswith("LDGSTS"):
        parts = op.split(".")
        return 16 if "128" in parts else 8 if "64" in parts else 4
    if not op.startswith("LDG") or op.startswith("LDGDEPBAR"):
        return 0
    width = mix_class(op)
    return {"LDG.128": 16, "LDG.64": 8, "LDG.32": 4, "LDG.16": 2, "LDG.8": 1}[width]


def _registers(operand_text: str) -> set:
    """General registers an operand list names: R5 -> {5}; a 64-bit pair R4.64 -> {4, 5}; RZ names none."""
    out = set()
    for number, pair in _REGISTER.findall(operand_text):
        out.update((int(number), int(number) + 1) if pair else (int(number),))
    return out


def _reads_writes(text: str, no_destination=_NO_DESTINATION):
    """(opcode, registers read, registers written) of one instruction, its predicate left out; an opcode in
    `no_destination` writes none (its first operand is an address or a target)."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    if not words:
        return "", set(), set()
    op, operands = words[0], " ".join(words[1:])
    head = operands.split(",")[0] if "," in operands else operands
    writes = set() if op.startswith(no_destination) else _registers(head)
    reads = _registers(operands[len(head):] if writes else operands)
    return op, reads, writes


def loads_in_flight(instructions) -> dict:
    """How many bytes of global loads one warp has issued and not yet used, walking the key loop once in program
    order: a load's destination registers (4 for .128, 2 for .64) are in flight from its issue until the first
    instruction that reads or overwrites one of them, where the warp waits for it (the scoreboard). Returns
    first_use (bytes a warp has in flight when it first waits on a load of the trip) and peak (the most at once),
    both for the 32 lanes of a warp, and the loads counted."""
    outstanding = {}                                # load index -> (registers, bytes for the warp)
    first_use, peak, loads = None, 0, 0
    for index, (_, text, _) in enumerate(instructions):
        op, reads, writes = _reads_writes(text)
        if not op:
            continue
        touched = reads | writes
        waited = [k for k, (regs, _) in outstanding.items() if regs & touched]
        if waited:
            held = sum(size for _, size in outstanding.values())
            peak = max(peak, held)
            first_use = held if first_use is None else first_use
            for k in waited:
                del outstanding[k]
        size = load_bytes(op)
        if size:
            loads += 1
            first = min(writes) if writes else 0
            count = max(1, size // 4)
            outstanding[index] = (set(range(first, first + count)), 32 * size)
            peak = max(peak, sum(size for _, size in outstanding.values()))
    return dict(first_use=first_use or 0, peak=peak, loads=loads)


def excerpt(instructions, span, classes=("LDG", "LDS", "STS", "SHFL", "BAR", "HMMA", "MUFU.EX2"), per_class=3) -> list:
    """The key loop's memory, shuffle, barrier, tensor-core and exp instructions in program order, the first
    `per_class` of each class (global loads by width), each '/*addr*/ instruction', then the backward branch that
    closes the loop."""
    first, last = span
    keep, seen = [], Counter()
    for address, text, _ in instructions[first:last]:
        kind = mix_class(opcode(text)) or ""
        if kind.startswith(classes) and seen[kind] < per_class:
            seen[kind] += 1
            keep.append(f"/*{address:04x}*/ {_short(text)}")
    address, text, _ = instructions[last]
    return keep + [f"/*{address:04x}*/ {_short(text)}"]


def _short(text: str) -> str:
    return re.sub(r"\s+", " ", text)[:96]


# ------------------------------------------------------------------------------ paths and chains (for the bounds)

# The work a trip (or a warp's whole run) must do: the shortest path the bounds count still runs these.
_MUST = ("LDG", "LD.", "STG", "ST.", "LDS", "STS", "HMMA", "MUFU.EX2", "BAR", "SHFL")
# Instructions that never fall through to the next one.
_NO_FALLTHROUGH = ("EXIT", "RET")


def _global_load_bytes(op: str) -> int:
    """Bytes a lane of a global load reads (LDG, or a generic LD the compiler could not prove global), else 0."""
    if op.startswith("LDG"):
        return load_bytes(op)
    if op.startswith("LD.") or op == "LD":
        return load_bytes("LDG" + op[2:])
    return 0


def _must(op: str) -> bool:
    return op.startswith(_MUST) and not op.startswith(("LDSM", "LDC", "LDL", "STL"))


def _successors(instructions, i, first, last) -> list:
    """Forward successors of instruction i inside [first, last]: its fall-through, unless it is an unconditional
    branch, an EXIT or a RET, and a forward branch's target (back edges, the loops' repeats, are left out)."""
    where = _label_index(instructions)
    _, text, _ = instructions[i]
    op, predicated = opcode(text), text.startswith("@")
    out = []
    # BRA.DIV (taken only when the warp has diverged) falls through like a predicated branch
    unconditional = (op == "BRA" or op.startswith(_NO_FALLTHROUGH)) and not predicated
    if not unconditional and i + 1 <= last:
        out.append(i + 1)
    if op.startswith("BRA"):
        target = _TARGET.search(text)
        j = where.get(target.group(1)) if target else None
        if j is not None and i < j <= last and j >= first:
            out.append(j)
    return out


_LABELS: dict = {}


def _label_index(instructions) -> dict:
    key = id(instructions)
    if key not in _LABELS:
        _LABELS.clear()
        _LABELS[key] = {label: i for i, (_, _, labels) in enumerate(instructions) for label in labels}
    return _LABELS[key]


def _distances(instructions, start, first, last) -> dict:
    """Fewest instructions from `start` (counted) to each instruction reachable forward within [first, last]
    (each counted too): the path's length up to and including it."""
    dist = {start: 1}
    for i in range(start, last + 1):
        if i not in dist:
            continue
        for j in _successors(instructions, i, first, last):
            if dist.get(j, math.inf) > dist[i] + 1:
                dist[j] = dist[i] + 1
    return dist


def _path(instructions, start, first, last, ends) -> list:
    """The instructions of the shortest forward path from `start` to one of `ends` that still runs the trip's
    must-do work: every memory, shuffle, mma, exp2 and barrier instruction in address order that the path so far
    can reach (of two alternatives, the first; a later one no longer reachable is left out). Inner loops count
    once. Returns instruction indices in order."""
    must = [i for i in range(start, last + 1) if _must(opcode(instructions[i][1]))]
    path, at = [], start
    for target in [m for m in must if m != start] + [None]:
        dist = _distances(instructions, at, first, last)
        if target is None:
            reachable = [e for e in ends if e in dist]
            if not reachable:
                raise ValueError(f"no path from /*{instructions[at][0]:04x}*/ to the end of the span")
            target = min(reachable, key=dist.get)
        elif target not in dist or not any(e in _distances(instructions, target, first, last) for e in ends):
            continue
        # walk back along the distances from target to at
        segment, j = [target], target
        while j != at:
            j = next(p for p in range(at, j) if j in _successors(instructions, p, first, last)
                     and dist.get(p, math.inf) == dist[j] - 1)
            segment.append(j)
        path += segment[::-1][1:] if path else segment[::-1]
        at = target
    return path


def path_mix(instructions, path) -> dict:
    """Classes on a path: total, LDG (global loads, generic LD included), global load bytes a warp, STG, LDS, STS,
    SHFL, HMMA, MUFU.EX2, BAR, CALL (calls to the compiler's helpers, such as 64-bit division, whose bodies the
    path does not count)."""
    out = dict(total=len(path), LDG=0, load_bytes=0, STG=0, LDS=0, STS=0, SHFL=0, HMMA=0, EX2=0, BAR=0, CALL=0)
    for i in path:
        op = opcode(instructions[i][1])
        size = _global_load_bytes(op)
        if size:
            out["LDG"] += 1
            out["load_bytes"] += 32 * size
        head = op.split(".")[0]
        if head in ("STG", "LDS", "STS", "SHFL", "HMMA", "BAR", "CALL"):
            out[head] += 1
        elif op.startswith("ST.") and not op.startswith("STL"):
            out["STG"] += 1
        elif op.startswith("MUFU.EX2"):
            out["EX2"] += 1
    return out


def _most_work_path(instructions, start, first, last, ends) -> list:
    """The forward path from `start` to one of `ends` with the most must-do instructions, the shortest of those."""
    best, previous = {start: (-int(_must(opcode(instructions[start][1]))), 1)}, {}
    for i in range(start, last + 1):
        if i not in best:
            continue
        for j in _successors(instructions, i, first, last):
            cost = (best[i][0] - int(_must(opcode(instructions[j][1]))), best[i][1] + 1)
            if j not in best or cost < best[j]:
                best[j], previous[j] = cost, i
    end = min((e for e in ends if e in best), key=best.get)
    path = [end]
    while path[-1] != start:
        path.append(previous[path[-1]])
    return path[::-1]


def trip_path(instructions, span) -> list:
    """The shortest path through one trip of the loop `span` (its head to its closing branch) that still does the
    trip's must-do work: of two ways to choose it (`_path`, the first of alternatives; the path with the most
    must-do instructions), the shorter. Inner loops count once."""
    first, last = span
    return min(_path(instructions, first, first, last, [last]),
               _most_work_path(instructions, first, first, last, [last]), key=len)


def outside_path(instructions, span) -> list:
    """The shortest path of a warp from the kernel's entry to its EXIT that passes the loop `span` (counted as
    none of its own instructions) and runs the must-do work before and after it: the prologue, the query's
    loads, the merge and the epilogue, what runs once per warp."""
    first, last = span
    exits = [i for i, (_, text, _) in enumerate(instructions) if opcode(text).startswith("EXIT")]
    after = [e for e in exits if e > last]
    if not after:
        raise ValueError("no EXIT after the key loop")
    before = _path(instructions, 0, 0, first, [first])[:-1] if first else []
    end = max(after)
    return before + _path(instructions, last + 1, last + 1, end, after)


def dependent_chain(instructions, path, hbm_weight: float = 690.0, near_weight: float = 30.0,
                    passes: int = 3) -> dict:
    """The global round trips one warp waits on in series per trip of a loop whose trip runs `path`.

    The warp issues in order: an instruction that reads (or overwrites) a register a load has not yet filled
    waits for it, so every later instruction issues after that load's round trip; a load's data arrive one round
    trip after it issues. Walking the path `passes` times (the registers a trip leaves in flight carry into the
    next, as a software-pipelined loop's do), the last pass's advance of the issue point is the trip's chain. A
    16-byte load (a lane's piece of K or V, 512 fresh bytes a warp) is a round trip to HBM; a narrower one (a
    page-table entry, an index, a scale, or a narrow K/V piece whose line a neighbouring load may have brought) is
    charged as an L1 hit, the least any load waits; the weights order them (clocks). Returns hbm and near (the
    round trips of the chain), trip_bytes (global load bytes a warp's trip asks for) and loads."""
    def later(a, b):
        return a if a[0] * hbm_weight + a[1] * near_weight >= b[0] * hbm_weight + b[1] * near_weight else b

    ready, issue, marks = {}, (0, 0), []
    for _ in range(passes):
        for i in path:
            op, reads, writes = _reads_writes(instructions[i][1])
            for reg in reads | writes:
                if reg in ready:
                    issue = later(issue, ready[reg])
            size = _global_load_bytes(op)
            if size:
                done = (issue[0] + 1, issue[1]) if size >= 16 else (issue[0], issue[1] + 1)
                first = min(writes) if writes else 0
                for reg in range(first, first + max(1, size // 4)):
                    ready[reg] = done
            else:
                for reg in writes:
                    ready.pop(reg, None)
        marks.append(issue)
    (h0, l0), (h1, l1) = marks[-2], marks[-1]
    mix = path_mix(instructions, path)
    return dict(hbm=h1 - h0, near=l1 - l0, trip_bytes=mix["load_bytes"], loads=mix["LDG"])


# --------------------------------------------------------------------------------------------------------- occupancy

def occupancy(registers: int, shared_static: int, shared_dynamic: int, threads: int, sm=SM90) -> dict:
    """Theoretical occupancy of a kernel on one SM by the occupancy calculator's rules: blocks a limit allows
    (registers, shared memory, warps, blocks), the smallest of them, active warps and their share of the SM's.

    registers: per thread (ptxas); shared_static + shared_dynamic: bytes per block, to which the system's per-block
    reservation is added before rounding up to the allocation unit."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // sm["register_unit"]) * sm["register_unit"]
    warps_by_registers = (sm["registers"] // sm["sub_partitions"] // per_warp) * sm["sub_partitions"] \
        if per_warp else sm["max_warps"]
    shared = shared_static + shared_dynamic + sm["shared_reserved_per_block"]
    shared = -(-shared // sm["shared_unit"]) * sm["shared_unit"]
    limits = dict(registers=warps_by_registers // warps, shared=sm["shared_bytes"] // shared,
                  warps=sm["max_warps"] // warps, blocks=sm["max_blocks"])
    blocks = min(limits.values())
    return dict(blocks_per_sm=blocks, warps_per_sm=blocks * warps, occupancy=blocks * warps / sm["max_warps"],
                limited_by=min(limits, key=limits.get), limits=limits)


# ------------------------------------------------------------------------------------------------ compile (no sim)

def _record_launch(variant: Variant):
    """(kernel, args, threads) of the attention launch the OpenPPL launcher makes for `variant` (launches recorded,
    not run): a paged cache, two sequences, one position each (decode) or PREFILL_ROWS (prefill, causal); for
    TensorRT-LLM, the generation step of the lab's bench case (`cases.TrtBenchCase`) over 2 cached tokens."""
    import numpy as np

    from kernels_numba import _launch
    from kernels_numba.ppl_multi_head_cache_attention import multi_head_cache_attention

    if variant.operator == "trtllm":
        return _record_trtllm_launch(variant)

    quant_bit = CACHES[variant.cache]
    seqlen = 1 if variant.phase == "decode" else PREFILL_ROWS
    batch, kvlen, page = 2, seqlen + 2, 32
    stored = HEAD_DIM // 2 if quant_bit == 4 else HEAD_DIM
    cache = np.zeros((2 * page, 1, 2, NUM_KV_HEADS, stored), np.int8 if quant_bit else np.float16)
    scale = np.ones((2 * page, 1, 2, NUM_KV_HEADS, HEAD_DIM // QUANT_GROUP), np.float16) if quant_bit else None
    query = np.ones((batch * seqlen, NUM_HEADS, HEAD_DIM), np.float16)
    current = np.ones((batch * seqlen, NUM_KV_HEADS, HEAD_DIM), np.float16)
    with _launch.recorded_launches() as launches:
        multi_head_cache_attention(
            query, current, current, np.arange(batch + 1) * seqlen, np.arange(batch + 1) * kvlen,
            np.array([[0], [page]]), np.full(batch, 2), batch if seqlen == 1 else 0, seqlen, kvlen, cache, scale, None,
            num_heads=NUM_HEADS, head_dim=HEAD_DIM, is_causal=True, num_kv_heads=NUM_KV_HEADS, quant_bit=quant_bit,
            quant_group=QUANT_GROUP, cache_mode=1, page_size=page, cache_axes="T L KV H D", rung=variant.rung,
            threads=THREADS, num_splits=2 if variant.rung == 4 else None)
    return _the_launch(variant, launches)


def _the_launch(variant: Variant, launches) -> tuple:
    """(kernel, args, threads) of the variant's kernel among the recorded launches."""
    found = [(kernel, args) for kernel, args in launches if kernel.py_func.__name__ == variant.kernel]
    if not found:
        raise RuntimeError(f"{variant.key}: the launcher made no {variant.kernel} launch")
    return (*found[0], THREADS)


def _record_trtllm_launch(variant: Variant):
    """`_record_launch` for TensorRT-LLM's generation: the operator's arguments validated as the one call does,
    then the kernels' launcher at the variant's rung."""
    import inspect

    from kernels_numba import _launch
    from kernels_numba.trtllm_gpt_attention import gpt_attention as launch_kernels

    from .. import trtllm
    from ..examples import build_trt
    from .cases import TrtBenchCase

    case = TrtBenchCase(variant.key, 2, 2, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                        kv_cache=variant.cache)
    bound = inspect.signature(trtllm.gpt_attention).bind(**build_trt(case.trt_case()))
    bound.apply_defaults()
    call = trtllm.validate({k: v for k, v in bound.arguments.items()
                            if k not in ("backend", "threads", "rung", "num_splits")})
    with _launch.recorded_launches() as launches:
        launch_kernels(**call, threads=THREADS, rung=variant.rung, num_splits=None)
    return _the_launch(variant, launches)


def _compile(variant: Variant) -> dict:
    """ptxas -v's report and nvdisasm's listing of one variant (PTX -> sm_90 cubin -> SASS), in this process, which
    must not run the simulator."""
    import numba
    from numba import cuda

    from kernels_numba import ptx_check

    ptx_check._allow_device_functions_without_gpu()
    ptx_check._target_cc[0] = (9, 0)
    kernel, args, threads = _record_launch(variant)
    ptx, _ = cuda.compile_ptx(kernel.py_func, tuple(numba.typeof(a) for a in args), cc=(9, 0))
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        Path(source).write_text(ptx)
        assembled = subprocess.run([_nvidia_binary("ptxas"), "-v", "-arch=sm_90", source, "-o", cubin],
                                   capture_output=True, text=True)
        if assembled.returncode:
            raise RuntimeError(f"ptxas failed on {variant.key}: {assembled.stderr.strip()[:2000]}")
        disassembled = subprocess.run([_nvidia_binary("nvdisasm"), "-c", cubin], capture_output=True, text=True)
        if disassembled.returncode:
            raise RuntimeError(f"nvdisasm failed on {variant.key}: {disassembled.stderr.strip()[:2000]}")
    return dict(ptxas=assembled.stdout + assembled.stderr, sass=disassembled.stdout, threads=threads)


def analyse(variant: Variant, ptxas_text: str, sass_text: str, threads: int) -> dict:
    """The figures of one variant from ptxas -v's output and nvdisasm's listing (no tool runs here)."""
    resources = parse_ptxas(ptxas_text)
    instructions = parse_sass(sass_text)
    if not instructions:
        raise ValueError(f"{variant.key}: nvdisasm printed no instructions")
    span = key_loop(instructions)
    body = instructions[span[0]:span[1] + 1]
    inner = [(a, b) for a, b in loops(instructions) if span[0] <= a and b <= span[1] and (a, b) != span]
    walks = page_walks(instructions, inner)
    try:
        trip, once = trip_path(instructions, span), outside_path(instructions, span)
    except (ValueError, StopIteration) as exc:
        raise ValueError(f"{variant.key}: the SASS paths could not be read ({exc})") from exc
    return dict(rung=variant.rung, cache=variant.cache, phase=variant.phase, kernel=variant.kernel,
                threads=threads, **resources, shared_dynamic=0,         # numba's kernels declare static arrays only
                spill_bytes=resources["spill_stores"],                 # bytes a thread spills (and reloads)
                occupancy=occupancy(resources["registers"], resources["shared"], 0, threads),
                instructions=len(instructions), loops=len(loops(instructions)),
                key_loop=dict(first=body[0][0], last=body[-1][0], inner_loops=len(inner), walk_loops=len(walks),
                              mix=instruction_mix(body), in_flight=loads_in_flight(body),
                              trip=path_mix(instructions, trip), chain=dependent_chain(instructions, trip),
                              excerpt=excerpt(instructions, span)),
                once_per_warp=path_mix(instructions, once))


# ------------------------------------------------------------------------------------------------------------ cache

def _fingerprint(variant: Variant) -> str:
    """Hash of what decides a variant's machine code: the kernels' sources, the launch recipe (`_record_launch`,
    `_compile`), the variant, the versions of numba-cuda and the toolkit wheels, and the tools' paths. The cache holds
    the tools' raw output, so a change to the analysis needs no compile."""
    import importlib.metadata as metadata
    import inspect

    digest = hashlib.sha256()
    for path in sorted((ROOT / "kernels_numba").glob("*.py")):
        digest.update(path.read_bytes())
    recipe = (_record_launch, _record_trtllm_launch, _the_launch, _compile)
    digest.update("".join(inspect.getsource(f) for f in recipe).encode())
    for name in ("numba-cuda", "numba", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvdisasm"):
        try:
            digest.update(f"{name}={metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name}=none".encode())
    digest.update(f"{_nvidia_binary('ptxas')}|{_nvidia_binary('nvdisasm')}|{variant.key}".encode())
    return digest.hexdigest()[:24]


def cache_dir() -> Path:
    """Where results are kept: $CACHEATTN_CACHE/sass, else ~/.cache/cacheattn/sass."""
    base = os.environ.get("CACHEATTN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cacheattn")
    return Path(base) / "sass"


def machine_code(variants=VARIANTS, *, use_cache: bool = True) -> dict:
    """{variant.key: figures} for `variants` (see `analyse` for the fields). The tools' output is cached on disk;
    what is missing is compiled in one subprocess without NUMBA_ENABLE_CUDASIM (the simulator cannot compile).
    ToolMissing when ptxas or nvdisasm is absent; RuntimeError with the subprocess's output when a compile fails."""
    _nvidia_binary("ptxas"), _nvidia_binary("nvdisasm")           # fail early, with the install hint
    variants = list(variants)
    results, missing = {}, []
    for variant in variants:
        path = cache_dir() / f"{variant.key}-{_fingerprint(variant)}.json"
        if use_cache and path.exists():
            results[variant.key] = json.loads(path.read_text())
        else:
            missing.append(variant)
    if missing:
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        with tempfile.TemporaryDirectory() as tmp:
            # The worker writes <key>.json as each compile ends, so what compiled is kept even when a later one fails.
            run = subprocess.run([sys.executable, "-m", "cacheattn.lab.sass", "--compile-to", tmp, "--variants",
                                  *[v.key for v in missing]], env=env, capture_output=True, text=True, cwd=ROOT)
            for variant in missing:
                done = Path(tmp) / f"{variant.key}.json"
                if done.exists():
                    results[variant.key] = json.loads(done.read_text())
                    if use_cache:
                        path = cache_dir() / f"{variant.key}-{_fingerprint(variant)}.json"
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(done.read_text())
        if run.returncode:
            raise RuntimeError(f"compiling {', '.join(v.key for v in missing if v.key not in results)} failed:\n"
                               f"{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return {v.key: analyse(v, results[v.key]["ptxas"], results[v.key]["sass"], results[v.key]["threads"])
            for v in variants}


def parse_key(key: str) -> Variant:
    """Variant from its key 'rung3-int8-decode'."""
    m = re.fullmatch(r"(trtllm-)?rung(\d)-(\w+)-(decode|prefill)", key)
    if m is None or m.group(3) not in (TRT_CACHES if m.group(1) else CACHES):
        raise ValueError(f"variant: expected [trtllm-]rung<N>-<{'|'.join(CACHES)}>-<decode|prefill> (TensorRT-LLM's "
                         f"caches: {'|'.join(TRT_CACHES)}), got {key!r}")
    return Variant(int(m.group(2)), m.group(3), m.group(4), "trtllm" if m.group(1) else "ppl")


# ----------------------------------------------------------------------------------------------------------- report

def table(results: dict) -> str:
    """A markdown table: one row per variant, resources and the key loop's static instruction mix."""
    head = "| launch | rung | cache | phase | regs | spill B | smem B | blocks/SM | occupancy | LDG.8/16/32/64/128 | " \
           "LDS | STS | SHFL | BAR | FFMA | HFMA2 | HMMA | MUFU.EX2 | loop instr. |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, r in results.items():
        mix = r["key_loop"]["mix"]
        loads = "/".join(str(mix[f"LDG.{w}"]) for w in (8, 16, 32, 64, 128))
        occ = r["occupancy"]
        launch = "TensorRT-LLM" if key.startswith("trtllm-") else "OpenPPL"
        cells = [launch, r["rung"], r["cache"], r["phase"], r["registers"], r["spill_bytes"], r["shared"],
                 f"{occ['blocks_per_sm']} ({occ['limited_by']})", f"{occ['occupancy']:.0%}", loads,
                 *(mix[name] for name in ("LDS", "STS", "SHFL", "BAR", "FFMA", "HFMA2", "HMMA", "MUFU.EX2", "total"))]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


COMMITTED = ROOT / "docs" / "kernel-ladder-sass.json"


def committed(path=COMMITTED) -> dict:
    """The figures `python -m cacheattn.lab.sass --write docs/kernel-ladder-sass.json` wrote: tools, target, shapes
    and variants (key -> figures); the ladder page reads them (tests/test_lab_sass.py checks them against a
    fresh compile). ValueError naming the file when it is not such a JSON document."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{Path(path).name}: not the JSON `python -m cacheattn.lab.sass --write` writes ({exc}); "
                         f"write it again") from exc
    if not isinstance(data, dict) or not isinstance(data.get("variants"), dict):
        raise ValueError(f"{Path(path).name}: no 'variants' map; write it again with python -m cacheattn.lab.sass "
                         f"--write")
    return data


def show_loop(result: dict) -> str:
    """One variant's key loop for a reader: where it is, its static mix, then its excerpt."""
    mix = result["key_loop"]["mix"]
    counts = ", ".join(f"{mix[name]} {name}" for name in MIX_CLASSES if name != "total" and mix[name])
    occ = result["occupancy"]
    head = (f"rung {result['rung']}, {result['cache']} cache, {result['phase']}: {result['registers']} registers, "
            f"{result['spill_bytes']} bytes spilled, {result['shared']} bytes of shared memory, "
            f"{occ['blocks_per_sm']} blocks/SM ({occ['occupancy']:.0%} occupancy, {occ['limited_by']})\n"
            f"key loop /*{result['key_loop']['first']:04x}*/-/*{result['key_loop']['last']:04x}*/, "
            f"{result['key_loop']['inner_loops']} inner loops ({result['key_loop']['walk_loops']} page walks): "
            f"{mix['total']} instructions; {counts}")
    return "\n".join([head, *("    " + line for line in result["key_loop"]["excerpt"])])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rung", nargs="+", type=int, choices=range(1, 7), help="only these rungs")
    parser.add_argument("--cache", nargs="+", choices=tuple(dict.fromkeys((*CACHES, *TRT_CACHES))),
                        help="only these cache formats")
    parser.add_argument("--operator", nargs="+", choices=("ppl", "trtllm"),
                        help="only these operators' launches (OpenPPL's, TensorRT-LLM's generation)")
    parser.add_argument("--write", metavar="JSON", help="write the figures (and tool versions) to this file, e.g. "
                                                        "docs/kernel-ladder-sass.json")
    parser.add_argument("--no-cache", action="store_true", help="compile again even when cached")
    parser.add_argument("--compile-to", help=argparse.SUPPRESS)   # the worker: compile --variants into this folder
    parser.add_argument("--variants", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_to:
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            print("cacheattn.lab.sass: unset NUMBA_ENABLE_CUDASIM; the simulator cannot compile", file=sys.stderr)
            return 2
        for key in args.variants:
            Path(args.compile_to, f"{key}.json").write_text(json.dumps(_compile(parse_key(key))))
        return 0
    variants = [v for v in VARIANTS if (not args.rung or v.rung in args.rung)
                and (not args.cache or v.cache in args.cache) and (not args.operator or v.operator in args.operator)]
    try:
        results = machine_code(variants, use_cache=not args.no_cache)
    except ToolMissing as exc:
        print(f"cacheattn.lab.sass: {exc}", file=sys.stderr)
        return 2
    print(table(results))
    if args.write:
        Path(args.write).write_text(json.dumps(dict(tools=tool_versions(), target="sm_90", shapes=dict(
            num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, quant_group=QUANT_GROUP,
            threads=THREADS, prefill_rows=PREFILL_ROWS), variants=results), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
