"""How `python -m cacheattn lab` gets the full launch's figures from cut-down launches (cacheattn/lab/counters.py):
the fit along the sequence must predict a launch it did not count, and rung 4 must split as its launcher would."""

import math
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
    assert counters.other_launches(plan, rung, threads) == shown["other launches"], stale
    b, key, why = counters.lower_bounds(shown, plan, rung, threads)
    assert shown["bounds"] == counters.bound_figures(b, plan.case, key, why), stale


def test_every_committed_bound_is_the_models_largest_term():
    """Every case and rung of docs/kernel-ladder-counts.json (OpenPPL's, every operator's), recomputed from its
    committed counts and the committed SASS through cacheattn.bounds: the bound written is the model's, and the
    largest of the terms written beside it; every one has the issue, latency and wave terms of its kernel's SASS,
    and names the SASS of each other launch its call makes."""
    result = counters.committed()
    assert result["machine"]["clock_hz"] == 1.83e9 and "sources" in result["machine"]
    plans = {p.case.label: p for p in counters.plans()}
    checked = 0
    for label, case in counters.every_case(result):
        for rung, shown in case["rungs"].items():
            b, key, why = counters.lower_bounds(shown, plans[label], int(rung), case["threads"])
            written = shown["bounds"]
            assert written == counters.bound_figures(b, plans[label].case, key, why), (label, rung)
            terms = {k: v for k, v in written.items()
                     if k.endswith(" µs (derived)") and k != "lower bound µs (derived)"}
            assert written["lower bound µs (derived)"] == max(terms.values()), (label, rung)
            assert terms[f"{written['limited by']} µs (derived)"] == written["lower bound µs (derived)"]
            assert {"issue µs (derived)", "latency µs (derived)", "waves µs (derived)",
                    "launch µs (derived)"} <= set(terms), (label, rung)
            # the attention's variant, then one for each kernel of the call's other launches
            others, case_ = shown["other launches"], plans[label].case
            assert written["SASS"] == key == " + ".join(
                [counters.sass_key(case_, int(rung))] + [counters.other_key(case_, k) for k in others]), (label, rung)
            assert bool(others) == (shown["counted"][-1]["launches"] > 1), (label, rung)
            checked += 1
    assert checked == sum(len(case["rungs"]) for _, case in counters.every_case(result)) >= 40


def test_the_warp_trips_count_the_masked_tail():
    # Rung 5's decode kernel at the headline decode: 512 blocks see 4097 keys each, 4 warps a step of 16 keys each:
    # ceil(4097 / 64) = 65 trips a warp (the last one has 1 key), not 64.02: 512 x 4 x 65 warp trips.
    plan = counters.plans()[0]
    full = {"kv_must_see": 512 * 4097 * 2 * plan.case.row_bytes, "attention blocks": 512}
    assert counters.warp_trips(full, plan, 5, 128) == 512 * 4 * 65
    # Rung 3: a block step of 16 keys (4 warps x 2 lane groups x 2 keys), every warp a trip per step.
    assert counters.warp_trips(full, plan, 3, 128) == 512 * 4 * 257
    # Rung 2: a warp per key.
    assert counters.warp_trips(full, plan, 2, 128) == 512 * 4 * 1025


def test_a_case_without_machine_code_is_named_and_a_broken_file_refused():
    from cacheattn.lab import sass
    plans = {p.case.label: p for p in counters.plans()}
    onnx = next(p for label, p in plans.items() if label.startswith("onnx"))
    machine = sass.committed()
    assert counters.sass_variant(onnx.case, 3, 128, machine)["kernel"] == "vector_attention_kernel"
    without = {**machine, "variants": {k: v for k, v in machine["variants"].items() if not k.startswith("onnx-")}}
    with pytest.raises(counters.SassMissing, match="onnx decode B64 past4096 fp16 rung 3.*'onnx-rung3-float16-decode'"):
        counters.sass_variant(onnx.case, 3, 128, without)
    with pytest.raises(counters.SassMissing, match=r"rung 1 \(copy_kernel\).*'onnx-rung1-float16-decode\+copy_kernel'"):
        counters.sass_variant(onnx.case, 1, 128, without, kernel="copy_kernel")
    decode = counters.plans()[0].case
    with pytest.raises(counters.SassMissing, match="head_dim 128, 128 threads, not 128, 256"):
        counters.sass_variant(decode, 3, 256, machine)
    broken = {**machine, "variants": {**machine["variants"], "rung3-float16-decode": {
        k: v for k, v in machine["variants"]["rung3-float16-decode"].items() if k != "once_per_warp"}}}
    with pytest.raises(ValueError, match="kernel-ladder-sass.json: variant 'rung3-float16-decode'.*once_per_warp"):
        counters.sass_variant(decode, 3, 128, broken)
    with pytest.raises(ValueError, match="kernel-ladder-sass.json.*sm_80"):
        counters.sass_variant(decode, 3, 128, {**machine, "target": "sm_80"})
    # no SASS, no bound: never one from part of the terms
    shown = counters.committed()["operators"][onnx.case.label]["rungs"]["3"]
    with pytest.raises(counters.SassMissing, match="onnx decode B64 past4096 fp16 rung 3"):
        counters.lower_bounds(shown, onnx, 3, 256)


