"""The latency bound of cacheattn.lab read from machine code: the chain of dependent global round trips one warp's
trip waits on (`sass.dependent_chain`), the shortest path through a trip and through what a warp runs once
(`sass.trip_path`, `sass.outside_path`), and the bytes a warp has in flight at most (`sass.loads_in_flight`, kept
as a figure)."""

import json
from pathlib import Path

import pytest

from cacheattn.lab import sass

ROOT = Path(__file__).resolve().parents[1]

# Two 16-byte loads and a 2-byte one issued back to back, the first used by an FFMA (the warp waits: 34 bytes a lane
# in flight), then an 8-byte load whose pair is overwritten (a wait too), a store that reads the 2-byte load's
# register, and a 4-byte load nobody waits on before the end.
LISTING = """
        /*0000*/                   LDG.E.128.CONSTANT R4, desc[UR4][R40.64] ;
        /*0010*/                   LDG.E.128.CONSTANT R8, desc[UR4][R42.64] ;
        /*0020*/                   LDG.E.U16 R12, desc[UR4][R44.64] ;
        /*0030*/                   IADD3 R30, R31, 0x1, RZ ;
        /*0040*/                   FFMA R20, R6, R21, R20 ;
        /*0050*/                   LDG.E.64 R14, desc[UR4][R46.64] ;
        /*0060*/                   MOV R15, RZ ;
        /*0070*/                   STG.E desc[UR4][R48.64], R12 ;
        /*0080*/                   LDG.E R16, desc[UR4][R50.64] ;
        /*0090*/                   FFMA R22, R9, R21, R22 ;
"""

# A decode trip as rung 5's kernel makes it: the page entry (8 bytes), an address from it, K (16 bytes a lane)
# consumed by an mma before V is loaded, V consumed by the next: page -> K -> V, three round trips in series.
SERIAL = """
.L_x_1:
        /*0000*/                   LDG.E.64 R2, desc[UR4][R10.64] ;
        /*0010*/                   IMAD.WIDE R4, R2, 0x100, R12 ;
        /*0020*/                   LDG.E.128.CONSTANT R16, desc[UR4][R4.64] ;
        /*0030*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
        /*0040*/                   LDG.E.128.CONSTANT R24, desc[UR4][R4.64+0x40] ;
        /*0050*/                   HMMA.16816.F32 R28, R24, R26, R28 ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
        /*0070*/                   STG.E desc[UR4][R6.64], R28 ;
        /*0080*/                   EXIT ;
"""
# The same trip with V loaded beside K, before either is used: page -> (K, V), two round trips.
OVERLAPPED = SERIAL.replace("""        /*0030*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
        /*0040*/                   LDG.E.128.CONSTANT R24, desc[UR4][R4.64+0x40] ;""",
                            """        /*0030*/                   LDG.E.128.CONSTANT R24, desc[UR4][R4.64+0x40] ;
        /*0040*/                   HMMA.16816.F32 R20, R16, R18, R20 ;""")

# A trip with two ways through it (three instructions or one), then its mma; the store and EXIT after the loop.
BRANCHY = """
.L_x_1:
        /*0000*/                   LDG.E.128 R16, desc[UR4][R4.64] ;
        /*0010*/               @P1 BRA `(.L_x_2) ;
        /*0020*/                   FMUL R1, R1, R1 ;
        /*0030*/                   FMUL R1, R1, R1 ;
        /*0040*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0050*/                   FADD R1, R1, R1 ;
.L_x_3:
        /*0060*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/                   STG.E desc[UR4][R6.64], R1 ;
        /*0090*/                   EXIT ;
"""


def test_loads_in_flight_until_their_first_use():
    got = sass.loads_in_flight(sass.parse_sass(LISTING))
    assert got == dict(first_use=32 * 34, peak=32 * 34, loads=5)


def test_load_widths():
    assert [sass.load_bytes(op) for op in ("LDG.E.128.CONSTANT", "LDG.E.64", "LDG.E", "LDG.E.U16", "LDG.E.S8",
                                          "FFMA")] == [16, 8, 4, 2, 1, 0]


def test_the_chain_of_a_trip_counts_the_round_trips_it_waits_on_in_series():
    code = sass.parse_sass(SERIAL)
    path = sass.trip_path(code, sass.key_loop(code))
    assert [code[i][0] for i in path] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
    # page entry (an L1-hit round trip), K and V (two HBM ones) in series; 8 + 16 + 16 bytes a lane
    assert sass.dependent_chain(code, path) == dict(hbm=2, near=1, trip_bytes=32 * 40, loads=3)
    overlapped = sass.parse_sass(OVERLAPPED)
    assert sass.dependent_chain(overlapped, sass.trip_path(overlapped, sass.key_loop(overlapped)))["hbm"] == 1


