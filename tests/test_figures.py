"""The docs figures are drawn from the rules the references state (and are well-formed SVG)."""

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from cacheattn import figures
from kernels_numba._warp import transpose_sum, xor_reduce


def test_every_figure_is_well_formed_svg(tmp_path):
    paths = figures.write_all(tmp_path)
    assert {p.name for p in paths} >= {"page-table.svg", "cyclic-sinks.svg", "causal-bottom-right.svg"}
    for path in paths:
        assert ET.fromstring(path.read_text()).tag.endswith("svg"), path.name
    before = {p: p.stat().st_mtime_ns for p in paths}
    figures.write_all(tmp_path)                                  # unchanged figures are not rewritten
    assert {p: p.stat().st_mtime_ns for p in paths} == before


def test_cyclic_slots_keep_sinks_and_wrap_the_window():
    window, sinks = 6, 2
    slots = [figures.cyclic_slot(t, window, sinks) for t in range(12)]
    assert slots == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3]
    # paged: the sinks get a whole block of 4, so the window starts at slot 4
    assert [figures.cyclic_slot(t, window, sinks, bubble=2) for t in range(7)] == [0, 1, 4, 5, 6, 7, 4]


def test_causal_figures_colour_what_each_document_lets_a_query_see():
    bottom_right, top_left = figures.causal_masks(seqlen=2, kvlen=3)
    seen = figures.PALETTE[0]
    # OpenPPL: query 0 sees keys 0, 1 and query 1 all three (5 cells); ONNX top-left: 1 + 2 = 3 cells.
    assert bottom_right.count(f"fill='{seen}'") == 5
    assert top_left.count(f"fill='{seen}'") == 3
    grid = np.array([[1, 0], [1, 1]], bool)
    assert figures.visibility(grid, "t").count(f"fill='{figures.HIDDEN}'") == 1


def test_multi_block_figure_colours_each_key_by_the_split_that_walks_it():
    svg = figures.multi_block_splits(kvlen=11, key_tile=2, num_splits=4)
    # split_keys: [0, 4), [4, 8), [8, 11) and an empty fourth split, which writes m = -inf, l = 0, o = 0
    assert [svg.count(f"fill='{figures.PALETTE[c]}'") for c in range(4)] == [4, 4, 3, 0]
    assert "split 3: no keys" in svg and "m=-inf, l=0, o=0" in svg


def test_the_lab_plot_draws_each_rung_as_the_floors_share_of_its_bound():
    # One decode case, two rungs: the floor (K/V once, Q, O over the achievable 3.1 TB/s) is 347 µs; a rung
    # bound at the floor fills the bar (100%), one bound at four times it a quarter.
    from cacheattn.lab.cases import LAB_CASES

    case = LAB_CASES[0]
    floor_us = case.floor_bytes / 3.1e12 * 1e6
    run = {"cases": {case.label: {"case": {f: getattr(case, f) for f in case.__dataclass_fields__},
                                  "rungs": {"1": {"bounds": {"lower bound µs (derived)": 4 * floor_us,
                                                             "limited by": "shared"}},
                                            "3": {"bounds": {"lower bound µs (derived)": floor_us,
                                                             "limited by": "DRAM"}}}}}}
    svg = figures.bounds_plot(run)
    assert ET.fromstring(svg).tag.endswith("svg")
    assert f"floor {floor_us:,.1f} µs" in svg
    assert "25%" in svg and "(bound: shared)" in svg and "100%  ≥" in svg and "(bound: DRAM)" in svg


# The kernel ladder's rung pictures (cacheattn.ladder_figures): each geometric fact a picture shows is checked
# against the kernel code, run in the simulator where the fact is a kernel's behaviour.

