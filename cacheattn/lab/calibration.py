"""Calibration of the lab's lower bounds against outside kernels whose H100 time is published.

The bounds (`cacheattn.lab.bounds`) have never been held against a kernel with a known time. Public kernels with
published H100 figures serve: FlashAttention-2's forward (head_dim 128, float16, the sm_80-class kernel
FlashAttention-2 runs on an H100) and FlashInfer's CUDA-core decode (float16, head_dim 128: over a paged cache at
group 8 and group 4, and single-request at group 8). Each was compiled for sm_90 without a GPU
(`cacheattn/lab/calibration_build.sh`) and its machine code read with the project's own reader (`cacheattn.lab.sass`);
only the statistics are kept, in docs/calibration-sass.json, with where each kernel came from, its shape and its
published figure (null where none was found).

From those statistics `terms` computes every term of the bound model the statistics support (DRAM, tensor pipe,
shared-memory wavefronts, instruction issue, MUFU, FMA pipe; L2 once the machine carries its rate), each with its
formula, and the bound is the largest:

    python -m cacheattn.lab.calibration            # kernel | shape | published µs | bound µs | ratio | binding term
    python -m cacheattn.lab.calibration --derive OUT --write docs/calibration-sass.json   # after the build script

A ratio bound / published near 1 says the model explains the kernel's time; well below 1, that the kernel loses
time to something no term charges for (latency, dependencies, a pipe slower than its peak).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path

from .. import bounds
from . import sass

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "calibration-sass.json"
LADDER_RUN = ROOT / "docs" / "kernel-ladder-counts.json"


def default_machine():
    """The bound model's H100 SXM (`cacheattn.bounds.H100_SXM`)."""
    return bounds.H100_SXM


# --------------------------------------------------------------------------------------- statistics from the SASS

# Classes the outside kernels use beyond `sass.MIX_CLASSES` (cp.async, ldmatrix, scoreboard waits, the FP32 and
# half2 arithmetic, integer and control instructions), by opcode head.
EXTRA_CLASSES = {
    "LDGSTS": ("LDGSTS",), "LDSM": ("LDSM",), "DEPBAR": ("DEPBAR", "LDGDEPBAR"), "FMUL": ("FMUL",),
    "FADD": ("FADD",), "FMNMX": ("FMNMX",), "HADD2/HMUL2": ("HADD2", "HMUL2"), "MUFU (other)": ("MUFU",),
    "integer": ("IMAD", "IADD3", "IADD", "LEA", "SHF", "LOP3", "ISETP", "SEL", "VIADD", "IABS", "PRMT", "IMNMX",
                "UIADD3", "ULOP3", "ULEA", "USHF", "UIMAD", "USEL", "UISETP", "POPC", "FLO", "I2F", "F2I", "F2FP",
                "I2FP", "F2F", "PLOP3", "FSETP", "FSEL", "CS2R", "S2R", "S2UR", "MOV", "UMOV", "ULDC", "LDC",
                "SHL", "SHR", "P2R", "R2P", "R2UR"),
    "control": ("BRA", "EXIT", "BSSY", "BSYNC", "NOP", "WARPSYNC", "RET", "CALL", "PREEXIT", "BPT", "YIELD",
                "ACQBULK"),
}
# The FP32 pipe's instructions (32 lanes each against Machine.fma_per_clock lanes a clock) and the half2 ones the
# same pipe runs.
FMA_PIPE = ("FFMA", "FMUL", "FADD", "HFMA2", "HADD2", "HMUL2")


def mix(instructions) -> dict:
    """`sass.instruction_mix` of `instructions` plus EXTRA_CLASSES (MUFU (other): MUFU but not EX2; integer counts
    moves, predicates and conversions with the integer arithmetic) and `other` (the rest), which together sum to
    `total`; and the FMA-pipe subtotal (FFMA, FMUL, FADD and the half2 arithmetic)."""
    out = sass.instruction_mix(instructions)
    heads = Counter(sass.opcode(text).split(".")[0] for _, text, _ in instructions)
    for name, members in EXTRA_CLASSES.items():
        out[name] = sum(heads[m] for m in members)
    out["MUFU (other)"] -= out["MUFU.EX2"]
    out["other"] = out["total"] - sum(v for k, v in out.items() if k != "total")
    out["FMA pipe"] = sum(heads[m] for m in FMA_PIPE)          # a subtotal across classes, not a class
    return out


