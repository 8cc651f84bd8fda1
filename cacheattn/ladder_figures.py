"""Pictures of the kernel ladder's rungs (docs/rung-1.md .. rung-6.md), drawn from the kernels' own geometry.

Each picture reads the constants and layout functions of the kernel it shows: rung 1's tile plan, the warp
size and butterfly of `_warp`, the chunk sizes and lane groups of rungs 3 and 4, the mma fragment layouts of
`_mma`, the stage's store permutation of `_attention_mma` and rung 6's swizzle, so a change in a kernel changes
its picture.
The shapes are the first bench case's (`cacheattn.lab.cases.LAB_CASES`: 32 query heads over 8 kv heads,
head_dim 128). Cells carry `data-*` attributes (lane, bank, element), so the tests read a picture back.
The kernels are imported inside the functions: numba reads the simulator flag on its first import.
`figures()` returns {file name: SVG text}; `cacheattn.figures.figures` adds them to the site's figures.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from ._svg import PALETTE, Svg

BANKS = 32              # shared memory: 32 banks of 4-byte words (CUDA C++ Programming Guide, "Shared Memory")
CONFLICT, CLEAR, GRID = "#e15759", "#59a14f", "#dddddd"


def _lighter(colour: str) -> str:
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{(c + 255) // 2:02x}" for c in rgb)


def _case():
    from .lab.cases import LAB_CASES
    return LAB_CASES[0]


def _hue(k: int, n: int) -> str:
    return f"hsl({round(360 * k / max(n, 1))}, 55%, 62%)"


def wavefronts(words) -> int:
    """Wavefronts of one shared-memory request of 4-byte words: the bank holding the most distinct words."""
    return max(Counter(w % BANKS for w in set(words)).values())


# ---------------------------------------------------------------------------------------------------- rung 1
def tile_column_words(key_tile: int, row_words: int, d: int = 0) -> list[int]:
    """The word of k_s[j, d] that each lane of a warp reads in rung 1's step 3 (thread e takes query row
    e // key_tile and key j = e % key_tile, all at the same d), in a tile of rows of `row_words` float32 words."""
    from kernels_numba._warp import WARP_SIZE

    return [(lane % key_tile) * row_words + d for lane in range(WARP_SIZE)]


def rung1_banks() -> str:
    """The banks of one K-tile column as rung 1 reads it: rows of head_dim words (the kernel's k_s), and rows
    padded by one word. A cell (key j, bank) is filled where key j's word falls; red where a bank holds
    several of the column's words (each one more wavefront)."""
    from kernels_numba._attention_core import plan_tiles

    case = _case()
    dim = case.head_dim
    _, _, key_tile = plan_tiles(case.num_heads, case.num_kv_heads, case.new_tokens, dim, dim)
    svg, cell, left, top = Svg(), 9, 48, 72
    svg.text(4, 14, f"rung 1: one K-tile column k_s[j, 0], key tile {key_tile} x head_dim {dim} (float32 words)",
             bold=True)
    svg.text(4, 30, f"a warp reads key j = lane % {key_tile}, all at the same d: which bank each word falls in")
    panel = BANKS * cell + 44
    for p, (row_words, name) in enumerate(((dim, f"rows of {dim} words (the kernel)"),
                                           (dim + 1, f"rows of {dim + 1} words (padded by 1)"))):
        x0 = left + p * (panel + 24)
        words = tile_column_words(key_tile, row_words)
        per_bank = Counter(w % BANKS for w in set(words))
        svg.text(x0, top - 20, name, bold=True)
        for b in range(0, BANKS, 4):
            svg.text(x0 + b * cell + cell / 2, top - 4, b, anchor="middle")
        svg.text(x0 + BANKS * cell + 4, top - 4, "bank")
        svg.rect(x0, top, BANKS * cell, key_tile * cell, "#fff")
        for k in range(1, BANKS):
            svg.plain_line(x0 + k * cell, top, x0 + k * cell, top + key_tile * cell, GRID, 0.5)
        for j in range(key_tile):
            if j % 4 == 0:
                svg.text(x0 - 4, top + j * cell + cell - 1, j, anchor="end")
            bank = (j * row_words) % BANKS
            svg.cell(x0 + bank * cell, top + j * cell, cell, cell, CONFLICT if per_bank[bank] > 1 else CLEAR,
                     figure="rung1", row_words=row_words, key=j, bank=bank)
        waves = wavefronts(words)
        y = top + key_tile * cell + 16
        most = max(per_bank.values())
        svg.text(x0, y, f"{most} word{'s' * (most > 1)} in the busiest bank: {waves} wavefront{'s' * (waves > 1)},")
        svg.text(x0, y + 15, f"{waves - 1} bank conflicts a request")
    svg.text(4, top - 4, "key j")
    return svg.render()


