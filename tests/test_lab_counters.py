"""How `python -m cacheattn lab` gets the full launch's figures from cut-down launches (cacheattn/lab/counters.py):
the fit along the sequence must predict a launch it did not count, and rung 4 must split as its launcher would."""

import os
from dataclasses import replace

import pytest

from cacheattn.lab import counters
from cacheattn.lab.cases import LAB_CASES
from cacheattn.lab.recorder import DRAM_READ, HMMA, SECTORS_LD, WAVEFRONTS_LD, WAVEFRONTS_ST

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="the lab counts in numba's CUDA simulator")

COUNTS = (SECTORS_LD, WAVEFRONTS_LD, WAVEFRONTS_ST, DRAM_READ, HMMA, "kv_ld_bytes_requested", "kv_must_see",
          "barriers")


@pytest.mark.parametrize("rung", [3, 5])
def test_the_linear_fit_predicts_a_decode_it_did_not_count(rung):
    (plan,) = counters.plans(quick=True)
    counted = [counters._count((plan, rung, length, 128, 1)) for length in plan.points]
    third = counters._count((plan, rung, 3 * plan.points[0], 128, 1))
    for name in COUNTS:
        predicted = counters.fit(plan.points, [c[name] for c in counted], 3 * plan.points[0])
        # Exact, but for DRAM bytes: the page table (2 requests x ceil(keys / 64) int64 entries) grows by whole
        # sectors, 1 of the ~3,100 sectors read here and 33 KB of the full launch's 1 GB.
        assert predicted == pytest.approx(third[name], abs=1e-6, rel=1e-3 if name == DRAM_READ else 0), name


def test_the_quadratic_fit_predicts_a_prefill_it_did_not_count():
    # Causal prefill: later query tiles walk more keys, so the counts grow as N^2. Rung 5 at head_dim 16 (a small,
    # fast launch of the same block plan), the lab's prompt lengths (16, 32, 48 tokens) predict a fourth, 64.
    case = replace(LAB_CASES[-1], head_dim=16)
    plan = counters.Plan(case, counters.cut_down(case), counters.PREFILL_POINTS)
    assert plan.points == (16, 32, 48)
    counted = [counters._count((plan, 5, n, 128, 1)) for n in plan.points]
    fourth = counters._count((plan, 5, 64, 128, 1))
    for name in COUNTS:
        predicted = counters.fit(plan.points, [c[name] for c in counted], 64)
        assert predicted == pytest.approx(fourth[name], abs=1e-6), name


def test_rungs_4_and_5_split_the_long_decode_over_two_blocks_an_sm():
    long_decode = LAB_CASES[3]
    assert (long_decode.batch, long_decode.kvlen) == (1, 32769)
    # 8 blocks (one per kv head, its GQA group of 4 in one block): ceil(2 x 132 / 8) = 33 splits, 264 blocks; a
    # rung-4 block step is 4 warps x 2 lane groups x a tile of 2 keys = 16 keys, so rung 4 is counted at 33 x 16 x
    # (1, 2); rung 5's decode kernel steps 4 warps x a trip of 16 keys: 33 x 64 x (1, 2).
    assert counters.split_steps(long_decode) == {4: (33, 16), 5: (33, 64)}
    # The B = 64 decode's 512 blocks fill the GPU: no split.
    assert counters.split_steps(LAB_CASES[0]) == {4: (1, 16), 5: (1, 64)}
    (plan,) = [p for p in counters.plans() if p.case is long_decode]
    assert plan.points_for(4) == (528, 1056) and plan.points_for(5) == (2112, 4224)
    assert plan.points_for(3) == (128, 256) and plan.points_for(1) == (64, 128)
    assert plan.splits(5) == 33


@pytest.mark.parametrize("case_index,rung", [(0, 3), (4, 5)])
def test_the_committed_counts_are_current(case_index, rung):
    # The ladder page shows docs/kernel-ladder-counts.json (`python -m cacheattn lab --write ...`, minutes). Recount
    # its first point of the best decode rung and of the prefill's tensor-core rung: a kernel change that moves
    # any count must come with a new file.
    result = counters.committed()
    plan = counters.plans()[case_index]
    shown = result["cases"][plan.case.label]["rungs"][str(rung)]
    threads = result["cases"][plan.case.label]["threads"]
    now = counters._count((plan, rung, shown["points"][0], threads, shown["derived"]["splits"]))
    stale = "run python -m cacheattn lab --write docs/kernel-ladder-counts.json"
    assert now == shown["counted"][0], stale
    # ... and the derivations from the committed full-launch figures are today's.
    assert counters.derived(shown["full"], plan, shown["derived"]["splits"]) == shown["derived"], stale
    bound = counters.bound_figures(counters.lower_bounds(shown["full"], plan), plan.case)
    assert {k: v for k, v in shown["bounds"].items() if "estimate" not in k} == bound, stale


def test_the_issue_estimate_is_the_key_loop_once_per_trip_of_every_warp():
    # Rung 3, float16, head_dim 128: 16 lanes share a key (16 chunks of 8 halves), two lane groups a warp, each
    # taking a tile of 2 keys: 4 keys a trip. 512 blocks see 4097 keys each: 512 x 4097 / 4 trips of the committed
    # loop body, at 4 warp instructions per
    # clock per SM, the busiest SM running ceil(512 / 132) = 4 blocks where the average is 3.879.
    from cacheattn.lab import sass
    plan = counters.plans()[0]
    full = {"kv_must_see": 512 * 4097 * 2 * plan.case.row_bytes, "attention blocks": 512}
    body = sass.committed()["variants"]["rung3-float16-decode"]["key_loop"]["mix"]["total"]
    expected = 512 * 4097 / 4 * body / (4 * 132 * 1.98e9 * 512 / (4 * 132)) * 1e6
    assert counters.issue_estimate(full, plan, 3, 128) == pytest.approx(expected)
    # Rung 2: a warp per key, four times the trips, of a body of its own.
    body2 = sass.committed()["variants"]["rung2-float16-decode"]["key_loop"]["mix"]["total"]
    assert counters.issue_estimate(full, plan, 2, 128) == pytest.approx(expected * 4 * body2 / body)
    # Rung 3's page walks run at most once a trip while a page holds a block's 16 keys; not with pages of 8.
    assert sass.committed()["variants"]["rung3-float16-decode"]["key_loop"]["walk_loops"] > 0
    small_pages = replace(plan, case=replace(plan.case, page_size=8))
    assert counters.issue_estimate(full, small_pages, 3, 128) is None
    # Rung 5's decode kernel: a warp's trip of 16 keys (whole trips need pages of a multiple of 16 keys).
    body5 = sass.committed()["variants"]["rung5-float16-decode"]["key_loop"]["mix"]["total"]
    assert counters.issue_estimate(full, plan, 5, 128) == pytest.approx(expected * 4 / 16 * body5 / body)
    assert counters.issue_estimate(full, replace(plan, case=replace(plan.case, page_size=24)), 5, 128) is None
    # No estimate where the loop has inner loops that load (rung 1), for prefill or for other shapes than the SASS's.
    assert counters.issue_estimate(full, plan, 1, 128) is None
    assert counters.issue_estimate(full, plan, 3, 256) is None
    assert counters.issue_estimate(full, counters.plans()[4], 3, 128) is None
