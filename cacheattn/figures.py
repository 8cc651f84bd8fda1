"""SVG pictures for the docs site, drawn from the same rules the references use (no plotting library).

`write_all(directory)` writes every figure; the mkdocs hook (cacheattn/_site_hooks.py) calls it
before each build, so a picture can never disagree with the code. The figures are git-ignored.
Each figure function returns the SVG text, so a docs page or a test can also look at it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ._svg import PALETTE, Svg

CELL = 22                   # side of one grid cell, px
HIDDEN, EMPTY, SINK = "#eeeeee", "#ffffff", "#9c755f"
# The GPU bench run the kernel-ladder page plots, once a session with a GPU commits one.
BENCH_RUN = Path(__file__).resolve().parents[1] / "docs" / "bench" / "bench.json"
# The lab's counted run (python -m cacheattn lab --write), whose derived bounds the kernel-ladder page plots.
LAB_RUN = Path(__file__).resolve().parents[1] / "docs" / "kernel-ladder-counts.json"


def visibility(visible: np.ndarray, title: str, *, row_label="query i", col_label="key j") -> str:
    """A (rows, cols) boolean mask: filled where query row i sees key j."""
    svg, left, top = Svg(), 70, 54
    svg.text(4, 14, title, bold=True)
    svg.text(left, top - 18, col_label)
    for j in range(visible.shape[1]):
        svg.text(left + j * CELL + CELL / 2, top - 4, j, anchor="middle")
    for i, row in enumerate(visible):
        svg.text(left - 8, top + i * CELL + CELL / 2 + 4, f"{row_label.split()[-1]}={i}", anchor="end")
        for j, seen in enumerate(row):
            svg.rect(left + j * CELL, top + i * CELL, CELL, CELL, PALETTE[0] if seen else HIDDEN)
    return svg.render()


def causal_masks(seqlen: int = 3, kvlen: int = 7) -> tuple[str, str]:
    """OpenPPL's bottom-right causal (query i sees j <= kvlen - seqlen + i: the new tokens follow the cached
    ones) and ONNX's top-left one without past (query i sees j <= i), for the same shapes."""
    i, j = np.arange(seqlen)[:, None], np.arange(kvlen)[None, :]
    bottom_right = visibility(j <= kvlen - seqlen + i, f"OpenPPL causal, seqlen {seqlen}, kvlen {kvlen}: bottom-right")
    top_left = visibility(j <= i, f"ONNX is_causal=1 without past, {seqlen} x {kvlen}: top-left")
    return bottom_right, top_left


def causal_ranges(seqlen: int = 4, kvlen: int = 10, window: int = 5, sinks: int = 2) -> str:
    """The keys a step's new tokens see, side by side: causal (bottom-right: new token i is at position
    kvlen - seqlen + i), then with a sliding window, then with sink tokens in the window; TensorRT-LLM's rule
    (`reference.trtllm_gpt_attention.visible_keys`). Keys in the future are white; keys in the past the window
    leaves out are grey."""
    from reference.trtllm_gpt_attention import CAUSAL, SLIDING_WINDOW_CAUSAL, visible_keys

    positions = np.arange(kvlen - seqlen, kvlen)
    panels = [("causal", visible_keys(positions, kvlen, mask_type=CAUSAL, window=kvlen, sinks=0, dense=True)),
              (f"window {window}", visible_keys(positions, kvlen, mask_type=SLIDING_WINDOW_CAUSAL, window=window,
                                                sinks=0, dense=False)),
              (f"window {window}, {sinks} sinks", visible_keys(positions, kvlen, mask_type=SLIDING_WINDOW_CAUSAL,
                                                               window=window, sinks=sinks, dense=False))]
    svg, top, label_w, gap = Svg(), 68, 62, 36
    svg.text(4, 14, f"{seqlen} new tokens after {kvlen - seqlen} cached ones: the keys each sees", bold=True)
    for n, (title, visible) in enumerate(panels):
        left = label_w + n * (label_w + kvlen * CELL + gap)
        svg.text(left, top - 30, title, bold=True)
        svg.text(left - 6, top - 6, "key j", anchor="end")
        for j in range(kvlen):
            svg.text(left + j * CELL + CELL / 2, top - 6, j, anchor="middle")
        for i, row in enumerate(visible):
            p = int(positions[i])
            svg.text(left - 6, top + i * CELL + CELL / 2 + 4, f"p={p}", anchor="end")
            for j, seen in enumerate(row):
                fill = (SINK if j < sinks and "sinks" in title else PALETTE[0]) if seen else \
                    HIDDEN if j <= p else EMPTY
                svg.rect(left + j * CELL, top + i * CELL, CELL, CELL, fill, seen=int(seen))
    svg.text(4, top + seqlen * CELL + 20, "blue: seen; brown: a sink, seen; grey: past, outside the window; "
             "white: future", fill="#555")
    return svg.render()