def test_the_shortest_path_through_a_trip_and_what_a_warp_runs_once():
    code = sass.parse_sass(BRANCHY)
    span = sass.key_loop(code)
    trip = sass.trip_path(code, span)
    assert [code[i][0] for i in trip] == [0x0, 0x10, 0x50, 0x60, 0x70]          # the one-instruction way
    mix = sass.path_mix(code, trip)
    assert (mix["total"], mix["LDG"], mix["HMMA"], mix["load_bytes"]) == (5, 1, 1, 512)
    once = sass.outside_path(code, span)
    assert [code[i][0] for i in once] == [0x80, 0x90]
    with pytest.raises(ValueError, match="no EXIT"):
        sass.outside_path(sass.parse_sass(BRANCHY.replace("EXIT", "NOP")), span)


def test_a_listing_the_reader_cannot_use_is_named():
    variant = sass.Variant(5, "float16")
    ptxas = "ptxas info    : Used 168 registers, used 1 barriers, 13056 bytes smem\n"
    with pytest.raises(ValueError, match="rung5-float16-decode: nvdisasm printed no instructions"):
        sass.analyse(variant, ptxas, "garbage", 128)
    with pytest.raises(ValueError, match="rung5-float16-decode: the SASS paths could not be read"):
        sass.analyse(variant, ptxas, BRANCHY.replace("EXIT", "NOP"), 128)


def test_a_committed_file_the_reader_cannot_use_is_named(tmp_path):
    broken = tmp_path / "kernel-ladder-sass.json"
    broken.write_text('{"variants": {"rung3-float16-decode": ')
    with pytest.raises(ValueError, match="kernel-ladder-sass.json: not the JSON"):
        sass.committed(broken)
    broken.write_text('{"tools": {}}')
    with pytest.raises(ValueError, match="kernel-ladder-sass.json: no 'variants' map"):
        sass.committed(broken)


def test_the_committed_chains():
    """Rung 5's decode kernel waits on the page entry, then K, then V each trip (the K loads are consumed by the
    scores' mma before the V loads issue): two HBM round trips and a short one in series, not one, for every cache
    (an int8 cache's K chunks issue together). A trip's mma: D / 16 for the transposed scores, D / 16 for the
    transposed P·V."""
    variants = json.loads((ROOT / "docs" / "kernel-ladder-sass.json").read_text())["variants"]
    for key, hbm in (("rung5-float16-decode", 2), ("rung5-int8-decode", 2), ("trtllm-rung5-float16-decode", 2)):
        chain = variants[key]["key_loop"]["chain"]
        assert (chain["hbm"], chain["near"]) == (hbm, 1), key
        assert variants[key]["key_loop"]["trip"]["HMMA"] == 16
    prefill = variants["rung5-float16-prefill"]["key_loop"]["trip"]
    # each step's 64 LDS, 32 HMMA, 10 exp2 and 4 barriers on the path; the 64-bit division's inline way, not its
    # call (the same work); K staged in two passes of 4 stores to shared memory, V in one of 8
    assert (prefill["LDS"], prefill["HMMA"], prefill["EX2"], prefill["BAR"], prefill["CALL"]) == (64, 32, 10, 4, 0)
    assert (prefill["STS"], prefill["LDG"]) == (16, 40)
    assert 1100 < prefill["total"] < variants["rung5-float16-prefill"]["key_loop"]["mix"]["total"]


# Two ways through a trip, each doing its K/V load and mma: a vector load (three instructions) or a slow path of
# byte loads beside it (five); then the page entry, loaded on one way only, and the mma.
TWO_WAYS = """
.L_x_1:
        /*0000*/               @P1 BRA `(.L_x_2) ;
        /*0010*/                   IADD3 R4, R4, 0x10, RZ ;
        /*0020*/                   LDG.E.128 R16, desc[UR4][R4.64] ;
        /*0030*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0040*/                   LDG.E.U8 R16, desc[UR4][R4.64] ;
        /*0050*/                   LDG.E.U8 R17, desc[UR4][R4.64+0x1] ;
        /*0060*/                   LDG.E.U8 R18, desc[UR4][R4.64+0x2] ;
        /*0070*/                   LDG.E.U8 R19, desc[UR4][R4.64+0x3] ;
.L_x_3:
        /*0080*/               @P2 BRA `(.L_x_4) ;
        /*0090*/                   LDG.E.64 R2, desc[UR4][R10.64] ;
        /*00a0*/                   IMAD.WIDE R4, R2, 0x100, R12 ;
.L_x_4:
        /*00b0*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
        /*00c0*/               @P0 BRA `(.L_x_1) ;
        /*00d0*/                   EXIT ;
"""


