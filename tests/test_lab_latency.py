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
    scores' mma before the V loads issue): two HBM round trips and a short one in series, not one. With an int8
    cache ptxas issues K's second chunks behind the first chunks' mma, so V waits behind a third. A trip's mma:
    D / 16 for the transposed scores, D / 8 for P·V."""
    variants = json.loads((ROOT / "docs" / "kernel-ladder-sass.json").read_text())["variants"]
    for key, hbm in (("rung5-float16-decode", 2), ("rung5-int8-decode", 3), ("trtllm-rung5-float16-decode", 2)):
        chain = variants[key]["key_loop"]["chain"]
        assert (chain["hbm"], chain["near"]) == (hbm, 1), key
        assert variants[key]["key_loop"]["trip"]["HMMA"] == 24
    prefill = variants["rung5-float16-prefill"]["key_loop"]["trip"]
    # each step's 64 LDS, 32 HMMA, 10 exp2 and 4 barriers on the path, and the 64-bit division's call
    assert (prefill["LDS"], prefill["HMMA"], prefill["EX2"], prefill["BAR"], prefill["CALL"]) == (64, 32, 10, 4, 1)
    assert 1100 < prefill["total"] < variants["rung5-float16-prefill"]["key_loop"]["mix"]["total"]