def test_the_other_launches_grids_and_their_issue():
    # The calls' launches besides the attention, their grids at the full launch: OpenPPL's store, a block a
    # request (64); TensorRT-LLM's preprocess, a thread per 16-byte chunk of a head row (16 at head_dim 128), 128
    # threads a block: 8 heads of Q, K and V a block, 64 x 48 / 8; ONNX's rung-1
    # present copy, an element a thread, K and V: 2 x 64 requests x 4097 x 8 heads x 128 / 128 threads; the split
    # B = 1 decode's combine, 32 heads x 128 outputs / 128 threads for its one request.
    plans = {p.case.label: p for p in counters.plans()}
    assert counters.other_launches(plans["decode B64 ctx4096 paged fp16"], 3) == {"store_kernel": 64}
    assert counters.other_launches(plans["trtllm generation B64 ctx4096 paged fp16"], 5) == \
        {"preprocess_kernel": 64 * 48 // 8}
    assert counters.other_launches(plans["onnx decode B64 past4096 fp16"], 1) == {"copy_kernel": 2 * 64 * 4097 * 8}
    assert counters.other_launches(plans["onnx decode B64 past4096 fp16"], 3) == {}
    assert counters.other_launches(plans["decode B1 ctx32768 paged fp16"], 4) == {"store_kernel": 1,
                                                                                 "combine_kernel": 32}
    # Each adds its warps x what a warp of it runs at least to the issue term (serial launches add).
    plan = plans["onnx decode B64 past4096 fp16"]
    shown = counters.committed()["operators"][plan.case.label]["rungs"]["1"]
    work, keys, _ = counters.call_work(shown, plan, 1, 128)
    assert keys == "onnx-rung1-float16-decode + onnx-rung1-float16-decode+copy_kernel"
    copy = counters.sass_variant(plan.case, 1, 128, kernel="copy_kernel")["once_per_warp"]["total"]
    attention = counters.sass_variant(plan.case, 1, 128)
    trips = counters.warp_trips(shown["full"], plan, 1, 128)
    def share(blocks):            # the busiest SM's share of a launch's blocks over the average
        return 132 * math.ceil(blocks / 132) / blocks

    blocks, copies = shown["full"]["attention blocks"], 2 * 64 * 4097 * 8
    alone = trips * attention["key_loop"]["trip"]["total"] + 4 * blocks * attention["once_per_warp"]["total"]
    assert work.warp_instructions == pytest.approx(alone + copies * 4 * copy * share(copies) / share(blocks))


def test_the_flash_prefills_committed_shared_traffic_is_its_tile_plans():
    """Rung 6's counted shared memory (its cp.async stores and ldmatrix loads, docs/kernel-ladder-counts.json) is
    what its tile plan says by hand (`_attention_flash.shared_wavefronts`: 2.5 wavefronts a mma at head_dim 128,
    4 warps), without a bank conflict; its K and V reach L2 through the copies, every byte of their sectors used;
    and the prefill's default call is rung 6."""
    from cacheattn.lab.recorder import CONFLICTS_LD, CONFLICTS_ST
    from kernels_numba._attention_flash import shared_wavefronts

    plan = next(p for p in counters.plans() if p.prefill and counters.FLASH_RUNG in p.rungs)
    case = counters.committed()["cases"][plan.case.label]
    full = case["rungs"][str(counters.FLASH_RUNG)]["full"]
    per_mma = (full[WAVEFRONTS_LD] + full[WAVEFRONTS_ST]) / full[HMMA]
    assert per_mma == pytest.approx(shared_wavefronts(plan.case.head_dim, case["threads"] // 32), rel=1e-3)
    assert full[CONFLICTS_LD] == full[CONFLICTS_ST] == 0
    assert full["ldmatrix_requests"] == full["shared_ld_requests"] > 0
    assert full["kv_ld_bytes_requested"] == 32 * full["kv_ld_sectors"] == full["kv_must_see"]
    assert case["default"]["rung"] == counters.FLASH_RUNG and case["default"]["counted as"] == "6"
