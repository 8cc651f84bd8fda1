"""The calibration statistics (docs/calibration-sass.json) and the bound terms computed from them."""

import copy
import json
import math
import re

import pytest

from cacheattn.lab import calibration

DATA = calibration.committed()
KERNELS = DATA["kernels"]


def test_stored_bounds_are_recomputed_from_the_statistics():
    for key, entry in KERNELS.items():
        value, name = calibration.bound(entry)
        assert name == entry["binding_term"], key
        assert math.isclose(value, entry["bound_us"], abs_tol=5e-4), (key, value, entry["bound_us"])  # stored to 1 ns
        found = calibration.terms(entry)
        assert {"DRAM", "issue"} <= set(found), key
        assert value == max(v for v, _ in found.values())
        for term, (us, how) in found.items():
            assert us > 0 and how, (key, term)


def test_at_least_two_kernels_each_with_source_published_and_shape():
    assert len(KERNELS) >= 2
    for key, entry in KERNELS.items():
        assert entry["source"]["repo"].startswith("https://github.com/"), key
        assert re.fullmatch(r"[0-9a-f]{40}", entry["source"]["commit"]), key
        assert set(entry["published"]) >= {"value", "unit", "what"}, key
        assert {"batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim", "dtype"} <= set(entry["shape"]), key
        # A kernel without a published figure says why; one with a figure converts it to µs.
        assert entry["published"]["what"], key
        assert (entry["published"]["value"] is None) == (entry["published_us"]["value"] is None), key
    assert sum(entry["published_us"]["value"] is not None for entry in KERNELS.values()) >= 2


def test_flashattention_published_time_follows_from_its_shape():
    entry = KERNELS["fa2_fwd_hdim128"]
    s = entry["shape"]
    flops = 4 * s["batch"] * s["seqlen_q"] * s["seqlen_k"] * s["heads"] * s["head_dim"] // (2 if s["causal"] else 1)
    assert entry["published"]["unit"] == "TFLOP/s"
    us = flops / (entry["published"]["value"] * 1e12) * 1e6
    assert math.isclose(us, entry["published_us"]["value"], rel_tol=1e-3)