@cuda.jit
def partial_sums(out):
    """out[r, lane]: `xor_reduce` of 1 << lane over the lanes its first r offsets (1, 2, ..., 2 ** (r - 1))
    combine, so the bits say which lanes each lane has summed after round r."""
    scratch = cuda.shared.array((1, 32), np.int64)
    lane = cuda.threadIdx.x
    for r in range(1, out.shape[0]):
        out[r, lane] = xor_reduce(np.int64(1) << lane, scratch, 0, lane, 1, 1 << r, False)


@cuda.jit
def group_sums(values_in, out):
    """out[lane]: what `transpose_sum` leaves a lane of a group of 8 (one value a lane) from values_in[lane, :8]."""
    scratch = cuda.shared.array((1, 32, 8), np.float64)
    lane = cuda.threadIdx.x
    values = cuda.local.array(8, np.float64)
    for k in range(8):
        values[k] = values_in[lane, k]
    transpose_sum(values, 1, scratch, 0, lane, 8)
    out[lane] = values[0]


def _cells(svg: str, figure: str) -> list[dict]:
    """The data attributes of the cells of one picture part, as {name: text}."""
    return [{k[5:]: v for k, v in el.attrib.items() if k.startswith("data-")}
            for el in ET.fromstring(svg).iter() if el.attrib.get("data-figure") == figure]


def _lanes(mask: str) -> set:
    bits = int(mask, 16)
    return {lane for lane in range(64) if bits >> lane & 1}


def test_the_rung_pictures_are_drawn_and_embedded():
    from cacheattn import ladder_figures

    drawn = ladder_figures.figures()
    assert set(drawn) <= set(figures.figures())
    for rung in range(1, 7):
        names = [name for name in drawn if name.startswith(f"rung-{rung}-")]
        assert len(names) == 1, rung
        assert ET.fromstring(drawn[names[0]]).tag.endswith("svg")
        page = (Path(__file__).resolve().parents[1] / "docs" / f"rung-{rung}.md").read_text()
        assert f"](figures/{names[0]})" in page.split("```")[0], f"rung-{rung}.md: the picture before the first code"


def test_rung1_column_is_one_bank_unpadded_and_every_bank_padded():
    from cacheattn import ladder_figures
    from cacheattn.lab.cases import LAB_CASES
    from cacheattn.lab.recorder import _wavefronts
    from kernels_numba._attention_core import plan_tiles

    case = LAB_CASES[0]
    key_tile = plan_tiles(case.num_heads, case.num_kv_heads, 1, case.head_dim, case.head_dim)[2]
    svg = ladder_figures.rung1_banks()
    cells = _cells(svg, "rung1")
    for row_words, want_banks in ((case.head_dim, 1), (case.head_dim + 1, key_tile)):
        banks = [int(c["bank"]) for c in cells if int(c["row-words"]) == row_words]
        assert len(banks) == key_tile and len(set(banks)) == want_banks
        # the lab's own model of a shared request (the one that counts the kernels): lane j reads float32
        # k_s[j % key_tile, 0] of a (key_tile, row_words) array
        waves, fewest = _wavefronts([(lane, 4 * (lane % key_tile) * row_words, 4) for lane in range(32)])
        assert fewest == 1 and f"{waves - 1} bank conflicts a request" in svg
    assert key_tile == 32 and "31 bank conflicts" in svg and "0 bank conflicts" in svg


def test_rung2_rounds_are_what_xor_reduce_combines():
    from cacheattn import ladder_figures
    from kernels_numba._warp import WARP_SIZE

    rounds = 5
    got = np.zeros((rounds + 1, WARP_SIZE), np.int64)
    got[0] = 1 << np.arange(WARP_SIZE)
    partial_sums[1, WARP_SIZE](got)
    svg = ladder_figures.rung2_butterfly()
    drawn = {(int(c["round"]), int(c["lane"])): _lanes(c["lanes"]) for c in _cells(svg, "rung2")}
    assert max(r for r, _ in drawn) == rounds == int(np.log2(WARP_SIZE))
    for (r, lane), lanes in drawn.items():
        assert lanes == _lanes(hex(int(got[r, lane]))), (r, lane)
    assert "5 rounds of shfl_xor (offsets 1, 2, 4, 8, 16)" in svg