# ---------------------------------------------------------------------------------------------------- rung 2
def butterfly(lanes: int, first: int = 1) -> list[tuple[int | None, list[frozenset]]]:
    """The lanes whose values each lane has combined after each round of `_warp.xor_reduce(x, ..., first,
    lanes)` on a GPU: a round adds the value of lane ^ offset, offset = first, 2 first, ... below `lanes`.
    [(offset, sets)], the first entry (None, each lane alone)."""
    sets = [frozenset([lane]) for lane in range(lanes)]
    rounds: list[tuple[int | None, list[frozenset]]] = [(None, sets)]
    offset = first
    while offset < lanes:
        sets = [sets[lane] | sets[lane ^ offset] for lane in range(lanes)]
        rounds.append((offset, sets))
        offset *= 2
    return rounds


def _mask(lanes: frozenset) -> str:
    return hex(sum(1 << lane for lane in lanes))


def rung2_butterfly() -> str:
    """`warp_sum` as rung 2 runs it: the shfl_xor rounds over a warp, each lane's count of lanes summed, and the
    warps' online-softmax states merged through shared memory."""
    import inspect

    from kernels_numba._warp import WARP_SIZE
    from kernels_numba.standalone import rung2

    rounds = butterfly(WARP_SIZE)
    offsets = [offset for offset, _ in rounds[1:]]
    svg, cell, left, top, gap = Svg(), 19, 62, 40, 36
    svg.text(4, 14, f"rung 2: warp_sum over {WARP_SIZE} lanes, {len(offsets)} rounds of shfl_xor "
                    f"(offsets {', '.join(map(str, offsets))})", bold=True)
    for lane in range(WARP_SIZE):
        svg.text(left + lane * cell + cell / 2, top - 4, lane, anchor="middle")
    svg.text(4, top - 4, "lane")
    for r, (offset, sets) in enumerate(rounds):
        y = top + r * (cell + gap)
        svg.text(4, y + cell / 2 + 4, "own q·k" if offset is None else f"xor {offset}")
        for lane, lanes in enumerate(sets):
            shade = _lighter(PALETTE[0]) if (min(lanes) // len(lanes)) % 2 == 0 else _lighter(_lighter(PALETTE[0]))
            svg.cell(left + lane * cell, y, cell, cell, shade, len(lanes), text_fill="#000",
                     figure="rung2", round=r, lane=lane, lanes=_mask(lanes))
            if offset is not None:                       # the partner's value arrives from the row above
                partner = lane ^ offset
                svg.plain_line(left + partner * cell + cell / 2, y - gap, left + lane * cell + cell / 2, y,
                               PALETTE[(r - 1) % len(PALETTE)], 0.8)
    y = top + len(rounds) * (cell + gap) - gap + 16
    svg.text(4, y, "a cell: how many lanes' partial dot products it holds; after the last round every lane has the "
                   "whole q·k")
    warps = inspect.signature(rung2.attention).parameters["threads"].default // WARP_SIZE
    box_w, box_top = (WARP_SIZE * cell + left - 4 - (warps - 1) * 10) / warps, y + 22
    for w in range(warps):
        bx = 4 + w * (box_w + 10)
        svg.rect(bx, box_top, box_w, 38, _lighter(PALETTE[(w + 1) % len(PALETTE)]))
        keys = ", ".join(str(w + k * warps) for k in range(2))
        svg.text(bx + 6, box_top + 15, f"warp {w}: keys {keys}, …")
        svg.text(bx + 6, box_top + 31, f"its own (m{w}, l{w}, o{w})")
        svg.line(bx + box_w / 2, box_top + 40, bx + box_w / 2, box_top + 70)
    svg.rect(4, box_top + 72, warps * (box_w + 10) - 10, 38, "#fff")
    svg.text(12, box_top + 87, f"merge of the {warps} warps (threads={warps * WARP_SIZE}) through shared memory:")
    svg.text(12, box_top + 103, "M = max m_w, L = Σ e^(m_w − M) l_w, O = Σ e^(m_w − M) o_w / L")
    return svg.render()


# ---------------------------------------------------------------------------------------------------- rung 3
FORMATS = (("float16", 0, np.float16, 16), ("int8", 8, np.int8, 8), ("int4", 4, np.int8, 4))


def row_chunks(head_dim: int, quant_bit: int, dtype, bits: int, rung: int = 3) -> dict:
    """How rung 3's lane group covers one K row: the chunk size `_cache.chunk_elements` gives, the group's lanes
    (`lanes_per_key`) and, per chunk c, the lane that loads it (lane l takes chunks l, l + lanes, ...) and its
    bytes [lo, hi) in the row."""
    from kernels_numba._attention_vector import lanes_per_key
    from kernels_numba._cache import chunk_elements

    elements = chunk_elements(quant_bit, dtype, rung)
    nbytes = elements * bits // 8
    chunks = -(-head_dim // elements)
    lanes = lanes_per_key(chunks)
    return {"elements": elements, "bytes": nbytes, "lanes": lanes, "row_bytes": head_dim * bits // 8,
            "chunks": [(c % lanes, c * nbytes, min((c + 1) * nbytes, head_dim * bits // 8)) for c in range(chunks)]}


def halving(lanes: int, per: int = 1) -> list[tuple[int | None, list[list[tuple[int, frozenset]]]]]:
    """`_warp.transpose_sum`'s butterfly on a GPU, round by round: each lane's values as (entry, the lanes
    summed into it). A round with `half` keeps the upper half of the values in the lanes whose bit `half` is set
    (the lower half in the others) and adds the partner's (lane ^ half) copy of the same entries; at the end lane
    n holds entries n * per .. n * per + per - 1, summed over the group."""
    held = [[(k, frozenset([lane])) for k in range(lanes * per)] for lane in range(lanes)]
    rounds: list = [(None, held)]
    half = lanes // 2
    while half >= 1:
        keep = []
        for lane in range(lanes):
            partner = held[lane ^ half]
            upper = lane & half != 0
            values = []
            for k in range(half * per):
                entry, mine = held[lane][k + half * per] if upper else held[lane][k]
                other_entry, other = partner[k + half * per] if upper else partner[k]
                assert entry == other_entry
                values.append((entry, mine | other))
            keep.append(values)
        held = keep
        rounds.append((half, held))
        half //= 2
    return rounds


def rung3_vector() -> str:
    """Rung 3's lane groups: which lane loads which bytes of a K row for each cache format, and the butterfly
    that halves the group's partial sums until lane n holds logit n (int8's group)."""
    from kernels_numba._attention_vector import _pow2, keys_per_tile, plan_vector_rows
    from kernels_numba._warp import WARP_SIZE

    case = _case()
    dim = case.head_dim
    layouts = {name: row_chunks(dim, qb, dtype, bits) for name, qb, dtype, bits in FORMATS}
    scale = 600 / max(lay["row_bytes"] for lay in layouts.values())      # px a byte
    svg, left, top = Svg(), 64, 44
    svg.text(4, 14, f"rung 3: one K row of head_dim {dim}, and the lane of its group that loads each chunk",
             bold=True)
    for b in range(0, layouts["float16"]["row_bytes"] + 1, 32):
        svg.text(left + b * scale, top - 6, b, anchor="middle")
    svg.text(left + layouts["float16"]["row_bytes"] * scale + 14, top - 6, "byte")
    y = top
    for name, lay in layouts.items():
        svg.text(4, y + 16, name, bold=True)
        for lane, lo, hi in lay["chunks"]:
            svg.cell(round(left + lo * scale, 1), y, round((hi - lo) * scale, 1), 22, _hue(lane, lay["lanes"]),
                     lane, figure="rung3", format=name, lane=lane, lo=lo, hi=hi)
        svg.text(left, y + 36, f"{lay['elements']} {name} = {lay['bytes']} bytes a load, {lay['lanes']} lanes a key, "
                               f"{WARP_SIZE // lay['lanes']} keys a warp at once")
        y += 54
    # the halving inside a group: int8's, whose lanes each finish one (row slot, key) logit
    name, qb, dtype, bits = FORMATS[1]
    chunk, lanes = layouts[name]["elements"], layouts[name]["lanes"]
    heads, q_tile = plan_vector_rows(case.num_heads, case.num_kv_heads, case.new_tokens, dim, chunk, 4)
    tile = keys_per_tile(dim, chunk)
    slots = max(_pow2(heads * q_tile), lanes // tile)
    per = slots * tile // lanes
    rounds = halving(lanes, per)
    y += 8
    svg.text(4, y, f"{name}: the {lanes} lanes of a group sum their partial q·k of {slots} row slots x {tile} keys "
                   f"(transpose_sum)", bold=True)
    cell, gap, x0, y0 = 15, 26, 52, y + 40
    count = lanes * per
    for r, (half, held) in enumerate(rounds):
        px = x0 + r * (lanes * cell + gap)
        svg.text(px, y0 - 20, "start" if half is None else f"xor {half}: keep half")
        for lane in range(lanes):
            svg.text(px + lane * cell + cell / 2, y0 - 4, lane, anchor="middle")
        for lane, values in enumerate(held):
            have = dict(values)
            for k in range(count):
                summed = have.get(k)
                svg.cell(px + lane * cell, y0 + k * cell, cell, cell,
                         "#fff" if summed is None else _hue(k, count), "" if summed is None else len(summed),
                         figure="rung3-sum", round=r, lane=lane, entry=k,
                         lanes=_mask(summed) if summed is not None else "")
    svg.text(4, y0 - 4, "lane")
    for k in range(count):
        svg.text(x0 - 4, y0 + k * cell + cell - 3, f"s{k // tile} k{k % tile}" if per == 1 else k, anchor="end")
    yb = y0 + count * cell + 16
    svg.text(4, yb, "a cell: the lanes summed into that (row slot s, key k) value; at the end lane n holds logit n")
    return svg.render()


# ---------------------------------------------------------------------------------------------------- rung 4
def combine(maxes, sums, outs):
    """The splits' softmax states (m_c, l_c, o_c) merged as `_split_k.combine_kernel` does: M = max m_c,
    L = sum e^(m_c - M) l_c, O = sum e^(m_c - M) o_c / L over the splits that saw a key (m_c > -inf);
    (M, L, O), with L = O = 0 when none did."""
    big_m = max(maxes)
    if big_m == -math.inf:
        return big_m, 0.0, 0.0
    weights = [math.exp(m - big_m) if m != -math.inf else 0.0 for m in maxes]
    total = sum(w * s for w, s in zip(weights, sums))
    return big_m, total, sum(w * o for w, o in zip(weights, outs)) / total


def split_example(kvlen: int = 10, num_splits: int = 3, seed: int = 4) -> dict:
    """A worked example of split-K on one query row and one output element: keys' scores s and values v (one
    decimal, so a reader can redo it), each split's (m, l, o) over its share of the keys (ceil(kvlen /
    num_splits) each, as rung 4's blocks take them), the combine, and softmax over all the keys at once."""
    rng = np.random.default_rng(seed)
    s = [round(float(x), 1) + 0.0 for x in rng.normal(0.0, 1.5, kvlen)]      # + 0.0: no "-0"
    v = [round(float(x), 1) + 0.0 for x in rng.normal(0.0, 1.0, kvlen)]
    per = -(-kvlen // num_splits)
    splits = []
    for c in range(num_splits):
        lo, hi = min(c * per, kvlen), min((c + 1) * per, kvlen)
        m = max(s[lo:hi], default=-math.inf)
        p = [math.exp(x - m) for x in s[lo:hi]]
        splits.append({"keys": (lo, hi), "m": m, "l": sum(p), "o": sum(pi * vi for pi, vi in zip(p, v[lo:hi]))})
    big_m, big_l, out = combine([x["m"] for x in splits], [x["l"] for x in splits], [x["o"] for x in splits])
    p = np.exp(np.array(s, np.float64) - max(s))
    return {"s": s, "v": v, "splits": splits, "M": big_m, "L": big_l, "O": out,
            "direct": float(p @ np.array(v, np.float64) / p.sum())}


def rung4_combine() -> str:
    """The worked split-K example as a picture: three blocks' partial states and the combine."""
    ex = split_example()
    svg, box_w, top = Svg(), 214, 44
    n = len(ex["splits"])
    svg.text(4, 14, f"rung 4: one query row over {len(ex['s'])} keys in {n} splits; each block leaves (m, l, o)",
             bold=True)
    svg.text(4, 30, "s: the keys' scores q·k·scale, v: their values (one element of head_dim)")
    weights = [math.exp(x["m"] - ex["M"]) for x in ex["splits"]]
    for c, x in enumerate(ex["splits"]):
        lo, hi = x["keys"]
        bx, colour = 4 + c * (box_w + 12), PALETTE[c % len(PALETTE)]
        svg.rect(bx, top, box_w, 104, _lighter(colour))
        svg.text(bx + 6, top + 15, f"split {c}: keys {lo}..{hi - 1}", bold=True)
        svg.text(bx + 6, top + 31, "s " + " ".join(f"{a:g}" for a in ex["s"][lo:hi]))
        svg.text(bx + 6, top + 47, "v " + " ".join(f"{a:g}" for a in ex["v"][lo:hi]))
        svg.text(bx + 6, top + 63, f"m{c} = max s = {x['m']:g}")
        svg.text(bx + 6, top + 79, f"l{c} = Σ e^(s − m{c}) = {x['l']:.4f}")
        svg.text(bx + 6, top + 95, f"o{c} = Σ e^(s − m{c}) v = {x['o']:.4f}")
        svg.items.append(f"<g data-figure='rung4' data-split='{c}' data-m='{x['m']!r}' data-l='{x['l']!r}' "
                         f"data-o='{x['o']!r}'/>")
        svg.line(bx + box_w / 2, top + 106, bx + box_w / 2, top + 134)
    cy, width = top + 136, n * (box_w + 12) - 12
    svg.rect(4, cy, width, 88, "#fff")
    svg.text(12, cy + 15, f"combine: M = max m_c = {ex['M']:g};  e^(m_c − M) = "
                          + ", ".join(f"{w:.4f}" for w in weights), bold=True)
    svg.text(12, cy + 33, "L = Σ e^(m_c − M) l_c = " + " + ".join(f"{w:.4f}·{x['l']:.4f}"
                                                                  for w, x in zip(weights, ex["splits"]))
             + f" = {ex['L']:.4f}")
    svg.text(12, cy + 51, "O = Σ e^(m_c − M) o_c / L = " + f"{ex['O']:.6f}")
    svg.text(12, cy + 69, f"softmax over all {len(ex['s'])} keys at once:  {ex['direct']:.6f}  (the same, to rounding)")
    svg.items.append(f"<g data-figure='rung4-combine' data-m='{ex['M']!r}' data-l='{ex['L']!r}' "
                     f"data-o='{ex['O']!r}'/>")
    return svg.render()


# ---------------------------------------------------------------------------------------------------- rung 5
def stage_stores(head_dim: int, permuted: bool = True) -> list[list[int]]:
    """The bank each lane of a warp's first K staging chunk (`_attention_mma`'s stage_k, float16 cache) writes at
    its j-th word store: lane l stages chunk l % chunks of key l // chunks into rows of words + 4, storing word
    j ^ masks[l] (`store_masks`) at its j-th store, or word j unpermuted. [j][lane] -> bank."""
    from kernels_numba._attention_mma import stage_shape, store_masks
    from kernels_numba._cache import chunk_elements
    from kernels_numba._warp import WARP_SIZE

    chunk = chunk_elements(0, np.float16, 5)
    words = stage_shape(head_dim, head_dim, 1, 1)[1]
    row_words, chunk_words = words + 4, chunk // 2          # K_ROW: rows padded by 4 words, as the kernel's
    chunks = -(-2 * words // chunk)
    masks, _ = store_masks(row_words, chunk_words, chunks)
    return [[(lane // chunks * row_words + lane % chunks * chunk_words + (j ^ int(masks[lane]) if permuted else j))
             % BANKS for lane in range(WARP_SIZE)] for j in range(chunk_words)]


def rung5_fragments() -> str:
    """The m16n8k16 fragments of rung 5: the two 16x8 C tiles of S (`c_position`) and P as the 16x16 A operand of
    P·V (`a_position`), each cell labelled with the lane that holds it; then the bank each lane's K staging
    store hits, with and without `store_masks`' permutation."""
    from kernels_numba._mma import MMA_K, MMA_M, MMA_N, a_position, c_position
    from kernels_numba._warp import WARP_SIZE

    svg, cell, top = Svg(), 18, 64
    svg.text(4, 14, f"rung 5: S = Q Kᵀ as two {MMA_M}x{MMA_N} accumulator tiles is P·V's {MMA_M}x{MMA_K} A operand, "
                    "lane for lane", bold=True)
    from_tile = [sorted({i for i in range(8) if a_position(0, i)[1] // MMA_N == t}) for t in range(MMA_K // MMA_N)]
    svg.text(4, 30, f"a cell: the lane holding it; blue: S tile 0 = a{from_tile[0][0]}-a{from_tile[0][-1]}, "
                    f"orange: tile 1 = a{from_tile[1][0]}-a{from_tile[1][-1]} of the lane; pale: rows 8-15")
    tiles = MMA_K // MMA_N
    x_tiles = [34 + t * (MMA_N * cell + 10) for t in range(tiles)]
    x_a = x_tiles[-1] + MMA_N * cell + 64

    def fill(tile, row):
        colour = _lighter(PALETTE[tile % len(PALETTE)])
        return colour if row < MMA_M // 2 else _lighter(colour)

    for t, x0 in enumerate(x_tiles):
        svg.text(x0, top - 20, f"S tile {t}: keys {t * MMA_N}-{t * MMA_N + MMA_N - 1}")
        for col in range(MMA_N):
            svg.text(x0 + col * cell + cell / 2, top - 4, col, anchor="middle")
        for lane in range(WARP_SIZE):
            for i in range(4):
                row, col = c_position(lane, i)
                svg.cell(x0 + col * cell, top + row * cell, cell, cell, fill(t, row), lane,
                         figure="rung5-c", tile=t, lane=lane, element=i, row=row, col=col)
    for row in range(MMA_M):
        svg.text(x_tiles[0] - 4, top + row * cell + cell - 5, row, anchor="end")
    svg.text(4, top - 4, "row")
    svg.line(x_tiles[-1] + MMA_N * cell + 8, top + MMA_M * cell / 2, x_a - 8, top + MMA_M * cell / 2)
    svg.text(x_a, top - 20, f"P as the A operand ({MMA_M}x{MMA_K}, k = key)")
    for col in range(0, MMA_K):
        svg.text(x_a + col * cell + cell / 2, top - 4, col, anchor="middle")
    for lane in range(WARP_SIZE):
        for i in range(8):
            row, col = a_position(lane, i)
            svg.cell(x_a + col * cell, top + row * cell, cell, cell, fill(col // MMA_N, row), lane,
                     figure="rung5-a", lane=lane, element=i, row=row, col=col)
    for row in range(MMA_M):
        svg.text(x_a + MMA_K * cell + 4, top + row * cell + cell - 5, row)
    # the stage's bank map
    dim = _case().head_dim
    y = top + MMA_M * cell + 30
    svg.text(4, y, f"K staging, float16, head_dim {dim}: the bank each lane's word store hits (lane in the cell)",
             bold=True)
    x0, bcell = 84, 19
    for b in range(BANKS):
        svg.text(x0 + b * bcell + bcell / 2, y + 16, b, anchor="middle")
    svg.text(4, y + 16, "bank")
    rows = [("unpermuted", 0, stage_stores(dim, permuted=False)[0])]
    rows += [(f"store {j}", j, banks) for j, banks in enumerate(stage_stores(dim))]
    for r, (label, j, banks) in enumerate(rows):
        yy = y + 22 + r * (bcell + 4)
        svg.text(4, yy + bcell / 2 + 4, label)
        lanes_at = _by_bank(banks)
        for b in range(BANKS):
            here = lanes_at.get(b, [])
            fill_b = "#fff" if not here else CONFLICT if len(here) > 1 else _hue(here[0], WARP_SIZE)
            svg.cell(x0 + b * bcell, yy, bcell, bcell, fill_b, "" if not here else
                     here[0] if len(here) == 1 else f"×{len(here)}", figure="rung5-stage",
                     permuted=int(label != "unpermuted"), store=j, bank=b, lanes=" ".join(map(str, here)))
    yy = y + 22 + len(rows) * (bcell + 4) + 12
    shared = max(len(v) for v in _by_bank(rows[0][2]).values())
    fewest = min(len(_by_bank(banks)) for _, _, banks in rows[1:])
    svg.text(4, yy, f"unpermuted: {shared} lanes a bank (red), {shared} wavefronts a store; with store_masks: "
                    f"{fewest} banks a store")
    return svg.render()


def rung6_stage(head_dim: int = 128) -> str:
    """Rows 0-7 of a rung 6 K tile in shared memory, unswizzled and swizzled (`standalone.rung6.swizzled`): each
    16-byte slot labelled with the chunk of the row it holds; the slots of chunk 0, which one 8x8 matrix of an
    ldmatrix reads (one 16-byte row address a lane), outlined in colour, with the banks they fall in."""
    from kernels_numba.standalone.rung6 import E, swizzled

    chunks, row_words, slot = head_dim // E, head_dim // 2, 26
    svg = Svg()
    svg.text(4, 14, f"rung 6: a K tile in shared memory, head_dim {head_dim} ({chunks} chunks of 16 bytes a row): "
                    "where ldmatrix's 8 rows of chunk 0 fall", bold=True)
    svg.text(4, 30, "a cell: the chunk of the row stored in that slot; coloured: chunk 0, the bank group (4 banks) "
                    "it falls in")
    y = 50
    for swizzle in (False, True):
        title = "swizzled: chunk c of row r in slot c ^ (r % 8)" if swizzle else "unswizzled: chunk c in slot c"
        svg.text(4, y, title, bold=True)
        y += 8
        for s_ in range(chunks):
            svg.text(60 + s_ * slot + slot / 2, y + 10, s_, anchor="middle")
        svg.text(4, y + 10, "slot")
        groups = set()
        for row in range(8):
            yy = y + 16 + row * (slot - 6)
            svg.text(4, yy + 14, f"row {row}")
            for s_ in range(chunks):
                chunk = next(c for c in range(chunks) if (swizzled(row, c, chunks) if swizzle else c) == s_)
                bank = (row * row_words + 4 * s_) % BANKS
                if chunk == 0:
                    groups.add(bank // 4)
                svg.cell(60 + s_ * slot, yy, slot, slot - 6, _hue(bank // 4, 8) if chunk == 0 else "#f4f4f4", chunk,
                         figure="rung6-stage", swizzled=int(swizzle), row=row, slot=s_, chunk=chunk, bank=bank)
        y += 16 + 8 * (slot - 6) + 16
        svg.text(4, y, f"chunk 0 of rows 0-7: banks {', '.join(f'{4 * g}-{4 * g + 3}' for g in sorted(groups))}: "
                       f"{'one wavefront' if len(groups) == 8 else f'{8 // len(groups)} wavefronts'} "
                       f"({'conflict-free' if len(groups) == 8 else f'{8 // len(groups)}-way conflict'})")
        y += 30
    return svg.render()


def _by_bank(banks) -> dict:
    """{bank: the lanes whose store hits it} from [lane] -> bank."""
    out: dict = {}
    for lane, bank in enumerate(banks):
        out.setdefault(bank, []).append(lane)
    return out


# ------------------------------------------------------------------------------------------- the whole ladder
LADDER_CASES = ("decode B64 ctx4096 paged fp16", "prefill B1 4096 tokens fp16")   # the headline decode, 4k prefill
IDEAS = {"1": "a shared K/V tile", "2": "a warp per key", "3": "16-byte chunks", "4": "split-K",
         "5": "tensor cores", "6": "cp.async, ldmatrix"}
# One colour per resource, the same in both panels, so a rung that changes what binds it changes colour.
TERM_COLOURS = {"DRAM": "#4e79a7", "issue": "#f28e2b", "shared": "#e15759", "latency": "#b07aa1",
                "waves": "#76b7b2", "LSU": "#59a14f", "FMA": "#edc948"}
NEXT_TERMS = 2


def case_floor_us(case: dict) -> float:
    """The floor under a bench case (its fields as a lab run records them), in µs on an H100 SXM: what any kernel
    needs, the bytes at the achievable bandwidth, and a prefill's FLOPs at the tensor cores' dense peak (wgmma's;
    the ladder's mma.sync is charged less in the rungs' bounds). Derived, never timed."""
    from . import bounds
    from .lab import cases

    machine, bench = bounds.H100_SXM, cases.BenchCase(**case)
    floor_us = bench.floor_bytes / machine.hbm_bytes_per_s * 1e6
    if bench.new_tokens > 1:
        floor_us = max(floor_us, bench.flops / 4096 / (machine.wgmma_per_clock * machine.sms * machine.clock_hz) * 1e6)
    return floor_us


def ladder_terms(run: dict, labels=LADDER_CASES) -> str:
    """Each rung's binding term and the next NEXT_TERMS terms of its lower bound (`bounds['limited by']`, then
    `bounds['then']`) on each of `labels`' bench cases of a lab run (docs/kernel-ladder-counts.json), as bars on
    a log scale of µs, with the case's floor (`case_floor_us`) as a line. Derived from counts, never
    timed."""

    svg, left, width, bar, gap = Svg(), 214, 440, 11, 2
    svg.text(4, 14, "What bounds each rung, and what would bind next: lower bounds on an H100 SXM (derived from "
                    "counts, not timed)", bold=True)
    svg.text(4, 30, "per rung: the binding term (dark, bold) and the next two (pale); log scale; "
                    "dashed: the case's floor")
    y = 46
    for label in labels:
        case = run["cases"][label]
        floor_us = case_floor_us(case["case"])
        shown = {rung: [(b["limited by"], b[f"{b['limited by']} µs (derived)"])]
                 + [(t, b[f"{t} µs (derived)"]) for t in b["then"][:NEXT_TERMS]]
                 for rung, b in ((rung, r["bounds"]) for rung, r in case["rungs"].items())}
        values = [us for terms in shown.values() for _, us in terms] + [floor_us]
        lo, hi = 10 ** math.floor(math.log10(min(values))), 10 ** math.ceil(math.log10(max(values)))

        def x(us, lo=lo, hi=hi):
            return round(left + width * math.log10(us / lo) / math.log10(hi / lo), 1)

        svg.text(4, y + 12, f"{label}: floor ≥ {floor_us:,.1f} µs", bold=True)
        y += 20
        top, under = y, len(svg.items)          # the decades' lines go under the bars
        for rung, terms in shown.items():
            svg.text(4, y + bar + 6, f"rung {rung}: {IDEAS.get(rung, '')}")
            for k, (term, us) in enumerate(terms):
                colour = TERM_COLOURS.get(term, "#bab0ac")
                svg.cell(left, y, max(1.0, x(us) - left), bar, colour if k == 0 else _lighter(colour),
                         figure="ladder-terms", case=label, rung=rung, rank=k, term=term, us=us)
                svg.text(x(us) + 4, y + bar - 2, f"{term} ≥ {us:,.1f} µs" + (" (bound)" if k == 0 else ""),
                         bold=k == 0)
                y += bar + gap
            y += 6
        decade, grid = lo, Svg()
        while decade <= hi:
            grid.plain_line(x(decade), top - 2, x(decade), y, GRID)
            svg.text(x(decade), y + 12, f"{decade:g} µs" if decade < 1000 else f"{decade / 1000:g} ms",
                     anchor="middle")
            decade *= 10
        svg.items[under:under] = grid.items
        svg.plain_line(x(floor_us), top - 4, x(floor_us), y, "#333", 1.5)
        svg.items[-1] = svg.items[-1].replace("/>", f" stroke-dasharray='4 3' data-figure='ladder-floor' "
                                                    f"data-case='{label}' data-us='{floor_us}'/>")
        y += 30
    return svg.render()


def figures() -> dict[str, str]:
    """{file name: SVG text} of the rung pages' pictures."""
    return {"rung-1-banks.svg": rung1_banks(), "rung-2-butterfly.svg": rung2_butterfly(),
            "rung-3-chunks.svg": rung3_vector(), "rung-4-combine.svg": rung4_combine(),
            "rung-5-fragments.svg": rung5_fragments(), "rung-6-stage.svg": rung6_stage()}