def test_flashattention_counts_match_its_tiling():
    """128 query rows over 4 warps, 64-key tiles, head_dim 128: a warp's trip is S = Q K^T (32 x 64 x 128) and
    O += P V (32 x 128 x 64) in m16n8k16 steps; the grid's HMMA cover the operator's FLOPs exactly."""
    entry = KERNELS["fa2_fwd_hdim128"]
    s, launch = entry["shape"], entry["launch"]
    rows, keys, d = 128 // 4, 64, s["head_dim"]
    per_trip = (rows // 16) * (keys // 8) * (d // 16) + (rows // 16) * (d // 8) * (keys // 16)
    assert entry["main_loop"]["mix"]["HMMA"] == per_trip
    assert entry["main_loop"]["trips_per_block"] == s["seqlen_k"] // keys - 1          # first tile peeled
    assert launch["blocks"] == math.prod(launch["grid"]) == s["seqlen_q"] // 128 * s["batch"] * s["heads"]
    hmma = launch["blocks"] * 4 * (per_trip * entry["main_loop"]["trips_per_block"]
                                   + entry["outside_main_loop"]["mix"]["HMMA"])
    assert hmma * 16 * 8 * 16 * 2 == 4 * s["batch"] * s["heads"] * s["seqlen_q"] * s["seqlen_k"] * d


def test_decode_dram_bytes_follow_from_its_shape():
    entry = KERNELS["fi_decode_hdim128_gqa4"]
    s = entry["shape"]
    kv = s["batch"] * s["seqlen_k"] * s["kv_heads"] * s["head_dim"] * 2 * 2
    qo = 2 * s["batch"] * s["heads"] * s["head_dim"] * 2
    pages = s["batch"] * (s["seqlen_k"] // s["page_size"]) * 4
    assert entry["dram_bytes"]["value"] == kv + qo + pages
    assert entry["launch"]["blocks"] == s["batch"] * s["kv_heads"]


def test_single_decode_split_follows_from_its_occupancy():
    """FlashInfer splits the keys into as many chunks as fill the SMs at the kernel's occupancy, each at least 256
    keys; a block walks its chunk in iterations of bdy x bdz = 32 keys, two a trip."""
    entry = KERNELS["fi_single_decode_hdim128_gqa8"]
    s, launch = entry["shape"], entry["launch"]
    sms = calibration.default_machine().sms
    chunks_max = entry["occupancy"]["blocks_per_sm"] * sms // s["kv_heads"]
    chunk = max(-(-s["seqlen_k"] // chunks_max), 256)
    chunks = -(-s["seqlen_k"] // chunk)
    assert launch["grid"] == [chunks, s["kv_heads"]] and launch["blocks"] == chunks * s["kv_heads"]
    iterations = -(-chunk // (8 * 4))
    assert iterations % 2 == 0 and entry["main_loop"]["trips_per_block"] == iterations // 2
    kv = s["seqlen_k"] * s["kv_heads"] * s["head_dim"] * 2 * 2
    assert math.isclose(entry["published_us"]["value"], kv / (entry["published"]["value"] / 100 * 3.352e12) * 1e6,
                        rel_tol=1e-3)


def test_batch_decode_split_follows_from_its_occupancy():
    """FlashInfer's planner splits each request's pages into the fewest pages a chunk (at least 128 / page_size)
    for which chunks x kv heads fit the SMs at the kernel's occupancy; a block walks its chunk 8 keys an iteration
    (bdy 8 x bdz 1), two a trip."""
    entry = KERNELS["fi_decode_hdim128_gqa8"]
    s, launch = entry["shape"], entry["launch"]
    grid_max = entry["occupancy"]["blocks_per_sm"] * calibration.default_machine().sms
    assert s["batch"] * s["kv_heads"] < grid_max                                        # so it splits
    pages = s["seqlen_k"] // s["page_size"]
    chunk = next(c for c in range(max(128 // s["page_size"], 1), pages + 1)
                 if s["batch"] * -(-pages // c) * s["kv_heads"] <= grid_max)
    chunks = s["batch"] * -(-pages // chunk)
    assert launch["grid"] == [chunks, s["kv_heads"]] and launch["blocks"] == chunks * s["kv_heads"]
    assert entry["main_loop"]["trips_per_block"] == chunk * s["page_size"] // 8 // 2
    kv = s["batch"] * s["seqlen_k"] * s["kv_heads"] * s["head_dim"] * 2 * 2
    assert math.isclose(entry["published_us"]["value"], kv / (entry["published"]["value"] / 100 * 3.352e12) * 1e6,
                        rel_tol=1e-3)


@pytest.mark.parametrize("path", ["source", "published", "shape", "launch.blocks", "main_loop.trips_per_block",
                                  "main_loop.mix.HMMA", "main_loop.mix", "outside_main_loop.mix.HMMA",
                                  "dram_bytes.value", "published_us.conversion"])
def test_partial_entry_names_kernel_and_key(path):
    entry = copy.deepcopy(KERNELS["fa2_fwd_hdim128"])
    node = entry
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    del node[last]
    with pytest.raises(ValueError, match=re.escape(entry["kernel"][:40]) + ".*" + re.escape(repr(path))):
        calibration.terms(entry)
    with pytest.raises(ValueError, match=re.escape(repr(path))):
        calibration.bound(entry)


@pytest.mark.parametrize("field, value", [("blocks", 0), ("blocks", "2048"), ("threads", -128), ("blocks", True)])
def test_corrupt_numbers_rejected(field, value):
    entry = copy.deepcopy(KERNELS["fi_decode_hdim128_gqa4"])
    entry["launch"][field] = value
    with pytest.raises(ValueError, match=f"FlashInfer.*{field} must be a positive number"):
        calibration.terms(entry)


def test_committed_file_with_a_broken_entry_raises(tmp_path):
    data = copy.deepcopy(DATA)
    del data["kernels"]["fi_decode_hdim128_gqa4"]["main_loop"]["wavefronts"]
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="FlashInfer.*'main_loop.wavefronts'"):
        calibration.committed(path)
    path.write_text(json.dumps({"kernels": {}}))
    with pytest.raises(ValueError, match="non-empty 'kernels'"):
        calibration.committed(path)
    with pytest.raises(ValueError, match="expected an object"):
        calibration.check([], "broken")


def test_terms_go_through_the_bound_model_and_take_its_machine():
    """The terms are `cacheattn.bounds.ceilings` of the kernel's work: twice the clock halves every per-SM term,
    another HBM rate moves the DRAM term alone, and the stored bound follows the machine it was derived on."""
    from dataclasses import replace

    from cacheattn import bounds

    entry = KERNELS["fa2_fwd_hdim128"]
    base = calibration.default_machine()
    assert calibration.terms(entry) == {name: (fig.value, fig.how) for name, fig in
                                        bounds.ceilings(calibration.work(entry), base).resources.items()}
    was = calibration.terms(entry, base)
    fast = calibration.terms(entry, replace(base, clock_hz=2 * base.clock_hz))
    for term in ("tensor", "shared", "issue", "FMA", "MUFU", "LSU"):
        assert math.isclose(fast[term][0], was[term][0] / 2), term
    slow_hbm = calibration.terms(entry, replace(base, hbm_bytes_per_s=base.hbm_bytes_per_s / 2))
    assert math.isclose(slow_hbm["DRAM"][0], was["DRAM"][0] * 2)
    assert slow_hbm["tensor"] == was["tensor"]
    # FlashAttention-2 re-reads K and V from L2 (every query block), and its trips wait on HBM one tile apart
    assert was["L2"][0] > 0 and was["latency"][0] > 0


def test_the_ladder_data_carries_the_calibration_list():
    """docs/kernel-ladder-counts.json's `calibration`: every kernel with its source, shape, published time and this
    model's bound, as `python -m cacheattn.lab.calibration --update` writes it; published kernels sit within the
    model's aim, 0.5 to 1.0 of the published time (a lower bound above a measurement would be a wrong model)."""
    from cacheattn.lab import counters

    listed = counters.committed()["calibration"]
    assert listed == calibration.entries(DATA)
    published = [e for e in listed if e["published_us"]]
    assert len(published) >= 2
    for e in listed:
        assert e["kernel"] and e["source"]["code"] and e["shape"]
    for e in published:
        assert 0.5 <= e["bound / published"] <= 1.0, e["key"]


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_4:
        /*0010*/                   LDGSTS.E.BYPASS.LTC128B.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0030*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0040*/                   LDSM.16.MT88.2 R12, [R2+0x10] ;
        /*0050*/                   HMMA.16816.F32 R16, R8, R12, R16 ;
        /*0060*/                   LDS.64 R20, [R3] ;
        /*0070*/              @P0 BRA `(.L_x_4) ;
.L_x_3:
        /*0080*/                   MUFU.EX2 R5, R5 ;
        /*0090*/                   FMUL R6, R5, R5 ;
        /*00a0*/                   STS [R3], R6 ;
        /*00b0*/              @P1 BRA `(.L_x_2) ;
        /*00c0*/                   EXIT ;
"""


def test_rotated_loops_merge_and_counts():
    instructions = calibration.sass.parse_sass(SASS)
    assert sorted(calibration.sass.loops(instructions)) == [(1, 7), (3, 11)]
    assert calibration.regions(instructions) == [(1, 11)]
    assert calibration.sass.key_loop(instructions) == (1, 11)     # the ladder's reader, rotated loops joined
    body = instructions[1:12]
    # ldmatrix x4 4, x2 2, LDS.64 2, STS 1, cp.async 16 B a lane 4
    assert calibration.wavefronts(body) == 4 + 2 + 2 + 1 + 4
    counts = calibration.mix(body)
    assert (counts["LDSM"], counts["LDGSTS"], counts["HMMA"], counts["MUFU.EX2"], counts["FMUL"]) == (2, 1, 1, 1, 1)
    assert counts["FMA pipe"] == 1 and counts["control"] == 3 and counts["total"] == 11
    assert counts["other"] == 0 and sum(v for k, v in counts.items() if k not in ("total", "FMA pipe")) == 11
    for key, entry in KERNELS.items():                  # the committed classes cover every instruction once
        for part in ("main_loop", "outside_main_loop"):
            found = entry[part]["mix"]
            assert sum(v for k, v in found.items() if k not in ("total", "FMA pipe")) == found["total"], key
            assert found["total"] == entry[part]["instructions"], key
        assert entry["main_loop"]["instructions"] + entry["outside_main_loop"]["instructions"] == \
            entry["total_instructions"], key
    with pytest.raises(ValueError, match="no loop with a global load"):
        calibration.sass.key_loop(instructions[:1])


def test_derive_from_the_tools_output():
    ptxas = ("ptxas info    : Used 96 registers, used 1 barriers\n"
             "    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads")
    meta = dict(kernel="toy", launch=dict(threads=128, blocks=4, dynamic_shared=16384),
                main_loop=dict(trips_per_block=3, skipped_per_trip=0))
    entry = calibration.derive(ptxas, SASS, meta)
    assert entry["resources"]["registers"] == 96 and entry["resources"]["spill_stores"] == 8
    assert entry["occupancy"]["blocks_per_sm"] == 5 and entry["occupancy"]["limited_by"] == "registers"
    assert entry["main_loop"]["instructions"] == 11 and entry["main_loop"]["trips_per_block"] == 3
    assert entry["outside_main_loop"]["instructions"] == 2 and entry["total_instructions"] == 13
    assert entry["loops"] == [dict(first="0010", last="00b0", instructions=11)]
    with pytest.raises(ValueError, match="Used N registers"):
        calibration.derive("no report", SASS, meta)
    with pytest.raises(ValueError, match="toy: nvdisasm printed no instructions"):
        calibration.derive(ptxas, "", meta)


CHAINED = """
        /*0000*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0010*/                   IMAD R6, R2, 0x100, RZ ;
        /*0020*/                   STS [R8], R6 ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   LDS R10, [R8] ;
        /*0050*/                   IADD3 R12, P0, R10, R14, RZ ;
        /*0060*/                   LDGSTS.E.BYPASS.LTC128B.128 [R16], desc[UR4][R12.64] ;
        /*0070*/                   LDGDEPBAR ;
        /*0080*/                   DEPBAR.LE SB0, 0x0 ;
        /*0090*/                   LDSM.16.M88.4 R20, [R16] ;
"""


def test_the_chain_through_shared_memory_and_cp_async():
    """The calibration reads its kernels' chains with the ladder's reader (`sass.dependent_chain`): a page index
    (a narrow load) stored to shared memory and read back for a tile's address, whose cp.async copy the DEPBAR
    waits for: a near round trip, then an HBM one, each trip. Waiting with one group left in flight (a copy
    issued a trip ahead) leaves the near one alone; with no DEPBAR nothing waits on the copy."""
    code = calibration.sass.parse_sass(CHAINED)
    every = range(len(code))
    assert calibration.sass.dependent_chain(code, every) == dict(hbm=1, near=1, trip_bytes=32 * 20, loads=2)
    ahead = calibration.sass.parse_sass(CHAINED.replace("SB0, 0x0", "SB0, 0x1"))
    got = calibration.sass.dependent_chain(ahead, every)
    assert (got["hbm"], got["near"]) == (0, 1)
    unwaited = calibration.sass.parse_sass(CHAINED.replace("DEPBAR.LE SB0, 0x0", "NOP"))
    assert calibration.sass.dependent_chain(unwaited, every)["hbm"] == 0
    # the committed kernels: FlashAttention-2 waits on its K tile and its V tile, each copied half a trip ahead,
    # in series; FlashInfer's decode waits on one group a trip, its page-table read hidden two stages ahead
    assert {k: (e["main_loop"]["chain"]["hbm"], e["main_loop"]["chain"]["near"]) for k, e in KERNELS.items()} == {
        "fa2_fwd_hdim128": (2, 0), "fi_decode_hdim128_gqa4": (1, 0), "fi_single_decode_hdim128_gqa8": (1, 0),
        "fi_decode_hdim128_gqa8": (1, 0)}


def test_cli_prints_the_table(capsys):
    assert calibration.main([]) == 0
    out = capsys.readouterr().out
    assert "| kernel | shape | published µs | bound µs | ratio | binding term |" in out
    for key, entry in KERNELS.items():
        row = next(line for line in out.splitlines() if line.startswith(f"| {key} |"))
        assert f"{entry['bound_us']:,.1f}" in row and entry["binding_term"] in row
