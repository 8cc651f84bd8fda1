"""The exercises as data: what each asks, its inputs (small, random, fixed shapes drawn from a few sizes), the
float64 reference its outputs must match, how its kernel is launched, and the counts it should reach.

Every exercise's kernel works on head_dim 32, one dimension a lane of one warp, so that the counts are easy to
check by hand: 32 float32 lanes side by side are 128 bytes, 4 sectors; 32 int8 lanes are one sector. Exercise 9
reads rows of 64 float16, 8 a lane (16 bytes); exercise 10 is a plain Python function, checked for right only.
Exercises 11 and 12 are the rung pages' own: rung 1 to rung 2 (a warp per key) and rung 4 (split-K partials).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..lab.recorder import CONFLICTS_LD, CONFLICTS_ST
from . import _shuffle, skeletons
from .skeletons import GROUP

HEAD_DIM = 32


@dataclass(frozen=True)
class Target:
    """One count the kernel should reach: `what` (a phrase), measured on a recording at the exercise's sizes, at
    most `limit(sizes)`; `fix` says what to change when it is over."""
    what: str
    measure: Callable
    limit: Callable
    fix: str


@dataclass(frozen=True)
class Exercise:
    """An exercise: its task, the kernel's signature and launch, its sizes (the default and the least each may
    shrink to), how inputs are made, its float64 reference, and its targets."""
    number: int
    title: str
    idea: str
    task: str
    skeleton: object
    launch: str
    sizes: dict
    smallest: dict
    make: Callable            # (sizes, rng) -> {name: array or int}; outputs included, as NaN
    outputs: tuple
    reference: Callable       # inputs -> {output name: float64 array}
    grid: Callable            # inputs -> grid
    args: tuple               # the kernel's parameters, in order
    targets: tuple
    inputs_text: str
    reference_text: str
    largest: dict = field(default_factory=dict)     # sizes with an upper bound (a tile's rows)
    function: bool = False    # a plain Python function called with args, not a kernel: right is all there is

    def launch_kernel(self, kernel, inputs):
        with _shuffle.installed():                  # the simulator has no warp shuffles of its own
            kernel[self.grid(inputs), 32](*(inputs[name] for name in self.args))


# A measure returns None when the kernel made no access it could count: a skeleton is not fast for reading nothing.
def _array_figure(array, figure):
    def measure(rec):
        loads = sum(launch.arrays.get(array, {}).get("ld_requests", 0) for launch in rec.launches)
        return sum(launch.arrays.get(array, {}).get(figure, 0) for launch in rec.launches) if loads else None
    return measure


def _sectors_per_load(array):
    requests, sectors = _array_figure(array, "ld_requests"), _array_figure(array, "ld_sectors")
    return lambda rec: None if requests(rec) is None else sectors(rec) / requests(rec)


def _bank_conflicts(rec):
    if not rec.extra["shared_ld_requests"]:
        return None
    return rec.metrics[CONFLICTS_LD] + rec.metrics[CONFLICTS_ST]


def _shared_traffic(rec):
    extra = rec.extra
    traffic = extra["shared_ld_requests"] + extra["shared_st_requests"] + extra["barriers"]
    return None if not traffic and not extra.get("warp_shuffles") else traffic


def _nan(*shape):
    return np.full(shape, np.nan, np.float32)


def _normal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# --- 1. coalesced loads
def _make_copy(s, rng):
    tokens, kv_heads = s["tokens"], s["kv_heads"]
    return {"k_cache": _normal(rng, tokens, kv_heads, HEAD_DIM), "head": kv_heads - 1,
            "out": _nan(tokens, HEAD_DIM)}


# --- 2. a padded shared tile
def _make_tile(s, rng):
    return {"q": _normal(rng, HEAD_DIM), "k": _normal(rng, s["keys"], HEAD_DIM), "scores": _nan(s["keys"])}


# --- 3. online softmax
def _make_softmax(s, rng):
    keys, rows = s["keys"], s["rows"]
    return {"scores": _normal(rng, keys, rows) * np.float32(3), "values": _normal(rng, keys, rows),
            "out": _nan(rows)}


def _softmax_reference(x):
    scores, values = x["scores"].astype(np.float64), x["values"].astype(np.float64)
    p = np.exp(scores - scores.max(axis=0))
    return {"out": (p * values).sum(axis=0) / p.sum(axis=0)}


# --- 4. the page lookup
def _make_pages(s, rng):
    batch, pages, page_size = s["batch"], s["pages"], s["page_size"]
    pool = batch * pages + 1                            # one page more than needed: not every slot is used
    order = rng.permutation(pool) * page_size           # pages anywhere in the pool, in any order
    kvlens = rng.integers(1, pages * page_size + 1, batch)
    cachestarts = np.full((batch, pages), -1, np.int64)
    for b in range(batch):
        used = -(-int(kvlens[b]) // page_size)
        cachestarts[b, :used] = order[b * pages:b * pages + used]
    return {"k_cache": _normal(rng, pool * page_size, HEAD_DIM), "cachestarts": cachestarts, "kvlens": kvlens,
            "page_size": page_size, "out": _nan(batch, pages * page_size, HEAD_DIM)}


def _pages_reference(x):
    out = np.zeros(x["out"].shape)
    for b, kvlen in enumerate(x["kvlens"]):
        t = np.arange(kvlen)
        out[b, :kvlen] = x["k_cache"][x["cachestarts"][b, t // x["page_size"]] + t % x["page_size"]]
    return {"out": out}


# --- 5. int8 dequantization
def _make_int8(s, rng):
    tokens = s["tokens"]
    return {"k": rng.integers(-127, 128, (tokens, HEAD_DIM)).astype(np.int8),
            "scale": (rng.random((tokens, HEAD_DIM // 8)) * 0.05 + 0.001).astype(np.float16),
            "out": _nan(tokens, HEAD_DIM)}


# --- 6. GQA sharing
def _make_gqa(s, rng):
    tokens, kv_heads = s["tokens"], s["kv_heads"]
    probs = rng.random((kv_heads * GROUP, tokens))
    return {"probs": (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32),
            "v": _normal(rng, tokens, kv_heads, HEAD_DIM), "out": _nan(kv_heads * GROUP, HEAD_DIM)}


def _gqa_reference(x):
    probs, v = x["probs"].astype(np.float64), x["v"].astype(np.float64)
    g = np.arange(probs.shape[0]) // GROUP
    return {"out": np.einsum("ht,thd->hd", probs, v[:, g])}


# --- 7. split-K combine
def _make_splits(s, rng):
    splits, heads, per_split = s["splits"], s["heads"], s["keys_per_split"]
    scores = rng.standard_normal((splits, heads, per_split)) * 3
    values = rng.standard_normal((splits, per_split, HEAD_DIM))
    m = scores.max(axis=2)
    p = np.exp(scores - m[..., None])
    partial = np.einsum("shk,skd->shd", p, values) / p.sum(axis=2)[..., None]
    # all_scores / all_values: what the splits were computed from (not the kernel's), for the reference
    return {"partial_out": partial.astype(np.float32), "partial_max": m.astype(np.float32),
            "partial_sum": p.sum(axis=2).astype(np.float32), "out": _nan(heads, HEAD_DIM),
            "all_scores": scores.transpose(1, 0, 2).reshape(heads, -1), "all_values": values.reshape(-1, HEAD_DIM)}


def _splits_reference(x):
    # Attention over all the keys at once, in float64, from the scores and values the splits were made of: the
    # combine must give what one block over every key would have.
    scores = x["all_scores"]
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    return {"out": p @ x["all_values"] / p.sum(axis=1, keepdims=True)}


# --- 8. a warp shuffle sum
def _make_rows(s, rng):
    return {"x": _normal(rng, s["rows"], 32), "out": _nan(s["rows"], 32)}


def _rows_reference(x):
    sums = x["x"].astype(np.float64).sum(axis=1, keepdims=True)
    return {"out": np.repeat(sums, 32, axis=1)}


# --- 9. unpacking a 16-byte chunk
def _make_halves(s, rng):
    return {"k": _normal(rng, s["tokens"], 64, dtype=np.float16), "out": _nan(s["tokens"], 64)}


# --- 11. a warp per key
def _make_keys(s, rng):
    return {"q": _normal(rng, HEAD_DIM), "k": _normal(rng, s["keys"], HEAD_DIM), "scores": _nan(s["keys"])}


def _shared_traffic_reading(array):
    # The shared-memory requests and barriers of a kernel that reads `array`: a kernel with neither is not fast
    # for having read nothing (None), but one that reads the array through registers alone counts 0.
    requests = _array_figure(array, "ld_requests")
    return lambda rec: None if requests(rec) is None else (
        rec.extra["shared_ld_requests"] + rec.extra["shared_st_requests"] + rec.extra["barriers"])


# --- 12. split-K partials
def _make_partials(s, rng):
    splits, heads, keys = s["splits"], s["heads"], s["keys"]
    return {"scores": _normal(rng, heads, keys) * np.float32(3), "values": _normal(rng, keys, HEAD_DIM),
            "partial_out": _nan(splits, heads, HEAD_DIM), "partial_max": _nan(splits, heads),
            "partial_sum": _nan(splits, heads)}


def _partials_reference(x):
    scores, values = x["scores"].astype(np.float64), x["values"].astype(np.float64)
    splits, (heads, keys) = x["partial_max"].shape[0], scores.shape
    per = -(-keys // splits)                            # keys a split, rounded up: the last splits may be empty
    m, total = np.full((splits, heads), -np.inf), np.zeros((splits, heads))
    o = np.zeros((splits, heads, HEAD_DIM))
    for c in range(splits):
        lo, hi = c * per, min(keys, (c + 1) * per)
        if lo < hi:                                     # an empty split keeps (-inf, 0, 0)
            m[c] = scores[:, lo:hi].max(axis=1)
            p = np.exp(scores[:, lo:hi] - m[c][:, None])                  # (heads, hi - lo)
            total[c], o[c] = p.sum(axis=1), p @ values[lo:hi]
    return {"partial_out": o, "partial_max": m, "partial_sum": total}


# --- 10. an mma fragment's position
def _fragment_reference(x):
    from kernels_numba import _mma
    return {"position": np.array([[_mma.c_position(lane, e) for e in range(4)] for lane in range(32)])}


EXERCISES = {e.number: e for e in (
    Exercise(
        1, "Coalesced loads", "Neighbouring lanes read neighbouring bytes: a warp's request then touches the fewest "
        "32-byte sectors.",
        "Copy one key/value head out of a cache (tokens, kv_heads, 32) into out (tokens, 32).",
        skeletons.copy_head, "1 block of 32 threads",
        {"tokens": 16, "kv_heads": 4}, {"tokens": 1, "kv_heads": 1}, _make_copy, ("out",),
        lambda x: {"out": x["k_cache"][:, x["head"]].astype(np.float64)},
        lambda x: 1, ("k_cache", "head", "out"),
        (Target("sectors per load request of k_cache", _sectors_per_load("k_cache"), lambda s: 4,
                "let the lane pick the dimension d, the fastest-moving index of k_cache: 32 floats side by side "
                "are 4 sectors"),),
        "k_cache float32 (tokens, kv_heads, 32); head: the last head; out float32 (tokens, 32)",
        "out = k_cache[:, head]"),
    Exercise(
        2, "A padded shared tile", "A shared tile read down a column hits one bank 32 times; one word of padding "
        "per row spreads the column over all 32 banks.",
        "scores[j] = sum_d q[d] k[j, d] for keys j < 32: load k into a shared tile a row at a time (coalesced), "
        "then lane j reads row j.",
        skeletons.tile_scores, "1 block of 32 threads",
        {"keys": 32}, {"keys": 1}, _make_tile, ("scores",),
        lambda x: {"scores": x["k"].astype(np.float64) @ x["q"].astype(np.float64)},
        lambda x: 1, ("q", "k", "scores"),
        (Target("shared-memory bank conflicts", _bank_conflicts, lambda s: 0,
                "give the tile rows of 33 words: lane j's word (j, d) is then in bank (j + d) % 32, a bank a lane"),),
        "q float32 (32,); k float32 (keys, 32), keys <= 32; scores float32 (keys,)",
        "scores = k @ q", largest={"keys": 32}),
    Exercise(
        3, "Online softmax", "Keep a running maximum and rescale what was summed against the old one: softmax and "
        "the weighted sum in one pass over the scores.",
        "out[r] = sum_t softmax(scores[:, r])[t] * values[t, r], lane r for row r, reading each score once.",
        skeletons.online_softmax, "1 block of 32 threads",
        {"keys": 24, "rows": 32}, {"keys": 1, "rows": 1}, _make_softmax, ("out",), _softmax_reference,
        lambda x: 1, ("scores", "values", "out"),
        (Target("load requests of scores", _array_figure("scores", "ld_requests"), lambda s: s["keys"],
                "read each score once (one request a key): when a score beats the maximum, multiply the sums so "
                "far by exp(old maximum - new maximum) instead of making a first pass for the maximum"),),
        "scores float32 (keys, rows), standard normal x 3; values float32 (keys, rows); out float32 (rows,)",
        "out = (softmax(scores, axis=0) * values).sum(axis=0)"),
    Exercise(
        4, "The page lookup", "A paged cache finds token t through its sequence's page table: page t // page_size, "
        "row t % page_size.",
        "Gather each sequence's keys out of a paged cache: out[b, t] = its token t for t < kvlens[b], zeros after.",
        skeletons.gather_pages, "one block of 32 threads per sequence",
        {"batch": 2, "pages": 3, "page_size": 4}, {"batch": 1, "pages": 1, "page_size": 1}, _make_pages, ("out",),
        _pages_reference, lambda x: x["out"].shape[0], ("k_cache", "cachestarts", "kvlens", "page_size", "out"),
        (Target("sectors per load request of k_cache", _sectors_per_load("k_cache"), lambda s: 4,
                "let the lane pick the dimension: one token's 32 floats are 4 sectors"),),
        "k_cache float32 (slots, 32), pages of page_size slots in shuffled order; cachestarts int64 (batch, pages): "
        "token offsets of each page, -1 past the sequence's last page; kvlens int64 (batch,); "
        "out float32 (batch, pages * page_size, 32)",
        "out[b, t] = k_cache[cachestarts[b, t // page_size] + t % page_size] for t < kvlens[b], else 0"),
    Exercise(
        5, "int8 dequantization", "An int8 cache stores codes and one scale per group of 8 dimensions: the value is "
        "code x scale, and a warp's 32 codes are one 32-byte sector.",
        "out[t, d] = k[t, d] * scale[t, d // 8] in float32.",
        skeletons.dequantize_int8, "1 block of 32 threads",
        {"tokens": 8}, {"tokens": 1}, _make_int8, ("out",),
        lambda x: {"out": x["k"].astype(np.float64) * np.repeat(x["scale"].astype(np.float64), 8, axis=1)},
        lambda x: 1, ("k", "scale", "out"),
        (Target("sectors per load request of k", _sectors_per_load("k"), lambda s: 1,
                "keep the lane on the dimension d: 32 int8 codes side by side are one sector"),),
        "k int8 (tokens, 32); scale float16 (tokens, 4), positive; out float32 (tokens, 32)",
        "out = k * scale[:, d // 8] (an int8 times a float16 is exact in float32)"),
    Exercise(
        6, "GQA sharing", f"With grouped-query attention {GROUP} query heads read the same key/value head: load "
        "each value row once and use it for all of them.",
        f"out[h] = sum_t probs[h, t] v[t, h // {GROUP}], one block per key/value head.",
        skeletons.gqa_values, "one block of 32 threads per key/value head",
        {"tokens": 8, "kv_heads": 2}, {"tokens": 1, "kv_heads": 1}, _make_gqa, ("out",), _gqa_reference,
        lambda x: x["v"].shape[1], ("probs", "v", "out"),
        (Target("load requests of v", _array_figure("v", "ld_requests"), lambda s: s["tokens"] * s["kv_heads"],
                f"load each value row once (one request a token and key/value head) and add it to all {GROUP} "
                "query heads of the group, each in its own accumulator"),),
        f"probs float32 (kv_heads * {GROUP}, tokens), rows summing to 1; v float32 (tokens, kv_heads, 32); "
        f"out float32 (kv_heads * {GROUP}, 32)",
        "out[h] = probs[h] @ v[:, h // GROUP]"),
    Exercise(
        7, "A split-K combine", "Splits of the keys each return a softmax-weighted output, their largest score and "
        "their sum; the whole softmax reweighs each split by exp(its maximum - the overall maximum) x its sum.",
        "Combine the splits' partial outputs into attention over all the keys, one block per head.",
        skeletons.combine_splits, "one block of 32 threads per head",
        {"splits": 3, "heads": 2, "keys_per_split": 5}, {"splits": 1, "heads": 1, "keys_per_split": 1},
        _make_splits, ("out",), _splits_reference, lambda x: x["out"].shape[0],
        ("partial_out", "partial_max", "partial_sum", "out"),
        (Target("load requests of partial_max", _array_figure("partial_max", "ld_requests"),
                lambda s: s["splits"] * s["heads"],
                "read each split's maximum once: keep a running maximum and rescale the sums when it grows "
                "(exercise 3's idea)"),),
        "partial_out float32 (splits, heads, 32); partial_max, partial_sum float32 (splits, heads), made from "
        "all_scores (heads, splits * keys_per_split), standard normal x 3, and all_values (splits * keys_per_split, "
        "32); out float32 (heads, 32)",
        "out[h] = softmax(all_scores[h]) @ all_values: attention over every key of every split"),
    Exercise(
        8, "A warp shuffle sum", "The 32 lanes of a warp can hand each other registers: five butterfly steps of "
        "cuda.shfl_xor_sync (lanes 16 apart, then 8, 4, 2, 1) leave the warp's sum in every lane, with no shared "
        "memory and no barrier.",
        "out[r, lane] = sum_d x[r, d] in every lane, one warp a row.",
        skeletons.warp_sum, "one block of 32 threads per row",
        {"rows": 4}, {"rows": 1}, _make_rows, ("out",), _rows_reference,
        lambda x: x["x"].shape[0], ("x", "out"),
        (Target("shared-memory requests and barriers", _shared_traffic, lambda s: 0,
                "sum in registers: v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset) for offset 16, 8, 4, 2, 1 needs "
                "neither shared memory nor a barrier"),),
        "x float32 (rows, 32); out float32 (rows, 32)",
        "out[r, :] = x[r].sum()"),
    Exercise(
        9, "Unpacking a 16-byte chunk", "One 16-byte load a lane (load16: four 32-bit words) brings 8 float16 in one "
        "instruction, where 8 two-byte loads take 8; the lane then unpacks the words in registers, low half first.",
        "out[t, d] = k[t, d] as float32 for a float16 k (tokens, 64): each lane loads 16-byte chunks of 8 halves, "
        "one load16 a chunk, and unpacks them with half_from_bits.",
        skeletons.unpack_halves, "1 block of 32 threads",
        {"tokens": 8}, {"tokens": 1}, _make_halves, ("out",),
        lambda x: {"out": x["k"].astype(np.float64)},
        lambda x: 1, ("k", "out"),
        (Target("load requests of k", _array_figure("k", "ld_requests"), lambda s: -(-s["tokens"] * 8 // 32),
                "load each chunk's 8 halves with one load16(k[t], 8 * j) (a warp's 32 chunks in one request) and "
                "unpack the four words with half_from_bits(word) and half_from_bits(word >> 16)"),),
        "k float16 (tokens, 64); out float32 (tokens, 64)",
        "out = k (float16 to float32 is exact)"),
    Exercise(
        10, "An mma fragment's position", "mma.sync.m16n8k16 spreads its 16x8 float32 accumulator over the 32 lanes of "
        "a warp, 4 elements a lane: the 4 lanes of a quad (lane // 4) share two rows 8 apart, and each holds two "
        "neighbouring columns of both. Knowing which lane holds what is how a kernel reads its scores out of a "
        "tensor-core tile.",
        "c_position(lane, e) = the (row, col) of element e (0..3) of lane's accumulator fragment.",
        skeletons.c_position, "none: a plain Python function, called for every lane 0..31 and element 0..3",
        {}, {}, lambda s, rng: {}, ("position",), _fragment_reference,
        lambda x: 1, ("lane", "e"), (),
        "lane 0..31; e 0..3",
        "the PTX ISA's fragment layout for mma.m16n8k16 (section 9.7.14.5.8), as kernels_numba._mma.c_position "
        "has it", function=True),
    Exercise(
        11, "A warp per key", "Rung 2's idea: instead of a thread walking a whole key out of a shared tile, the warp "
        "takes the key, a lane a dimension, in one coalesced load, and a shuffle butterfly sums the 32 products in "
        "registers: no tile, so no bank to conflict in and no barrier.",
        "scores[j] = sum_d q[d] k[j, d] for every key j, the warp on one key at a time.",
        skeletons.warp_scores, "1 block of 32 threads",
        {"keys": 40}, {"keys": 1}, _make_keys, ("scores",),
        lambda x: {"scores": x["k"].astype(np.float64) @ x["q"].astype(np.float64)},
        lambda x: 1, ("q", "k", "scores"),
        (Target("sectors per load request of k", _sectors_per_load("k"), lambda s: 4,
                "let the lane pick the dimension d of key j: the key's 32 floats side by side are 4 sectors"),
         Target("shared-memory requests and barriers", _shared_traffic_reading("k"), lambda s: 0,
                "keep the products in registers and sum them with cuda.shfl_xor_sync (exercise 8)")),
        "q float32 (32,); k float32 (keys, 32); scores float32 (keys,)",
        "scores = k @ q"),
    Exercise(
        12, "Split-K partials", "Rung 4's idea: split c of a sequence's keys goes to a block of its own, "
        "ceil(keys / splits) keys a split, so the last splits may get fewer or none. Each block writes its online-"
        "softmax state (m, l, O) unnormalised, and an empty split writes (-inf, 0, 0), which a combine weighs 0.",
        "For split c of head h's keys: partial_max[c, h] = m, partial_sum[c, h] = sum exp(s - m), "
        "partial_out[c, h] = sum exp(s - m) values[t], in one pass over the split's scores.",
        skeletons.split_partials, "a block of 32 threads per (split, head): grid (splits, heads)",
        {"keys": 10, "splits": 8, "heads": 2}, {"keys": 1, "splits": 1, "heads": 1}, _make_partials,
        ("partial_out", "partial_max", "partial_sum"), _partials_reference,
        lambda x: x["partial_max"].shape, ("scores", "values", "partial_out", "partial_max", "partial_sum"),
        (Target("load requests of scores", _array_figure("scores", "ld_requests"), lambda s: s["heads"] * s["keys"],
                "read each score once (exercise 3's running maximum): a split's keys are read by its block alone, "
                "so the heads x keys scores need as many requests"),),
        "scores float32 (heads, keys), standard normal x 3; values float32 (keys, 32); partial_out float32 "
        "(splits, heads, 32); partial_max, partial_sum float32 (splits, heads)",
        "split c takes keys [c per, min(keys, (c + 1) per)) with per = ceil(keys / splits); m its largest score "
        "(-inf when empty), l and O its sums against m (0 when empty)"),
)}
