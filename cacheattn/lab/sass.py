"""The machine code of every rung of the kernel ladder, read without a GPU.

For each rung (docs/kernel-ladder.md) and cache format at the headline shapes (32 query / 8 kv heads, head_dim 128,
quant_group 8 with float16 scales, a float16 query, 128 threads a block as the launchers use by default), this
records the OpenPPL launch the launcher makes (and TensorRT-LLM's generation step on rungs 1, 3 and 5, with its
float16, INT8 and FP8 caches; the other operators' bench cases as their own calls launch them: TensorRT-LLM's
context step, ONNX's decode, FasterTransformer's cross attention at its head_dim 64; the lab's quick decode at
head_dim 64), compiles the kernel to PTX (`cuda.compile_ptx`, in a process without NUMBA_ENABLE_CUDASIM, as
`kernels_numba.ptx_check` does), assembles it for sm_90 with `ptxas -v` (registers, spills, static shared memory)
and disassembles the cubin with `nvdisasm`. The calls' other launches (`OTHER_VARIANTS`: the cache store, ONNX's
present copy, TensorRT-LLM's preprocess, FasterTransformer's query bias, the split-K combine) are compiled the same
way, for what one of their warps runs at least (`whole_path`). From those it derives

- the theoretical occupancy on sm_90 by the occupancy calculator's rules (`occupancy`);
- the key loop: the loop region (rotated loops joined, `regions`) whose body holds the most global loads, LDG and
  cp.async alike (the loop over keys; inner loops of rung 1 sit inside it), and its *static* instruction mix: each
  instruction of the body counted once, however often it runs (`instruction_mix`);
- for the bounds (`cacheattn.bounds`): the path through one trip of the key loop that does the most of its
  required work (mma, exp2, barriers, shuffles, shared and global stores, its widest global loads) in the fewest
  instructions (`trip_path`, `path_mix`; an inner loop whose trips the kernel's shape fixes counted that often,
  `inner_trips`), the same around it for what a warp runs once (`outside_path`: prologue, the query's loads, merge,
  epilogue), and the chain of global round trips a trip waits on in series, cp.async copies until the DEPBAR
  that retires them (`dependent_chain`). The outside kernels of `cacheattn.lab.calibration` are read the same way.

    python -m cacheattn.lab.sass [--write docs/kernel-ladder-sass.json] [--rung 3] [--cache int8] [--operator onnx]

The tools' output is cached on disk, keyed by the kernels' sources, the variant and the tools' versions, so a second
call costs a file read and the parsing. Everything here is counted from the compiler's output, never timed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
    """One kernel of the ladder: rung 1-5, cache format, decode (one query position) or prefill (PREFILL_ROWS
    positions, rung 5's case), at the headline shapes unless `head_dim` says otherwise; OpenPPL's launch
    (`operator` "ppl"), TensorRT-LLM's generation step ("trtllm", decode: its own vector kernel, with its caches,
    TRT_CACHES) or its context step ("trtllm", prefill), ONNX's decode with past ("onnx") or FasterTransformer's
    cross-attention step ("ft"), the last three as the lab's bench case of that operator launches them
    (`cases.OPERATOR_CASES`: their heads and head_dim)."""
    rung: int
    cache: str
    phase: str = "decode"
    operator: str = "ppl"
    head_dim: int = HEAD_DIM
    part: str = ""              # another launch of the call than its attention: that kernel's name

    @property
    def key(self) -> str:
        prefix = "" if self.operator == "ppl" else self.operator + "-"
        suffix = "" if self.head_dim == HEAD_DIM else f"-d{self.head_dim}"
        return f"{prefix}rung{self.rung}-{self.cache}-{self.phase}{suffix}{'+' + self.part if self.part else ''}"

    @property
    def kernel(self) -> str:
        """The name of the kernel the launcher runs for this variant."""
        return self.part or PHASE_KERNELS.get((self.rung, self.phase), RUNG_KERNELS[self.rung])


TRT_CACHES = ("float16", "int8", "fp8")               # TensorRT-LLM's KV cache formats (one per-tensor scale)
# Each operator's cache formats (ONNX and FasterTransformer: the float16 tensors of their bench cases).
OPERATOR_CACHES = {"ppl": tuple(CACHES), "trtllm": TRT_CACHES, "onnx": ("float16",), "ft": ("float16",)}
# The operators' bench cases whose launches compile as they run them (the rest record OpenPPL's launcher or
# TensorRT-LLM's generation at the headline shapes): variant operator and phase -> the case's name in `cases`.
CASE_VARIANTS = {("trtllm", "prefill"): "TRT_CONTEXT", ("onnx", "decode"): "ONNX_DECODE", ("ft", "decode"): "FT_CROSS"}
QUICK_HEAD_DIM = 64           # the lab's quick run (`counters.plans(quick=True)`): the float16 decode at head_dim 64
# Every rung and cache of OpenPPL's launch; TensorRT-LLM's generation on rung 3 (its rung 4 is the same loop
# writing split-K partials) and on rung 5's decode kernel, its default at the headline decode; every rung the lab
# counts of the other operators' bench cases (TensorRT-LLM's context step, ONNX, FasterTransformer at its
# head_dim 64); the quick run's float16 decode at head_dim 64.
VARIANTS = tuple([Variant(rung, cache) for rung in range(1, 6) for cache in CACHES]
                 + [Variant(5, cache, "prefill") for cache in CACHES]
                 + [Variant(rung, "float16", "prefill") for rung in range(1, 5)]
                 + [Variant(6, "float16", "prefill")]          # rung 6: the FlashAttention-2 prefill
                 + [Variant(rung, cache, operator="trtllm") for rung in (1, 3, 5) for cache in TRT_CACHES]
                 + [Variant(rung, "float16", "prefill", "trtllm") for rung in (1, 5, 6)]
                 + [Variant(rung, "float16", operator="onnx") for rung in (1, 3, 4)]
                 + [Variant(rung, "float16", operator="ft", head_dim=64) for rung in (1, 3, 4)]
                 + [Variant(rung, "float16", head_dim=QUICK_HEAD_DIM) for rung in range(1, 6)])
# The calls' other launches, each compiled from the call at one rung that makes it (the kernel is the same at
# every rung): OpenPPL's cache store (per cache format, the decode's and the prefill's) and its split-K combine
# (rungs 4 and 5 share it), TensorRT-LLM's preprocess (generation per cache format, context), ONNX's present copy
# (rung 1), FasterTransformer's query bias.
OTHER_VARIANTS = tuple([Variant(3, cache, part="store_kernel") for cache in CACHES]
                       + [Variant(3, "float16", "prefill", part="store_kernel"),
                          Variant(3, "float16", head_dim=QUICK_HEAD_DIM, part="store_kernel"),
                          Variant(4, "float16", part="combine_kernel")]
                       + [Variant(3, cache, operator="trtllm", part="preprocess_kernel") for cache in TRT_CACHES]
                       + [Variant(5, "float16", "prefill", "trtllm", part="preprocess_kernel"),
                          Variant(1, "float16", operator="onnx", part="copy_kernel"),
                          Variant(3, "float16", operator="ft", head_dim=64, part="query_bias_kernel")])


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


def regions(instructions) -> list[tuple[int, int]]:
    """Loops as the code runs them: `loops` spans joined where they cross (a compiler that rotates a loop leaves two
    conditional backward branches whose spans overlap without one holding the other, as FlashAttention-2's main
    loop does); a loop nested inside another stays a loop of its own, and so does the span of an unconditional
    backward branch (the way back from an out-of-line block, such as a diverged warp's shuffle, into the loop).
    In address order."""
    def closes(span):                       # a loop's closing branch is conditional
        return instructions[span[1]][1].startswith("@")

    out = []
    for first, last in sorted(loops(instructions), key=lambda span: (span[0], -span[1])):
        crossing = [k for k, (a, b) in enumerate(out) if a < first <= b < last and closes((a, b))
                    and closes((first, last))]
        if crossing:
            k = crossing[0]
            out[k] = (out[k][0], last)
        else:
            out.append((first, last))
    return sorted(set(out))


def _global_loads(instructions, span) -> int:
    """Global loads in `span`: LDG and cp.async's LDGSTS (not its commit, LDGDEPBAR)."""
    return sum(load_bytes(opcode(text)) > 0 for _, text, _ in instructions[span[0]:span[1] + 1])


def key_loop(instructions) -> tuple[int, int]:
    """(first, last) of the key loop: the loop region (`regions`: rotated loops joined) whose body holds the most
    global loads, LDG and cp.async alike, the innermost of equals (the loop over keys loads K and V; rung 1's tile
    loads sit in inner loops that the key loop encloses, and it has more loads than any one of them). ValueError
    when the code has no loop with a global load."""
    candidates = [span for span in regions(instructions) if _global_loads(instructions, span) > 0]
    if not candidates:
        raise ValueError("no loop with a global load in this SASS: is it an attention kernel?")
    return max(candidates, key=lambda span: (_global_loads(instructions, span), -(span[1] - span[0])))


def page_walks(instructions, spans) -> list[tuple[int, int]]:
    """The loops of `spans` that touch no memory: in the ladder's key loops, page walks (`_cache.page_walk`), which
    run at most once a trip while a page holds a block's step of keys. A loop that loads or stores (rung 1's
    tiles, rung 5's head_dim) runs many times a trip."""
    return [(a, b) for a, b in spans
            if not any(opcode(text).startswith(("LD", "ST")) for _, text, _ in instructions[a:b + 1])]


_REGISTER = re.compile(r"\bR(\d+)(\.64)?")
# cp.async (LDGSTS) writes shared memory, not a register; its commit (LDGDEPBAR) and wait (DEPBAR) write none.
_NO_DESTINATION = ("ST", "RED", "ATOM", "BRA", "BAR", "EXIT", "BSYNC", "BSSY", "WARPSYNC", "CALL", "RET", "NOP",
                   "LDGSTS", "LDGDEPBAR", "DEPBAR")


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


def _groups_kept(text: str):
    """How many cp.async groups a DEPBAR leaves in flight ('DEPBAR.LE SB0, 0x1' -> 1: it waits for every committed
    group but the newest one), or None when the instruction is no DEPBAR."""
    op = opcode(text)
    if not op.startswith("DEPBAR"):
        return None
    found = re.search(r"SB\d+\s*,\s*(0x[0-9a-f]+|\d+)", text)
    return int(found.group(1), 0) if found else 0


class _CpAsync:
    """cp.async's groups as a warp sees them: LDGSTS copies join the open group, LDGDEPBAR commits it, DEPBAR.LE N
    waits until at most N committed groups are left. A copy writes shared memory, not a register, so nothing
    waits on it through the scoreboard: it is in flight from its issue until the DEPBAR that retires its group."""

    def __init__(self):
        self.open, self.committed = [], []

    def issue(self, item):
        self.open.append(item)

    def step(self, text) -> list:
        """Feed one instruction; returns the copies its wait retires (empty for anything but a DEPBAR)."""
        if opcode(text).startswith("LDGDEPBAR"):
            if self.open:
                self.committed.append(self.open)
            self.open = []
            return []
        kept = _groups_kept(text)
        if kept is None or len(self.committed) <= kept:
            return []
        done = [item for group in self.committed[:len(self.committed) - kept] for item in group]
        self.committed = self.committed[len(self.committed) - kept:]
        return done


def loads_in_flight(instructions) -> dict:
    """How many bytes of global loads one warp has issued and not yet used, walking the key loop once in program
    order: a load's destination registers (4 for .128, 2 for .64) are in flight from its issue until the first
    instruction that reads or overwrites one of them, where the warp waits for it (the scoreboard); a cp.async copy
    (LDGSTS) until the DEPBAR that waits for its group (`_CpAsync`). Returns first_use (bytes a warp has in flight
    when it first waits on a load of the trip) and peak (the most at once), both for the 32 lanes of a warp, and
    the loads counted."""
    outstanding = {}                                # load index -> (registers, bytes for the warp)
    copies = _CpAsync()
    first_use, peak, loads = None, 0, 0
    for index, (_, text, _) in enumerate(instructions):
        op, reads, writes = _reads_writes(text)
        if not op:
            continue
        touched = reads | writes
        waited = [k for k, (regs, _) in outstanding.items() if regs & touched] + copies.step(text)
        if waited:
            held = sum(size for _, size in outstanding.values())
            peak = max(peak, held)
            first_use = held if first_use is None else first_use
            for k in waited:
                del outstanding[k]
        size = load_bytes(op)
        if size:
            loads += 1
            if op.startswith("LDGSTS"):
                outstanding[index] = (set(), 32 * size)
                copies.issue(index)
            else:
                first = min(writes) if writes else 0
                outstanding[index] = (set(range(first, first + max(1, size // 4))), 32 * size)
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

# The work a trip (or a warp's whole run) must do, global loads apart (`_required`).
_MUST = ("STG", "ST.", "LDS", "STS", "HMMA", "MUFU.EX2", "BAR", "SHFL")
# Instructions that never fall through to the next one.
_NO_FALLTHROUGH = ("EXIT", "RET")


def _global_load_bytes(op: str) -> int:
    """Bytes a lane of a global load reads (LDG, cp.async's LDGSTS, or a generic LD the compiler could not prove
    global), else 0."""
    if op.startswith("LDG"):
        return load_bytes(op)
    if op.startswith("LD.") or op == "LD":
        return load_bytes("LDG" + op[2:])
    return 0


def _must(op: str) -> bool:
    return op.startswith(_MUST) and not op.startswith(("LDSM", "STL"))


def _required(instructions, first, last) -> list:
    """The work of each instruction of [first, last] as the lower bound's path weighs it: 2, required work (the
    mma, exp2, barriers, shuffles, shared loads and stores, global stores, and the span's widest global loads: its
    K/V pieces); 1, a narrower global load (a page entry, a scale, or a slow path's byte loads beside the vector
    ones); 0, anything else."""
    widest = max((_global_load_bytes(opcode(text)) for _, text, _ in instructions[first:last + 1]), default=0)
    out = []
    for _, text, _ in instructions[first:last + 1]:
        op, size = opcode(text), _global_load_bytes(opcode(text))
        out.append(2 if _must(op) or (widest > 0 and size == widest) else 1 if size else 0)
    return out


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


def _path(instructions, start, first, last, ends) -> list:
    """The lower bound's path from `start` to one of `ends` within [first, last], forward edges only (an inner
    loop's body once). The rule: of all paths, those with the most required work (`_required`: as many mma, exp2,
    barriers, shuffles, shared accesses, global stores and widest global loads as any path has), of those the
    ones with the most narrower global loads (a full trip reads its page entries and scales too), and of those
    the one with the fewest instructions. So a slow path of byte loads beside the vector loads, or a masked tail
    that skips the loads, is never taken for its brevity, and where two ways do the same work the shorter one is.
    Exact: the forward edges make a DAG whose instruction order is a topological order, so one pass keeps, for
    each instruction, the best path reaching it by that ordering. Returns instruction indices in order;
    ValueError when no end is reachable."""
    work = _required(instructions, first, last)

    def cost(i, before=(0, 0, 0)):         # (-required, -narrow loads, instructions): smaller is better
        return (before[0] - (work[i - first] == 2), before[1] - (work[i - first] == 1), before[2] + 1)

    best, previous = {start: cost(start)}, {}
    for i in range(start, last + 1):
        if i not in best:
            continue
        for j in _successors(instructions, i, first, last):
            found = cost(j, best[i])
            if j not in best or found < best[j]:
                best[j], previous[j] = found, i
    reachable = [e for e in ends if e in best]
    if not reachable:
        raise ValueError(f"no path from /*{instructions[start][0]:04x}*/ to the end of the span")
    path = [min(reachable, key=best.get)]
    while path[-1] != start:
        path.append(previous[path[-1]])
    return path[::-1]


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


def trip_path(instructions, span, inner_trips=None) -> list:
    """The lower bound's path through one trip of the loop `span` (its head to its closing branch, `_path`): the
    most required work any path does, in the fewest instructions. An inner loop's body runs once, unless
    `inner_trips` gives {(first, last): trips} for it, where the path's pass through that body is repeated `trips`
    times (the count a warp runs at least: `inner_trips`)."""
    first, last = span
    path = _path(instructions, first, first, last, [last])
    for (a, b), trips in sorted((inner_trips or {}).items()):
        inside = [k for k, i in enumerate(path) if a <= i <= b]
        if trips > 1 and inside:
            body = path[inside[0]:inside[-1] + 1]
            path = path[:inside[0]] + body * trips + path[inside[-1] + 1:]
    return path


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
    charged as an L1 hit, the least any load waits; the weights order them (clocks). A cp.async copy (LDGSTS) is
    waited on by the DEPBAR that retires its group (`_CpAsync`), so a copy issued a trip ahead is waited on a trip
    later; an address computed from a loaded value that went through shared memory waits for the store that put it
    there (the warp issues in order). Returns hbm and near (the
    round trips of the chain), trip_bytes (global load bytes a warp's trip asks for) and loads."""
    def later(a, b):
        return a if a[0] * hbm_weight + a[1] * near_weight >= b[0] * hbm_weight + b[1] * near_weight else b

    ready, issue, marks, copies = {}, (0, 0), [], _CpAsync()
    for _ in range(passes):
        for i in path:
            text = instructions[i][1]
            op, reads, writes = _reads_writes(text)
            for reg in reads | writes:
                if reg in ready:
                    issue = later(issue, ready[reg])
            for done in copies.step(text):          # a DEPBAR waits for the cp.async groups it retires
                issue = later(issue, done)
            size = _global_load_bytes(op)
            if size:
                done = (issue[0] + 1, issue[1]) if size >= 16 else (issue[0], issue[1] + 1)
                if op.startswith("LDGSTS"):
                    copies.issue(done)
                    continue
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

    if (variant.operator, variant.phase) in CASE_VARIANTS:
        return _record_case_launch(variant)
    if variant.operator == "trtllm":
        return _record_trtllm_launch(variant)

    quant_bit = CACHES[variant.cache]
    head_dim = variant.head_dim
    seqlen = 1 if variant.phase == "decode" else PREFILL_ROWS
    batch, kvlen, page = 2, seqlen + 2, 32
    stored = head_dim // 2 if quant_bit == 4 else head_dim
    cache = np.zeros((2 * page, 1, 2, NUM_KV_HEADS, stored), np.int8 if quant_bit else np.float16)
    scale = np.ones((2 * page, 1, 2, NUM_KV_HEADS, head_dim // QUANT_GROUP), np.float16) if quant_bit else None
    query = np.ones((batch * seqlen, NUM_HEADS, head_dim), np.float16)
    current = np.ones((batch * seqlen, NUM_KV_HEADS, head_dim), np.float16)
    with _launch.recorded_launches() as launches:
        multi_head_cache_attention(
            query, current, current, np.arange(batch + 1) * seqlen, np.arange(batch + 1) * kvlen,
            np.array([[0], [page]]), np.full(batch, 2), batch if seqlen == 1 else 0, seqlen, kvlen, cache, scale, None,
            num_heads=NUM_HEADS, head_dim=head_dim, is_causal=True, num_kv_heads=NUM_KV_HEADS, quant_bit=quant_bit,
            quant_group=QUANT_GROUP, cache_mode=1, page_size=page, cache_axes="T L KV H D", rung=variant.rung,
            threads=THREADS, num_splits=2 if variant.rung == 4 else None)
    return _the_launch(variant, launches)


def _the_launch(variant: Variant, launches) -> tuple:
    """(kernel, args, threads) of the variant's kernel among the recorded launches."""
    found = [(kernel, args) for kernel, args in launches if kernel.py_func.__name__ == variant.kernel]
    if not found:
        raise RuntimeError(f"{variant.key}: the launcher made no {variant.kernel} launch")
    return (*found[0], THREADS)


def bench_case(variant: Variant):
    """The lab's bench case whose launch `variant` compiles (`CASE_VARIANTS`), or None (OpenPPL's launch and
    TensorRT-LLM's generation step are recorded at the headline shapes)."""
    from . import cases
    name = CASE_VARIANTS.get((variant.operator, variant.phase))
    return None if name is None else getattr(cases, name)


def _record_case_launch(variant: Variant):
    """`_record_launch` for the other operators' bench cases: the case's own call (`case.call`: the operator's
    validation, its plan, its launcher) at the variant's rung, with the heads and head_dim of the full case and the
    split count its full launch runs, over a short sequence (2 requests of 16 keys; a prompt of PREFILL_ROWS
    tokens). The kernels are specialised by heads, head_dim, block size and splits, not by batch or length, so the
    kernel compiled is the one the full launch runs. Launches are recorded, never run: no GPU is asked for."""
    from dataclasses import replace
    from unittest import mock

    from numba import cuda

    from kernels_numba import _launch

    case = bench_case(variant)
    if case.head_dim != variant.head_dim:
        raise ValueError(f"{variant.key}: the bench case {case.label!r} has head_dim {case.head_dim}, not "
                         f"{variant.head_dim}")
    if variant.phase == "prefill":
        small = replace(case, new_tokens=PREFILL_ROWS)
    elif hasattr(case, "with_keys"):
        small = replace(case.with_keys(16), batch=2)
    else:
        small = replace(case, batch=2, context=15)
    # The public call checks that the numba backend has a GPU (or the simulator) before it plans; this process
    # has neither and runs nothing: the launches are only recorded.
    with mock.patch.object(cuda, "is_available", lambda: True), _launch.recorded_launches() as launches:
        small.call(variant.rung, THREADS, case.splits(variant.rung, THREADS))
    return _the_launch(variant, launches)


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


def inner_trips(variant: Variant, instructions, span) -> list:
    """Inner loops of the key loop whose trips a warp runs at least a known number of times, each {first, last (the
    loop's indices), trips, how}. Rung 5's prefill stages K, then V, through shared memory in loops over the
    block's chunks, `for at in range(tid, n, threads)` (n = keys x chunks for K, keys / 2 x chunks for V, fixed by
    the kernel's shape: `_attention_mma.stage_shape`, `_cache.chunk_elements`). The SASS computes the loop's count
    from n - tid (`IADD3 Rc, P, -Rtid, n, RZ`, the last such before the loop's head, in the key loop), so n is read
    there and checked against the shape's; tid is known only at run time, so a warp runs as many trips as its first
    lane, and the last warp, first lane threads - 32, the fewest: ceil((n - threads + 32) / threads). The two are
    the key loop's inner loops that load and store to shared memory, K's first. Other inner loops (rung 1's tile
    loops, page walks) count once: a lower bound. ValueError when the SASS's n is not the shape's."""
    if variant.rung != 5 or variant.phase != "prefill":
        return []
    import numpy as np

    from kernels_numba._attention_mma import plan_mma_rows, stage_shape
    from kernels_numba._cache import chunk_elements
    warps = THREADS // 32
    row_tiles = plan_mma_rows(NUM_HEADS, NUM_KV_HEADS, PREFILL_ROWS, warps, HEAD_DIM)[2]
    keys, words = stage_shape(HEAD_DIM, HEAD_DIM, warps, row_tiles)
    quant_bit = CACHES[variant.cache]
    chunk = chunk_elements(quant_bit, np.int8 if quant_bit else np.float16, 5)
    chunks = -(-2 * words // chunk)
    staging = [(a, b) for a, b in loops(instructions) if span[0] <= a and b <= span[1] and (a, b) != span
               and any(opcode(t).startswith("LDG") for _, t, _ in instructions[a:b + 1])
               and any(opcode(t).startswith("STS") for _, t, _ in instructions[a:b + 1])]
    if len(staging) != 2:
        raise ValueError(f"{variant.key}: expected the K and V staging loops in the key loop, found {len(staging)}")
    out = []
    for (a, b), (name, n) in zip(sorted(staging), (("K", keys * chunks), ("V", keys // 2 * chunks))):
        read = next((k for k in range(a - 1, span[0] - 1, -1) if _RANGE_BOUND.search(instructions[k][1])), None)
        if read is None or int(_RANGE_BOUND.search(instructions[read][1]).group(1), 16) != n:
            found = "none" if read is None else instructions[read][1]
            raise ValueError(f"{variant.key}: {name} staging loop /*{instructions[a][0]:04x}*/: expected its count "
                             f"from {n} - tid in the SASS, found {found}")
        trips = max(1, -(-(n - THREADS + 32) // THREADS))
        out.append(dict(first=a, last=b, trips=trips,
                        how=f"{name} staging: range(tid, {n}, {THREADS}), {keys} keys x {chunks} chunks"
                            f"{' / 2' if name == 'V' else ''} (n - tid at /*{instructions[read][0]:04x}*/); the last "
                            f"warp's ceil(({n} - {THREADS - 32}) / {THREADS}) = {trips}"))
    return out


# n - tid, the count of a `range(tid, n, step)` loop before it is divided by the step (64 bits: the carry in P).
_RANGE_BOUND = re.compile(r"^IADD3 R\d+, P\d, -R\d+, (0x[0-9a-f]+), RZ$")


def analyse(variant: Variant, ptxas_text: str, sass_text: str, threads: int) -> dict:
    """The figures of one variant from ptxas -v's output and nvdisasm's listing (no tool runs here)."""
    resources = parse_ptxas(ptxas_text)
    instructions = parse_sass(sass_text)
    if not instructions:
        raise ValueError(f"{variant.key}: nvdisasm printed no instructions")
    if variant.part:
        return analyse_other(variant, resources, instructions, threads)
    span = key_loop(instructions)
    body = instructions[span[0]:span[1] + 1]
    inner = [(a, b) for a, b in loops(instructions) if span[0] <= a and b <= span[1] and (a, b) != span]
    walks = page_walks(instructions, inner)
    trips = inner_trips(variant, instructions, span)
    try:
        trip = trip_path(instructions, span, {(t["first"], t["last"]): t["trips"] for t in trips})
        once = outside_path(instructions, span)
    except (ValueError, StopIteration) as exc:
        raise ValueError(f"{variant.key}: the SASS paths could not be read ({exc})") from exc
    return dict(_described(variant, resources, instructions, threads),
                key_loop=dict(first=body[0][0], last=body[-1][0], inner_loops=len(inner), walk_loops=len(walks),
                              inner_trips=[dict(t, first=instructions[t["first"]][0], last=instructions[t["last"]][0])
                                           for t in trips],
                              mix=instruction_mix(body), in_flight=loads_in_flight(body),
                              trip=path_mix(instructions, trip), chain=dependent_chain(instructions, trip),
                              excerpt=excerpt(instructions, span)),
                once_per_warp=path_mix(instructions, once))


def whole_path(instructions) -> list:
    """The shortest path of a warp from the kernel's entry to an EXIT that still runs the must-do work it can reach
    (memory, shuffle, mma, exp2, barriers; a loop's body counted once): the least a warp of a launch issues."""
    exits = [i for i, (_, text, _) in enumerate(instructions) if opcode(text).startswith("EXIT")]
    if not exits:
        raise ValueError("no EXIT in this SASS")
    return _path(instructions, 0, 0, max(exits), exits)


def analyse_other(variant: Variant, resources: dict, instructions, threads: int) -> dict:
    """The figures of one of a call's other launches (a cache store, a copy, a preprocess, a split-K combine):
    its resources and occupancy, and what one warp issues at least (`whole_path`), for the issue term."""
    try:
        path = whole_path(instructions)
    except (ValueError, StopIteration) as exc:
        raise ValueError(f"{variant.key}: the SASS path could not be read ({exc})") from exc
    return dict(_described(variant, resources, instructions, threads), once_per_warp=path_mix(instructions, path))


def _described(variant: Variant, resources: dict, instructions, threads: int) -> dict:
    """What every variant's figures begin with: what it is (rung, cache, phase, kernel, operator, heads), its
    resources as ptxas reports them, its occupancy and the size of its SASS."""
    case = bench_case(variant)
    heads = (NUM_HEADS, NUM_KV_HEADS) if case is None else (case.num_heads, case.num_kv_heads)
    return dict(rung=variant.rung, cache=variant.cache, phase=variant.phase, kernel=variant.kernel,
                operator=variant.operator, head_dim=variant.head_dim, num_heads=heads[0], num_kv_heads=heads[1],
                threads=threads, **resources, shared_dynamic=0,         # numba's kernels declare static arrays only
                spill_bytes=resources["spill_stores"],                 # bytes a thread spills (and reloads)
                occupancy=occupancy(resources["registers"], resources["shared"], 0, threads),
                instructions=len(instructions), loops=len(loops(instructions)))


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
    if bench_case(variant) is not None:
        # which kernel such a variant compiles is the operator's choice: its module, the plan, the case
        for path in sorted((ROOT / "cacheattn").glob("*.py")) + [ROOT / "cacheattn" / "lab" / "cases.py"]:
            digest.update(path.read_bytes())
    recipe = (_record_launch, _record_trtllm_launch, _record_case_launch, bench_case, _the_launch, _compile)
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


def machine_code(variants=VARIANTS + OTHER_VARIANTS, *, use_cache: bool = True) -> dict:
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
    """Variant from its key 'rung3-int8-decode', 'trtllm-rung5-float16-prefill', 'ft-rung3-float16-decode-d64',
    'rung3-int8-decode+store_kernel'."""
    m = re.fullmatch(r"(?:(trtllm|onnx|ft)-)?rung(\d)-(\w+?)-(decode|prefill)(?:-d(\d+))?(?:\+(\w+))?", key)
    operator = (m.group(1) or "ppl") if m else None
    if m is None or m.group(3) not in OPERATOR_CACHES[operator]:
        formats = "; ".join(f"{name}: {'|'.join(caches)}" for name, caches in OPERATOR_CACHES.items())
        raise ValueError(f"variant: expected [trtllm-|onnx-|ft-]rung<N>-<cache>-<decode|prefill>[-d<head_dim>]"
                         f"[+<kernel>] "
                         f"(each operator's caches: {formats}), got {key!r}")
    return Variant(int(m.group(2)), m.group(3), m.group(4), operator, int(m.group(5) or HEAD_DIM), m.group(6) or "")


# ----------------------------------------------------------------------------------------------------------- report

LAUNCH_NAMES = {"ppl": "OpenPPL", "trtllm": "TensorRT-LLM", "onnx": "ONNX", "ft": "FasterTransformer"}


def table(results: dict) -> str:
    """A markdown table: one row per variant, resources and the key loop's static instruction mix."""
    head = "| launch | rung | cache | phase | regs | spill B | smem B | blocks/SM | occupancy | LDG.8/16/32/64/128 | " \
           "LDS | STS | SHFL | BAR | FFMA | HFMA2 | HMMA | MUFU.EX2 | loop instr. |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, r in results.items():
        if "key_loop" not in r:                  # a call's other launch: no key loop to show
            continue
        mix = r["key_loop"]["mix"]
        loads = "/".join(str(mix[f"LDG.{w}"]) for w in (8, 16, 32, 64, 128))
        occ = r["occupancy"]
        variant = parse_key(key)
        launch = LAUNCH_NAMES[variant.operator] + ("" if variant.head_dim == HEAD_DIM else
                                                   f" (head_dim {variant.head_dim})")
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


PLAN_TABLE = ROOT / "cacheattn" / "_sass_work.py"
PLAN_RUNGS = (3, 4, 5, 6)      # the rungs the plan weighs by their machine code (rung 1 is its fallback)
_PLAN_KEY = re.compile(r"rung(\d)-(float16|int8|int4)-(decode|prefill)")
_PLAN_BITS = {"float16": 0, "int8": 8, "int4": 4}


def plan_work(variants: dict) -> dict:
    """What the plan (`cacheattn.kernel_choice`) reads of the committed SASS: for OpenPPL's launch of each rung it
    weighs, at head_dim 128 and 128 threads, (rung, phase, quant_bit) -> (instructions of a key-loop trip, a
    warp's once, MUFU.EX2 a trip, LDS + STS + SHFL a trip, HBM round trips in series, short ones, blocks an SM)."""
    table = {}
    for key, v in variants.items():
        match = _PLAN_KEY.fullmatch(key)
        if match is None or int(match[1]) not in PLAN_RUNGS:
            continue
        trip, chain = v["key_loop"]["trip"], v["key_loop"]["chain"]
        table[(int(match[1]), match[3], _PLAN_BITS[match[2]])] = (
            trip["total"], v["once_per_warp"]["total"], trip["EX2"], trip["SHFL"] + trip["LDS"] + trip["STS"],
            chain["hbm"], chain["near"], v["occupancy"]["blocks_per_sm"])
    return table


def write_plan_table(variants: dict, path=PLAN_TABLE) -> None:
    """Write `plan_work`'s table as the Python module the plan imports (no JSON read at plan time, and none
    needed where the package is installed without the docs)."""
    rows = "".join(f"    {key!r}: {value!r},\n" for key, value in sorted(plan_work(variants).items()))
    Path(path).write_text(
        '"""The committed sm_90 SASS figures the kernel plan weighs (`cacheattn.lab.sass.plan_work`), written by\n'
        '`python -m cacheattn.lab.sass --write docs/kernel-ladder-sass.json`: do not edit by hand."""\n\n'
        f"SASS_WORK = {{\n{rows}}}\n")


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
    parser.add_argument("--cache", nargs="+", choices=tuple(dict.fromkeys(c for cs in OPERATOR_CACHES.values()
                                                                           for c in cs)),
                        help="only these cache formats")
    parser.add_argument("--operator", nargs="+", choices=tuple(OPERATOR_CACHES),
                        help="only these operators' launches (OpenPPL's, TensorRT-LLM's generation and context "
                             "steps, ONNX's, FasterTransformer's)")
    parser.add_argument("--write", metavar="JSON", help="write the figures (and tool versions) to this file, e.g. "
                                                        "docs/kernel-ladder-sass.json; with --rung, --cache or "
                                                        "--operator, only those variants are replaced in it")
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
    variants = [v for v in VARIANTS + OTHER_VARIANTS if (not args.rung or v.rung in args.rung)
                and (not args.cache or v.cache in args.cache) and (not args.operator or v.operator in args.operator)]
    try:
        results = machine_code(variants, use_cache=not args.no_cache)
    except ToolMissing as exc:
        print(f"cacheattn.lab.sass: {exc}", file=sys.stderr)
        return 2
    print(table(results))
    if args.write:
        target = Path(args.write)
        if (args.rung or args.cache or args.operator) and target.exists():
            # A filtered run replaces its own variants and keeps the rest, in the order the full run writes them.
            kept = json.loads(target.read_text())["variants"]
            order = [v.key for v in VARIANTS + OTHER_VARIANTS]
            merged = {**kept, **results}
            results = {key: merged[key] for key in order if key in merged}
        target.write_text(json.dumps(dict(tools=tool_versions(), target="sm_90", shapes=dict(
            num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, quant_group=QUANT_GROUP,
            threads=THREADS, prefill_rows=PREFILL_ROWS), variants=results), indent=1) + "\n")
        if target.resolve() == COMMITTED.resolve():
            write_plan_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