def page_table(cachestarts: np.ndarray, kvlens, page_size: int, max_t: int) -> str:
    """Each request's logical pages (top) and where its page table puts them among the cache's MaxT slots
    (bottom); entries are token offsets into MaxT, as in OpenPPL's cache_mode 1."""
    svg, left = Svg(), 80
    svg.text(4, 14, f"paged cache: page_size {page_size}, MaxT {max_t}; cachestarts[b, p] = first slot of page p",
             bold=True)
    slots_top = 40 + len(kvlens) * (CELL + 10) + 30
    for b, kvlen in enumerate(kvlens):
        y = 36 + b * (CELL + 10)
        svg.text(4, y + CELL / 2 + 4, f"request {'abcdef'[b]}")
        for t in range(kvlen):
            page, row = divmod(t, page_size)
            x = left + (page * (page_size + 1) + row) * CELL
            svg.rect(x, y, CELL, CELL, PALETTE[b], f"{t}", text_fill="#fff")
            if row == 0:
                slot = int(cachestarts[b, page])
                svg.line(x + CELL / 2, y + CELL, left + slot * CELL + CELL / 2, slots_top - 2, PALETTE[b])
    owner = {}
    for b, kvlen in enumerate(kvlens):
        for t in range(kvlen):
            owner[int(cachestarts[b, t // page_size]) + t % page_size] = (b, t)
    svg.text(4, slots_top + CELL / 2 + 4, "cache slot")
    for s in range(max_t):
        b, t = owner.get(s, (None, None))
        svg.rect(left + s * CELL, slots_top, CELL, CELL, EMPTY if b is None else PALETTE[b],
                 "" if b is None else f"{'abcdef'[b]}{t}", text_fill="#fff")
        if s % page_size == 0:
            svg.text(left + s * CELL + 2, slots_top + CELL + 14, s)
    return svg.render()


def memory_order(axes: str, extents: dict, count: int, title: str) -> str:
    """The first `count` elements of a cache with named axes in memory order, coloured K / V, labelled by token.
    Shows what a layout means: which tokens and heads sit next to each other."""
    svg, names = Svg(), axes.split()
    shape = [extents[n] for n in names]
    svg.text(4, 14, title, bold=True)
    for flat in range(min(count, int(np.prod(shape)))):
        idx = dict(zip(names, (int(v) for v in np.unravel_index(flat, shape))))
        fill = PALETTE[0] if idx.get("KV", 0) == 0 else PALETTE[1]
        label = f"t{idx.get('T', 0)}" if idx.get("D", 0) == 0 else ""
        svg.rect(4 + flat * 12, 24, 12, CELL, fill if idx.get("H", 0) == 0 else _lighter(fill))
        if label:
            svg.text(4 + flat * 12, 24 + CELL + 12, label)
    svg.text(4, 24 + CELL + 28, "blue K, orange V; pale = head 1; a label marks d = 0 of a token t")
    return svg.render()


def _lighter(colour: str) -> str:
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{(c + 255) // 2:02x}" for c in rgb)


def cyclic_slot(t: int, window: int, sinks: int, bubble: int = 0) -> int:
    """Slot of token t in a cyclic cache of `window` slots whose first `sinks` tokens stay (StreamingLLM)."""
    return t if t < sinks else sinks + bubble + (t - sinks) % (window - sinks)


def cyclic_cache(window: int = 8, sinks: int = 2, tokens: int = 14) -> str:
    """Which token each slot of a cyclic KV cache holds after each step: sinks stay, the rest wrap."""
    svg, left = Svg(), 90
    svg.text(4, 14, f"cyclic KV cache, window {window}, {sinks} sink tokens: slot of token t after each step",
             bold=True)
    for s in range(window):
        svg.text(left + s * CELL + CELL / 2, 36, s, anchor="middle")
    held = [None] * window
    for t in range(tokens):
        held[cyclic_slot(t, window, sinks)] = t
        y = 42 + t * (CELL + 2)
        svg.text(4, y + CELL / 2 + 4, f"after t={t}")
        for s, token in enumerate(held):
            fill = EMPTY if token is None else SINK if token < sinks else PALETTE[0]
            colour = "#fff" if token is not None else "#000"
            svg.rect(left + s * CELL, y, CELL, CELL, fill, "" if token is None else token, text_fill=colour)
    return svg.render()


def multi_block_splits(kvlen: int = 11, key_tile: int = 2, num_splits: int = 4) -> str:
    """How multi-block mode splits one sequence's keys (the kernels' `split_keys`): key tiles coloured by the
    split that walks them, each split's block writing its (m, l, o) partial, and the combine reducing them."""
    # Imported here, not at the top: numba reads the simulator flag on its first import.
    from kernels_numba._attention_core import split_keys

    svg, left, top, gap = Svg(), 70, 40, 6
    svg.text(4, 14, f"multi-block: {kvlen} keys in key tiles of {key_tile}, {num_splits} splits of whole tiles",
             bold=True)
    svg.text(4, top + CELL / 2 + 4, "key t")
    svg.text(4, top + CELL + 14, "key tile")

    def x_of(t):                                               # a gap between key tiles
        return left + t * CELL + (t // key_tile) * gap

    tiles = -(-kvlen // key_tile)
    for tile in range(tiles):
        width = min(key_tile, kvlen - tile * key_tile) * CELL
        svg.text(x_of(tile * key_tile) + width / 2, top + CELL + 14, tile, anchor="middle")
    box_top, box_w, box_h = top + CELL + 60, 150, 2 * CELL
    combine_top = box_top + box_h + 36
    for split in range(num_splits):
        lo, hi = split_keys(split, num_splits, kvlen, key_tile)
        colour = PALETTE[split % len(PALETTE)]
        for t in range(lo, hi):
            svg.rect(x_of(t), top, CELL, CELL, colour, t, text_fill="#fff")
        bx = 4 + split * (box_w + 12)
        keys = f"keys {lo}..{hi - 1}" if hi > lo else "no keys"
        svg.rect(bx, box_top, box_w, box_h, _lighter(colour))
        svg.text(bx + 6, box_top + 15, f"split {split}: {keys}")
        svg.text(bx + 6, box_top + 31, f"writes (m{split}, l{split}, o{split})" if hi > lo else "m=-inf, l=0, o=0")
        if hi > lo:
            svg.line((x_of(lo) + x_of(hi - 1) + CELL) / 2, top + CELL + 20, bx + box_w / 2, box_top - 2, colour)
        svg.line(bx + box_w / 2, box_top + box_h + 2, bx + box_w / 2, combine_top - 2)
    svg.rect(4, combine_top, num_splits * (box_w + 12) - 12, box_h, EMPTY)
    svg.text(12, combine_top + 15, "combine: M = max m_c, L = sum e^(m_c - M) l_c,")
    svg.text(12, combine_top + 31, "O = sum e^(m_c - M) o_c / L  (a split with no keys adds nothing)")
    return svg.render()


def bench_plot(result: dict) -> str:
    """A `python -m cacheattn bench` run (its bench.json) as bars: per case, our kernel, the other rungs and the
    peers, each as a share of the nearer ceiling measured in the same run (the copy bandwidth for the bytes the
    case must read, the float16 matmul rate for its flops), so decode and prefill share one axis: a roofline."""
    copy_gb, matmul_tflops = result["copy_bandwidth_gb_per_s"], result["fp16_matmul_tflops"]
    svg, left, full, bar = Svg(), 340, 300, 12        # bars start at `left`; `full` px = 100 % of the ceiling
    svg.text(4, 14, f"{result['device']['device']}: share of the nearer ceiling (copy {copy_gb:.4g} GB/s, "
                    f"matmul {matmul_tflops:.4g} TFLOP/s)", bold=True)
    y = 30
    for row in result["rows"]:
        svg.text(4, y + 12, row["label"], bold=True)
        y += 18
        timed = [("ours (the plan's rung)", row["ms"])] + [(name, ms) for name, ms in row["peers_ms"].items()
                                                            if ms == ms]     # NaN: not measured
        for k, (name, ms) in enumerate(timed):
            speed = row["ms"] / ms                                 # the same work in ms: scale our figures
            share = max(row["gb_per_s"] * speed / copy_gb, row["tflops"] * speed / matmul_tflops)
            svg.text(left - 6, y + 10, name, anchor="end")
            svg.rect(left, y, max(1.0, round(min(share, 1.2) * full, 1)), bar, PALETTE[k % len(PALETTE)])
            svg.text(round(left + min(share, 1.2) * full + 6, 1), y + 10, f"{100 * share:.1f}%  {ms:.3f} ms")
            y += bar + 4
        y += 8
    svg.rect(left + full, 24, 1, y - 24, "#555")                 # 100 %: the ceiling
    svg.text(left + full, y + 12, "100%", anchor="middle")
    return svg.render()


def bounds_plot(result: dict) -> str:
    """A `python -m cacheattn lab` run (docs/kernel-ladder-counts.json) drawn as the bench plot is: per bench case,
    one bar per rung, the floor's time (the bytes the case must move over the HBM bandwidth, or its FLOPs over the
    tensor cores) as a share of the rung's lower bound, so 100% is a rung that can reach the floor. Derived from
    counts, never timed."""
    from . import bounds, ladder_figures

    machine = bounds.H100_SXM
    svg, left, full, bar = Svg(), 260, 300, 12
    svg.text(4, 14, f"{machine.name}: the floor's time as a share of each rung's lower bound (derived, not timed)",
             bold=True)
    y = 30
    for label, case in result["cases"].items():
        floor_us = ladder_figures.case_floor_us(case["case"])
        svg.text(4, y + 12, f"{label}: floor {floor_us:,.1f} µs", bold=True)
        y += 18
        for k, (rung, figures_rung) in enumerate(case["rungs"].items()):
            b = figures_rung["bounds"]
            share = floor_us / b["lower bound µs (derived)"]
            svg.text(left - 6, y + 10, f"rung {rung}", anchor="end")
            svg.rect(left, y, max(1.0, round(min(share, 1.0) * full, 1)), bar, PALETTE[k % len(PALETTE)])
            svg.text(round(left + min(share, 1.0) * full + 6, 1), y + 10,
                     f"{100 * share:.0f}%  ≥ {b['lower bound µs (derived)']:,.1f} µs (bound: {b['limited by']})")
            y += bar + 4
        y += 8
    svg.rect(left + full, 24, 1, y - 24, "#555")                 # 100 %: the floor
    svg.text(left + full, y + 12, "100%", anchor="middle")
    return svg.render()


def figures() -> dict[str, str]:
    """{file name: SVG text} of every figure the pages embed."""
    from cacheattn import ladder_figures
    from reference.cache_layout import DYNAMIC_LAYOUTS

    bottom_right, top_left = causal_masks()
    out = {"causal-bottom-right.svg": bottom_right, "causal-top-left.svg": top_left,
           "page-table.svg": page_table(np.array([[12, 0], [24, -1], [4, 28]]), (6, 3, 7), 4, 32),
           "cyclic-sinks.svg": cyclic_cache(), "multi-block-splits.svg": multi_block_splits(),
           "causal-ranges.svg": causal_ranges()}
    extents = dict(L=1, KV=2, T=3, H=2, D=2)
    for layout, axes in DYNAMIC_LAYOUTS.items():
        out[f"ppl-layout-{layout}.svg"] = memory_order(
            axes, extents, 24, f"cache_layout {layout}: ({', '.join(axes.split())}) with T=3 tokens, H=2, Dh=2")
    if BENCH_RUN.exists():                       # committed from a GPU run (python -m cacheattn gpu-session)
        out["bench.svg"] = bench_plot(json.loads(BENCH_RUN.read_text()))
    if LAB_RUN.exists():                         # committed from python -m cacheattn lab --write
        lab_run = json.loads(LAB_RUN.read_text())
        out["lab-bounds.svg"] = bounds_plot(lab_run)
        out["ladder-terms.svg"] = ladder_figures.ladder_terms(lab_run)
    out.update(ladder_figures.figures())         # the kernel ladder's rung pages, drawn from the kernels
    return out


def write_all(directory: Path) -> list[Path]:
    """Write every figure into directory; a file whose text is unchanged is left alone (so `mkdocs serve`,
    which rebuilds on change, does not loop). Returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in figures().items():
        path = directory / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        paths.append(path)
    return paths
