"""The latency bound (Little's law) of cacheattn.lab: the bytes a warp of a SASS listing has in flight
(`sass.loads_in_flight`), the bound from them (`bounds.latency_bound`), and its rows in the committed counts."""

import json
from pathlib import Path

import pytest

from cacheattn import bounds
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


def test_loads_in_flight_until_their_first_use():
    got = sass.loads_in_flight(sass.parse_sass(LISTING))
    # at the first FFMA: 16 + 16 + 2 bytes a lane; at the MOV: 16 + 2 + 8; at the STG: 16 + 2; at the last FFMA
    # 16 + 4 (the 16-byte load of R8 .. R11 is still in flight)
    assert got == dict(first_use=32 * 34, peak=32 * 34, loads=5)


def test_load_widths():
    assert [sass.load_bytes(op) for op in ("LDG.E.128.CONSTANT", "LDG.E.64", "LDG.E", "LDG.E.U16", "LDG.E.S8",
                                          "FFMA")] == [16, 8, 4, 2, 1, 0]


def test_latency_bound_is_littles_law():
    m = bounds.H100_SXM
    dram = 1e9
    needed = m.hbm_bytes_per_s * bounds.HBM_LATENCY_CLOCKS / m.clock_hz / m.sms
    short = bounds.latency_bound(dram, needed / 16, 8)               # half of what HBM needs
    assert short["needed B/SM"].value == pytest.approx(needed)
    assert short["in flight / needed"].value == pytest.approx(0.5)
    assert short["latency"].value == pytest.approx(2 * dram / m.hbm_bytes_per_s * 1e6)
    ample = bounds.latency_bound(dram, needed, 8)                    # 8 times what it needs: HBM's bandwidth
    assert ample["latency"].value == pytest.approx(dram / m.hbm_bytes_per_s * 1e6)
    few = bounds.latency_bound(dram, needed / 16, 8, blocks=33)      # 33 SMs busy, a quarter of them
    assert few["latency"].value == pytest.approx(short["latency"].value * m.sms / 33)
    with pytest.raises(ValueError, match="in_flight_per_warp"):
        bounds.latency_bound(dram, 0, 8)


def test_committed_figures_hold_the_latency_rows():
    machine = json.loads((ROOT / "docs" / "kernel-ladder-sass.json").read_text())
    counts = json.loads((ROOT / "docs" / "kernel-ladder-counts.json").read_text())
    for cache, quant_bit in sass.CACHES.items():
        in_flight = machine["variants"][f"rung3-{cache}-decode"]["key_loop"]["in_flight"]
        assert 0 < in_flight["first_use"] <= in_flight["peak"]
        shown = next(case for case in counts["cases"].values()
                     if case["case"]["quant_bit"] == quant_bit and case["case"]["batch"] == 64)["rungs"]["3"]["bounds"]
        ratio = in_flight["peak"] * machine["variants"][f"rung3-{cache}-decode"]["occupancy"]["warps_per_sm"] / (
            bounds.H100_SXM.hbm_bytes_per_s * bounds.HBM_LATENCY_CLOCKS / bounds.H100_SXM.clock_hz
            / bounds.H100_SXM.sms)
        assert shown["loads in flight / needed (SASS estimate)"] == pytest.approx(ratio, abs=1e-3)
        assert shown["latency µs (Little's law estimate)"] >= shown["DRAM µs (derived)"] - 0.1