def test_the_trip_path_rule_is_exact_on_two_branches():
    """The lower bound's path: the most required work (mma, exp2, barriers, shuffles, shared and global stores, the
    widest global loads), then the most narrower loads, then the fewest instructions, over every path of the
    trip's forward edges."""
    code = sass.parse_sass(TWO_WAYS)
    path = [code[i][0] for i in sass.trip_path(code, sass.key_loop(code))]
    # the vector load, not the four byte loads (more loads, but not the widest); the page entry, not the skip
    assert path == [0x0, 0x10, 0x20, 0x30, 0x80, 0x90, 0xa0, 0xb0, 0xc0]
    # where both ways do the same work, the shorter one: the slow path's first byte load widened to a vector
    # load, the others to arithmetic (four instructions against three)
    same = sass.parse_sass(TWO_WAYS.replace("LDG.E.U8 R16", "LDG.E.128 R16").replace("LDG.E.U8", "IADD3"))
    assert [same[i][0] for i in sass.trip_path(same, sass.key_loop(same))][:4] == [0x0, 0x10, 0x20, 0x30]
    longer = sass.parse_sass(TWO_WAYS.replace("LDG.E.U8 R16", "LDG.E.128 R16").replace("LDG.E.U8", "IADD3").replace(
        "        /*0010*/                   IADD3 R4, R4, 0x10, RZ ;\n", "".join(
            f"        /*001{k}*/                   IADD3 R4, R4, 0x10, RZ ;\n" for k in range(4))))
    assert [longer[i][0] for i in sass.trip_path(longer, sass.key_loop(longer))][:3] == [0x0, 0x40, 0x50]
    # a way that skips the mma is not a lower bound's path, however short
    skip = sass.parse_sass(TWO_WAYS.replace("@P2 BRA `(.L_x_4)", "@P2 BRA `(.L_x_5)").replace(
        "        /*00c0*/               @P0", ".L_x_5:\n        /*00c0*/               @P0"))
    assert 0xb0 in [skip[i][0] for i in sass.trip_path(skip, sass.key_loop(skip))]


def test_an_inner_loop_counts_its_trips():
    """An inner loop's body runs `trips` times on the trip's path (rung 5's prefill stages K in two passes)."""
    code = sass.parse_sass("""
.L_x_1:
        /*0000*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
.L_x_2:
        /*0010*/                   LDG.E.128 R16, desc[UR4][R4.64] ;
        /*0020*/                   STS.128 [R6], R16 ;
        /*0030*/               @P1 BRA `(.L_x_2) ;
        /*0040*/               @P0 BRA `(.L_x_1) ;
        /*0050*/                   EXIT ;
""")
    span = (0, 4)                                   # the outer loop (key_loop would take the inner, as loaded)
    once = sass.trip_path(code, span)
    assert [code[i][0] for i in once] == [0x0, 0x10, 0x20, 0x30, 0x40]
    twice = sass.trip_path(code, span, {(1, 3): 2})
    assert [code[i][0] for i in twice] == [0x0, 0x10, 0x20, 0x30, 0x10, 0x20, 0x30, 0x40]
    assert sass.path_mix(code, twice)["load_bytes"] == 2 * 512
    # each pass stores what it loaded before the next pass loads: two HBM round trips in series, not one
    assert (sass.dependent_chain(code, once)["hbm"], sass.dependent_chain(code, twice)["hbm"]) == (1, 2)


def test_the_committed_inner_trips():
    """Rung 5's float16 prefill stages 16 keys x 16 chunks of K in 2 passes of 128 threads, V in one."""
    variants = json.loads((ROOT / "docs" / "kernel-ladder-sass.json").read_text())["variants"]
    assert [t["trips"] for t in variants["rung5-float16-prefill"]["key_loop"]["inner_trips"]] == [2, 1]
    assert all(t["trips"] == 1 for key in ("rung5-int8-prefill", "rung5-int4-prefill")
               for t in variants[key]["key_loop"]["inner_trips"])
    assert variants["rung5-float16-decode"]["key_loop"]["inner_trips"] == []


def test_the_staging_loops_trips_are_read_and_checked():
    """Rung 5's prefill staging loops: n - tid read from the SASS (256 for K, 128 for V at the headline shape,
    float16), the trips of the last warp from the shape; a count the shape does not give is refused."""
    listing = """
.L_x_1:
        /*0000*/                   IADD3 R5, P1, -R0, 0x100, RZ ;
.L_x_2:
        /*0010*/                   LDG.E.128 R16, desc[UR4][R4.64] ;
        /*0020*/                   STS.128 [R6], R16 ;
        /*0030*/               @P1 BRA `(.L_x_2) ;
        /*0040*/                   IADD3 R7, P1, -R0, 0x80, RZ ;
.L_x_3:
        /*0050*/                   LDG.E.128 R16, desc[UR4][R4.64] ;
        /*0060*/                   STS.128 [R6], R16 ;
        /*0070*/               @P1 BRA `(.L_x_3) ;
        /*0080*/                   HMMA.16816.F32 R20, R16, R18, R20 ;
        /*0090*/               @P0 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
"""
    code, prefill = sass.parse_sass(listing), sass.Variant(5, "float16", "prefill")
    got = sass.inner_trips(prefill, code, (0, 9))
    assert [(t["first"], t["last"], t["trips"]) for t in got] == [(1, 3, 2), (5, 7, 1)]
    assert sass.inner_trips(sass.Variant(5, "float16"), code, (0, 9)) == []          # decode stages nothing
    with pytest.raises(ValueError, match="V staging loop /\\*0050\\*/: expected its count from 128 - tid"):
        sass.inner_trips(prefill, sass.parse_sass(listing.replace("-R0, 0x80", "-R0, 0x40")), (0, 9))