def wavefronts(instructions) -> int:
    """Shared-memory wavefronts of one warp running `instructions` once, at best (no bank conflicts): a wavefront
    moves 128 bytes, so ldmatrix .x4 (four 8x8 half matrices, 512 bytes) is 4, .x2 2, .x1 1; LDS / STS of 128, 64
    or 32 bits a lane 4, 2, 1; cp.async of 16 bytes a lane (LDGSTS .128) writes 4."""
    total = 0
    for _, text, _ in instructions:
        parts = sass.opcode(text).split(".")
        if parts[0] == "LDSM":
            total += 4 if "4" in parts[-1:] else 2 if "2" in parts[-1:] else 1
        elif parts[0] in ("LDS", "STS", "LDGSTS"):
            total += 4 if "128" in parts else 2 if "64" in parts else 1
    return total


def regions(instructions) -> list[tuple[int, int]]:
    """Loops as the code runs them (`sass.regions`: rotated loops joined)."""
    return sass.regions(instructions)


def derive(ptxas_text: str, sass_text: str, meta: dict) -> dict:
    """The statistics of one kernel from ptxas -v's output and nvdisasm's listing, merged into `meta` (its source,
    shape, launch, published figure, and `main_loop`: trips a block makes and the instructions a trip may skip),
    read as the ladder's kernels are: the main loop is `sass.key_loop` (rotated loops joined), its chain of
    dependent round trips `sass.dependent_chain` over the loop's body in address order (cp.async copies in
    flight until the DEPBAR that retires their group, so a copy issued trips ahead is waited on trips later)."""
    resources = sass.parse_ptxas(ptxas_text)
    instructions = sass.parse_sass(sass_text)
    if not instructions:
        raise ValueError(f"{meta['kernel']}: nvdisasm printed no instructions")
    first, last = sass.key_loop(instructions)
    body = instructions[first:last + 1]
    outside = instructions[:first] + instructions[last + 1:]
    launch = meta["launch"]
    occ = sass.occupancy(resources["registers"], resources["shared"], launch["dynamic_shared"], launch["threads"])
    out = dict(meta)
    out["resources"] = dict(resources, shared_dynamic=launch["dynamic_shared"])
    out["occupancy"] = dict(blocks_per_sm=occ["blocks_per_sm"], warps_per_sm=occ["warps_per_sm"],
                            limited_by=occ["limited_by"], limits=occ["limits"])
    out["total_instructions"] = len(instructions)
    out["loops"] = [dict(first=f"{instructions[a][0]:04x}", last=f"{instructions[b][0]:04x}",
                         instructions=b - a + 1) for a, b in regions(instructions)]
    facts = {k: v for k, v in meta["main_loop"].items() if k not in _DERIVED_LOOP_FIELDS}
    out["main_loop"] = dict(facts, first=f"{body[0][0]:04x}", last=f"{body[-1][0]:04x}",
                            instructions=len(body), mix=mix(body), wavefronts=wavefronts(body),
                            chain=sass.dependent_chain(instructions, range(first, last + 1)),
                            in_flight=sass.loads_in_flight(body))
    out["outside_main_loop"] = dict(instructions=len(outside), mix=mix(outside), wavefronts=wavefronts(outside))
    return out


# ----------------------------------------------------------------------------------------------------------- terms

REQUIRED = {
    "": ("kernel", "source", "shape", "published", "published_us", "compiler", "launch", "resources", "occupancy",
         "main_loop", "outside_main_loop", "dram_bytes"),
    "launch": ("threads", "blocks", "dynamic_shared"),
    "main_loop": ("instructions", "trips_per_block", "skipped_per_trip", "mix", "wavefronts", "chain"),
    "main_loop.chain": ("hbm", "near", "trip_bytes"),
    "main_loop.mix": ("HMMA", "MUFU.EX2", "FMA pipe", "total"),
    "outside_main_loop": ("instructions", "mix"),
    "outside_main_loop.mix": ("HMMA",),
    "dram_bytes": ("value", "how"),
    "published_us": ("value", "conversion"),
}