def test_rung3_chunks_tile_the_row_and_the_halving_ends_as_transpose_sum_does():
    from cacheattn import ladder_figures
    from cacheattn.lab.cases import LAB_CASES
    from kernels_numba._vector import VECTOR_BYTES

    head_dim = LAB_CASES[0].head_dim
    svg = ladder_figures.rung3_vector()
    chunks = _cells(svg, "rung3")
    for name, chunk_bytes, lanes in (("float16", VECTOR_BYTES, 16), ("int8", VECTOR_BYTES, 8),
                                     ("int4", VECTOR_BYTES // 2, 8)):      # rung 3's int4 loads 8 bytes a lane
        row = sorted((int(c["lo"]), int(c["hi"]), int(c["lane"])) for c in chunks if c["format"] == name)
        assert [lo for lo, _, _ in row] == [hi for _, hi, _ in [(0, 0, 0)] + row[:-1]]    # no gap, no overlap
        assert all(hi - lo == chunk_bytes for lo, hi, _ in row)
        assert row[-1][1] == head_dim * {"float16": 2, "int8": 1, "int4": 0.5}[name]
        assert [lane for _, _, lane in row] == [c % lanes for c in range(len(row))]

    rng = np.random.default_rng(3)
    values = rng.integers(-1000, 1000, (32, 8)).astype(np.float64)     # exact sums in float64
    out = np.zeros(32)
    group_sums[1, 32](values, out)
    final = [c for c in _cells(svg, "rung3-sum") if c["round"] == "3" and c["lanes"]]
    assert len(final) == 8
    for c in final:                     # lane n of the group ends with entry n, summed over the group's 8 lanes
        lane, entry, summed = int(c["lane"]), int(c["entry"]), sorted(_lanes(c["lanes"]))
        assert entry == lane and summed == list(range(8))
        assert out[lane] == values[summed, entry].sum()


def test_rung4_numbers_are_the_combine_kernels():
    from cacheattn import ladder_figures
    from kernels_numba._split_k import combine_kernel

    def run_kernel(maxes, sums, outs):
        out = np.full(1, np.nan)
        combine_kernel(np.float64, 1, 1)[(1, 1), 32](np.array(outs, np.float64), np.array(maxes, np.float64),
                                                     np.array(sums, np.float64), len(maxes), np.array([0]),
                                                     np.array([0, 1]), out)
        return out[0]

    ex = ladder_figures.split_example()
    svg = ladder_figures.rung4_combine()
    parts = sorted(_cells(svg, "rung4"), key=lambda c: int(c["split"]))
    maxes, sums, outs = ([float(c[k]) for c in parts] for k in "mlo")
    (combined,) = _cells(svg, "rung4-combine")
    assert float(combined["o"]) == ex["O"]
    np.testing.assert_allclose(run_kernel(maxes, sums, outs), float(combined["o"]), rtol=1e-12)
    # and the splits' states are the keys' own: softmax over all keys at once gives the same output
    s, v = np.array(ex["s"]), np.array(ex["v"])
    p = np.exp(s - s.max())
    np.testing.assert_allclose(float(combined["o"]), p @ v / p.sum(), rtol=1e-12)
    np.testing.assert_allclose(float(combined["l"]), p.sum(), rtol=1e-12)
    # random states, one split empty (m = -inf, l = o = 0): the picture's combine is the kernel's
    rng = np.random.default_rng(11)
    for _ in range(3):
        maxes = list(rng.normal(0, 3, 4))
        maxes[1] = -np.inf
        sums = [0.0 if x == -np.inf else float(rng.uniform(1, 5)) for x in maxes]
        outs = [0.0 if x == -np.inf else float(rng.normal()) for x in maxes]
        np.testing.assert_allclose(ladder_figures.combine(maxes, sums, outs)[2], run_kernel(maxes, sums, outs),
                                   rtol=1e-12)


def test_rung5_fragments_are_the_ptx_layout_and_s_is_p_lane_for_lane():
    from cacheattn import ladder_figures
    from cacheattn.lab import counters
    from cacheattn.lab.recorder import _wavefronts

    svg = ladder_figures.rung5_fragments()
    a = {(int(c["row"]), int(c["col"])): (int(c["lane"]), int(c["element"])) for c in _cells(svg, "rung5-a")}
    s = {(int(c["tile"]), int(c["row"]), int(c["col"])): int(c["lane"]) for c in _cells(svg, "rung5-c")}
    assert len(a) == 16 * 16 and len(s) == 2 * 16 * 8
    for (row, col), (lane, i) in a.items():
        # PTX ISA 9.7.14.5.8, m16n8k16 A (f16): groupID = lane >> 2, threadID_in_group = lane % 4
        assert row == (lane >> 2) + 8 * (i in (2, 3, 6, 7))
        assert col == 2 * (lane % 4) + (i & 1) + 8 * (i >= 4)
        assert s[col // 8, row, col % 8] == lane               # the same lane holds it in S's C tile
    # K staging: unpermuted, lanes pile 4 to a bank; permuted, each of the 4 stores of a 16-byte chunk hits 32
    stores = _cells(svg, "rung5-stage")
    for permuted, want in (("0", 4), ("1", 1)):
        for store in {c["store"] for c in stores if c["permuted"] == permuted}:
            lanes_at = [(int(c["bank"]), [int(x) for x in c["lanes"].split()]) for c in stores
                        if c["permuted"] == permuted and c["store"] == store]
            accesses = [(lane, 4 * bank, 4) for bank, lanes in lanes_at for lane in lanes]
            assert sorted(lane for lane, _, _ in accesses) == list(range(32))
            # a bank holding several lanes' words: distinct words (the lab's model counts wavefronts)
            accesses = [(lane, 4 * (bank + 32 * k), 4) for bank, lanes in lanes_at for k, lane in enumerate(lanes)]
            assert _wavefronts(accesses)[0] == want
    # and the lab, counting the kernel itself on this shape, saw no shared-store bank conflicts
    rung5 = counters.committed()["cases"]["decode B64 ctx4096 paged fp16"]["rungs"]["5"]
    assert all(run["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"] == 0 for run in rung5["counted"])


def test_rung6_stage_is_the_kernels_swizzle_and_ldmatrix_rows_hit_32_banks():
    from cacheattn import ladder_figures
    from cacheattn.lab.recorder import _wavefronts
    from kernels_numba.standalone.rung6 import swizzled

    svg = ladder_figures.rung6_stage()
    cells = _cells(svg, "rung6-stage")
    assert len(cells) == 2 * 8 * 16
    for swz in ("0", "1"):
        mine = [c for c in cells if c["swizzled"] == swz]
        for row in range(8):
            held = {int(c["slot"]): int(c["chunk"]) for c in mine if int(c["row"]) == row}
            assert sorted(held.values()) == list(range(16))         # every chunk of the row stored once
            for slot, chunk in held.items():                     # where the kernel's `place` puts it
                assert slot == (swizzled(row, chunk, 16) if swz == "1" else chunk)
        # an 8x8 matrix of ldmatrix: 8 lanes' 16-byte rows, chunk 0 of rows 0-7, in the lab's wavefront model
        rows = [(row, int(c["bank"])) for c in mine for row in range(8) if int(c["row"]) == row and c["chunk"] == "0"]
        accesses = [(row, 4 * bank + 4 * 32 * row, 16) for row, bank in rows]
        assert _wavefronts(accesses)[0] == (1 if swz == "1" else 8)
    assert "one wavefront (conflict-free)" in svg and "8 wavefronts (8-way conflict)" in svg
    # every chunk, at every head_dim rung 6 takes: 8 consecutive rows' copies of it in 8 bank groups
    for chunks in (2, 4, 8, 16):
        for chunk in range(chunks):
            for r0 in range(0, 64, 8):
                groups = {((r * chunks + swizzled(r, chunk, chunks)) * 4 % 32) // 4 for r in range(r0, r0 + 8)}
                assert len(groups) == 8, (chunks, chunk, r0)


def test_ladder_terms_draw_rung6_when_the_counts_have_it():
    import copy

    from cacheattn import ladder_figures
    from cacheattn.lab import counters

    run = copy.deepcopy(counters.committed())
    prefill = run["cases"][ladder_figures.LADDER_CASES[1]]["rungs"]
    prefill.setdefault("6", copy.deepcopy(prefill["5"]))
    svg = ladder_figures.ladder_terms(run)
    assert "rung 6: cp.async, ldmatrix" in svg
    assert any(el.attrib.get("data-rung") == "6" for el in ET.fromstring(svg).iter())


def test_ladder_terms_are_each_rungs_committed_bound_and_its_next_terms():
    from cacheattn import ladder_figures
    from cacheattn.lab import counters
    from cacheattn.lab.cases import LAB_CASES

    run = counters.committed()
    svg = ladder_figures.ladder_terms(run)
    bars = [dict(el.attrib) for el in ET.fromstring(svg).iter() if el.attrib.get("data-figure") == "ladder-terms"]
    for label in ladder_figures.LADDER_CASES:
        for rung, counted in run["cases"][label]["rungs"].items():
            b = counted["bounds"]
            mine = sorted((c for c in bars if c["data-case"] == label and c["data-rung"] == rung),
                          key=lambda c: int(c["data-rank"]))
            # the binding term first, at the rung's lower bound, then the model's next terms in its order
            assert [c["data-term"] for c in mine] == [b["limited by"], *b["then"][:ladder_figures.NEXT_TERMS]]
            assert float(mine[0]["data-us"]) == b["lower bound µs (derived)"]
            widths = [float(c["width"]) for c in mine]
            assert widths == sorted(widths, reverse=True)          # a larger bound draws a longer bar
    # the headline decode's floor: K/V once, Q and O over the achievable 3.1 TB/s
    floor = {c["case"]: float(c["us"]) for c in _cells(svg, "ladder-floor")}
    assert floor[LAB_CASES[0].label] == pytest.approx(LAB_CASES[0].floor_bytes / 3.1e12 * 1e6)
    # where the rungs differ the picture does: the decode binds rung 2 by issue, rung 3 by DRAM
    binding = {(c["data-case"], c["data-rung"]): c["data-term"] for c in bars if c["data-rank"] == "0"}
    decode = ladder_figures.LADDER_CASES[0]
    assert binding[decode, "2"] == "issue" and binding[decode, "3"] == "DRAM"
    page = (Path(__file__).resolve().parents[1] / "docs" / "kernel-ladder.md").read_text()
    assert "](figures/ladder-terms.svg)" in page.split("```")[0], "kernel-ladder.md: the picture before any code"


def test_causal_ranges_colour_the_keys_visible_keys_lets_each_new_token_see():
    from reference.trtllm_gpt_attention import SLIDING_WINDOW_CAUSAL, visible_keys

    svg = figures.causal_ranges(seqlen=3, kvlen=7, window=4, sinks=1)
    cells = [int(c.get("data-seen")) for c in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}rect")]
    assert len(cells) == 3 * 3 * 7
    # causal: 5 + 6 + 7 keys; the window of 4 keeps 4 a row; 1 sink + the last 3 keeps 4 a row too
    assert [sum(cells[k * 21:(k + 1) * 21]) for k in range(3)] == [18, 12, 12]
    sinks = visible_keys(np.arange(4, 7), 7, mask_type=SLIDING_WINDOW_CAUSAL, window=4, sinks=1, dense=False)
    assert cells[42:] == sinks.astype(int).ravel().tolist()
    assert svg.count(f"fill='{figures.SINK}'") == 3 and svg.count(f"fill='{figures.EMPTY}'") == 3 * 3
