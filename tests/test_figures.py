"""The docs figures are drawn from the rules the references state (and are well-formed SVG)."""

import xml.etree.ElementTree as ET

import numpy as np

from cacheattn import figures


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