def check(entry: dict, name: str = "?") -> None:
    """ValueError naming the kernel and the first missing or malformed key: a bound is never computed from a partial
    entry."""
    if not isinstance(entry, dict):
        raise ValueError(f"calibration entry {name!r}: expected an object, got {type(entry).__name__}")
    name = entry.get("kernel", name) if isinstance(entry.get("kernel"), str) else name
    for path, keys in REQUIRED.items():
        node = entry
        for part in path.split(".") if path else ():
            node = node.get(part) if isinstance(node, dict) else None
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                raise ValueError(f"calibration entry {name!r}: missing key {'.'.join(filter(None, (path, key)))!r}")
    numbers = dict(threads=entry["launch"]["threads"], blocks=entry["launch"]["blocks"],
                   trips=entry["main_loop"]["trips_per_block"], instructions=entry["main_loop"]["instructions"],
                   dram_bytes=entry["dram_bytes"]["value"])
    for key, value in numbers.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"calibration entry {name!r}: {key} must be a positive number, got {value!r}")
    if entry["published_us"]["value"] is not None and entry["published_us"]["value"] <= 0:
        raise ValueError(f"calibration entry {name!r}: published_us.value must be positive or null")


def work(entry: dict) -> bounds.Work:
    """The call's work (`cacheattn.bounds.Work`) from one kernel's statistics: the main loop's counts per warp a
    trip times its trips and the grid's warps, plus what each warp runs outside it once (prologue, the peeled first
    tile, epilogue). A trip may skip `skipped_per_trip` instructions (a prefetch the last trip leaves out), so the
    issue counts instructions - skipped: a lower bound. The latency chain is the main loop's (`sass.dependent_chain`:
    the round trips a trip waits on in series, where a cp.async copy issued trips ahead is waited on by a later
    trip's DEPBAR, so the source's `trips_ahead` is read from the code, not divided by)."""
    check(entry)
    launch, loop, outside = entry["launch"], entry["main_loop"], entry["outside_main_loop"]
    warps = math.ceil(launch["threads"] / 32)
    warp_count = launch["blocks"] * warps
    trips = loop["trips_per_block"]

    def each_warp(in_loop, once=0):
        return warp_count * (in_loop * trips + once)

    lsu = ("LDS", "STS", "SHFL", "LDSM")
    mix, out_mix = loop["mix"], outside["mix"]
    return bounds.Work(
        dram_bytes=entry["dram_bytes"]["value"],
        l2_bytes=entry["l2_bytes"]["value"] if "l2_bytes" in entry else 0.0,
        shared_wavefronts=each_warp(loop["wavefronts"]),
        mma=each_warp(mix["HMMA"], out_mix["HMMA"]),
        fma_flops=2 * 32 * each_warp(mix["FMA pipe"]),
        ex2=each_warp(mix["MUFU.EX2"], out_mix["MUFU.EX2"]),
        lsu_instructions=each_warp(sum(mix.get(k, 0) for k in lsu), sum(out_mix.get(k, 0) for k in lsu)),
        warp_instructions=each_warp(loop["instructions"] - loop["skipped_per_trip"], outside["instructions"]),
        launches=launch.get("launches", 1),
        blocks=launch["blocks"], blocks_per_sm=entry["occupancy"]["blocks_per_sm"], warps_per_block=warps,
        warp_trips=each_warp(1), chain_hbm=loop["chain"]["hbm"], chain_near=loop["chain"]["near"],
        trip_bytes=loop["chain"]["trip_bytes"])


def ceilings(entry: dict, machine=None) -> bounds.Bounds:
    """Every term of the bound model (`cacheattn.bounds.ceilings`) for one kernel's statistics."""
    return bounds.ceilings(work(entry), machine or default_machine())


def terms(entry: dict, machine=None) -> dict:
    """{term: (µs, formula)} of one kernel, the bound model's terms on `machine` (H100_SXM by default)."""
    found = ceilings(entry, machine)
    return {name: (fig.value, fig.how) for name, fig in found.resources.items()}


def bound(entry: dict, machine=None) -> tuple[float, str]:
    """(bound µs, binding term): the largest term."""
    found = terms(entry, machine)
    name = max(found, key=lambda k: found[k][0])
    return found[name][0], name


def rebound(data: dict, machine=None) -> dict:
    """`data` with each kernel's `bound_us` (to 1 ns) and `binding_term` recomputed through the bound model."""
    for entry in data["kernels"].values():
        value, name = bound(entry, machine)
        entry["bound_us"], entry["binding_term"] = round(value, 3), name
    return data


# FlashAttention-2's forward tiles at head_dim 128 on sm_90 (kBlockM query rows, kBlockN keys a block: the entry's
# launch and main loop): what moving its kernel to another prefill shape needs.
FA2_TILES = {"fa2_fwd_hdim128": (128, 64)}
# The lab's 4k prefill (`cacheattn.lab.cases.PREFILL`): one request of 4096 tokens, 32 query heads over 8 KV heads.
PREFILL_SHAPE = dict(batch=1, heads=32, kv_heads=8, seqlen=4096, causal=True)


