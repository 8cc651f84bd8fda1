"""cacheattn.bounds on hand-made figures whose bounds are worked out by hand in the comments."""

import dataclasses

import pytest

from cacheattn.bounds import H100_SXM, Figure, Work, bounds, ceilings, latency_bound
from cacheattn.lab.cases import LAB_CASES, BenchCase

DECODE_F16, DECODE_I8, DECODE_I4, LONG, PREFILL = LAB_CASES
CLOCKS = 132 * 1.83e9            # SM clocks per second over the whole H100 SXM: 2.4156e11


def test_the_machine_and_where_each_rate_comes_from():
    m = H100_SXM
    assert (m.sms, m.hbm_peak_bytes_per_s, m.hbm_bytes_per_s, m.clock_hz) == (132, 3.35e12, 3.1e12, 1.83e9)
    # the datasheet's dense float16 peak is wgmma's rate at this clock: 132 x 4096 x 1.83e9 = 989.4 TFLOP/s
    assert m.sms * 4096 * m.wgmma_per_clock * m.clock_hz == pytest.approx(989.4e12, rel=1e-4)
    assert m.mma_per_clock < m.wgmma_per_clock                       # mma.sync is charged below wgmma
    assert m.hbm_bytes_per_s < m.hbm_peak_bytes_per_s
    rates = [f.name for f in dataclasses.fields(m) if f.name not in ("name", "sources")]
    assert sorted(m.sources) == sorted(rates)
    assert all(len(text) > 20 for text in m.sources.values())


def test_bytes_the_decode_cases_must_move():
    # K and V of 64 sequences x 4097 keys (4096 cached + the new token) x 8 kv heads x 128 float16 (256 bytes):
    # 2 x 64 x 4097 x 8 x 256 = 1,074,003,968; Q and O: 64 x 32 heads x 128 x 2 bytes = 524,288 each.
    assert DECODE_F16.must_move == dict(kv=1_074_003_968, q=524_288, o=524_288)
    assert DECODE_F16.floor_bytes == 1_075_052_544
    # int8: 128 bytes of values + 16 float16 scales (quant_group 8) = 160 a row; int4: 64 + 32 = 96.
    assert (DECODE_F16.row_bytes, DECODE_I8.row_bytes, DECODE_I4.row_bytes) == (256, 160, 96)
    assert DECODE_F16.must_move["kv"] / DECODE_I8.must_move["kv"] == pytest.approx(1.6)
    assert LONG.floor_bytes == 134_221_824 + 2 * 8_192


def test_prefill_flops_and_the_mma_sync_bound():
    # Causal 4096 x 4096: 8,390,656 visible pairs x 4 x 128 FLOPs x 32 heads = 137,472,507,904 FLOPs =
    # 33,562,624 m16n8k16. mma.sync at 2/3 a clock per SM: 33,562,624 / (2/3 x 2.4156e11) = 208.41 µs; issued as
    # wgmma (1 a clock) the same work would take 138.94 µs.
    assert PREFILL.flops == 137_472_507_904
    mma = PREFILL.flops // 4096
    b = bounds({}, mma=mma, case=PREFILL)
    assert b.limiter == "tensor"
    assert b.bound_us == pytest.approx(208.4124, rel=1e-5)
    assert ceilings(Work(wgmma=mma)).bound_us == pytest.approx(138.9416, rel=1e-5)


def test_a_decode_launch_at_the_floor():
    # Two blocks of rung 3's 512 counted, scaled by 256: exactly the floor, 1,075,052,544 bytes, over the
    # achievable 3.1 TB/s: 346.791 µs, which uses 1,075,052,544 / 346.791 µs / 3.35 TB/s = 92.5% of the datasheet's.
    metrics = {"dram__bytes_read.sum": 2 * (2_097_664 + 1_024), "dram__bytes_write.sum": 2 * 1_024}
    b = bounds(metrics, scale=256, case=DECODE_F16)
    assert b.figures["DRAM bytes"].value == 1_075_052_544
    assert b.figures["DRAM / floor"].value == pytest.approx(1.0)
    assert (b.limiter, b.bound_us) == ("DRAM", pytest.approx(346.7911, rel=1e-6))
    assert b.hbm_share == pytest.approx(3.1 / 3.35)
    assert "cannot run faster than 346.79 µs" in b.summary()


def test_every_term_of_a_call_and_the_order():
    w = Work(dram_bytes=3.1e9,                       # 1000 µs at 3.1 TB/s
             l2_bytes=5.4e9,                         # 450 µs at 12 TB/s
             shared_wavefronts=1.2078e8,             # 500 µs at 1 a clock: 1.2078e8 / 2.4156e11
             l1_sectors=2.4156e8,                    # 250 µs at 4 a clock
             mma=1.6104e7,                           # 100 µs at 2/3 a clock
             fma_flops=2 * 128 * 2.4156e7,           # 100 µs
             ex2=1.2078e7,                           # 100 µs at half a warp instruction a clock
             lsu_instructions=4.8312e7,              # 200 µs at 1 a clock
             warp_instructions=5.7974e8,             # 600 µs at 4 a clock
             launches=3)                             # 6 µs at 2 µs each
    b = ceilings(w)
    us = {name: fig.value for name, fig in b.resources.items()}
    assert us == pytest.approx({"DRAM": 1000, "L2": 450, "shared": 500, "L1": 250, "tensor": 100, "FMA": 100,
                                "MUFU": 100, "LSU": 200, "issue": 600, "launch": 6}, rel=1e-4)
    assert b.ranked[:4] == ["DRAM", "issue", "shared", "L2"]
    assert (b.limiter, b.bound_us) == ("DRAM", pytest.approx(1000))
    # each term names its rate's source
    assert "3.1 TB/s" in b.resources["DRAM"].how and "Luo et al." in b.resources["DRAM"].how
    assert "2 µs" in b.resources["launch"].how


