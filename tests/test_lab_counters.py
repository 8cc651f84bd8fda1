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
    # fast launch of the same block plan), prompts of 16, 32, 48 tokens predict 64.
    case = replace(LAB_CASES[-1], head_dim=16)
    plan = counters.Plan(case, counters.cut_down(case), (16, 32, 48))
    counted = [counters._count((plan, 5, n, 128, 1)) for n in plan.points]
    fourth = counters._count((plan, 5, 64, 128, 1))
    for name in COUNTS:
        predicted = counters.fit(plan.points, [c[name] for c in counted], 64)
        assert predicted == pytest.approx(fourth[name], abs=1e-6), name


def test_rung_4_splits_the_long_decode_over_two_blocks_an_sm():
    long_decode = LAB_CASES[3]
    assert (long_decode.batch, long_decode.kvlen) == (1, 32769)
    # 8 blocks (one per kv head, its GQA group of 4 in one block): ceil(2 x 132 / 8) = 33 splits, 264 blocks.
    assert counters.splits_for(long_decode) == (33, 8)
    # The B = 64 decode's 512 blocks fill the GPU: no split.
    assert counters.splits_for(LAB_CASES[0])[0] == 1
    (plan,) = [p for p in counters.plans() if p.case is long_decode]
    assert plan.points_for(4) == (264, 528) and plan.points_for(3) == (128, 256)