def at_shape(key: str, entry: dict, *, batch: int, heads: int, kv_heads: int, seqlen: int, causal: bool) -> dict:
    """FlashAttention-2's entry moved to another self-attention prefill shape (seqlen queries over as many keys,
    float16, the entry's head_dim), derived from the same machine code: its grid (ceil(seqlen / kBlockM) x batch
    x heads blocks), each block's key tiles (all of them, or with `causal` those up to its last row's diagonal),
    the first peeled as at the entry's shape and the rest counted as main-loop trips, and the bytes (DRAM: Q, K,
    V read and O written once; L2: every block's K and V tiles). A causal call runs FlashAttention-2's causal
    instantiation, whose machine code was not compiled: its unmasked tiles run this same loop, and its masked
    tiles, which add the mask's instructions, are counted as plain trips, so the bound stays a lower bound."""
    rows, keys = FA2_TILES[key]
    head_dim = entry["shape"]["head_dim"]
    q_blocks = -(-seqlen // rows)
    tiles = [min(-(-seqlen // keys), -(-min(seqlen, (i + 1) * rows) // keys)) if causal else -(-seqlen // keys)
             for i in range(q_blocks)]
    blocks = q_blocks * batch * heads
    tile_bytes = keys * head_dim * 2
    qo_bytes = 2 * batch * seqlen * heads * head_dim * 2
    kv_bytes = 2 * batch * seqlen * kv_heads * head_dim * 2
    moved = json.loads(json.dumps(entry))
    moved["shape"] = dict(entry["shape"], batch=batch, heads=heads, kv_heads=kv_heads, seqlen_q=seqlen,
                          seqlen_k=seqlen, causal=causal)
    moved["launch"] = dict(entry["launch"], blocks=blocks, grid=[q_blocks, batch, heads],
                           how=f"grid (ceil({seqlen} / kBlockM {rows}), batch, heads), as at the entry's shape")
    moved["main_loop"] = dict(entry["main_loop"], trips_per_block=sum(t - 1 for t in tiles) / q_blocks,
                              how=f"key tiles of {keys} a block, {'up to its diagonal, ' if causal else ''}"
                                  f"{sum(tiles) / q_blocks:.1f} on average over the query blocks, the first peeled")
    moved["dram_bytes"] = dict(value=qo_bytes + kv_bytes, how="Q, K and V read and O written once, float16")
    moved["l2_bytes"] = dict(value=batch * heads * sum(tiles) * 2 * tile_bytes + qo_bytes,
                             how="every block's K and V tiles, plus Q read and O written once")
    moved["published"] = dict(value=None, what="none at this shape: derived from the entry's machine code")
    moved["published_us"] = dict(value=None, conversion="none")
    moved["derived_from"] = key
    return moved


def entries(data: dict | None = None, machine=None) -> list[dict]:
    """The calibration list of docs/kernel-ladder-counts.json: for each outside kernel its name, source (code and
    published figure), shape, the published time, this model's bound, their ratio and the terms that bind."""
    data = committed() if data is None else data
    out = []
    kernels = dict(data["kernels"])
    for key in FA2_TILES:
        if key in kernels:        # FlashAttention-2 at the lab's 4k prefill, beside the ladder's prefill rungs
            kernels[f"{key} at the 4k prefill"] = at_shape(key, kernels[key], **PREFILL_SHAPE)
    for key, entry in kernels.items():
        found = ceilings(entry, machine)
        published = entry["published_us"]["value"]
        source = entry["source"]
        out.append({"key": key, "kernel": entry["kernel"],
                    "source": {"code": f"{source['repo']} at {source['commit']}",
                               "published": entry["published"].get("what", ""),
                               "citation": source.get("citation", "")},
                    "shape": entry["shape"], "published_us": published, "bound_us": round(found.bound_us, 3),
                    "bound / published": round(found.bound_us / published, 3) if published else None,
                    "limited by": found.ranked[:3]})
    return out


def committed(path=COMMITTED) -> dict:
    """docs/calibration-sass.json: {'machine_note', 'kernels': {key: entry}}, every entry checked."""
    data = json.loads(Path(path).read_text())
    kernels = data.get("kernels") if isinstance(data, dict) else None
    if not isinstance(kernels, dict) or not kernels:
        raise ValueError(f"{path}: expected an object with a non-empty 'kernels' object")
    for key, entry in kernels.items():
        check(entry, key)
    return data


def _shape_text(shape: dict) -> str:
    keys = ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim", "page_size", "causal", "dtype")
    return " ".join(f"{k}={shape[k]}" for k in keys if k in shape)


def table(data: dict, machine=None) -> str:
    """kernel | shape | published µs | bound µs | ratio | binding term, one row per kernel."""
    lines = ["| kernel | shape | published µs | bound µs | ratio | binding term |", "|---|---|---|---|---|---|"]
    for key, entry in data["kernels"].items():
        value, name = bound(entry, machine)
        published = entry["published_us"]["value"]
        ratio = f"{value / published:.2f}" if published else "n/a (no published figure)"
        shown = f"{published:,.1f}" if published else "n/a"
        lines.append(f"| {key} | {_shape_text(entry['shape'])} | {shown} | {value:,.1f} | {ratio} | {name} |")
    return "\n".join(lines)


def show_terms(data: dict, machine=None) -> str:
    """Every term of every kernel with its formula."""
    lines = []
    for key, entry in data["kernels"].items():
        lines.append(key)
        for name, (value, how) in sorted(terms(entry, machine).items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {name:<7} {value:>10,.1f} µs  {how}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------- derive & CLI

def _kernel_name(sass_text: str) -> str:
    found = re.search(r"\.text\.(\S+?):", sass_text)
    return found.group(1) if found else "?"


def derive_all(build_dir, kernels_meta: dict) -> dict:
    """{'kernels': {key: statistics}} from the build script's OUT folder (<key>.ptxas, <key>.sass, nvcc.version)."""
    build = Path(build_dir)
    nvcc = (build / "nvcc.version").read_text().strip().splitlines()
    nvdisasm = (build / "nvdisasm.version").read_text().strip().splitlines()
    out = {}
    for key, meta in kernels_meta.items():
        sass_text = (build / f"{key}.sass").read_text()
        entry = derive((build / f"{key}.ptxas").read_text(), sass_text, meta)
        entry["compiler"] = dict(entry.get("compiler", {}), nvcc=nvcc[0], nvdisasm=nvdisasm[0],
                                 mangled=_kernel_name(sass_text))
        out[key] = entry
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(COMMITTED), help="the statistics (docs/calibration-sass.json)")
    parser.add_argument("--terms", action="store_true", help="print every term with its formula")
    parser.add_argument("--derive", metavar="OUT", help="read the build script's OUT folder (needs --write)")
    parser.add_argument("--write", metavar="JSON", help="write the derived statistics here")
    parser.add_argument("--update", action="store_true", help="recompute every bound through the bound model into "
                        "the statistics and into docs/kernel-ladder-counts.json's calibration list")
    args = parser.parse_args(argv)
    if args.derive:
        if not args.write:
            parser.error("--derive needs --write")
        existing = json.loads(Path(args.write).read_text()) if Path(args.write).exists() else {}
        meta = {k: {f: v for f, v in e.items() if f in _META_FIELDS} for k, e in existing.get("kernels", {}).items()}
        if not meta:
            parser.error(f"{args.write}: no kernel metadata (source, shape, launch, published) to derive into")
        existing["kernels"] = derive_all(args.derive, meta)
        data = rebound(existing)
        Path(args.write).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    else:
        data = committed(args.json)
    if args.update:
        data = rebound(data)
        Path(args.json).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        # The lab's committed run carries the list too (the lab writes it there with every run it writes).
        ladder = json.loads(LADDER_RUN.read_text())
        ladder["calibration"] = entries(data)
        LADDER_RUN.write_text(json.dumps(ladder, indent=1, ensure_ascii=False) + "\n")
    print(table(data))
    if args.terms:
        print(show_terms(data))
    return 0


# What derive recomputes in main_loop (and drops when an older reader wrote a field no longer derived).
_DERIVED_LOOP_FIELDS = ("first", "last", "instructions", "mix", "wavefronts", "chain", "in_flight",
                        "dependent_global_loads")
# What --derive keeps of an entry (the hand-written facts); the rest is recomputed from the tools' output.
_META_FIELDS = ("kernel", "source", "shape", "published", "published_us", "compiler", "launch", "dram_bytes",
                "l2_bytes", "main_loop", "load_chain", "notes")


if __name__ == "__main__":
    sys.exit(main())