def test_latency_is_littles_law_on_the_average_in_flight_and_waves_quantize():
    # 512 blocks of 4 warps, 3 resident a SM; 65 trips a warp, each waiting on 2 HBM round trips (570 / 1.98 GHz
    # = 287.88 ns) and 1 L1 hit (30 / 1.98 GHz = 15.15 ns): 590.91 ns a trip. Busy SMs 132, each holding
    # min(3, ceil(512 / 132) = 4) x 4 = 12 warps: 133,120 trips x 590.91 ns / (132 x 12) = 49.66 µs. The busiest
    # SM runs its 4 blocks in ceil(4 / 3) = 2 waves of 65 trips: 2 x 65 x 590.91 ns = 76.82 µs.
    trip = 2 * 570 / 1.98e9 + 30 / 1.98e9
    w = Work(warp_trips=512 * 4 * 65, chain_hbm=2, chain_near=1, blocks=512, blocks_per_sm=3, warps_per_block=4,
             trip_bytes=8448)
    b = ceilings(w)
    assert b.resources["latency"].value == pytest.approx(133_120 * trip / (132 * 12) * 1e6)
    assert b.resources["waves"].value == pytest.approx(2 * 65 * trip * 1e6)
    assert b.figures["waves"].value == 2
    # average bytes in flight per SM, in HBM-latency terms: 8448 B over a 591 ns trip x 288 ns x 12 warps
    assert b.figures["in flight B/SM"].value == pytest.approx(8448 / trip * 570 / 1.98e9 * 12)
    same = latency_bound(512 * 4 * 65, 2, 1, blocks=512, blocks_per_sm=3, warps_per_block=4, trip_bytes=8448)
    assert same["latency"].value == pytest.approx(b.resources["latency"].value)
    # 8 blocks of one resident wave: 8 busy SMs
    few = ceilings(dataclasses.replace(w, blocks=8, warp_trips=8 * 4 * 65))
    assert few.resources["latency"].value == pytest.approx(8 * 4 * 65 * trip / (8 * 4) * 1e6)
    with pytest.raises(ValueError, match="warp_trips"):
        latency_bound(0, 2, 1, blocks=8, blocks_per_sm=1, warps_per_block=4)


def test_few_blocks_leave_sms_idle():
    # 2.4156e8 sectors take 250 µs over 132 SMs; on 8 blocks only 8 SMs work: 16.5x; 512 blocks put 4 on the
    # busiest SM where the average is 3.879: 1.03125x. DRAM is shared by all SMs.
    metrics = {"l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": 2.4156e8, "dram__bytes_read.sum": 3.1e6}
    spread = bounds(metrics)
    assert spread.resources["L1"].value == pytest.approx(250.0)
    assert bounds(metrics, blocks=8).resources["L1"].value == pytest.approx(250.0 * 16.5)
    assert bounds(metrics, blocks=8).resources["DRAM"].value == pytest.approx(spread.resources["DRAM"].value)
    assert bounds(metrics, blocks=512).resources["L1"].value == pytest.approx(250.0 * 1.03125)
    with pytest.raises(ValueError, match="blocks"):
        bounds(metrics, blocks=0)


def test_cuda_core_rungs_are_held_to_the_fma_rate():
    b = bounds({"dram__bytes_read.sum": PREFILL.floor_bytes}, case=PREFILL, fma_flops=PREFILL.flops)
    assert b.resources["FMA"].value == pytest.approx(PREFILL.flops / (256 * CLOCKS) * 1e6)
    assert b.limiter == "FMA" and b.resources["FMA"].basis == "derived"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="scale"):
        bounds({"dram__bytes_read.sum": 1}, scale=0)
    with pytest.raises(ValueError, match="metrics"):
        bounds({"unrelated": 3})
    with pytest.raises(ValueError, match="work.dram_bytes"):
        ceilings(Work(dram_bytes=-1))
    with pytest.raises(ValueError, match="work.blocks_per_sm"):
        ceilings(Work(dram_bytes=1, blocks_per_sm=0))
    with pytest.raises(ValueError, match="work"):
        ceilings(Work())
    with pytest.raises(ValueError, match="quant_bit"):
        _ = BenchCase("bad", batch=1, context=1, new_tokens=1, quant_bit=3).row_bytes


def test_a_figures_text_is_made_once_when_read():
    class Counted:
        made = 0

        def __format__(self, spec):
            Counted.made += 1
            return format(2.5, spec)

    fig = Figure(1.0, "µs", "derived", "{:g} a clock; {}", Counted(), "source")
    assert Counted.made == 0                        # the plan builds Figures it never prints
    assert fig.how == "2.5 a clock; source" and str(fig) == "1 µs (derived: 2.5 a clock; source)"
    assert Counted.made == 1
    assert fig == Figure(1.0, "µs", "derived", "2.5 a clock; source")


def test_the_ranking_follows_the_terms_as_they_change():
    b = ceilings(Work(dram_bytes=3.1e9, launches=3))                  # DRAM 1000 µs, launch 6 µs
    assert (b.limiter, b.ranked) == ("DRAM", ["DRAM", "launch"])
    b.resources["launch"] = Figure(2000.0, "µs", "derived", "replaced")
    assert (b.limiter, b.ranked, b.bound_us) == ("launch", ["launch", "DRAM"], 2000.0)
    del b.resources["launch"]
    assert (b.limiter, b.ranked) == ("DRAM", ["DRAM"])
